// The fused WaveNet sampler for CPU: many sample steps of every stream inside one XLA custom call.
//
// Per-op overhead dominates one WaveNet step when it is a graph of small ops; here one step is a
// loop over the layers with the weights packed once, contiguous, in the order the step reads
// them, and every weight row loaded once per step for all streams (each streamed weight meets B
// streams). Each step ends with the sampling rule of sampler.py (inverse CDF of the softmax, one
// uniform number per stream and step, passed in), so the samples equal the JAX samplers'.
// Python side: models/wavenet/fused_sampler.py, which packs the weights (the layout below is
// written down there too, in `pack_weights`); tests/test_wavenet.py checks the samples and logits
// against the JAX samplers.
//
// Packed weights (float32 or float16), in this order:
//   embedding   [levels, residual]
//   per layer:  gate [2 * residual (current rows, then past rows), 2 * residual]
//               residual [residual, residual], skip [residual, skip]
//               residual_skip_bias [residual + skip]
//               local [local_channels, 2 * residual]            (only when local_channels > 0)
//   hidden [skip, hidden], hidden_bias [hidden], logits [hidden, levels], logits_bias [levels]
// Every matrix [rows, cols] is stored as column panels of `panel_width` columns (the last one
// narrower), each panel row-major [rows, width]: a tile of the product then reads one contiguous
// block, which the hardware prefetchers stream, instead of short pieces of many long rows.
// The gate bias is an operand of its own, [layers, batch, 2 * residual]: the layer's bias plus
// the stream's speaker embedding (global conditioning is a per-stream constant).
//
// Queues (Fast WaveNet, Paine et al. 2016): for each layer a ring of its last `dilation` inputs,
// [sum of dilations, batch, residual]; layer i's slot for step t is t % dilation_i.
// The AVX2/FMA kernels are compiled (with target attributes, so the rest of the binary stays
// baseline x86-64) on x86 only, and chosen at run time by CpuHasAvx2Fma().
#if (defined(__x86_64__) || defined(__i386__)) && !defined(JAXRING_NO_SIMD)
#define JAXRING_X86_SIMD 1
#include <immintrin.h>
#else
#define JAXRING_X86_SIMD 0
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <utility>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/config.h"
#include "common/types.h"
#include "kernels/reduce_cpu.h"
#include "models/targets.h"
#include "models/wavenet_layout.h"
#include "transports/mailbox.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxring::models {
namespace {

// ------------------------------------------------------------------------------------------------
// Kernels. y[b, n] += sum_k x[b, k] * w[k, n] for b < batch, n < cols;
// w is row-major with leading dimension ld, x and y have row strides x_stride and y_stride.

inline float ToFloat(float w) { return w; }
inline float ToFloat(uint16_t w) { return HalfToFloat(w); }

template <typename W>
void GemvPortable(const W* w, int64_t ld, int64_t rows, int64_t cols, const float* x,
                  int64_t x_stride, int64_t batch, float* y, int64_t y_stride) {
  for (int64_t b = 0; b < batch; ++b) {
    float* out = y + b * y_stride;
    for (int64_t k = 0; k < rows; ++k) {
      const float xk = x[b * x_stride + k];
      const W* row = w + k * ld;
      for (int64_t n = 0; n < cols; ++n) out[n] += xk * ToFloat(row[n]);
    }
  }
}

void GatePortable(const float* z, int64_t residual, float* a) {
  for (int64_t c = 0; c < residual; ++c) {
    a[c] = std::tanh(z[c]) / (1.0f + std::exp(-z[residual + c]));
  }
}

#if JAXRING_X86_SIMD
__attribute__((target("avx2,fma,f16c"))) inline __m256 Load8(const float* p) {
  return _mm256_loadu_ps(p);
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 Load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Register tiles: y[s, 0:8V] += sum_k x[s, k] w[k, 0:8V] for S streams, the accumulators in named
// registers (GCC keeps an array of __m256 accumulators in memory and stores it every iteration).
// Each loaded weight vector meets every stream of the tile; 8 independent FMA chains hide the FMA
// latency. 1 x 64 columns for one stream, 2 x 32 and 4 x 16 for several.
#define JR_TARGET __attribute__((target("avx2,fma,f16c")))
#define JR_FMA(acc, x, w) acc = _mm256_fmadd_ps(x, w, acc)

template <typename W>
JR_TARGET void Tile1x8(const W* w, int64_t ld, int64_t rows, const float* x, int64_t, float* y,
                       int64_t) {
  __m256 c0 = _mm256_loadu_ps(y), c1 = _mm256_loadu_ps(y + 8), c2 = _mm256_loadu_ps(y + 16),
         c3 = _mm256_loadu_ps(y + 24), c4 = _mm256_loadu_ps(y + 32), c5 = _mm256_loadu_ps(y + 40),
         c6 = _mm256_loadu_ps(y + 48), c7 = _mm256_loadu_ps(y + 56);
  for (int64_t k = 0; k < rows; ++k) {
    const W* row = w + k * ld;
    const __m256 xk = _mm256_broadcast_ss(x + k);
    JR_FMA(c0, xk, Load8(row));
    JR_FMA(c1, xk, Load8(row + 8));
    JR_FMA(c2, xk, Load8(row + 16));
    JR_FMA(c3, xk, Load8(row + 24));
    JR_FMA(c4, xk, Load8(row + 32));
    JR_FMA(c5, xk, Load8(row + 40));
    JR_FMA(c6, xk, Load8(row + 48));
    JR_FMA(c7, xk, Load8(row + 56));
  }
  _mm256_storeu_ps(y, c0);
  _mm256_storeu_ps(y + 8, c1);
  _mm256_storeu_ps(y + 16, c2);
  _mm256_storeu_ps(y + 24, c3);
  _mm256_storeu_ps(y + 32, c4);
  _mm256_storeu_ps(y + 40, c5);
  _mm256_storeu_ps(y + 48, c6);
  _mm256_storeu_ps(y + 56, c7);
}

template <typename W>
JR_TARGET void Tile2x4(const W* w, int64_t ld, int64_t rows, const float* x, int64_t x_stride,
                       float* y, int64_t y_stride) {
  float* y1 = y + y_stride;
  const float* x1 = x + x_stride;
  __m256 a0 = _mm256_loadu_ps(y), a1 = _mm256_loadu_ps(y + 8), a2 = _mm256_loadu_ps(y + 16),
         a3 = _mm256_loadu_ps(y + 24), b0 = _mm256_loadu_ps(y1), b1 = _mm256_loadu_ps(y1 + 8),
         b2 = _mm256_loadu_ps(y1 + 16), b3 = _mm256_loadu_ps(y1 + 24);
  for (int64_t k = 0; k < rows; ++k) {
    const W* row = w + k * ld;
    const __m256 xa = _mm256_broadcast_ss(x + k), xb = _mm256_broadcast_ss(x1 + k);
    __m256 v = Load8(row);
    JR_FMA(a0, xa, v);
    JR_FMA(b0, xb, v);
    v = Load8(row + 8);
    JR_FMA(a1, xa, v);
    JR_FMA(b1, xb, v);
    v = Load8(row + 16);
    JR_FMA(a2, xa, v);
    JR_FMA(b2, xb, v);
    v = Load8(row + 24);
    JR_FMA(a3, xa, v);
    JR_FMA(b3, xb, v);
  }
  _mm256_storeu_ps(y, a0);
  _mm256_storeu_ps(y + 8, a1);
  _mm256_storeu_ps(y + 16, a2);
  _mm256_storeu_ps(y + 24, a3);
  _mm256_storeu_ps(y1, b0);
  _mm256_storeu_ps(y1 + 8, b1);
  _mm256_storeu_ps(y1 + 16, b2);
  _mm256_storeu_ps(y1 + 24, b3);
}

template <typename W>
JR_TARGET void Tile4x2(const W* w, int64_t ld, int64_t rows, const float* x, int64_t x_stride,
                       float* y, int64_t y_stride) {
  float *y1 = y + y_stride, *y2 = y1 + y_stride, *y3 = y2 + y_stride;
  const float *x1 = x + x_stride, *x2 = x1 + x_stride, *x3 = x2 + x_stride;
  __m256 a0 = _mm256_loadu_ps(y), a1 = _mm256_loadu_ps(y + 8), b0 = _mm256_loadu_ps(y1),
         b1 = _mm256_loadu_ps(y1 + 8), c0 = _mm256_loadu_ps(y2), c1 = _mm256_loadu_ps(y2 + 8),
         d0 = _mm256_loadu_ps(y3), d1 = _mm256_loadu_ps(y3 + 8);
  for (int64_t k = 0; k < rows; ++k) {
    const W* row = w + k * ld;
    const __m256 v0 = Load8(row), v1 = Load8(row + 8);
    __m256 xk = _mm256_broadcast_ss(x + k);
    JR_FMA(a0, xk, v0);
    JR_FMA(a1, xk, v1);
    xk = _mm256_broadcast_ss(x1 + k);
    JR_FMA(b0, xk, v0);
    JR_FMA(b1, xk, v1);
    xk = _mm256_broadcast_ss(x2 + k);
    JR_FMA(c0, xk, v0);
    JR_FMA(c1, xk, v1);
    xk = _mm256_broadcast_ss(x3 + k);
    JR_FMA(d0, xk, v0);
    JR_FMA(d1, xk, v1);
  }
  _mm256_storeu_ps(y, a0);
  _mm256_storeu_ps(y + 8, a1);
  _mm256_storeu_ps(y1, b0);
  _mm256_storeu_ps(y1 + 8, b1);
  _mm256_storeu_ps(y2, c0);
  _mm256_storeu_ps(y2 + 8, c1);
  _mm256_storeu_ps(y3, d0);
  _mm256_storeu_ps(y3 + 8, d1);
}

// One stream, 8 columns: the remainder of a tile; two chains over even and odd rows.
template <typename W>
JR_TARGET void Tile1x1(const W* w, int64_t ld, int64_t rows, const float* x, int64_t, float* y,
                       int64_t) {
  __m256 even = _mm256_loadu_ps(y), odd = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 2 <= rows; k += 2) {
    JR_FMA(even, _mm256_broadcast_ss(x + k), Load8(w + k * ld));
    JR_FMA(odd, _mm256_broadcast_ss(x + k + 1), Load8(w + (k + 1) * ld));
  }
  if (k < rows) JR_FMA(even, _mm256_broadcast_ss(x + k), Load8(w + k * ld));
  _mm256_storeu_ps(y, _mm256_add_ps(even, odd));
}

// `Tile` over `streams` streams (its height) and all columns (its width, then 8 at a time).
template <int kStreams, int kWidth, typename W, typename TileFn>
JR_TARGET void GemvStreamsAvx2(TileFn tile, const W* w, int64_t ld, int64_t rows, int64_t cols,
                               const float* x, int64_t x_stride, float* y, int64_t y_stride) {
  int64_t n = 0;
  for (; n + kWidth <= cols; n += kWidth) tile(w + n, ld, rows, x, x_stride, y + n, y_stride);
  for (; n < cols; n += 8) {
    for (int s = 0; s < kStreams; ++s) {
      Tile1x1(w + n, ld, rows, x + s * x_stride, x_stride, y + s * y_stride + n, y_stride);
    }
  }
}

// y[b, :cols] += x[b, :rows] @ w for b < batch (w row-major with leading dimension ld, cols a
// multiple of 8): streams in blocks of 4, then 2, then 1.
template <typename W>
JR_TARGET void GemvAvx2(const W* w, int64_t ld, int64_t rows, int64_t cols, const float* x,
                        int64_t x_stride, int64_t batch, float* y, int64_t y_stride) {
  int64_t b = 0;
  for (; b + 4 <= batch; b += 4) {
    GemvStreamsAvx2<4, 16>(Tile4x2<W>, w, ld, rows, cols, x + b * x_stride, x_stride,
                           y + b * y_stride, y_stride);
  }
  for (; b + 2 <= batch; b += 2) {
    GemvStreamsAvx2<2, 32>(Tile2x4<W>, w, ld, rows, cols, x + b * x_stride, x_stride,
                           y + b * y_stride, y_stride);
  }
  for (; b < batch; ++b) {
    GemvStreamsAvx2<1, 64>(Tile1x8<W>, w, ld, rows, cols, x + b * x_stride, x_stride,
                           y + b * y_stride, y_stride);
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

// A draw from softmax(logits) by the inverse CDF, as models/wavenet/sampler.py's sample_token:
// the first level whose running sum of exp(logit - max) exceeds u times the total.
__attribute__((target("avx2,fma,f16c"))) void ExpShiftedAvx2(const float* x, float shift,
                                                               int64_t n, float* out) {
  const __m256 s = _mm256_set1_ps(shift);
  for (int64_t i = 0; i < n; i += 8) {
    _mm256_storeu_ps(out + i, Exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), s)));
  }
}

