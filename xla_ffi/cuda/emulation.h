// Runs CUDA-style kernel code on the host, for tests: every thread block is a team of host
// threads that run the block's body together, share one dynamic shared-memory buffer, and wait
// for each other wherever the body calls SyncThreads (__syncthreads). Blocks run one after
// another. The kernel code asks for its indices through the functions below, which
// cuda/wavenet_sampler.h maps onto threadIdx and friends under nvcc.
//
// It checks what the host can check: indexing, the division of work between threads, and that
// every value read after a SyncThreads was written before it (a missing SyncThreads shows up as a
// wrong or flaky result, as on a GPU). It is not a model of GPU timing.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "kernels/reduce_cpu.h"

namespace jaxring::models::emulation {

// A reusable barrier for the threads of one block (std::barrier is C++20).
class Barrier {
 public:
  explicit Barrier(int count) : count_(count) {}
  void Wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t generation = generation_;
    if (++arrived_ == count_) {
      arrived_ = 0;
      ++generation_;
      released_.notify_all();
      return;
    }
    released_.wait(lock, [&] { return generation_ != generation; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable released_;
  const int count_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
};

struct ThreadContext {
  int thread = 0, block = 0, block_size = 1;
  float* shared = nullptr;
  Barrier* barrier = nullptr;
};

inline ThreadContext& Current() {
  thread_local ThreadContext context;
  return context;
}

inline int ThreadIndex() { return Current().thread; }
inline int BlockIndex() { return Current().block; }
inline int BlockSize() { return Current().block_size; }
inline float* DynamicShared() { return Current().shared; }
inline void SyncThreads() { Current().barrier->Wait(); }
inline float HalfBitsToFloat(uint16_t bits) { return HalfToFloat(bits); }

// Runs body() as `grid` blocks of `block_size` threads, each block with `shared_floats` floats of
// shared memory (filled with NaN, so that reading what nobody wrote shows). Returns false if a
// block wrote past its shared memory (into a guard area behind it).
template <typename Body>
bool Launch(int grid, int block_size, int64_t shared_floats, Body body) {
  constexpr int64_t kGuardFloats = 64;
  constexpr float kGuard = 1234.5f;
  for (int block = 0; block < grid; ++block) {
    std::vector<float> shared(static_cast<size_t>(shared_floats), __builtin_nanf(""));
    shared.resize(static_cast<size_t>(shared_floats + kGuardFloats), kGuard);
    Barrier barrier(block_size);
    std::vector<std::thread> threads;
    for (int thread = 0; thread < block_size; ++thread) {
      threads.emplace_back([&, thread] {
        Current() = ThreadContext{thread, block, block_size, shared.data(), &barrier};
        body();
      });
    }
    for (std::thread& t : threads) t.join();
    for (int64_t i = shared_floats; i < shared_floats + kGuardFloats; ++i) {
      if (shared[i] != kGuard) return false;
    }
  }
  return true;
}

}  // namespace jaxring::models::emulation
