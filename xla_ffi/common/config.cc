#include "common/config.h"

#include <mutex>

namespace jaxring {
namespace {
std::mutex config_mutex;
Config global_config;
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
  std::lock_guard<std::mutex> lock(config_mutex);
  return global_config;
}

void SetConfig(const Config& config) {
  std::lock_guard<std::mutex> lock(config_mutex);
  global_config = config;
}

}  // namespace jaxring