#else  // not x86: only the portable loops run (CpuHasAvx2Fma() is false); these never do.
template <typename W>
void GemvAvx2(const W* w, int64_t ld, int64_t rows, int64_t cols, const float* x,
              int64_t x_stride, int64_t batch, float* y, int64_t y_stride) {
  GemvPortable(w, ld, rows, cols, x, x_stride, batch, y, y_stride);
}
inline void GateAvx2(const float* z, int64_t residual, float* a) { GatePortable(z, residual, a); }
inline void ExpShiftedAvx2(const float* x, float shift, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = std::exp(x[i] - shift);
}
#endif  // JAXRING_X86_SIMD

int32_t SampleLevel(const float* logits, int64_t levels, float u, float* cdf, bool simd) {
  float max = logits[0];
  for (int64_t q = 1; q < levels; ++q) max = std::max(max, logits[q]);
  if (simd) {
    ExpShiftedAvx2(logits, max, levels, cdf);
  } else {
    for (int64_t q = 0; q < levels; ++q) cdf[q] = std::exp(logits[q] - max);
  }
  float total = 0.0f;
  for (int64_t q = 0; q < levels; ++q) cdf[q] = total += cdf[q];
  const float threshold = u * total;
  int64_t below = 0;
  for (int64_t q = 0; q < levels; ++q) below += cdf[q] <= threshold;
  return static_cast<int32_t>(std::min(below, levels - 1));
}

