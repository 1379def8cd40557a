#include "cpu/handoff.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

#if defined(__linux__)
#include <pthread.h>
#endif

namespace jaxring {
namespace {

// A thread that found no task for this long exits (a program that waits for peers again later
// starts a new one, which costs tens of microseconds once).
constexpr std::chrono::seconds kIdleExit{30};

class Threads {
 public:
  static Threads& Get() {
    static Threads* threads = new Threads();  // never destroyed: its threads may outlive exit
    return *threads;
  }

  void Run(std::function<void()> task) {
    std::unique_lock<std::mutex> lock(mutex_);
    tasks_.push_back(std::move(task));
    // Every queued task needs an idle thread of its own: a task may block until a later one runs.
    if (tasks_.size() > static_cast<size_t>(idle_)) {
      try {
        std::thread([this] { Work(); }).detach();
      } catch (...) {  // no thread to be had: the caller runs the task itself
        tasks_.pop_back();
        throw;
      }
    } else {
      ready_.notify_one();
    }
  }

 private:
  void Work() {
#if defined(__linux__)
    pthread_setname_np(pthread_self(), "jaxring-wait");
#endif
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      if (tasks_.empty()) {
        ++idle_;
        const bool woken = ready_.wait_for(lock, kIdleExit, [this] { return !tasks_.empty(); });
        --idle_;
        if (!woken) return;
      }
      std::function<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task();
      task = nullptr;  // release what it holds before sleeping
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> tasks_;
  int idle_ = 0;
};

std::atomic<int64_t> hand_offs{0};

}  // namespace

void HandOff(std::function<void()> task) {
  Threads::Get().Run(std::move(task));
  hand_offs.fetch_add(1, std::memory_order_relaxed);
}

int64_t HandOffCount() { return hand_offs.load(std::memory_order_relaxed); }

}  // namespace jaxring
