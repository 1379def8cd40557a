// The fused WaveNet sampler for CPU: many sample steps of every stream inside one XLA custom call.
//
// Per-op overhead dominates one WaveNet step when it is a graph of small ops; here one step is a
// loop over the layers with the weights packed once, contiguous, in the order the step reads
// them, and every weight row loaded once per step for all streams (each streamed weight meets B
// streams). Python side: models/wavenet/fused_sampler.py, which packs the weights (the layout
// below is written down there too, in `pack_weights`) and checks the result against the JAX
// samplers' math.
//
// Packed weights (float32 or float16), in this order:
//   embedding   [levels, residual]
//   per layer:  gate [2 * residual (current rows, then past rows), 2 * residual]
//               residual_skip [residual, residual + skip] (residual columns, then skip columns)
//               residual_skip_bias [residual + skip]
//               local [local_channels, 2 * residual]            (only when local_channels > 0)
//   hidden [skip, hidden], hidden_bias [hidden], logits [hidden, levels], logits_bias [levels]
// The gate bias is an operand of its own, [layers, batch, 2 * residual]: the layer's bias plus
// the stream's speaker embedding (global conditioning is a per-stream constant).
//
// Queues (Fast WaveNet, Paine et al. 2016): for each layer a ring of its last `dilation` inputs,
// [sum of dilations, batch, residual]; layer i's slot for step t is t % dilation_i.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "kernels/reduce_cpu.h"
#include "models/targets.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxring::models {
namespace {

// ------------------------------------------------------------------------------------------------
// Kernels. y[b, n] = (accumulate ? y[b, n] : 0) + sum_k x[b, k] * w[k, n] for b < batch, n < cols;
// w is row-major with leading dimension ld, x and y have row strides x_stride and y_stride.

inline float ToFloat(float w) { return w; }
inline float ToFloat(uint16_t w) { return HalfToFloat(w); }

template <typename W>
void GemvPortable(const W* w, int64_t ld, int64_t rows, int64_t cols, const float* x,
                  int64_t x_stride, int64_t batch, float* y, int64_t y_stride, bool accumulate) {
  for (int64_t b = 0; b < batch; ++b) {
    float* out = y + b * y_stride;
    if (!accumulate) std::memset(out, 0, cols * sizeof(float));
    for (int64_t k = 0; k < rows; ++k) {
      const float xk = x[b * x_stride + k];
      const W* row = w + k * ld;
      for (int64_t n = 0; n < cols; ++n) out[n] += xk * ToFloat(row[n]);
    }
  }
}

__attribute__((target("avx2,fma,f16c"))) inline __m256 Load8(const float* p) {
  return _mm256_loadu_ps(p);
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 Load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// A tile of kStreams streams x kVectors * 8 columns, accumulated in registers over all rows: the
// weights of the tile are loaded once for kStreams streams.
template <int kStreams, int kVectors, typename W>
__attribute__((target("avx2,fma,f16c"))) inline void GemvTileAvx2(
    const W* w, int64_t ld, int64_t rows, const float* x, int64_t x_stride, float* y,
    int64_t y_stride, bool accumulate) {
  __m256 acc[kStreams][kVectors];
  for (int s = 0; s < kStreams; ++s) {
    for (int v = 0; v < kVectors; ++v) {
      acc[s][v] = accumulate ? _mm256_loadu_ps(y + s * y_stride + 8 * v) : _mm256_setzero_ps();
    }
  }
  for (int64_t k = 0; k < rows; ++k) {
    const W* row = w + k * ld;
    __m256 xk[kStreams];
    for (int s = 0; s < kStreams; ++s) xk[s] = _mm256_broadcast_ss(x + s * x_stride + k);
    for (int v = 0; v < kVectors; ++v) {
      const __m256 wv = Load8(row + 8 * v);
      for (int s = 0; s < kStreams; ++s) acc[s][v] = _mm256_fmadd_ps(xk[s], wv, acc[s][v]);
    }
  }
  for (int s = 0; s < kStreams; ++s) {
    for (int v = 0; v < kVectors; ++v) _mm256_storeu_ps(y + s * y_stride + 8 * v, acc[s][v]);
  }
}

template <int kStreams, int kVectors, typename W>
__attribute__((target("avx2,fma,f16c"))) void GemvStreamsAvx2(
    const W* w, int64_t ld, int64_t rows, int64_t cols, const float* x, int64_t x_stride,
    float* y, int64_t y_stride, bool accumulate) {
  int64_t n = 0;
  for (; n + 8 * kVectors <= cols; n += 8 * kVectors) {
    GemvTileAvx2<kStreams, kVectors>(w + n, ld, rows, x, x_stride, y + n, y_stride, accumulate);
  }
  for (; n < cols; n += 8) {
    GemvTileAvx2<kStreams, 1>(w + n, ld, rows, x, x_stride, y + n, y_stride, accumulate);
  }
}

// Register blocking by the number of streams left: 16 ymm registers hold the accumulators, the
// broadcast inputs and one weight vector. One stream gets 8 vectors so that 8 independent FMA
// chains hide the FMA latency.
template <typename W>
__attribute__((target("avx2,fma,f16c"))) void GemvAvx2(const W* w, int64_t ld, int64_t rows,
                                                         int64_t cols, const float* x,
                                                         int64_t x_stride, int64_t batch,
                                                         float* y, int64_t y_stride,
                                                         bool accumulate) {
  int64_t b = 0;
  for (; b + 4 <= batch; b += 4) {
    GemvStreamsAvx2<4, 2>(w, ld, rows, cols, x + b * x_stride, x_stride, y + b * y_stride,
                          y_stride, accumulate);
  }
  for (; b + 2 <= batch; b += 2) {
    GemvStreamsAvx2<2, 4>(w, ld, rows, cols, x + b * x_stride, x_stride, y + b * y_stride,
                          y_stride, accumulate);
  }
  for (; b < batch; ++b) {
    GemvStreamsAvx2<1, 8>(w, ld, rows, cols, x + b * x_stride, x_stride, y + b * y_stride,
                          y_stride, accumulate);
  }
}

// exp(x) for 8 floats: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two parts for an exact
// reduction), e^r by its degree-6 Taylor polynomial (error below 2^-24 on that interval), times
// 2^n through the exponent bits. Inputs are clamped to [-87, 87], where float32 e^x is finite.
__attribute__((target("avx2,fma,f16c"))) inline __m256 Exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i exponent = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

// a = tanh(z[:R]) * sigmoid(z[R:]) (WaveNet equation 2), tanh(u) = 1 - 2 / (e^{2u} + 1) and
// sigmoid(v) = 1 / (1 + e^{-v}), with exact divisions.
__attribute__((target("avx2,fma,f16c"))) void GateAvx2(const float* z, int64_t residual,
                                                         float* a) {
  const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
  for (int64_t c = 0; c < residual; c += 8) {
    const __m256 u = _mm256_loadu_ps(z + c), v = _mm256_loadu_ps(z + residual + c);
    const __m256 tanh_u =
        _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(Exp8(_mm256_add_ps(u, u)), one)));
    const __m256 sigmoid_v =
        _mm256_div_ps(one, _mm256_add_ps(one, Exp8(_mm256_sub_ps(_mm256_setzero_ps(), v))));
    _mm256_storeu_ps(a + c, _mm256_mul_ps(tanh_u, sigmoid_v));
  }
}

