#include "models/targets.h"

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* JaxringWaveNetSampleCpu(XLA_FFI_CallFrame*);  // models/wavenet_cpu.cc
}

namespace jaxring::models {

std::vector<FfiTarget> CpuTargets() {
  return {
      {"jaxring_wavenet_sample", reinterpret_cast<void*>(JaxringWaveNetSampleCpu)},
  };
}

}  // namespace jaxring::models
