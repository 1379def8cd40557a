#include "common/config.h"

#include <atomic>
#include <cstdint>
#include <mutex>

namespace jaxring {
namespace {
std::mutex config_mutex;
Config global_config;
// Bumped by every SetConfig, so that a thread re-reads the configuration (under the lock) only
// after it changed: every call of every device thread reads it, and changes are rare.
std::atomic<uint64_t> config_version{1};
}  // namespace

const char* AlgorithmName(Algorithm a) {
  switch (a) {
    case Algorithm::kAuto: return "auto";
    case Algorithm::kDirect: return "direct";
    case Algorithm::kRing: return "ring";
  }
  return "unknown";
}

const char* ShmStoresName(ShmStores s) {
  switch (s) {
    case ShmStores::kAuto: return "auto";
    case ShmStores::kPlain: return "plain";
    case ShmStores::kStreaming: return "streaming";
  }
  return "unknown";
}

const char* CpuKernelsName(CpuKernels k) {
  switch (k) {
    case CpuKernels::kAuto: return "auto";
    case CpuKernels::kBaseline: return "baseline";
    case CpuKernels::kAvx2: return "avx2";
    case CpuKernels::kAvx512: return "avx512";
  }
  return "unknown";
}

Config CurrentConfig() {
  thread_local uint64_t seen = 0;
  thread_local Config copy;
  if (config_version.load(std::memory_order_acquire) != seen) {
    std::lock_guard<std::mutex> lock(config_mutex);
    copy = global_config;
    seen = config_version.load(std::memory_order_relaxed);
  }
  return copy;
}

void SetConfig(const Config& config) {
  std::lock_guard<std::mutex> lock(config_mutex);
  global_config = config;
  config_version.fetch_add(1, std::memory_order_release);
}

}  // namespace jaxring