void GatePortable(const float* z, int64_t residual, float* a) {
  for (int64_t c = 0; c < residual; ++c) {
    a[c] = std::tanh(z[c]) / (1.0f + std::exp(-z[residual + c]));
  }
}

bool CpuHasAvx2Fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
}

// ------------------------------------------------------------------------------------------------
// The sampler.

struct Sizes {
  int64_t residual, skip, hidden, levels, local_channels, batch;
  std::vector<int64_t> dilations;
};

// The streams [first, first + count) of a batch of `total` that one thread samples.
struct Streams {
  int64_t first, count, total;
};

template <typename W>
struct PackedWeights {
  struct Layer {
    const W* gate;
    const W* residual_skip;
    const W* residual_skip_bias;
    const W* local;
  };
  const W* embedding;
  std::vector<Layer> layers;
  const W* hidden;
  const W* hidden_bias;
  const W* logits;
  const W* logits_bias;
  int64_t count;  // elements in all

  PackedWeights(const W* base, const Sizes& s) {
    const W* p = base;
    embedding = p;
    p += s.levels * s.residual;
    for (size_t i = 0; i < s.dilations.size(); ++i) {
      Layer layer;
      layer.gate = p;
      p += 4 * s.residual * s.residual;
      layer.residual_skip = p;
      p += s.residual * (s.residual + s.skip);
      layer.residual_skip_bias = p;
      p += s.residual + s.skip;
      layer.local = p;
      p += s.local_channels * 2 * s.residual;
      layers.push_back(layer);
    }
    hidden = p;
    p += s.skip * s.hidden;
    hidden_bias = p;
    p += s.hidden;
    logits = p;
    p += s.hidden * s.levels;
    logits_bias = p;
    p += s.levels;
    count = p - base;
  }
};

