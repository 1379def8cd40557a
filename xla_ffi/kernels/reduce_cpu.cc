#include "kernels/reduce_cpu.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace jaxring {
namespace {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Half { uint16_t bits; };
struct BFloat16 { uint16_t bits; };

// Storage type T, accumulator type Acc and the conversions between them.
template <typename T> struct Traits {
  using Acc = T;
  static Acc Load(T v) { return v; }
  static T Store(Acc v) { return v; }
};
template <> struct Traits<Half> {
  using Acc = float;
  static Acc Load(Half v) { return HalfToFloat(v.bits); }
  static Half Store(Acc v) { return Half{FloatToHalf(v)}; }
};
template <> struct Traits<BFloat16> {
  using Acc = float;
  static Acc Load(BFloat16 v) { return BFloat16ToFloat(v.bits); }
  static BFloat16 Store(Acc v) { return BFloat16{FloatToBFloat16(v)}; }
};

// max/min propagate NaN, as lax.max does (std::max would not; XLA's CPU all-reduce drops NaN):
// a if a is NaN or the larger, else b (which is then NaN or the larger). One select on an or-ed
// condition vectorizes to a compare and a blend; nested selects cost 1.5x as much.
template <typename A> inline A Max(A a, A b) { return (a > b) | (a != a) ? a : b; }
template <typename A> inline A Min(A a, A b) { return (a < b) | (a != a) ? a : b; }

constexpr int64_t kBlock = 512;  // elements per block: the block's accumulators stay in L1

// When every target streams, the sources come from memory and the stores go straight to it, and
// each block reads all its sources, then writes all its targets. With 512-element blocks those
// phases grow long enough to stall each other: in a C microbenchmark (two threads, 16 MiB per
// stream) a 4-input, 4-output float32 reduction so blocked ran at 0.70-0.73x a copy's speed,
// while one storing straight from registers kept up with the copy, and 16-64-element blocks came
// within 2-13% of that. So a streamed block moves about kStreamedBlockBytes over all its streams
// (2 and 8 KiB measured no better in jaxring).
// Against 512-element blocks, jaxring's lone float32 all-reduces then took 0.82-0.93x the time on
// 4 and 8 devices from 4 to 16 MiB (0.89-0.97x at 64 MiB) and 0.96-1.02x on 2; reduce-scatters,
// with one target, and all-reduces inside a loop moved within this machine's noise (A/B in turns).
// Most of those reductions now go a line at a time instead (StreamLines); blocks remain for
// reductions of few streams, in place, or into unaligned targets.
constexpr int64_t kStreamedBlockBytes = 4096;

// Elements per block of a reduction of `num_srcs` sources into `dsts` that accumulates in
// `acc_width`-byte elements: kBlock, or fewer (a multiple of 16) when every target streams.
int64_t BlockElements(size_t acc_width, int num_srcs, const Target* dsts, int num_dsts) {
  bool all_streaming = num_dsts > 0;
  for (int d = 0; d < num_dsts; ++d) all_streaming = all_streaming && dsts[d].streaming;
  if (!all_streaming) return kBlock;
  const int64_t streams = num_srcs + num_dsts;
  const int64_t elements = kStreamedBlockBytes / (streams * static_cast<int64_t>(acc_width));
  return std::clamp<int64_t>(elements / 16 * 16, 16, kBlock);
}

// Copies `bytes` from `src` to `dst` with non-temporal stores from dst's first 16-byte boundary
// on (plain stores for the unaligned head and the tail); the caller fences once at the end.
void StreamBytes(void* dst, const void* src, size_t bytes) {
#if defined(__SSE2__)
  const size_t head = std::min(bytes, (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15);
  std::memcpy(dst, src, head);
  auto* d = reinterpret_cast<__m128i*>(static_cast<char*>(dst) + head);
  const auto* s = reinterpret_cast<const __m128i*>(static_cast<const char*>(src) + head);
  const size_t vectors = (bytes - head) / 16;
  for (size_t i = 0; i < vectors; ++i) _mm_stream_si128(d + i, _mm_loadu_si128(s + i));
  const size_t done = head + vectors * 16;
  std::memcpy(static_cast<char*>(dst) + done, static_cast<const char*>(src) + done, bytes - done);
#else
  std::memcpy(dst, src, bytes);
#endif
}

void StoreFence() {
#if defined(__SSE2__)
  _mm_sfence();  // streaming stores are weakly ordered: publish them before any flag is set
#endif
}

// One step of the fold: sum and mean add; max and min keep NaN.
template <ReduceOp kOp, typename A>
inline A Combine(A a, A b) {
  if constexpr (kOp == ReduceOp::kMax) return Max<A>(a, b);
  else if constexpr (kOp == ReduceOp::kMin) return Min<A>(a, b);
  else return a + b;
}

template <typename Tr, ReduceOp kOp, bool kUse, typename T>
inline typename Tr::Acc FoldOne(typename Tr::Acc v, T x) {
  if constexpr (kUse) return Combine<kOp>(v, Tr::Load(x));
  else return v;
}

// v op s[kFirst][i] op ... op s[K-1][i]. Unrolled by hand: as a loop over sources it kept GCC
// from if-converting, and so from vectorizing, max and min (which ran 4.2x slower than a sum).
template <typename Tr, ReduceOp kOp, int kFirst, typename T, int... k>
inline typename Tr::Acc FoldAt(typename Tr::Acc v, const T* const* s, int64_t i,
                               std::integer_sequence<int, k...>) {
  ((v = FoldOne<Tr, kOp, (k >= kFirst)>(v, s[k][i])), ...);
  return v;
}

// How "mean" finishes each element: divided by n, or multiplied by 1/n when n is a power of two
// (that product rounds the same real number the quotient does, so the bits agree with
// lax.pmean's division, at a multiply's cost instead of the divider's).
enum class Finish { kNone, kMultiply, kDivide };

template <typename Acc>
struct Mean {
  Finish finish = Finish::kNone;
  Acc factor = Acc(1);
};

template <typename Acc>
Mean<Acc> MeanOf(ReduceOp op, int64_t divisor) {
  if (op != ReduceOp::kMean || divisor <= 0) return {};
  if (std::is_floating_point_v<Acc> && (divisor & (divisor - 1)) == 0)
    return {Finish::kMultiply, Acc(1) / static_cast<Acc>(divisor)};
  return {Finish::kDivide, static_cast<Acc>(divisor)};
}

template <Finish kFinish, typename Acc>
inline Acc Apply(Acc v, Acc factor) {
  if constexpr (kFinish == Finish::kMultiply) return v * factor;
  else if constexpr (kFinish == Finish::kDivide) return v / factor;
  else return v;
}

// acc[i] = fold of (acc[i] if kFromAcc,) srcs[0][i], ..., srcs[K-1][i], left to right, in
// registers, finished by the mean's scaling when this is the last group: one pass over the block
// however many sources there are.
template <typename T, ReduceOp kOp, int K, bool kFromAcc, Finish kFinish>
void FoldGroup(typename Traits<T>::Acc* acc, const Operand* srcs, int64_t base, int64_t len,
               typename Traits<T>::Acc factor) {
  using Tr = Traits<T>;
  using Acc = typename Tr::Acc;
  const T* s[K];
  for (int k = 0; k < K; ++k) s[k] = static_cast<const T*>(srcs[k].data) + base;
  for (int64_t i = 0; i < len; ++i) {
    Acc v = kFromAcc ? acc[i] : Tr::Load(s[0][i]);
    v = FoldAt<Tr, kOp, kFromAcc ? 0 : 1>(v, s, i, std::make_integer_sequence<int, K>{});
    acc[i] = Apply<kFinish>(v, factor);
  }
}

constexpr int kMaxGroup = 8;  // sources folded in registers at once

// body(K, finish) with K = std::integral_constant<int, k> for k sources (1 to kMaxGroup) and
// finish = std::integral_constant<Finish, ...> as `mean` says (only "mean" instantiates the scaled
// kinds): the one place that turns a reduction's run-time shape into the kernels' template
// arguments.
template <ReduceOp kOp, typename Acc, typename Body>
auto WithGroup(int k, const Mean<Acc>& mean, Body&& body) {
  auto sized = [&](auto finish) {
    switch (k) {
      case 1: return body(std::integral_constant<int, 1>{}, finish);
      case 2: return body(std::integral_constant<int, 2>{}, finish);
      case 3: return body(std::integral_constant<int, 3>{}, finish);
      case 4: return body(std::integral_constant<int, 4>{}, finish);
      case 5: return body(std::integral_constant<int, 5>{}, finish);
      case 6: return body(std::integral_constant<int, 6>{}, finish);
      case 7: return body(std::integral_constant<int, 7>{}, finish);
      default: return body(std::integral_constant<int, kMaxGroup>{}, finish);
    }
  };
  if constexpr (kOp == ReduceOp::kMean) {
    if (mean.finish == Finish::kMultiply)
      return sized(std::integral_constant<Finish, Finish::kMultiply>{});
    if (mean.finish == Finish::kDivide)
      return sized(std::integral_constant<Finish, Finish::kDivide>{});
  }
  return sized(std::integral_constant<Finish, Finish::kNone>{});
}

// One group of k sources of the fold, finished as `mean` says.
template <typename T, ReduceOp kOp, bool kFromAcc>
void FoldGroupFinished(int k, typename Traits<T>::Acc* acc, const Operand* srcs, int64_t base,
                       int64_t len, const Mean<typename Traits<T>::Acc>& mean) {
  WithGroup<kOp>(k, mean, [&](auto group, auto finish) {
    FoldGroup<T, kOp, group(), kFromAcc, finish()>(acc, srcs, base, len, mean.factor);
  });
}

// acc[0, len) = srcs[0] op srcs[1] op ... at elements [base, base + len), folded left to right
// (the same order whatever the grouping, so the bits do not depend on it), then finished as
// `mean` says. `partial_sums`: some source is in accumulator type.
template <typename T, ReduceOp kOp>
void FoldSources(typename Traits<T>::Acc* acc, const Operand* srcs, int num_srcs,
                 bool partial_sums, int64_t base, int64_t len,
                 const Mean<typename Traits<T>::Acc>& mean) {
  using Tr = Traits<T>;
  using Acc = typename Tr::Acc;
  if (!partial_sums) {
    const Mean<Acc> unfinished;
    int done = std::min(num_srcs, kMaxGroup);
    FoldGroupFinished<T, kOp, false>(done, acc, srcs, base, len,
                                     done == num_srcs ? mean : unfinished);
    while (done < num_srcs) {
      const int k = std::min(num_srcs - done, kMaxGroup);
      FoldGroupFinished<T, kOp, true>(k, acc, srcs + done, base, len,
                                      done + k == num_srcs ? mean : unfinished);
      done += k;
    }
    return;
  }
  // Partial sums in accumulator type (the ring's 16-bit scratch): a pass per source.
  for (int s = 0; s < num_srcs; ++s) {
    if (srcs[s].is_accumulator) {
      const Acc* src = static_cast<const Acc*>(srcs[s].data) + base;
      for (int64_t i = 0; i < len; ++i) acc[i] = s == 0 ? src[i] : Combine<kOp>(acc[i], src[i]);
    } else {
      const T* src = static_cast<const T*>(srcs[s].data) + base;
      for (int64_t i = 0; i < len; ++i)
        acc[i] = s == 0 ? Tr::Load(src[i]) : Combine<kOp>(acc[i], Tr::Load(src[i]));
    }
  }
  if (mean.finish == Finish::kMultiply)
    for (int64_t i = 0; i < len; ++i) acc[i] = acc[i] * mean.factor;
  else if (mean.finish == Finish::kDivide)
    for (int64_t i = 0; i < len; ++i) acc[i] = acc[i] / mean.factor;
}

// Up to this many streams (sources and targets) a streamed reduction works in blocks; above, a
// line at a time (FoldLinesStreamed). Against 4 KiB blocks, lines took 0.91-0.99x the time of
// lone reduce-scatters of 4-64 MiB on 4 and 8 devices, 0.93-1.0x inside a loop, and 0.85-1.05x
// of lone all-reduces (A/B in turns); on 2 devices (4 streams at most) 1.01-1.12x at 16 MiB.
constexpr int kMaxBlockedStreams = 4;

#if defined(__SSE2__)
// Streams the 64-byte line at `line` (64-byte aligned) to `dst` (16-byte aligned).
inline void StreamLine(void* dst, const void* line) {
  auto* d = static_cast<__m128i*>(dst);
  const auto* s = static_cast<const __m128i*>(line);
  _mm_stream_si128(d, _mm_load_si128(s));
  _mm_stream_si128(d + 1, _mm_load_si128(s + 1));
  _mm_stream_si128(d + 2, _mm_load_si128(s + 2));
  _mm_stream_si128(d + 3, _mm_load_si128(s + 3));
}

// Elements [0, returned) of a one-pass reduction of K sources whose targets all stream, a 64-byte
// line at a time: each line is folded in registers (left to right, as FoldGroup folds, so the
// bits are the same) and streamed to every target at once, so that reading and writing never
// form phases.
template <typename T, ReduceOp kOp, int K, Finish kFinish>
int64_t FoldLinesStreamed(const Operand* srcs, const Target* dsts, int num_dsts, int64_t count,
                          T factor) {
  constexpr int64_t kLine = 64 / sizeof(T);
  const T* s[K];
  for (int k = 0; k < K; ++k) s[k] = static_cast<const T*>(srcs[k].data);
  int64_t i = 0;
  for (; i + kLine <= count; i += kLine) {
    alignas(64) T line[kLine];
    for (int64_t j = 0; j < kLine; ++j) {
      T v = s[0][i + j];
      v = FoldAt<Traits<T>, kOp, 1>(v, s, i + j, std::make_integer_sequence<int, K>{});
      line[j] = Apply<kFinish>(v, factor);
    }
    for (int d = 0; d < num_dsts; ++d) StreamLine(static_cast<T*>(dsts[d].data) + i, line);
  }
  return i;
}

// The elements FoldLinesStreamed takes: its whole lines when there are more than
// kMaxBlockedStreams streams and every target streams, is 16-byte aligned and is no source (in
// place, the line just read is still cached, and streaming it back at once cost up to 1.5x the
// time of a loop of 4 MiB all-reduces on 4 devices); otherwise none.
template <typename T, ReduceOp kOp>
int64_t StreamLines(const Operand* srcs, int num_srcs, const Target* dsts, int num_dsts,
                    int64_t count, const Mean<T>& mean) {
  if (num_dsts == 0 || num_srcs + num_dsts <= kMaxBlockedStreams) return 0;
  for (int d = 0; d < num_dsts; ++d) {
    if (!dsts[d].streaming || dsts[d].is_accumulator ||
        (reinterpret_cast<uintptr_t>(dsts[d].data) & 15) != 0)
      return 0;
    for (int k = 0; k < num_srcs; ++k)
      if (dsts[d].data == srcs[k].data) return 0;
  }
  return WithGroup<kOp>(num_srcs, mean, [&](auto group, auto finish) {
    return FoldLinesStreamed<T, kOp, group(), finish()>(srcs, dsts, num_dsts, count, mean.factor);
  });
}
#endif

template <typename T, ReduceOp kOp>
void ReduceTyped(const Operand* srcs, int num_srcs, const Target* dsts, int num_dsts,
                 int64_t count, int64_t mean_divisor) {
  using Tr = Traits<T>;
  using Acc = typename Tr::Acc;
  constexpr bool kStoredAsAccumulated = std::is_same_v<Acc, T>;
  // Where the fold lands: straight in the first target when it holds the dtype as accumulated,
  // is written normally, and the fold reads every source before it writes an element (one group,
  // no partial sums): then the target may be one of the sources, as the MPI transport's are.
  // Otherwise in a block of accumulators in L1. Either way the other targets copy from it.
  bool partial_sums = false;
  for (int s = 0; s < num_srcs; ++s) partial_sums = partial_sums || srcs[s].is_accumulator;
  const bool one_pass = !partial_sums && num_srcs <= kMaxGroup;
  const bool into_first = kStoredAsAccumulated && one_pass && num_dsts > 0 && !dsts[0].streaming;
  bool streamed = false;
  const Mean<Acc> mean = MeanOf<Acc>(kOp, mean_divisor);
  alignas(64) Acc acc[kBlock];
  int64_t lines = 0;
#if defined(__SSE2__)
  if constexpr (kStoredAsAccumulated) {
    if (one_pass) lines = StreamLines<T, kOp>(srcs, num_srcs, dsts, num_dsts, count, mean);
    streamed = lines > 0;
  }
#endif
  const int64_t block = BlockElements(sizeof(Acc), num_srcs, dsts, num_dsts);
  for (int64_t base = lines; base < count; base += block) {
    const int64_t len = count - base < block ? count - base : block;
    Acc* out = into_first ? static_cast<Acc*>(dsts[0].data) + base : acc;
    FoldSources<T, kOp>(out, srcs, num_srcs, partial_sums, base, len, mean);
    for (int d = into_first ? 1 : 0; d < num_dsts; ++d) {
      if (dsts[d].is_accumulator) {
        std::memcpy(static_cast<Acc*>(dsts[d].data) + base, out, len * sizeof(Acc));
      } else if (kStoredAsAccumulated && dsts[d].streaming) {
        StreamBytes(static_cast<T*>(dsts[d].data) + base, out, len * sizeof(T));
        streamed = true;
      } else if constexpr (kStoredAsAccumulated) {
        std::memcpy(static_cast<T*>(dsts[d].data) + base, out, len * sizeof(T));
      } else {
        T* dst = static_cast<T*>(dsts[d].data) + base;
        for (int64_t i = 0; i < len; ++i) dst[i] = Tr::Store(out[i]);
      }
    }
  }
  if (streamed) StoreFence();
}

template <typename T>
void ReduceDispatchOp(ReduceOp op, const Operand* srcs, int num_srcs, const Target* dsts,
                      int num_dsts, int64_t count, int64_t mean_divisor) {
  switch (op) {
    case ReduceOp::kSum:
      return ReduceTyped<T, ReduceOp::kSum>(srcs, num_srcs, dsts, num_dsts, count, 0);
    case ReduceOp::kMean:
      return ReduceTyped<T, ReduceOp::kMean>(srcs, num_srcs, dsts, num_dsts, count, mean_divisor);
    case ReduceOp::kMax:
      return ReduceTyped<T, ReduceOp::kMax>(srcs, num_srcs, dsts, num_dsts, count, 0);
    case ReduceOp::kMin:
      return ReduceTyped<T, ReduceOp::kMin>(srcs, num_srcs, dsts, num_dsts, count, 0);
  }
}

}  // namespace

void CopyStreamed(void* dst, const void* src, size_t bytes) {
  StreamBytes(dst, src, bytes);
  StoreFence();
}

bool StreamingPays(int64_t total_output_bytes) {
  // Half the last-level cache of the machines we measure on (32 MiB L3 for 2 cores); the
  // operating system's figure is not reliable under virtual machines (it reports the host's).
  // In a compiled loop of all-reduces on 2-8 CPU devices (benchmarks/allreduce.py sizes),
  // streaming cut 16 MiB per device by 15-20% and 4 MiB per device at 8 devices by about 20%.
  constexpr int64_t kStreamingBytes = int64_t{16} << 20;
  return total_output_bytes >= kStreamingBytes;
}

size_t AccumulatorWidth(DType dtype) {
  return dtype == DType::kF16 || dtype == DType::kBF16 ? sizeof(float) : ByteWidth(dtype);
}

void Reduce(DType dtype, ReduceOp op, const Operand* srcs, int num_srcs, const Target* dsts,
            int num_dsts, int64_t count, int64_t mean_divisor) {
  if (count <= 0 || num_srcs <= 0) return;
  switch (dtype) {
    case DType::kF32:
      return ReduceDispatchOp<float>(op, srcs, num_srcs, dsts, num_dsts, count, mean_divisor);
    case DType::kF64:
      return ReduceDispatchOp<double>(op, srcs, num_srcs, dsts, num_dsts, count, mean_divisor);
    case DType::kF16:
      return ReduceDispatchOp<Half>(op, srcs, num_srcs, dsts, num_dsts, count, mean_divisor);
    case DType::kBF16:
      return ReduceDispatchOp<BFloat16>(op, srcs, num_srcs, dsts, num_dsts, count, mean_divisor);
    case DType::kS32:
      return ReduceDispatchOp<int32_t>(op, srcs, num_srcs, dsts, num_dsts, count, mean_divisor);
    case DType::kS64:
      return ReduceDispatchOp<int64_t>(op, srcs, num_srcs, dsts, num_dsts, count, mean_divisor);
  }
}

// IEEE binary16 <-> binary32 (after F. Giesen's branch-light formulation).
float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return BitsFloat(FloatBits(magnitude) | sign);
  }
  if (exponent == 31) return BitsFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t FloatToHalf(float value) {
  uint32_t f = FloatBits(value);
  const uint16_t sign = static_cast<uint16_t>((f >> 16) & 0x8000u);
  f &= 0x7fffffffu;
  if (f >= 0x7f800000u) return sign | (f > 0x7f800000u ? 0x7e00u : 0x7c00u);  // NaN, inf
  if (f >= 0x477ff000u) return sign | 0x7c00u;  // rounds to inf (>= 65520)
  if (f < 0x38800000u) {  // below 2^-14: the float adder rounds the subnormal for us
    const float shifted = BitsFloat(f) + 0.5f;
    return sign | static_cast<uint16_t>(FloatBits(shifted) - FloatBits(0.5f));
  }
  const uint32_t mantissa_odd = (f >> 13) & 1u;
  f += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu;
  f += mantissa_odd;
  return sign | static_cast<uint16_t>(f >> 13);
}

float BFloat16ToFloat(uint16_t b) { return BitsFloat(static_cast<uint32_t>(b) << 16); }

uint16_t FloatToBFloat16(float value) {
  uint32_t f = FloatBits(value);
  if ((f & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((f >> 16) | 0x40u);  // NaN
  f += 0x7fffu + ((f >> 16) & 1u);
  return static_cast<uint16_t>(f >> 16);
}

}  // namespace jaxring