bool CpuHasAvx2Fma() {
#if JAXRING_X86_SIMD
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
#else
  return false;
#endif
}

inline void SpinPause() {
#if JAXRING_X86_SIMD
  _mm_pause();
#endif
}


// y[b, 0 : col_end - col_begin] += x[b, row_begin : row_end] @ w[row_begin : row_end,
// col_begin : col_end] for `batch` streams, w [rows, cols] stored in column panels of
// `panel_width`: the piece of a product that one thread of a team owns.
template <typename W>
void GemvBlock(const W* w, int64_t rows, int64_t cols, int64_t panel_width, int64_t row_begin,
               int64_t row_end, int64_t col_begin, int64_t col_end, const float* x,
               int64_t x_stride, int64_t batch, float* y, int64_t y_stride, bool simd) {
  for (int64_t col = col_begin; col < col_end;) {
    const int64_t panel_start = col / panel_width * panel_width;
    const int64_t width = std::min(panel_width, cols - panel_start);
    const int64_t segment_end = std::min(col_end, panel_start + width);
    const W* block = w + rows * panel_start + row_begin * width + (col - panel_start);
    if (simd) {
      GemvAvx2(block, width, row_end - row_begin, segment_end - col, x + row_begin, x_stride,
               batch, y + (col - col_begin), y_stride);
    } else {
      GemvPortable(block, width, row_end - row_begin, segment_end - col, x + row_begin, x_stride,
                   batch, y + (col - col_begin), y_stride);
    }
    col = segment_end;
  }
}

// ------------------------------------------------------------------------------------------------
// The sampler.

struct Sizes {
  int64_t residual, skip, hidden, levels, local_channels, panel_width, batch;
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
    const W* residual;
    const W* skip;
    const W* residual_skip_bias;
    const W* local;
  };
  const W* embedding;
  std::vector<Layer> layers;
  const W* hidden;
  const W* hidden_bias;
  const W* logits;
  const W* logits_bias;

  PackedWeights(const W* base, const Sizes& s) {
    const WaveNetLayout l(s.residual, s.skip, s.hidden, s.levels, s.local_channels,
                          static_cast<int64_t>(s.dilations.size()));
    embedding = base + l.embedding;
    for (size_t i = 0; i < s.dilations.size(); ++i) {
      const W* p = base + l.first_layer + static_cast<int64_t>(i) * l.layer_stride;
      layers.push_back(Layer{p + l.gate, p + l.residual, p + l.skip, p + l.biases, p + l.local});
    }
    hidden = base + l.hidden;
    hidden_bias = base + l.hidden_bias;
    logits = base + l.logits;
    logits_bias = base + l.logits_bias;
  }
};

template <typename W>
std::vector<float> ToFloats(const W* w, int64_t n) {
  std::vector<float> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = ToFloat(w[i]);
  return out;
}