template <typename W>
class Sampler {
 public:
  Sampler(const PackedWeights<W>& weights, const Sizes& sizes, Streams streams, bool allow_simd)
      : w_(weights),
        s_(sizes),
        streams_(streams),
        avx2_(allow_simd && CpuHasAvx2Fma() && Multiple8()) {
    const int64_t b = streams_.count, r = s_.residual;
    // The few vectors read element by element are kept in float32 (converted once per call).
    embedding_ = ToFloats(w_.embedding, s_.levels * r);
    for (const auto& layer : w_.layers) {
      layer_biases_.push_back(ToFloats(layer.residual_skip_bias, r + s_.skip));
    }
    hidden_bias_ = ToFloats(w_.hidden_bias, s_.hidden);
    logits_bias_ = ToFloats(w_.logits_bias, s_.levels);
    h_.resize(b * r);
    x_.resize(b * 2 * r);
    z_.resize(b * 2 * r);
    a_.resize(b * r);
    y_.resize(b * (r + s_.skip));
    skip_sum_.resize(b * s_.skip);
    hidden_.resize(b * s_.hidden);
    logits_.resize(b * s_.levels);
    int64_t offset = 0;
    for (int64_t d : s_.dilations) {
      queue_offsets_.push_back(offset);
      offset += d;
    }
  }

  // One step for this sampler's streams: tokens[b] (the previous samples) in, tokens[b] out.
  // The other pointers are the whole batch's (this step's local, noise and logits rows).
  void Step(int64_t t, const float* gate_bias, const float* local, const float* noise,
            int32_t* tokens, float* queues, float* logits_out) {
    const int64_t b_count = streams_.count, r = s_.residual, skip = s_.skip;
    const int64_t first = streams_.first, total = streams_.total;
    local += first * s_.local_channels;
    noise += first * s_.levels;
    for (int64_t b = 0; b < b_count; ++b) {
      std::memcpy(&h_[b * r], &embedding_[static_cast<int64_t>(tokens[b]) * r],
                  r * sizeof(float));
    }
    std::fill(skip_sum_.begin(), skip_sum_.end(), 0.0f);
    const int64_t layers = static_cast<int64_t>(s_.dilations.size());
    for (int64_t i = 0; i < layers; ++i) {
      const auto& layer = w_.layers[i];
      float* slot = queues + ((queue_offsets_[i] + t % s_.dilations[i]) * total + first) * r;
      for (int64_t b = 0; b < b_count; ++b) {
        std::memcpy(&x_[b * 2 * r], &h_[b * r], r * sizeof(float));
        std::memcpy(&x_[b * 2 * r + r], slot + b * r, r * sizeof(float));
        std::memcpy(slot + b * r, &h_[b * r], r * sizeof(float));
      }
      std::memcpy(z_.data(), gate_bias + (i * total + first) * 2 * r,
                  b_count * 2 * r * sizeof(float));
      Gemv(layer.gate, 2 * r, 2 * r, 2 * r, x_.data(), 2 * r, z_.data(), 2 * r, true);
      if (s_.local_channels > 0) {
        Gemv(layer.local, 2 * r, s_.local_channels, 2 * r, local, s_.local_channels, z_.data(),
             2 * r, true);
      }
      for (int64_t b = 0; b < b_count; ++b) Gate(&z_[b * 2 * r], r, &a_[b * r]);
      // The last layer's residual output is never read: compute its skip columns only.
      const bool last = i + 1 == layers;
      const int64_t first_col = last ? r : 0, cols = r + skip - first_col;
      for (int64_t b = 0; b < b_count; ++b) {
        std::memcpy(&y_[b * (r + skip) + first_col], &layer_biases_[i][first_col],
                    cols * sizeof(float));
      }
      Gemv(layer.residual_skip + first_col, r + skip, r, cols, a_.data(), r,
           y_.data() + first_col, r + skip, true);
      for (int64_t b = 0; b < b_count; ++b) {
        const float* y = &y_[b * (r + skip)];
        if (!last) {
          for (int64_t c = 0; c < r; ++c) h_[b * r + c] += y[c];
        }
        for (int64_t c = 0; c < skip; ++c) skip_sum_[b * skip + c] += y[r + c];
      }
    }
    // Output layers: relu -> dense -> relu -> dense, then Gumbel-max.
    for (float& v : skip_sum_) v = v > 0.0f ? v : 0.0f;
    SetBias(hidden_.data(), hidden_bias_, s_.hidden);
    Gemv(w_.hidden, s_.hidden, skip, s_.hidden, skip_sum_.data(), skip, hidden_.data(), s_.hidden,
         true);
    for (float& v : hidden_) v = v > 0.0f ? v : 0.0f;
    SetBias(logits_.data(), logits_bias_, s_.levels);
    Gemv(w_.logits, s_.levels, s_.hidden, s_.levels, hidden_.data(), s_.hidden, logits_.data(),
         s_.levels, true);
    for (int64_t b = 0; b < b_count; ++b) {
      const float* logits = &logits_[b * s_.levels];
      const float* gumbel = noise + b * s_.levels;
      int32_t best = 0;
      float best_value = logits[0] + gumbel[0];
      for (int64_t q = 1; q < s_.levels; ++q) {
        const float value = logits[q] + gumbel[q];
        if (value > best_value) {  // ties keep the first index, as jnp.argmax
          best_value = value;
          best = static_cast<int32_t>(q);
        }
      }
      tokens[b] = best;
    }
    if (logits_out != nullptr) {
      std::memcpy(logits_out + first * s_.levels, logits_.data(), logits_.size() * sizeof(float));
    }
  }

