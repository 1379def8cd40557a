// The public face of the CPU reduction kernels: the baseline build of reduce_cpu_impl.inc, the
// choice between it and the wider builds, and what does not depend on the instruction set.
#define JAXRING_CPU_KERNELS_NS baseline
#include "kernels/reduce_cpu_impl.inc"

#include <atomic>
#include <chrono>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace jaxring {

// The wider builds, where the compiler could make them (CMakeLists.txt).
#if defined(JAXRING_KERNELS_AVX2)
namespace avx2 {
void Reduce(DType, ReduceOp, const Operand*, int, const Target*, int, int64_t, int64_t);
}
#endif
#if defined(JAXRING_KERNELS_AVX512)
namespace avx512 {
void Reduce(DType, ReduceOp, const Operand*, int, const Target*, int, int64_t, int64_t);
}
#endif

namespace {

using ReduceFn = void (*)(DType, ReduceOp, const Operand*, int, const Target*, int, int64_t,
                          int64_t);

ReduceFn KernelsOf(CpuKernels kernels) {
  switch (kernels) {
#if defined(JAXRING_KERNELS_AVX2)
    case CpuKernels::kAvx2: return &avx2::Reduce;
#endif
#if defined(JAXRING_KERNELS_AVX512)
    case CpuKernels::kAvx512: return &avx512::Reduce;
#endif
    default: return &baseline::Reduce;
  }
}

bool Is16BitFloat(DType dtype) { return dtype == DType::kF16 || dtype == DType::kBF16; }

// The builds Reduce() runs: `chosen` for every reduction but those of dtypes other than float16
// and bfloat16 (whose every element is converted to float32 and back, so that arithmetic bounds
// them) whose targets stream, which memory bounds: those run `chosen_streamed`.
std::atomic<CpuKernels> chosen{CpuKernels::kBaseline}, chosen_streamed{CpuKernels::kBaseline};

bool ChooseAtLoad() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();  // __builtin_cpu_supports before the constructors have run
#endif
  return UseCpuKernels(CpuKernels::kAuto);
}
[[maybe_unused]] const bool chosen_at_load = ChooseAtLoad();

}  // namespace

bool CpuKernelsSupported(CpuKernels kernels) {
  switch (kernels) {
    case CpuKernels::kAuto:
    case CpuKernels::kBaseline: return true;
    // __builtin_cpu_supports also checks that the operating system saves the wider registers.
#if defined(JAXRING_KERNELS_AVX2)
    case CpuKernels::kAvx2: return __builtin_cpu_supports("avx2");
#endif
#if defined(JAXRING_KERNELS_AVX512)
    case CpuKernels::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
#endif
    default: return false;
  }
}

bool UseCpuKernels(CpuKernels kernels) {
  if (!CpuKernelsSupported(kernels)) return false;
  CpuKernels usual = kernels, streamed = kernels;
  if (kernels == CpuKernels::kAuto) {
    // The widest build, except for memory-bound reductions whose targets stream. bfloat16
    // all-reduces in a loop on 2-8 devices took 0.21-0.52x the SSE2 build's time with AVX-512
    // and 0.47-0.68x with AVX2 (benchmarks/kernels.py); float32 ones in the cache 0.81-0.96x
    // with AVX-512. Where the stores stream, float32 reduce-scatters of 16 MiB on 2 devices took
    // 1.07-1.17x SSE2's time with AVX-512 (alone and in a loop, two runs), and a loop of
    // all-reduces there on one buffer, in turns, took 809 us with SSE2, 914 us with AVX-512 and
    // 1245 us with AVX2. (All-reduces that stream a line at a time, on 4 and 8 devices at 4 MiB,
    // took 0.85-0.93x SSE2's time with either wider build: the case for a finer rule.)
    usual = streamed = CpuKernels::kBaseline;
    for (CpuKernels wider : {CpuKernels::kAvx2, CpuKernels::kAvx512})
      if (CpuKernelsSupported(wider)) usual = wider;
  }
  chosen.store(usual, std::memory_order_relaxed);
  chosen_streamed.store(streamed, std::memory_order_relaxed);
  return true;
}