// Where layer i's ring buffer of past inputs starts: the queues of all layers lie end to end,
// layer i's holding dilations[i] entries.
std::vector<int64_t> QueueOffsets(const std::vector<int64_t>& dilations) {
  std::vector<int64_t> offsets;
  int64_t offset = 0;
  for (int64_t d : dilations) {
    offsets.push_back(offset);
    offset += d;
  }
  return offsets;
}

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
    cdf_.resize(s_.levels);
    queue_offsets_ = QueueOffsets(s_.dilations);
  }

  // One step for this sampler's streams: tokens[b] (the previous samples) in, tokens[b] out.
  // The other pointers are the whole batch's (this step's local, noise and logits rows).
  void Step(int64_t t, const float* gate_bias, const float* local, const float* noise,
            int32_t* tokens, float* queues, float* logits_out) {
    Embed(tokens);
    Layers(t, 0, static_cast<int64_t>(s_.dilations.size()), gate_bias, local, queues);
    Head(noise, tokens, logits_out);
  }

  // The three parts of a step, for a pipeline of stages that each run some of the layers
  // (WaveNetStage): the embedding of the previous samples starts the residual stream and an
  // empty skip sum; layers [begin, end) advance both; the output layers sample the next tokens.
  void Embed(const int32_t* tokens) {
    const int64_t r = s_.residual;
    for (int64_t b = 0; b < streams_.count; ++b) {
      std::memcpy(&h_[b * r], &embedding_[static_cast<int64_t>(tokens[b]) * r],
                  r * sizeof(float));
    }
    std::fill(skip_sum_.begin(), skip_sum_.end(), 0.0f);
  }

  void Layers(int64_t t, int64_t begin, int64_t end, const float* gate_bias, const float* local,
              float* queues) {
    const int64_t b_count = streams_.count, r = s_.residual, skip = s_.skip;
    const int64_t first = streams_.first, total = streams_.total;
    local += first * s_.local_channels;
    const int64_t layers = static_cast<int64_t>(s_.dilations.size());
    for (int64_t i = begin; i < end; ++i) {
      const auto& layer = w_.layers[i];
      float* slot = queues + ((queue_offsets_[i] + t % s_.dilations[i]) * total + first) * r;
      for (int64_t b = 0; b < b_count; ++b) {
        std::memcpy(&x_[b * 2 * r], &h_[b * r], r * sizeof(float));
        std::memcpy(&x_[b * 2 * r + r], slot + b * r, r * sizeof(float));
        std::memcpy(slot + b * r, &h_[b * r], r * sizeof(float));
      }
      std::memcpy(z_.data(), gate_bias + (i * total + first) * 2 * r,
                  b_count * 2 * r * sizeof(float));
      Gemv(layer.gate, 2 * r, 2 * r, x_.data(), 2 * r, z_.data(), 2 * r);
      if (s_.local_channels > 0) {
        Gemv(layer.local, s_.local_channels, 2 * r, local, s_.local_channels, z_.data(), 2 * r);
      }
      for (int64_t b = 0; b < b_count; ++b) Gate(&z_[b * 2 * r], r, &a_[b * r]);
      // The last layer's residual output is never read: compute its skip columns only.
      const bool last = i + 1 == layers;
      const int64_t first_col = last ? r : 0, cols = r + skip - first_col;
      for (int64_t b = 0; b < b_count; ++b) {
        std::memcpy(&y_[b * (r + skip) + first_col], &layer_biases_[i][first_col],
                    cols * sizeof(float));
      }
      if (!last) Gemv(layer.residual, r, r, a_.data(), r, y_.data(), r + skip);
      Gemv(layer.skip, r, skip, a_.data(), r, y_.data() + r, r + skip);
      for (int64_t b = 0; b < b_count; ++b) {
        const float* y = &y_[b * (r + skip)];
        if (!last) {
          for (int64_t c = 0; c < r; ++c) h_[b * r + c] += y[c];
        }
        for (int64_t c = 0; c < skip; ++c) skip_sum_[b * skip + c] += y[r + c];
      }
    }
  }

  void Head(const float* noise, int32_t* tokens, float* logits_out) {
    const int64_t skip = s_.skip, first = streams_.first;
    noise += first;
    // Output layers: relu -> dense -> relu -> dense, then sample.
    for (float& v : skip_sum_) v = v > 0.0f ? v : 0.0f;
    SetBias(hidden_.data(), hidden_bias_, s_.hidden);
    Gemv(w_.hidden, skip, s_.hidden, skip_sum_.data(), skip, hidden_.data(), s_.hidden);
    for (float& v : hidden_) v = v > 0.0f ? v : 0.0f;
    SetBias(logits_.data(), logits_bias_, s_.levels);
    Gemv(w_.logits, s_.hidden, s_.levels, hidden_.data(), s_.hidden, logits_.data(), s_.levels);
    for (int64_t b = 0; b < streams_.count; ++b) {
      tokens[b] = SampleLevel(&logits_[b * s_.levels], s_.levels, noise[b], cdf_.data(), avx2_);
    }
    if (logits_out != nullptr) {
      std::memcpy(logits_out + first * s_.levels, logits_.data(), logits_.size() * sizeof(float));
    }
  }

  // What one stage hands the next between layers: the residual stream, then the skip sum.
  int64_t StateFloats() const { return streams_.count * (s_.residual + s_.skip); }
  void SaveState(float* out) const {
    std::memcpy(out, h_.data(), h_.size() * sizeof(float));
    std::memcpy(out + h_.size(), skip_sum_.data(), skip_sum_.size() * sizeof(float));
  }
  void LoadState(const float* in) {
    std::memcpy(h_.data(), in, h_.size() * sizeof(float));
    std::memcpy(skip_sum_.data(), in + h_.size(), skip_sum_.size() * sizeof(float));
  }
  const Streams& streams() const { return streams_; }

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

  // y[b, :cols] += x[b, :rows] @ w for this sampler's streams, w in column panels.
  void Gemv(const W* w, int64_t rows, int64_t cols, const float* x, int64_t x_stride, float* y,
            int64_t y_stride) {
    for (int64_t col = 0; col < cols; col += s_.panel_width) {
      const int64_t width = std::min(s_.panel_width, cols - col);
      const W* panel = w + rows * col;
      if (avx2_) {
        GemvAvx2(panel, width, rows, width, x, x_stride, streams_.count, y + col, y_stride);
      } else {
        GemvPortable(panel, width, rows, width, x, x_stride, streams_.count, y + col, y_stride);
      }
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
  std::vector<float> h_, x_, z_, a_, y_, skip_sum_, hidden_, logits_, cdf_;
};


// ------------------------------------------------------------------------------------------------
// One stream on several cores (nv-wavenet's layout on a CPU): thread p of a team owns a slice of
// the residual channels, of the hidden units and of the levels. Per layer it computes the gate
// for its channels (its gate columns), their activations, and the residual and skip products of
// those activations (its rows of the residual and skip matrices: partial sums over all output
// columns). So each thread reads only its own part of every weight matrix, which stays in its
// core's cache, and the team meets once per layer, to add up the residual partial sums; the skip
// partial sums are added once, after the last layer. Then two more meetings: the hidden units
// and the logits, each gathered from the threads' slices.

struct alignas(64) Flag {
  std::atomic<int64_t> value{0};
};

// Thread p announces that it reached meeting g and waits for the others to reach it. Spinning
// is cheap while every thread has a core (a partner arrives within a microsecond or two); past
// that it yields, so that on an oversubscribed machine a descheduled partner gets to run.
class Team {
 public:
  Team(int64_t size, int64_t exchange_floats)
      : size_(size), flags_(size), stride_((exchange_floats + 15) / 16 * 16),
        exchange_(2 * size * stride_) {}

  void Meet(int64_t self, int64_t meeting) {
    flags_[self].value.store(meeting, std::memory_order_release);
    for (int64_t other = 0; other < size_; ++other) {
      int64_t spins = 0;
      while (flags_[other].value.load(std::memory_order_acquire) < meeting) {
        if (++spins < 256) {
          SpinPause();
        } else {
          std::this_thread::yield();
        }
      }
    }
  }

  // What thread p hands to the others at meeting g. Two buffers by parity: a thread writes for
  // meeting g + 2 only after meeting g + 1, when everyone has read meeting g's.
  float* Exchange(int64_t meeting, int64_t thread) {
    return exchange_.data() + ((meeting % 2) * size_ + thread) * stride_;
  }

  int64_t size() const { return size_; }

 private:
  const int64_t size_;
  std::vector<Flag> flags_;
  const int64_t stride_;
  std::vector<float> exchange_;
};

// [begin, end) of `n` for part p of `parts`, in whole AVX2 vectors where n allows it.
inline std::pair<int64_t, int64_t> Slice(int64_t n, int64_t part, int64_t parts) {
  const int64_t unit = n % 8 == 0 ? 8 : 1;
  return {n / unit * part / parts * unit, n / unit * (part + 1) / parts * unit};
}

template <typename W>
class TeamSampler {
 public:
  TeamSampler(const PackedWeights<W>& weights, const Sizes& sizes, Team& team, int64_t part,
              bool allow_simd)
      : w_(weights),
        s_(sizes),
        team_(team),
        part_(part),
        simd_(allow_simd && CpuHasAvx2Fma() && sizes.residual % 8 == 0 && sizes.skip % 8 == 0 &&
              sizes.hidden % 8 == 0 && sizes.levels % 8 == 0 && sizes.local_channels % 8 == 0) {
    const int64_t b = s_.batch, r = s_.residual;
    channels_ = Slice(r, part, team.size());
    hidden_units_ = Slice(s_.hidden, part, team.size());
    levels_ = Slice(s_.levels, part, team.size());
    const int64_t own = channels_.second - channels_.first;
    embedding_.resize(s_.levels * r);
    for (int64_t i = 0; i < s_.levels * r; ++i) embedding_[i] = ToFloat(w_.embedding[i]);
    skip_bias_.assign(s_.skip, 0.0f);
    for (const auto& layer : w_.layers) {
      std::vector<float> bias(r);
      for (int64_t c = 0; c < r; ++c) bias[c] = ToFloat(layer.residual_skip_bias[c]);
      residual_biases_.push_back(bias);
      for (int64_t c = 0; c < s_.skip; ++c) {
        skip_bias_[c] += ToFloat(layer.residual_skip_bias[r + c]);
      }
    }
    hidden_bias_ = ToFloats(w_.hidden_bias, s_.hidden);
    logits_bias_ = ToFloats(w_.logits_bias, s_.levels);
    h_.resize(b * r);
    x_.resize(b * 2 * r);
    z_.resize(b * 2 * std::max<int64_t>(own, 1));
    a_.resize(b * std::max<int64_t>(own, 1));
    skip_partial_.resize(b * s_.skip);
    relu_skip_.resize(b * s_.skip);
    hidden_.resize(b * s_.hidden);
    logits_.resize(b * s_.levels);
    cdf_.resize(s_.levels);
    queue_offsets_ = QueueOffsets(s_.dilations);
  }

  void Step(int64_t t, const float* gate_bias, const float* local, const float* noise,
            int32_t* tokens, float* queues, float* logits_out) {
    const int64_t b_count = s_.batch, r = s_.residual, skip = s_.skip, c_local = s_.local_channels;
    const auto [c0, c1] = channels_;
    const int64_t own = c1 - c0, p = part_, team = team_.size();
    for (int64_t b = 0; b < b_count; ++b) {
      std::memcpy(&h_[b * r], &embedding_[static_cast<int64_t>(tokens[b]) * r], r * sizeof(float));
    }
    std::fill(skip_partial_.begin(), skip_partial_.end(), 0.0f);
    const int64_t layers = static_cast<int64_t>(s_.dilations.size());
    for (int64_t i = 0; i < layers; ++i) {
      const auto& layer = w_.layers[i];
      float* slot = queues + (queue_offsets_[i] + t % s_.dilations[i]) * b_count * r;
      for (int64_t b = 0; b < b_count; ++b) {
        std::memcpy(&x_[b * 2 * r], &h_[b * r], r * sizeof(float));
        std::memcpy(&x_[b * 2 * r + r], slot + b * r, r * sizeof(float));
        // z_[b] = [tanh half of my channels, sigmoid half of my channels], from the gate bias.
        const float* bias = gate_bias + (i * b_count + b) * 2 * r;
        std::memcpy(&z_[b * 2 * own], bias + c0, own * sizeof(float));
        std::memcpy(&z_[b * 2 * own + own], bias + r + c0, own * sizeof(float));
      }
      for (int64_t half = 0; half < 2; ++half) {
        GemvBlock(layer.gate, 2 * r, 2 * r, s_.panel_width, 0, 2 * r, half * r + c0,
                  half * r + c1, x_.data(), 2 * r, b_count, &z_[half * own], 2 * own, simd_);
        if (c_local > 0) {
          GemvBlock(layer.local, c_local, 2 * r, s_.panel_width, 0, c_local, half * r + c0,
                    half * r + c1, local, c_local, b_count, &z_[half * own], 2 * own, simd_);
        }
      }
      for (int64_t b = 0; b < b_count; ++b) {
        if (simd_) {
          GateAvx2(&z_[b * 2 * own], own, &a_[b * own]);
        } else {
          GatePortable(&z_[b * 2 * own], own, &a_[b * own]);
        }
      }
      // My rows of the skip matrix: partial sums of every skip column.
      GemvBlock(layer.skip, r, skip, s_.panel_width, c0, c1, 0, skip, a_.data() - c0, own,
                b_count, skip_partial_.data(), skip, simd_);
      const int64_t meeting = ++meetings_;
      const bool last = i + 1 == layers;
      float* mine = team_.Exchange(meeting, p);
      if (!last) {
        std::fill(mine, mine + b_count * r, 0.0f);
        GemvBlock(layer.residual, r, r, s_.panel_width, c0, c1, 0, r, a_.data() - c0, own,
                  b_count, mine, r, simd_);
      } else {
        std::memcpy(mine, skip_partial_.data(), b_count * skip * sizeof(float));
      }
      team_.Meet(p, meeting);
      // Everyone has read this layer's queue slot: store my channels of the layer input.
      for (int64_t b = 0; b < b_count; ++b) {
        std::memcpy(slot + b * r + c0, &h_[b * r + c0], own * sizeof(float));
      }
      if (!last) {
        for (int64_t b = 0; b < b_count; ++b) {
          for (int64_t c = 0; c < r; ++c) {
            float sum = residual_biases_[i][c];
            for (int64_t q = 0; q < team; ++q) sum += team_.Exchange(meeting, q)[b * r + c];
            h_[b * r + c] += sum;
          }
        }
      } else {
        for (int64_t b = 0; b < b_count; ++b) {
          for (int64_t c = 0; c < skip; ++c) {
            float sum = skip_bias_[c];
            for (int64_t q = 0; q < team; ++q) sum += team_.Exchange(meeting, q)[b * skip + c];
            relu_skip_[b * skip + c] = sum > 0.0f ? sum : 0.0f;
          }
        }
      }
    }
    // Output layers: my hidden units, gathered; my levels' logits, gathered; sample.
    Gathered(relu_skip_.data(), skip, w_.hidden, hidden_bias_, s_.hidden, hidden_units_, true,
             hidden_.data());
    Gathered(hidden_.data(), s_.hidden, w_.logits, logits_bias_, s_.levels, levels_, false,
             logits_.data());
    for (int64_t b = 0; b < b_count; ++b) {
      tokens[b] = SampleLevel(&logits_[b * s_.levels], s_.levels, noise[b], cdf_.data(), simd_);
    }
    if (logits_out != nullptr && p == 0) {
      std::memcpy(logits_out, logits_.data(), logits_.size() * sizeof(float));
    }
  }

 private:
  // out[b, :] = (relu)(bias + x[b] @ w), each thread computing its slice of the columns and
  // reading the others' slices after a meeting.
  void Gathered(const float* x, int64_t rows, const W* w, const std::vector<float>& bias,
                int64_t cols, std::pair<int64_t, int64_t> slice, bool relu, float* out) {
    const int64_t b_count = s_.batch, meeting = ++meetings_;
    const auto [begin, end] = slice;
    float* mine = team_.Exchange(meeting, part_);
    for (int64_t b = 0; b < b_count; ++b) {
      std::memcpy(mine + b * cols + begin, bias.data() + begin, (end - begin) * sizeof(float));
    }
    GemvBlock(w, rows, cols, s_.panel_width, 0, rows, begin, end, x, rows, b_count, mine + begin,
              cols, simd_);
    if (relu) {
      for (int64_t b = 0; b < b_count; ++b) {
        for (int64_t c = begin; c < end; ++c) {
          mine[b * cols + c] = std::max(mine[b * cols + c], 0.0f);
        }
      }
    }
    team_.Meet(part_, meeting);
    for (int64_t q = 0; q < team_.size(); ++q) {
      const auto [q_begin, q_end] = Slice(cols, q, team_.size());
      const float* theirs = team_.Exchange(meeting, q);
      for (int64_t b = 0; b < b_count; ++b) {
        std::memcpy(out + b * cols + q_begin, theirs + b * cols + q_begin,
                    (q_end - q_begin) * sizeof(float));
      }
    }
  }

  const PackedWeights<W>& w_;
  const Sizes& s_;
  Team& team_;
  const int64_t part_;
  const bool simd_;
  int64_t meetings_ = 0;
  std::pair<int64_t, int64_t> channels_, hidden_units_, levels_;
  std::vector<int64_t> queue_offsets_;
  std::vector<float> embedding_, skip_bias_, hidden_bias_, logits_bias_;
  std::vector<std::vector<float>> residual_biases_;
  std::vector<float> h_, x_, z_, a_, skip_partial_, relu_skip_, hidden_, logits_, cdf_;
};

// The operands and results of a sampling call, checked against the sizes.
struct Call {
  Sizes sizes;
  int64_t steps = 0, first_step = 0;
  const float* gate_bias = nullptr;
  const float* local = nullptr;
  const float* noise = nullptr;
  const int32_t* token = nullptr;
  float* queues = nullptr;
  int32_t* tokens_out = nullptr;
  float* logits_out = nullptr;  // null unless logits are returned
};

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jaxring_wavenet_sample: " + what);
}