 private:
  bool Multiple8() const {
    return s_.residual % 8 == 0 && s_.skip % 8 == 0 && s_.hidden % 8 == 0 &&
           s_.levels % 8 == 0 && s_.local_channels % 8 == 0;
  }

  void SetBias(float* y, const std::vector<float>& bias, int64_t n) {
    for (int64_t b = 0; b < streams_.count; ++b) {
      std::memcpy(y + b * n, bias.data(), n * sizeof(float));
    }
  }

  static std::vector<float> ToFloats(const W* w, int64_t n) {
    std::vector<float> out(n);
    for (int64_t i = 0; i < n; ++i) out[i] = ToFloat(w[i]);
    return out;
  }

  void Gemv(const W* w, int64_t ld, int64_t rows, int64_t cols, const float* x, int64_t x_stride,
            float* y, int64_t y_stride, bool accumulate) {
    if (avx2_) {
      GemvAvx2(w, ld, rows, cols, x, x_stride, streams_.count, y, y_stride, accumulate);
    } else {
      GemvPortable(w, ld, rows, cols, x, x_stride, streams_.count, y, y_stride, accumulate);
    }
  }

  void Gate(const float* z, int64_t residual, float* a) {
    if (avx2_) {
      GateAvx2(z, residual, a);
    } else {
      GatePortable(z, residual, a);
    }
  }

  const PackedWeights<W>& w_;
  const Sizes& s_;
  const Streams streams_;
  const bool avx2_;
  std::vector<float> embedding_, hidden_bias_, logits_bias_;
  std::vector<std::vector<float>> layer_biases_;
  std::vector<int64_t> queue_offsets_;
  std::vector<float> h_, x_, z_, a_, y_, skip_sum_, hidden_, logits_;
};

template <typename W>
ffi::Error Run(const W* weights, int64_t weight_count, const Sizes& sizes, bool allow_simd,
               int64_t threads, int64_t steps,
               int64_t first_step, const float* gate_bias, const float* local, const float* noise,
               const int32_t* token, float* queues, int32_t* tokens_out, float* logits_out) {
  const PackedWeights<W> packed(weights, sizes);
  if (packed.count != weight_count) {
    return ffi::Error::InvalidArgument(
        "jaxring_wavenet_sample: the packed weights have " + std::to_string(weight_count) +
        " elements, the sizes given need " + std::to_string(packed.count));
  }
  for (int64_t b = 0; b < sizes.batch; ++b) {
    if (token[b] < 0 || token[b] >= sizes.levels) {
      return ffi::Error::InvalidArgument("jaxring_wavenet_sample: stream " + std::to_string(b) +
                                         " starts from token " + std::to_string(token[b]) +
                                         ", outside [0, " + std::to_string(sizes.levels) + ")");
    }
  }
  // Streams are independent: each thread samples its share of them for every step, with no
  // synchronisation; all threads read the same packed weights.
  const int64_t b = sizes.batch;
  const int64_t thread_count = std::max<int64_t>(1, std::min<int64_t>(threads, b));
  auto sample_streams = [&](int64_t index) {
    const int64_t first = b * index / thread_count, last = b * (index + 1) / thread_count;
    Sampler<W> sampler(packed, sizes, Streams{first, last - first, b}, allow_simd);
    std::vector<int32_t> current(token + first, token + last);
    for (int64_t step = 0; step < steps; ++step) {
      sampler.Step(first_step + step, gate_bias, local + step * b * sizes.local_channels,
                   noise + step * b * sizes.levels, current.data(), queues,
                   logits_out == nullptr ? nullptr : logits_out + step * b * sizes.levels);
      std::memcpy(tokens_out + step * b + first, current.data(),
                  (last - first) * sizeof(int32_t));
    }
  };
  std::vector<std::thread> workers;
  for (int64_t index = 1; index < thread_count; ++index) workers.emplace_back(sample_streams, index);
  sample_streams(0);
  for (std::thread& worker : workers) worker.join();
  return ffi::Error::Success();
}

