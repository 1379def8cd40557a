// The fused WaveNet sampler's CUDA kernel: cuda/wavenet_sampler.h's SampleBlock, one persistent
// block per stream. Its FFI handler is wavenet_handler.cc.
#include <cuda_runtime.h>

#include <mutex>

#include "cuda/wavenet_sampler.h"

namespace jaxring::models {
namespace {

constexpr int kThreads = 256;

template <typename W>
__global__ void __launch_bounds__(kThreads)
    SampleKernel(const W* weights, WaveNetLayout layout, WaveNetSizes sizes, int64_t steps,
                 const int32_t* first_step, const float* gate_bias, const float* local,
                 const float* noise, const int32_t* token, float* queues, int32_t* tokens_out,
                 float* logits_out) {
  sampler_kernel::SampleBlock(weights, layout, sizes, steps, first_step, gate_bias, local, noise,
                              token, queues, tokens_out, logits_out);
}

template <typename W>
cudaError_t Launch(cudaStream_t stream, const W* weights, const WaveNetLayout& layout,
                   const WaveNetSizes& s, int64_t steps, const int32_t* first_step,
                   const float* gate_bias, const float* local, const float* noise,
                   const int32_t* token, float* queues, int32_t* tokens_out, float* logits_out) {
  // cudaGetLastError() below reports what these launches did, not an error left on this thread
  // by earlier, unrelated runtime calls.
  (void)cudaGetLastError();
  const size_t shared_bytes = sizeof(float) * SharedFloats(s);
  // The attribute is the kernel's, for the whole process: without the lock, a thread launching a
  // model that needs less could lower it between another's setting and launch.
  static std::mutex launching;
  std::lock_guard<std::mutex> lock(launching);
  if (shared_bytes > 48 * 1024) {
    const cudaError_t error = cudaFuncSetAttribute(
        SampleKernel<W>, cudaFuncAttributeMaxDynamicSharedMemorySize,
        static_cast<int>(shared_bytes));
    if (error != cudaSuccess) return error;
  }
  if (steps > 0 && s.batch > 0) {
    SampleKernel<W><<<s.batch, kThreads, shared_bytes, stream>>>(
        weights, layout, s, steps, first_step, gate_bias, local, noise, token, queues,
        tokens_out, logits_out);
  }
  return cudaGetLastError();
}

}  // namespace

int LaunchWaveNetSample(void* stream, const void* weights, bool half_weights,
                        const WaveNetLayout& layout, const WaveNetSizes& sizes, int64_t steps,
                        const int32_t* first_step, const float* gate_bias, const float* local,
                        const float* noise, const int32_t* token, float* queues,
                        int32_t* tokens_out, float* logits_out) {
  auto* s = static_cast<cudaStream_t>(stream);
  if (half_weights)
    return Launch(s, static_cast<const uint16_t*>(weights), layout, sizes, steps, first_step,
                  gate_bias, local, noise, token, queues, tokens_out, logits_out);
  return Launch(s, static_cast<const float*>(weights), layout, sizes, steps, first_step,
                gate_bias, local, noise, token, queues, tokens_out, logits_out);
}

}  // namespace jaxring::models