ffi::Error Prepare(int64_t weight_count, ffi::Buffer<ffi::F32> gate_bias,
                   ffi::Buffer<ffi::F32> local,
                   ffi::Buffer<ffi::F32> noise, ffi::Buffer<ffi::S32> token,
                   ffi::Buffer<ffi::F32> queues, ffi::Buffer<ffi::S32> first_step,
                   ffi::ResultBuffer<ffi::S32>& tokens, ffi::ResultBuffer<ffi::F32>& queues_out,
                   ffi::ResultBuffer<ffi::F32>& logits, int64_t residual, int64_t skip,
                   int64_t hidden, int64_t levels, int64_t local_channels, int64_t panel_width,
                   ffi::Span<const int64_t> dilations, Call* call) {
  const auto noise_dims = noise.dimensions();
  const auto count = [](const auto& buffer) {
    return static_cast<int64_t>(buffer.element_count());
  };
  const SampleShapes shapes{
      residual, skip, hidden, levels, local_channels, panel_width, dilations.begin(),
      static_cast<int64_t>(dilations.size()), count(token),
      static_cast<int64_t>(noise_dims.size()), noise_dims.size() > 0 ? noise_dims[0] : 0,
      noise_dims.size() > 1 ? noise_dims[1] : 0, count(queues), count(gate_bias), count(local),
      weight_count};
  if (std::string error = CheckSampleShapes(shapes); !error.empty()) return Invalid(error);
  if (std::string error = CheckTokens(token.typed_data(), shapes.batch, levels); !error.empty())
    return Invalid(error);
  call->sizes = Sizes{residual,    skip,         hidden, levels, local_channels,
                      panel_width, shapes.batch, std::vector<int64_t>(dilations.begin(),
                                                                      dilations.end())};
  call->steps = shapes.noise_rows;
  call->queues = queues_out->typed_data();
  if (call->queues != queues.typed_data()) {
    std::memcpy(call->queues, queues.typed_data(), queues.element_count() * sizeof(float));
  }
  call->logits_out = logits->element_count() == 0 ? nullptr : logits->typed_data();
  call->first_step = static_cast<int64_t>(first_step.typed_data()[0]);
  call->gate_bias = gate_bias.typed_data();
  call->local = local.typed_data();
  call->noise = noise.typed_data();
  call->token = token.typed_data();
  call->tokens_out = tokens->typed_data();
  return ffi::Error::Success();
}

