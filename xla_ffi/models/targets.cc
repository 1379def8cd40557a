#include "models/targets.h"

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* JaxringWaveNetSampleCpu(XLA_FFI_CallFrame*);  // models/wavenet_cpu.cc
XLA_FFI_Error* JaxringWaveNetStageCpu(XLA_FFI_CallFrame*);   // models/wavenet_cpu.cc
XLA_FFI_Error* JaxringWaveNetSampleGpuEmulatedCpu(XLA_FFI_CallFrame*);  // wavenet_gpu_emulated.cc
}

namespace jaxring::models {

std::vector<FfiTarget> CpuTargets() {
  return {
      {"jaxring_wavenet_sample", reinterpret_cast<void*>(JaxringWaveNetSampleCpu)},
      {"jaxring_wavenet_stage", reinterpret_cast<void*>(JaxringWaveNetStageCpu)},
      {"jaxring_wavenet_sample_gpu_emulated",
       reinterpret_cast<void*>(JaxringWaveNetSampleGpuEmulatedCpu)},
  };
}

}  // namespace jaxring::models