CpuKernels CpuKernelsFor(DType dtype, bool streaming) {
  return (streaming && !Is16BitFloat(dtype) ? chosen_streamed : chosen)
      .load(std::memory_order_relaxed);
}

void Reduce(DType dtype, ReduceOp op, const Operand* srcs, int num_srcs, const Target* dsts,
            int num_dsts, int64_t count, int64_t mean_divisor) {
  if (count <= 0 || num_srcs <= 0) return;
  bool streaming = false;
  for (int d = 0; d < num_dsts; ++d) streaming = streaming || dsts[d].streaming;
  KernelsOf(CpuKernelsFor(dtype, streaming))(dtype, op, srcs, num_srcs, dsts, num_dsts, count,
                                             mean_divisor);
}

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

bool LooksUncached(const void* data, size_t bytes) {
  // Eight pages spread over the bytes. A first load from each (untimed) brings its TLB entry in:
  // a page walk under the VM's nested paging costs about as much as a load from memory, and a
  // device thread that has just moved megabytes elsewhere has lost most entries, cached lines or
  // not. Then one load from another line of each page, timed, each address depending on the
  // last load's value (through a zero the compiler cannot see), so that they do not overlap.
  constexpr int kPages = 8;
  constexpr size_t kPage = 4096;
  constexpr size_t kWarmLine = 7 * 64, kTimedLine = 40 * 64;  // far from each other's prefetch
  constexpr double kUncachedNanoseconds = 8 * 70.0;
  static std::atomic<uintptr_t> opaque_zero{0};
  const uintptr_t first = (reinterpret_cast<uintptr_t>(data) + kPage - 1) & ~(kPage - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(data) + bytes;
  if (end < first + kPages * kPage) return false;
  const uintptr_t stride = (end - first) / kPages & ~(kPage - 1);
  const uintptr_t zero = opaque_zero.load(std::memory_order_relaxed);
  uintptr_t chain = 0;
  for (int i = 0; i < kPages; ++i)
    chain += *reinterpret_cast<const volatile unsigned char*>(first + i * stride + kWarmLine);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kPages; ++i) {
    chain += *reinterpret_cast<const volatile unsigned char*>(first + i * stride + kTimedLine +
                                                              (chain & zero));
  }
  const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - start;
  return took.count() > kUncachedNanoseconds;
}

bool EvictFromCaches(const void* data, size_t bytes) {
#if defined(__x86_64__) || defined(__i386__)
  constexpr uintptr_t kLine = 64;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data) & ~(kLine - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(data) + bytes;
  for (uintptr_t line = begin; line < end; line += kLine)
    _mm_clflush(reinterpret_cast<const void*>(line));
  _mm_mfence();
  return true;
#else
  (void)data;
  (void)bytes;
  return false;
#endif
}

namespace {
std::atomic<int64_t> uncached_outputs{0};
}

bool OutputLooksUncached(const void* output, int64_t bytes) {
  constexpr int64_t kProbeOutputBytes = int64_t{256} << 10;
  // Config's default huge_page_bytes: host.cc advises larger outputs onto huge pages, and a
  // read before their first write would fault them in as the shared zero page.
  constexpr int64_t kLargestProbed = int64_t{8} << 20;
  if (bytes < kProbeOutputBytes || bytes >= kLargestProbed ||
      !LooksUncached(output, static_cast<size_t>(bytes)))
    return false;
  uncached_outputs.fetch_add(1, std::memory_order_relaxed);
  return true;
}

int64_t UncachedOutputCount() { return uncached_outputs.load(std::memory_order_relaxed); }

size_t AccumulatorWidth(DType dtype) {
  return dtype == DType::kF16 || dtype == DType::kBF16 ? sizeof(float) : ByteWidth(dtype);
}

float HalfToFloat(uint16_t h) { return LoadHalf(h); }
uint16_t FloatToHalf(float f) { return StoreHalf(f); }
float BFloat16ToFloat(uint16_t b) { return LoadBFloat16(b); }
uint16_t FloatToBFloat16(float f) { return StoreBFloat16(f); }

}  // namespace jaxring