// Calls `run(typed weights)` for float32 or float16 weights.
template <typename Run>
ffi::Error WithWeights(ffi::AnyBuffer weights, Run run) {
  switch (weights.element_type()) {
    case ffi::DataType::F32:
      return run(static_cast<const float*>(weights.untyped_data()));
    case ffi::DataType::F16:
      return run(static_cast<const uint16_t*>(weights.untyped_data()));
    default:
      return Invalid("weights must be float32 or float16");
  }
}

template <typename W>
ffi::Error Run(const W* weights, bool allow_simd, int64_t threads, const Call& c) {
  const Sizes& sizes = c.sizes;
  const PackedWeights<W> packed(weights, sizes);
  const int64_t steps = c.steps, first_step = c.first_step;
  const float *gate_bias = c.gate_bias, *local = c.local, *noise = c.noise;
  const int32_t* token = c.token;
  float *queues = c.queues, *logits_out = c.logits_out;
  int32_t* tokens_out = c.tokens_out;
  const int64_t b = sizes.batch;
  if (threads > b) {
    // Fewer streams than threads: a team shares each step (TeamSampler).
    Team team(threads, b * std::max({sizes.residual, sizes.skip, sizes.hidden, sizes.levels}));
    auto run_part = [&](int64_t part) {
      TeamSampler<W> sampler(packed, sizes, team, part, allow_simd);
      std::vector<int32_t> current(token, token + b);
      for (int64_t step = 0; step < steps; ++step) {
        sampler.Step(first_step + step, gate_bias, local + step * b * sizes.local_channels,
                     noise + step * b, current.data(), queues,
                     logits_out == nullptr ? nullptr : logits_out + step * b * sizes.levels);
        if (part == 0) std::memcpy(tokens_out + step * b, current.data(), b * sizeof(int32_t));
      }
    };
    std::vector<std::thread> workers;
    for (int64_t part = 1; part < threads; ++part) workers.emplace_back(run_part, part);
    run_part(0);
    for (std::thread& worker : workers) worker.join();
    return ffi::Error::Success();
  }
  // Streams are independent: each thread samples its share of them for every step, with no
  // synchronisation; all threads read the same packed weights.
  const int64_t thread_count = std::max<int64_t>(1, std::min<int64_t>(threads, b));
  auto sample_streams = [&](int64_t index) {
    const int64_t first = b * index / thread_count, last = b * (index + 1) / thread_count;
    Sampler<W> sampler(packed, sizes, Streams{first, last - first, b}, allow_simd);
    std::vector<int32_t> current(token + first, token + last);
    for (int64_t step = 0; step < steps; ++step) {
      sampler.Step(first_step + step, gate_bias, local + step * b * sizes.local_channels,
                   noise + step * b, current.data(), queues,
                   logits_out == nullptr ? nullptr : logits_out + step * b * sizes.levels);
      std::memcpy(tokens_out + step * b + first, current.data(),
                  (last - first) * sizeof(int32_t));
    }
  };
  std::vector<std::thread> workers;
  for (int64_t index = 1; index < thread_count; ++index) {
    workers.emplace_back(sample_streams, index);
  }
  sample_streams(0);
  for (std::thread& worker : workers) worker.join();
  return ffi::Error::Success();
}

