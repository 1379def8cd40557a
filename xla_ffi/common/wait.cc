#include "common/wait.h"

#include <algorithm>
#include <climits>
#include <thread>

#include <sched.h>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

namespace jaxring {
namespace {

// Longest single sleep: a sleeper re-checks its deadline at least this often.
constexpr std::chrono::milliseconds kMaxSleep{50};
// After spinning, a waiter yields its core for up to this long before it sleeps. A yield costs
// well under a microsecond when nothing else wants the core, and hands the core to a peer device
// (often the very one being waited for) when devices outnumber cores; a futex sleep and wake-up
// costs 5-20 us. Measured in benchmarks/p2p.py.
constexpr std::chrono::microseconds kYieldPhase{100};

void SleepWhileEqual(const std::atomic<uint32_t>& word, uint32_t expected,
                     std::chrono::nanoseconds timeout) {
#if defined(__linux__)
  timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  syscall(SYS_futex, reinterpret_cast<const uint32_t*>(&word), FUTEX_WAIT, expected, &ts,
          nullptr, 0);
#else
  (void)expected;
  std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(timeout,
                                                                   std::chrono::microseconds(50)));
#endif
}

}  // namespace

// Limits beyond this (about 30 years, infinity included) mean no limit: the steady clock's
// 64-bit nanoseconds would overflow past about 292 years, and a wrapped deadline lies in the past.
constexpr double kLongestWaitSeconds = 1e9;

Deadline::Deadline(double seconds)
    : when_(std::chrono::steady_clock::now() +
            std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                std::chrono::duration<double>(std::min(seconds, kLongestWaitSeconds)))),
      seconds_(seconds) {}

std::chrono::nanoseconds Deadline::Remaining(std::chrono::nanoseconds cap) const {
  auto left = when_ - std::chrono::steady_clock::now();
  if (left <= std::chrono::nanoseconds::zero()) return std::chrono::nanoseconds::zero();
  return std::min<std::chrono::nanoseconds>(cap, left);
}

void Flag::WakeAll() {
  if (sleepers_.load(std::memory_order_seq_cst) == 0) return;
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&value_), FUTEX_WAKE, INT_MAX, nullptr,
          nullptr, 0);
#endif
}

void Flag::Store(uint32_t value) {
  value_.store(value, std::memory_order_seq_cst);
  WakeAll();
}

uint32_t Flag::Add(uint32_t delta) {
  uint32_t now = value_.fetch_add(delta, std::memory_order_seq_cst) + delta;
  WakeAll();
  return now;
}

bool Flag::AbandonBelow(uint32_t target) {
  uint32_t seen = value_.load(std::memory_order_seq_cst);
  // Already abandoned: another rank gave up first, and its reason is the one to tell.
  while ((seen & kAbandoned) == 0 && seen < target) {
    if (value_.compare_exchange_weak(seen, seen | kAbandoned, std::memory_order_seq_cst)) {
      WakeAll();
      return true;
    }
  }
  return false;
}

void Flag::Abandon() {
  value_.fetch_or(kAbandoned, std::memory_order_seq_cst);
  WakeAll();
}

void YieldCore() { sched_yield(); }

namespace {
// This thread's spin, as a fraction of the configured one (kSpinScale = all of it).
constexpr int64_t kSpinScale = 16;
thread_local int64_t spin_share = kSpinScale;
}  // namespace

int64_t SpinBudget(int64_t spin) { return spin * spin_share / kSpinScale; }

void RecordSpin(bool arrived, int64_t spin) {
  if (spin <= 0) return;
  spin_share = arrived ? std::min(kSpinScale, spin_share * 2) : std::max<int64_t>(1, spin_share / 2);
}

template <typename Done>
bool Flag::Wait(Done done, const Deadline& deadline, int64_t spin_iterations) const {
  if (SpinThenYield([&] { return done(value_.load(std::memory_order_acquire)); },
                    spin_iterations, kYieldPhase))
    return true;
  while (true) {
    uint32_t seen = value_.load(std::memory_order_acquire);
    if (done(seen)) return true;
    auto left = deadline.Remaining(kMaxSleep);
    if (left == std::chrono::nanoseconds::zero()) return false;
    // Announce the sleeper before re-checking, so a writer either sees us or we see its value.
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    seen = value_.load(std::memory_order_seq_cst);
    if (!done(seen)) SleepWhileEqual(value_, seen, left);
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
  }
}

bool Flag::WaitAtLeast(uint32_t target, const Deadline& deadline, int64_t spin_iterations) const {
  return Wait([target](uint32_t seen) { return seen >= target; }, deadline, spin_iterations);
}

bool Flag::WaitReached(uint32_t target, const Deadline& deadline, int64_t spin_iterations) const {
  return Wait([target](uint32_t seen) { return Reached(seen, target) || (seen & kAbandoned); },
              deadline, spin_iterations);
}

bool Flag::WaitUntilEqual(uint32_t target, const Deadline& deadline,
                          int64_t spin_iterations) const {
  return Wait([target](uint32_t seen) { return seen == target || (seen & kAbandoned); }, deadline,
              spin_iterations);
}

}  // namespace jaxring
