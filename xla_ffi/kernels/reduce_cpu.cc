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

std::atomic<ReduceFn> kernels_in_use{nullptr};
std::atomic<CpuKernels> kernels_chosen{CpuKernels::kBaseline};

ReduceFn Kernels() {
  ReduceFn fn = kernels_in_use.load(std::memory_order_relaxed);
  if (fn) return fn;
  UseCpuKernels(CpuKernels::kAuto);
  return kernels_in_use.load(std::memory_order_relaxed);
}

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
  if (kernels == CpuKernels::kAuto) {
    kernels = CpuKernels::kBaseline;
    for (CpuKernels wider : {CpuKernels::kAvx2, CpuKernels::kAvx512})
      if (CpuKernelsSupported(wider)) kernels = wider;
  }
  if (!CpuKernelsSupported(kernels)) return false;
  kernels_chosen.store(kernels, std::memory_order_relaxed);
  kernels_in_use.store(KernelsOf(kernels), std::memory_order_relaxed);
  return true;
}

CpuKernels CpuKernelsInUse() {
  Kernels();
  return kernels_chosen.load(std::memory_order_relaxed);
}

void Reduce(DType dtype, ReduceOp op, const Operand* srcs, int num_srcs, const Target* dsts,
            int num_dsts, int64_t count, int64_t mean_divisor) {
  if (count <= 0 || num_srcs <= 0) return;
  Kernels()(dtype, op, srcs, num_srcs, dsts, num_dsts, count, mean_divisor);
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