// ------------------------------------------------------------------------------------------------
// (c) with (d): one stage of a layer-sharded sampler. Device `rank` of a mesh axis of `stages`
// devices runs layers [L rank / stages, L (rank + 1) / stages) of every step, in its own fused
// loop, and hands each step on with jaxring's in-process point-to-point transport (the LL
// mailboxes of transports/mailbox.h: the receiver polls the slot, the sender never waits): stage
// j sends the residual stream and the skip sum to j + 1; the last stage runs the output layers,
// samples, and sends the tokens back to stage 0 for the next step. The streams are cut into
// `stream_groups` groups that follow each other through the stages, so with as many groups as
// stages every stage is busy; at most StageGroups() of them, as many as the ring of mailboxes
// between the stages can hold. Only the last stage's tokens and logits are the samples.
// The layers [begin, end) of stage `rank`: contiguous groups of about equal work, counting
// multiply-adds per stream and step. The last stage also runs the output layers (about three
// layers' worth at 64/256/20), so it gets fewer layers. Every stage has at least one layer.
std::pair<int64_t, int64_t> StageLayers(const Sizes& s, int64_t stages, int64_t rank) {
  const int64_t layers = static_cast<int64_t>(s.dilations.size());
  std::vector<int64_t> prefix(layers + 1, 0);  // work of layers [0, i)
  for (int64_t i = 0; i < layers; ++i) {
    const int64_t residual_out = i + 1 < layers ? s.residual * s.residual : 0;
    prefix[i + 1] = prefix[i] + 4 * s.residual * s.residual + residual_out +
                    s.residual * s.skip + s.local_channels * 2 * s.residual;
  }
  const int64_t total = prefix[layers] + s.skip * s.hidden + s.hidden * s.levels;
  auto boundary = [&](int64_t k) {  // first layer of stage k
    if (k <= 0) return int64_t{0};
    if (k >= stages) return layers;
    const double target = static_cast<double>(total) * k / stages;
    int64_t best = k;
    for (int64_t j = k; j <= layers - (stages - k); ++j) {
      if (std::abs(prefix[j] - target) < std::abs(prefix[best] - target)) best = j;
    }
    return best;
  };
  return {boundary(rank), boundary(rank + 1)};
}

// How many groups of streams circulate: `stream_groups`, but at least 1, at most one per stream,
// and, with more than one stage, at most (kMailboxSlots + 1) * stages - 1. Every group is a
// message in a mailbox or in a stage's hands, and each stage sends on before it receives the
// next; with every mailbox of the ring full and every stage holding one more, each would wait
// for room in the next stage's mailbox and none would receive: from 9 x stages groups on, the
// stages waited so until their timeout.
int64_t StageGroups(int64_t stream_groups, int64_t streams, int64_t stages) {
  int64_t groups = std::min(stream_groups, streams);
  if (stages > 1) groups = std::min(groups, (kMailboxSlots + 1) * stages - 1);
  return std::max<int64_t>(1, groups);
}

