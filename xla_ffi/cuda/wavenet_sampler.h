// The fused WaveNet sampler's GPU kernel, written once for two compilers: nvcc builds it into
// libjaxring_cuda.so (wavenet_kernels.cu, launched by wavenet_handler.cc), and the host compiler
// builds the same code into the CPU extension, where cuda/emulation.h runs each thread block as a
// team of host threads that meet at every __syncthreads (models/wavenet_gpu_emulated.cc). Tests
// run the emulated kernel against the JAX samplers, so the kernel's indexing, synchronisation and
// sampling rule are checked on every machine, not only on a GPU.
//
// One persistent thread block per stream runs every step of a chunk without returning to the
// host, as nv-wavenet's persistent kernels do: the residual stream, the skip sum and the
// activations stay in shared memory, the weights are read from global memory (the 64/256/20
// model's 3 MB stay in L2 from step to step), and each block keeps its last token on chip for the
// next step's embedding. Within a step each thread owns columns of every product: column c of a
// panel-stored matrix is read down its rows by one thread and neighbouring threads read
// neighbouring columns, so every weight load is coalesced. The sampling rule is sampler.py's
// (inverse CDF of the softmax, one uniform number per stream and step), with the running sum
// taken in level order by one thread, the order in which the CPU kernel adds.
//
// Not here yet: spreading one stream over several SMs (nv-wavenet's layer-parallel variant),
// which batch 1 needs to use more than one SM.
#pragma once

#include <math.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "models/wavenet_layout.h"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define JR_DEVICE __device__
#else
#include "cuda/emulation.h"
#define JR_DEVICE
#endif

