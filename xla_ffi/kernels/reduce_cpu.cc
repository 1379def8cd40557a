// The public face of the CPU reduction kernels: the baseline build of reduce_cpu_impl.inc, the
// choice between it and the wider builds, and what does not depend on the instruction set.
#define JAXRING_CPU_KERNELS_NS baseline
#include "kernels/reduce_cpu_impl.inc"

#include <atomic>

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

// The builds Reduce() runs: one for float16 and bfloat16, whose every element is converted to
// float32 and back, so that arithmetic bounds their reductions; one for the other dtypes, which
// memory bounds.
std::atomic<CpuKernels> chosen_16bit{CpuKernels::kBaseline}, chosen_other{CpuKernels::kBaseline};

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
  CpuKernels for_16bit = kernels, for_other = kernels;
  if (kernels == CpuKernels::kAuto) {
    // 16-bit floats: the widest build. bfloat16 all-reduces in a loop on 2-8 devices took
    // 0.21-0.52x the SSE2 build's time with AVX-512 and 0.47-0.68x with AVX2 (benchmarks/
    // kernels.py). The other dtypes: SSE2, since memory bounds them. In the cache the wider
    // builds took 0.85-1.04x its time (float32 all-reduces, 64 KiB-4 MiB); with 16 MiB on 2
    // devices, where the stores stream, they lost: in a loop of float32 all-reduces on one
    // buffer, taking turns, SSE2 took 809 us, AVX-512 914 us and AVX2 1245 us, and
    // reduce-scatters 1730, 1853 and 1875 us.
    for_16bit = for_other = CpuKernels::kBaseline;
    for (CpuKernels wider : {CpuKernels::kAvx2, CpuKernels::kAvx512})
      if (CpuKernelsSupported(wider)) for_16bit = wider;
  }
  chosen_16bit.store(for_16bit, std::memory_order_relaxed);
  chosen_other.store(for_other, std::memory_order_relaxed);
  return true;
}

CpuKernels CpuKernelsFor(DType dtype) {
  return (Is16BitFloat(dtype) ? chosen_16bit : chosen_other).load(std::memory_order_relaxed);
}

void Reduce(DType dtype, ReduceOp op, const Operand* srcs, int num_srcs, const Target* dsts,
            int num_dsts, int64_t count, int64_t mean_divisor) {
  if (count <= 0 || num_srcs <= 0) return;
  KernelsOf(CpuKernelsFor(dtype))(dtype, op, srcs, num_srcs, dsts, num_dsts, count, mean_divisor);
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

size_t AccumulatorWidth(DType dtype) {
  return dtype == DType::kF16 || dtype == DType::kBF16 ? sizeof(float) : ByteWidth(dtype);
}

float HalfToFloat(uint16_t h) { return LoadHalf(h); }
uint16_t FloatToHalf(float f) { return StoreHalf(f); }
float BFloat16ToFloat(uint16_t b) { return LoadBFloat16(b); }
uint16_t FloatToBFloat16(float f) { return StoreBFloat16(f); }

}  // namespace jaxring