template <typename W>
ffi::Error RunStage(const W* weights, bool allow_simd, const Call& c, PointToPoint& transport,
                    int64_t op_id, int64_t stream_groups) {
  const Sizes& sizes = c.sizes;
  const PackedWeights<W> packed(weights, sizes);
  const int64_t stages = transport.size(), rank = transport.rank(), b = sizes.batch;
  const auto [begin, end] = StageLayers(sizes, stages, rank);
  const bool first_stage = rank == 0, last_stage = rank + 1 == stages;
  const int64_t groups = StageGroups(stream_groups, b, stages);
  std::vector<Sampler<W>> samplers;
  samplers.reserve(groups);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t first = b * g / groups, last = b * (g + 1) / groups;
    samplers.emplace_back(packed, sizes, Streams{first, last - first, b}, allow_simd);
  }
  int64_t most = 0;
  for (const Sampler<W>& sampler : samplers) most = std::max(most, sampler.StateFloats());
  std::vector<float> state(most);
  std::vector<int32_t> tokens(b);
  std::copy(c.token, c.token + b, tokens.begin());
  if (!last_stage) std::fill(c.tokens_out, c.tokens_out + c.steps * b, 0);
  if (!last_stage && c.logits_out != nullptr)
    std::fill(c.logits_out, c.logits_out + c.steps * b * sizes.levels, 0.0f);
  auto message = [&](DType dtype, int64_t count) {
    Header h;
    h.kind = Collective::kPermute;
    h.dtype = dtype;
    h.op_id = op_id;
    h.count = count;
    return h;
  };
  auto fail = [&](const Status& status) {
    return ffi::Error::Internal("the layer-sharded WaveNet sampler's messages between stages (" +
                                std::to_string(groups) + " groups of streams a step): " +
                                status.message());
  };
  for (int64_t step = 0; step < c.steps; ++step) {
    const int64_t t = c.first_step + step;
    const float* local = c.local + step * b * sizes.local_channels;
    for (Sampler<W>& sampler : samplers) {
      const Streams& streams = sampler.streams();
      int32_t* group_tokens = tokens.data() + streams.first;
      const int64_t floats = sampler.StateFloats();
      if (first_stage) {
        if (step > 0 && stages > 1) {
          const Status status = transport.Receive(
              static_cast<int>(stages - 1), message(DType::kS32, streams.count), group_tokens,
              streams.count * sizeof(int32_t));
          if (!status.ok()) return fail(status);
        }
        sampler.Embed(group_tokens);
      } else {
        const Status status = transport.Receive(static_cast<int>(rank - 1),
                                                message(DType::kF32, floats), state.data(),
                                                floats * sizeof(float));
        if (!status.ok()) return fail(status);
        sampler.LoadState(state.data());
      }
      sampler.Layers(t, begin, end, c.gate_bias, local, c.queues);
      if (last_stage) {
        sampler.Head(c.noise + step * b, group_tokens,
                     c.logits_out == nullptr ? nullptr : c.logits_out + step * b * sizes.levels);
        std::copy(group_tokens, group_tokens + streams.count,
                  c.tokens_out + step * b + streams.first);
        if (stages > 1 && step + 1 < c.steps) {
          const Status status = transport.SendCopy(0, message(DType::kS32, streams.count),
                                                   group_tokens,
                                                   streams.count * sizeof(int32_t));
          if (!status.ok()) return fail(status);
        }
      } else {
        sampler.SaveState(state.data());
        const Status status = transport.SendCopy(static_cast<int>(rank + 1),
                                                 message(DType::kF32, floats), state.data(),
                                                 floats * sizeof(float));
        if (!status.ok()) return fail(status);
      }
    }
  }
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
                             int64_t panel_width, ffi::Span<const int64_t> dilations,
                             bool portable, int64_t threads) {
  Call call;
  if (ffi::Error error = Prepare(static_cast<int64_t>(weights.element_count()), gate_bias, local,
                                 noise, token, queues, first_step, tokens, queues_out, logits,
                                 residual, skip, hidden, levels, local_channels, panel_width,
                                 dilations, &call);
      error.failure())
    return error;
  return WithWeights(weights, [&](const auto* w) { return Run(w, !portable, threads, call); });
}

ffi::Error WaveNetStageImpl(ffi::RunId run_id, ffi::AnyBuffer weights,
                            ffi::Buffer<ffi::F32> gate_bias,
                            ffi::Buffer<ffi::F32> local, ffi::Buffer<ffi::F32> noise,
                            ffi::Buffer<ffi::S32> token, ffi::Buffer<ffi::F32> queues,
                            ffi::Buffer<ffi::S32> first_step, ffi::Buffer<ffi::S32> rank,
                            ffi::Buffer<ffi::S32> group, ffi::ResultBuffer<ffi::S32> tokens,
                            ffi::ResultBuffer<ffi::F32> queues_out,
                            ffi::ResultBuffer<ffi::F32> logits, int64_t residual, int64_t skip,
                            int64_t hidden, int64_t levels, int64_t local_channels,
                            int64_t panel_width, ffi::Span<const int64_t> dilations,
                            bool portable, int64_t comm, std::string_view comm_name,
                            int64_t size, int64_t op_id, int64_t stream_groups) {
  Call call;
  if (ffi::Error error = Prepare(static_cast<int64_t>(weights.element_count()), gate_bias, local,
                                 noise, token, queues, first_step, tokens, queues_out, logits,
                                 residual, skip, hidden, levels, local_channels, panel_width,
                                 dilations, &call);
      error.failure())
    return error;
  const int32_t stage = rank.typed_data()[0];
  if (size < 1 || stage < 0 || stage >= size || size > static_cast<int64_t>(dilations.size())) {
    return Invalid("stage " + std::to_string(stage) + " of " + std::to_string(size) +
                   ": a layer-sharded sampler needs 1 to " + std::to_string(dilations.size()) +
                   " stages (one layer each at least)");
  }
  const Config config = CurrentConfig();
  LocalPointToPoint transport(
      CommunicatorId{static_cast<uint64_t>(comm), group.typed_data()[0], static_cast<int>(size),
                     NameInGroup(comm_name, group.typed_data()[0])},
      stage, run_id.run_id, Collective::kPermute, config.timeout_seconds,
      config.spin_iterations);
  return WithWeights(weights, [&](const auto* w) {
    return RunStage(w, !portable, call, transport, op_id, stream_groups);
  });
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
                                  .Attr<int64_t>("panel_width")
                                  .Attr<xla::ffi::Span<const int64_t>>("dilations")
                                  .Attr<bool>("portable")
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringWaveNetStageCpu, jaxring::models::WaveNetStageImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::RunId>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<int64_t>("residual")
                                  .Attr<int64_t>("skip")
                                  .Attr<int64_t>("hidden")
                                  .Attr<int64_t>("levels")
                                  .Attr<int64_t>("local_channels")
                                  .Attr<int64_t>("panel_width")
                                  .Attr<xla::ffi::Span<const int64_t>>("dilations")
                                  .Attr<bool>("portable")
                                  .Attr<int64_t>("comm")
                                  .Attr<std::string_view>("comm_name")
                                  .Attr<int64_t>("size")
                                  .Attr<int64_t>("op_id")
                                  .Attr<int64_t>("stream_groups"));
