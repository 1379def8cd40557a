// The GPU WaveNet sampler's kernel (cuda/wavenet_sampler.h) run on the host through
// cuda/emulation.h, as the CPU FFI target jaxring_wavenet_sample_gpu_emulated: the same handler
// body as on CUDA (cuda/wavenet_handler.h) over host memory. Tests compare it with the JAX
// samplers, so the kernel is checked on machines without a GPU; it is far too slow for anything
// else (a host thread per GPU thread, meeting at every __syncthreads).
#include <cstring>

#include "cuda/wavenet_handler.h"

namespace jaxring::models {
namespace {

namespace ffi = xla::ffi;

// Threads per emulated block: fewer than the GPU's 256, so that every thread owns several
// columns of each product (the loops' strides) while the test stays quick.
constexpr int kEmulatedThreads = 24;

struct HostDevice {
  static constexpr const char* kName = "jaxring_wavenet_sample_gpu_emulated";

  std::string ReadTokens(const int32_t* tokens, std::vector<int32_t>& out) const {
    std::memcpy(out.data(), tokens, out.size() * sizeof(int32_t));
    return "";
  }
  std::string Copy(float* to, const float* from, size_t count) const {
    std::memcpy(to, from, count * sizeof(float));
    return "";
  }
  template <typename W>
  static std::string Run(const W* w, const WaveNetLayout& layout, const WaveNetSizes& s,
                         int64_t steps, const int32_t* first_step, const float* gate_bias,
                         const float* local, const float* noise, const int32_t* token,
                         float* queues, int32_t* tokens_out, float* logits_out) {
    const bool within = emulation::Launch(s.batch, kEmulatedThreads, SharedFloats(s), [&] {
      sampler_kernel::SampleBlock(w, layout, s, steps, first_step, gate_bias, local, noise,
                                  token, queues, tokens_out, logits_out);
    });
    return within ? "" : "the kernel wrote past the shared memory SharedFloats() gives it";
  }
  template <typename... Args>
  std::string Launch(const void* weights, bool half, Args... args) const {
    if (half) return Run(static_cast<const uint16_t*>(weights), args...);
    return Run(static_cast<const float*>(weights), args...);
  }
};

ffi::Error SampleEmulated(ffi::AnyBuffer weights, ffi::Buffer<ffi::F32> gate_bias,
                          ffi::Buffer<ffi::F32> local, ffi::Buffer<ffi::F32> noise,
                          ffi::Buffer<ffi::S32> token, ffi::Buffer<ffi::F32> queues,
                          ffi::Buffer<ffi::S32> first_step, ffi::ResultBuffer<ffi::S32> tokens,
                          ffi::ResultBuffer<ffi::F32> queues_out,
                          ffi::ResultBuffer<ffi::F32> logits, int64_t residual, int64_t skip,
                          int64_t hidden, int64_t levels, int64_t local_channels,
                          int64_t panel_width, ffi::Span<const int64_t> dilations, bool, int64_t) {
  HostDevice device;
  return RunSampleHandler(device, weights, gate_bias, local, noise, token, queues, first_step,
                          tokens, queues_out, logits, residual, skip, hidden, levels,
                          local_channels, panel_width, dilations);
}

}  // namespace
}  // namespace jaxring::models

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringWaveNetSampleGpuEmulatedCpu,
                              jaxring::models::SampleEmulated,
                              JAXRING_WAVENET_SAMPLE_OPERANDS(xla::ffi::Ffi::Bind()));