namespace jaxring::models {

constexpr int kMaxLayers = 256;

struct WaveNetSizes {
  int32_t residual, skip, hidden, levels, local_channels, panel_width, batch, layers;
  int32_t dilation[kMaxLayers];
  int32_t queue_offset[kMaxLayers];  // first row of layer i's ring buffer in the queues
};

inline WaveNetLayout LayoutOf(const WaveNetSizes& s) {
  return WaveNetLayout(s.residual, s.skip, s.hidden, s.levels, s.local_channels, s.layers);
}

// Floats of shared memory one block uses: h, x, z, a, y, the skip sum, the hidden units, the
// logits and their running sum (SampleBlock carves them in this order), and the token.
inline int64_t SharedFloats(const WaveNetSizes& s) {
  return 7 * int64_t{s.residual} + 2 * int64_t{s.skip} + s.hidden + 2 * s.levels + 1;
}

// Checks the call (CheckSampleShapes, and at most kMaxLayers layers), then fills `s` and the
// number of steps; returns what is wrong with the call, or "" if nothing.
inline std::string PlanSample(const SampleShapes& in, WaveNetSizes* s, int64_t* steps) {
  if (std::string error = CheckSampleShapes(in); !error.empty()) return error;
  if (in.layers < 1 || in.layers > kMaxLayers)
    return "1 to " + std::to_string(kMaxLayers) + " layers, got " + std::to_string(in.layers);
  *s = WaveNetSizes{};
  s->residual = static_cast<int32_t>(in.residual);
  s->skip = static_cast<int32_t>(in.skip);
  s->hidden = static_cast<int32_t>(in.hidden);
  s->levels = static_cast<int32_t>(in.levels);
  s->local_channels = static_cast<int32_t>(in.local_channels);
  s->panel_width = static_cast<int32_t>(in.panel_width);
  s->batch = static_cast<int32_t>(in.batch);
  s->layers = static_cast<int32_t>(in.layers);
  int64_t queue_rows = 0;
  for (int64_t i = 0; i < in.layers; ++i) {
    s->dilation[i] = static_cast<int32_t>(in.dilations[i]);
    s->queue_offset[i] = static_cast<int32_t>(queue_rows);
    queue_rows += in.dilations[i];
  }
  *steps = in.noise_rows;
  return "";
}

// Launches the kernel on `stream` (a cudaStream_t): one block per stream of the batch. The
// weights are float16 bits if `half_weights`, else float32; every pointer is device memory and
// `logits_out` may be null. Returns a cudaError_t (0: launched). wavenet_kernels.cu.
int LaunchWaveNetSample(void* stream, const void* weights, bool half_weights,
                        const WaveNetLayout& layout, const WaveNetSizes& sizes, int64_t steps,
                        const int32_t* first_step, const float* gate_bias, const float* local,
                        const float* noise, const int32_t* token, float* queues,
                        int32_t* tokens_out, float* logits_out);

namespace sampler_kernel {

#if defined(__CUDACC__)
__device__ inline int ThreadIndex() { return threadIdx.x; }
__device__ inline int BlockIndex() { return blockIdx.x; }
__device__ inline int BlockSize() { return blockDim.x; }
__device__ inline void SyncThreads() { __syncthreads(); }
__device__ inline float* DynamicShared() {
  extern __shared__ float dynamic_shared[];
  return dynamic_shared;
}
__device__ inline float Load(const uint16_t* w, int64_t i) {
  return __half2float(__ushort_as_half(w[i]));
}
#else
using emulation::BlockIndex;
using emulation::BlockSize;
using emulation::DynamicShared;
using emulation::SyncThreads;
using emulation::ThreadIndex;
inline float Load(const uint16_t* w, int64_t i) { return emulation::HalfBitsToFloat(w[i]); }
#endif
JR_DEVICE inline float Load(const float* w, int64_t i) { return w[i]; }

// y[c] (+)= sum_k x[k] w[k, c] for c < cols, w [rows, cols] in column panels of `panel` columns
// (the last one narrower), each panel row-major. Thread t handles columns t, t + block size, ...
template <typename W>
JR_DEVICE void Gemv(const W* w, int rows, int cols, int panel, const float* x, float* y) {
  for (int c = ThreadIndex(); c < cols; c += BlockSize()) {
    const int p = c / panel;
    const int width = cols - p * panel < panel ? cols - p * panel : panel;
    const W* column = w + int64_t{rows} * p * panel + (c - p * panel);
    float sum = y[c];
    for (int k = 0; k < rows; ++k) sum += x[k] * Load(column, int64_t{k} * width);
    y[c] = sum;
  }
}

template <typename W>
JR_DEVICE void CopyRow(const W* w, int n, float* out) {
  for (int c = ThreadIndex(); c < n; c += BlockSize()) out[c] = Load(w, c);
}

// Every step of one stream (this block's): fused_sampler.py's operands, on the device.
template <typename W>
JR_DEVICE void SampleBlock(const W* weights, const WaveNetLayout& layout, const WaveNetSizes& s,
                           int64_t steps, const int32_t* first_step_ptr, const float* gate_bias,
                           const float* local, const float* noise, const int32_t* token_in,
                           float* queues, int32_t* tokens_out, float* logits_out) {
  const int r = s.residual, skip = s.skip, b = BlockIndex(), batch = s.batch;
  const int me = ThreadIndex(), threads = BlockSize();
  float* h = DynamicShared();         // residual stream [r]
  float* x = h + r;                   // [current; past] [2r]
  float* z = x + 2 * r;               // gate pre-activations [2r]
  float* a = z + 2 * r;               // gated activations [r]
  float* y = a + r;                   // residual and skip outputs [r + skip]
  float* skip_sum = y + r + skip;     // [skip]
  float* hidden = skip_sum + skip;    // [hidden]
  float* logits = hidden + s.hidden;  // [levels]
  float* cdf = logits + s.levels;     // [levels]
  int32_t* token = reinterpret_cast<int32_t*>(cdf + s.levels);
  if (me == 0) *token = token_in[b];
  const int64_t first_step = *first_step_ptr;
  const W* layer0 = weights + layout.first_layer;
  for (int64_t step = 0; step < steps; ++step) {
    const int64_t t = first_step + step;
    SyncThreads();
    CopyRow(weights + layout.embedding + int64_t{*token} * r, r, h);
    for (int c = me; c < skip; c += threads) skip_sum[c] = 0.0f;
    for (int i = 0; i < s.layers; ++i) {
      const W* layer = layer0 + i * layout.layer_stride;
      float* slot = queues + ((int64_t{s.queue_offset[i]} + t % s.dilation[i]) * batch + b) * r;
      SyncThreads();
      for (int c = me; c < r; c += threads) {
        x[c] = h[c];
        x[r + c] = slot[c];
        slot[c] = h[c];
      }
      const float* bias = gate_bias + (int64_t{i} * batch + b) * 2 * r;
      for (int c = me; c < 2 * r; c += threads) z[c] = bias[c];
      SyncThreads();
      Gemv(layer + layout.gate, 2 * r, 2 * r, s.panel_width, x, z);
      if (s.local_channels > 0) {
        Gemv(layer + layout.local, s.local_channels, 2 * r, s.panel_width,
             local + (step * batch + b) * s.local_channels, z);
      }
      SyncThreads();
      for (int c = me; c < r; c += threads) {
        a[c] = tanhf(z[c]) * (1.0f / (1.0f + expf(-z[r + c])));
      }
      // The last layer's residual output is never read: its skip columns only.
      const bool last = i + 1 == s.layers;
      CopyRow(layer + layout.biases, r + skip, y);
      SyncThreads();
      if (!last) Gemv(layer + layout.residual, r, r, s.panel_width, a, y);
      Gemv(layer + layout.skip, r, skip, s.panel_width, a, y + r);
      SyncThreads();
      if (!last) {
        for (int c = me; c < r; c += threads) h[c] += y[c];
      }
      for (int c = me; c < skip; c += threads) skip_sum[c] += y[r + c];
    }
    // Output layers: relu -> dense -> relu -> dense, then sample.
    SyncThreads();
    for (int c = me; c < skip; c += threads) skip_sum[c] = skip_sum[c] > 0.0f ? skip_sum[c] : 0.0f;
    CopyRow(weights + layout.hidden_bias, s.hidden, hidden);
    SyncThreads();
    Gemv(weights + layout.hidden, skip, s.hidden, s.panel_width, skip_sum, hidden);
    SyncThreads();
    for (int c = me; c < s.hidden; c += threads) hidden[c] = hidden[c] > 0.0f ? hidden[c] : 0.0f;
    CopyRow(weights + layout.logits_bias, s.levels, logits);
    SyncThreads();
    Gemv(weights + layout.logits, s.hidden, s.levels, s.panel_width, hidden, logits);
    SyncThreads();
    if (logits_out != nullptr) {
      float* row = logits_out + (step * batch + b) * s.levels;
      for (int c = me; c < s.levels; c += threads) row[c] = logits[c];
    }
    if (me == 0) {
      float max = logits[0];
      for (int q = 1; q < s.levels; ++q) max = logits[q] > max ? logits[q] : max;
      cdf[0] = max;
    }
    SyncThreads();
    const float max = cdf[0];
    SyncThreads();
    for (int c = me; c < s.levels; c += threads) cdf[c] = expf(logits[c] - max);
    SyncThreads();
    if (me == 0) {
      // The running sum in level order (as the CPU kernel adds), then the first level above it.
      float total = 0.0f;
      for (int q = 0; q < s.levels; ++q) cdf[q] = total += cdf[q];
      const float threshold = noise[step * batch + b] * total;
      int below = 0;
      for (int q = 0; q < s.levels; ++q) below += cdf[q] <= threshold;
      *token = below < s.levels - 1 ? below : s.levels - 1;
      tokens_out[step * batch + b] = *token;
    }
  }
}

}  // namespace sampler_kernel
}  // namespace jaxring::models

#undef JR_DEVICE