ffi::Error WaveNetSampleImpl(ffi::AnyBuffer weights, ffi::Buffer<ffi::F32> gate_bias,
                             ffi::Buffer<ffi::F32> local, ffi::Buffer<ffi::F32> noise,
                             ffi::Buffer<ffi::S32> token, ffi::Buffer<ffi::F32> queues,
                             ffi::Buffer<ffi::S32> first_step,
                             ffi::ResultBuffer<ffi::S32> tokens,
                             ffi::ResultBuffer<ffi::F32> queues_out,
                             ffi::ResultBuffer<ffi::F32> logits, int64_t residual, int64_t skip,
                             int64_t hidden, int64_t levels, int64_t local_channels,
                             ffi::Span<const int64_t> dilations, bool portable,
                             int64_t threads) {
  Sizes sizes{residual, skip, hidden, levels, local_channels, token.element_count(),
              std::vector<int64_t>(dilations.begin(), dilations.end())};
  const auto noise_dims = noise.dimensions();
  if (noise_dims.size() != 3 || noise_dims[1] != sizes.batch || noise_dims[2] != levels) {
    return ffi::Error::InvalidArgument(
        "jaxring_wavenet_sample: noise must be [steps, batch=" + std::to_string(sizes.batch) +
        ", levels=" + std::to_string(levels) + "]");
  }
  const int64_t steps = noise_dims[0];
  int64_t queue_rows = 0;
  for (int64_t d : sizes.dilations) queue_rows += d;
  if (queues.element_count() != queue_rows * sizes.batch * residual ||
      gate_bias.element_count() !=
          static_cast<int64_t>(sizes.dilations.size()) * sizes.batch * 2 * residual ||
      local.element_count() != steps * sizes.batch * local_channels) {
    return ffi::Error::InvalidArgument(
        "jaxring_wavenet_sample: queues, gate bias or local conditioning do not match the sizes");
  }
  float* state = queues_out->typed_data();
  if (state != queues.typed_data()) {
    std::memcpy(state, queues.typed_data(), queues.element_count() * sizeof(float));
  }
  float* logits_out = logits->element_count() == 0 ? nullptr : logits->typed_data();
  const int64_t start = static_cast<int64_t>(first_step.typed_data()[0]);
  switch (weights.element_type()) {
    case ffi::DataType::F32:
      return Run(static_cast<const float*>(weights.untyped_data()), weights.element_count(),
                 sizes, !portable, threads, steps, start, gate_bias.typed_data(), local.typed_data(),
                 noise.typed_data(), token.typed_data(), state, tokens->typed_data(), logits_out);
    case ffi::DataType::F16:
      return Run(static_cast<const uint16_t*>(weights.untyped_data()), weights.element_count(),
                 sizes, !portable, threads, steps, start, gate_bias.typed_data(), local.typed_data(),
                 noise.typed_data(), token.typed_data(), state, tokens->typed_data(), logits_out);
    default:
      return ffi::Error::InvalidArgument(
          "jaxring_wavenet_sample: weights must be float32 or float16");
  }
}

}  // namespace
}  // namespace jaxring::models

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringWaveNetSampleCpu, jaxring::models::WaveNetSampleImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<int64_t>("residual")
                                  .Attr<int64_t>("skip")
                                  .Attr<int64_t>("hidden")
                                  .Attr<int64_t>("levels")
                                  .Attr<int64_t>("local_channels")
                                  .Attr<xla::ffi::Span<const int64_t>>("dilations")
                                  // Tests set it to run the portable kernels on AVX2 machines.
                                  .Attr<bool>("portable")
                                  .Attr<int64_t>("threads"));
