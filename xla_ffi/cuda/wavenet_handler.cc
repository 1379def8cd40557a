// The FFI handler of the fused WaveNet sampler on CUDA devices (cuda/wavenet_handler.h), which
// launches the kernel of wavenet_kernels.cu on XLA's stream.
#include "cuda/wavenet_handler.h"

#include <cuda_runtime.h>

namespace jaxring::models {
namespace {

namespace ffi = xla::ffi;

struct CudaDevice {
  static constexpr const char* kName = "jaxring_wavenet_sample (CUDA)";
  cudaStream_t stream;

  static std::string Failed(cudaError_t error, const char* what) {
    return error == cudaSuccess ? "" : std::string(what) + ": " + cudaGetErrorString(error);
  }
  std::string ReadTokens(const int32_t* tokens, std::vector<int32_t>& out) const {
    cudaError_t error = cudaMemcpyAsync(out.data(), tokens, out.size() * sizeof(int32_t),
                                        cudaMemcpyDeviceToHost, stream);
    if (error == cudaSuccess) error = cudaStreamSynchronize(stream);
    return Failed(error, "reading the starting tokens");
  }
  std::string Copy(float* to, const float* from, size_t count) const {
    return Failed(cudaMemcpyAsync(to, from, count * sizeof(float), cudaMemcpyDeviceToDevice,
                                  stream),
                  "copying the queues");
  }
  template <typename... Args>
  std::string Launch(Args... args) const {
    return Failed(static_cast<cudaError_t>(LaunchWaveNetSample(stream, args...)),
                  "launching the kernel");
  }
};

ffi::Error SampleCuda(cudaStream_t stream, ffi::AnyBuffer weights,
                      ffi::Buffer<ffi::F32> gate_bias, ffi::Buffer<ffi::F32> local,
                      ffi::Buffer<ffi::F32> noise, ffi::Buffer<ffi::S32> token,
                      ffi::Buffer<ffi::F32> queues, ffi::Buffer<ffi::S32> first_step,
                      ffi::ResultBuffer<ffi::S32> tokens, ffi::ResultBuffer<ffi::F32> queues_out,
                      ffi::ResultBuffer<ffi::F32> logits, int64_t residual, int64_t skip,
                      int64_t hidden, int64_t levels, int64_t local_channels,
                      int64_t panel_width, ffi::Span<const int64_t> dilations, bool, int64_t) {
  CudaDevice device{stream};
  return RunSampleHandler(device, weights, gate_bias, local, noise, token, queues, first_step,
                          tokens, queues_out, logits, residual, skip, hidden, levels,
                          local_channels, panel_width, dilations);
}

}  // namespace
}  // namespace jaxring::models

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxringWaveNetSampleCuda, jaxring::models::SampleCuda,
    JAXRING_WAVENET_SAMPLE_OPERANDS(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()));
