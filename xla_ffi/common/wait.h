// Waiting without starving peers. jaxring runs one thread per device, often more threads than
// cores (8 CPU devices on 2 cores), so a waiter polls briefly and then sleeps in the kernel
// (futex on Linux) until the writer wakes it. Every wait has a deadline. Futexes are the shared
// kind (not FUTEX_PRIVATE), because flags also live in segments that several processes map.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace jaxring {

// A pause instruction where the CPU has one: inline, since it sits in every spin loop.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}
void YieldCore();  // sched_yield

// How long this thread spins before it yields, adapted to how its recent waits went: halved
// (down to a sixteenth of `spin`) each time the peer had not arrived by the end of the spin, doubled
// (up to `spin`) each time it had. A thread whose peers run on other cores keeps spinning, which
// answers fastest; one whose peer shares its core (2 devices on 1 core, or 8 on 2) stops burning
// the time slice its peer needs. A 2-device ring pass with both device threads on one core (the
// scheduler often puts them there) took 13 us a hop with the full spin before every yield and
// takes 5 us now; an 8-device ring pass on 2 cores went from 18 to 12 us (benchmarks/p2p.py).
int64_t SpinBudget(int64_t spin);
void RecordSpin(bool arrived, int64_t spin);

// The first two phases of every wait: poll `done` up to `spin` times (SpinBudget), then keep
// polling while yielding the core for up to `yield_for` (when devices or ranks outnumber cores,
// the peer being waited for may need this core). True as soon as done() holds; false if it still
// does not, and the caller goes on to its own way of sleeping (a futex for flags, short naps for
// MPI requests).
template <typename Done>
bool SpinThenYield(Done done, int64_t spin, std::chrono::microseconds yield_for) {
  if (done()) return true;
  const int64_t budget = SpinBudget(spin);
  for (int64_t i = 0; i < budget; ++i) {
    CpuRelax();
    if (done()) {
      RecordSpin(true, spin);
      return true;
    }
  }
  RecordSpin(false, spin);
  const auto stop_yielding = std::chrono::steady_clock::now() + yield_for;
  do {
    for (int i = 0; i < 8; ++i) {
      if (done()) return true;
      YieldCore();
    }
  } while (std::chrono::steady_clock::now() < stop_yielding);
  return done();
}

class Deadline {
 public:
  explicit Deadline(double seconds);
  bool Expired() const { return std::chrono::steady_clock::now() >= when_; }
  // Time left, clamped to [0, cap].
  std::chrono::nanoseconds Remaining(std::chrono::nanoseconds cap) const;
  double seconds() const { return seconds_; }

 private:
  std::chrono::steady_clock::time_point when_;
  double seconds_;
};

// A 32-bit counter that threads wait on until it reaches a target. Writers issue a wake-up
// system call only when someone is asleep on it.
class Flag {
 public:
  uint32_t Load() const { return value_.load(std::memory_order_acquire); }
  void Store(uint32_t value);
  uint32_t Add(uint32_t delta);  // returns the new value
  // Marks a counter that never reached `target` as abandoned (sets kAbandoned, waking waiters),
  // unless it already reached `target` or was abandoned before. Returns whether this call
  // abandoned it. Used when a rank gives up, so that late peers fail instead of touching the
  // buffers of a rank that has left.
  bool AbandonBelow(uint32_t target);
  static constexpr uint32_t kAbandoned = 1u << 31;
  // Marks the flag abandoned (sets kAbandoned), waking waiters.
  void Abandon();
  // Waits until Load() == target or the flag is abandoned. For round numbers that wrap around
  // (point-to-point slots), where "at least" has no meaning. False when the deadline passed first.
  bool WaitUntilEqual(uint32_t target, const Deadline& deadline, int64_t spin_iterations) const;
  // Waits until Load() has reached `target` in serial-number order (31-bit counters that wrap
  // around; a value up to 2^30 past the target counts as reached) or the flag is abandoned. For
  // progress counters shared between processes, which may run for billions of steps.
  bool WaitReached(uint32_t target, const Deadline& deadline, int64_t spin_iterations) const;
  static bool Reached(uint32_t value, uint32_t target) {
    return ((value - target) & ~kAbandoned) < (1u << 30);
  }
  // Waits until Load() >= target (counters only grow; an abandoned counter satisfies any wait). False when the deadline passed first.
  bool WaitAtLeast(uint32_t target, const Deadline& deadline, int64_t spin_iterations) const;

 private:
  template <typename Done>
  bool Wait(Done done, const Deadline& deadline, int64_t spin_iterations) const;
  void WakeAll();
  std::atomic<uint32_t> value_{0};
  mutable std::atomic<uint32_t> sleepers_{0};
};

// For tests: a stall armed for the next `count` takers, each of which sleeps `seconds`, as a
// thread does that the scheduler leaves without a core.
class CountedStall {
 public:
  void Arm(double seconds, int64_t count) {
    microseconds_.store(static_cast<int64_t>(seconds * 1e6));
    left_.store(count);
  }
  // Sleeps if a stall is left; returns whether it did.
  bool TakeIfArmed() {
    if (left_.load(std::memory_order_relaxed) <= 0 || left_.fetch_sub(1) <= 0) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(microseconds_.load()));
    return true;
  }

 private:
  std::atomic<int64_t> left_{0};
  std::atomic<int64_t> microseconds_{0};
};

}  // namespace jaxring
