// CUDA reduction kernels: the GPU counterpart of kernels/reduce_cpu.cc, for the GPU transports
// (cuda-ipc reads peers' buffers directly and reduces them here, with no host copy).
//
// Each thread moves 16 bytes per load (uint4) when every pointer is 16-byte aligned; 16-bit
// floats accumulate in float32 and are rounded once on store.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/types.h"
#include "gpu/plan.h"

namespace jaxring {
namespace cuda {

constexpr int kMaxOperands = 16;
static_assert(kMaxOperands >= gpu::kIpcMaxRanks, "cuda-ipc reduces every rank in one kernel");

template <typename T> struct Pointers {
  const T* srcs[kMaxOperands];
  T* dsts[kMaxOperands];
};

template <typename T> struct Acc { using type = T; };
template <> struct Acc<__half> { using type = float; };
template <> struct Acc<__nv_bfloat16> { using type = float; };

template <typename T> __device__ __forceinline__ typename Acc<T>::type Load(T v) { return v; }
template <> __device__ __forceinline__ float Load(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float Load(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T Store(typename Acc<T>::type v) { return v; }
template <> __device__ __forceinline__ __half Store<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 Store<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Integers add as unsigned, which wraps as the CPU kernels (and psum) do, where a signed
// overflow would be undefined behaviour.
template <ReduceOp kOp, typename A> __device__ __forceinline__ A Combine(A a, A b) {
  if constexpr (kOp == ReduceOp::kMax) return a != a ? a : (b != b ? b : (a > b ? a : b));
  else if constexpr (kOp == ReduceOp::kMin) return a != a ? a : (b != b ? b : (a < b ? a : b));
  else if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
  } else return a + b;
}

// Reduces `kVec` consecutive elements starting at `i` across all sources into all targets.
template <typename T, ReduceOp kOp, int kVec>
__device__ __forceinline__ void ReduceVector(const Pointers<T>& p, int num_srcs, int num_dsts,
                                             int64_t i, int64_t divisor) {
  using A = typename Acc<T>::type;
  A acc[kVec];
  union Packet { uint4 raw; T v[kVec]; };
  static_assert(kVec == 1 || sizeof(Packet) == 16, "vector packets are 16 bytes");
  for (int s = 0; s < num_srcs; ++s) {
    Packet in;
    if constexpr (kVec == 1) in.v[0] = p.srcs[s][i];
    else in.raw = *reinterpret_cast<const uint4*>(p.srcs[s] + i);
#pragma unroll
    for (int j = 0; j < kVec; ++j)
      acc[j] = s == 0 ? Load<T>(in.v[j]) : Combine<kOp, A>(acc[j], Load<T>(in.v[j]));
  }
  Packet out;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    A v = acc[j];
    if constexpr (kOp == ReduceOp::kMean) v = divisor > 0 ? v / static_cast<A>(divisor) : v;
    out.v[j] = Store<T>(v);
  }
  for (int d = 0; d < num_dsts; ++d) {
    if constexpr (kVec == 1) p.dsts[d][i] = out.v[0];
    else *reinterpret_cast<uint4*>(p.dsts[d] + i) = out.raw;
  }
}

template <typename T, ReduceOp kOp, int kVec>
__global__ void ReduceKernel(Pointers<T> p, int num_srcs, int num_dsts, int64_t count,
                             int64_t divisor) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * kVec;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
       i + kVec <= count; i += stride)
    ReduceVector<T, kOp, kVec>(p, num_srcs, num_dsts, i, divisor);
}

template <typename T, ReduceOp kOp>
cudaError_t LaunchTyped(const void* const* srcs, int num_srcs, void* const* dsts, int num_dsts,
                        int64_t count, int64_t divisor, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  Pointers<T> p{};
  bool aligned = true;
  for (int s = 0; s < num_srcs; ++s) {
    p.srcs[s] = static_cast<const T*>(srcs[s]);
    aligned &= reinterpret_cast<uintptr_t>(srcs[s]) % 16 == 0;
  }
  for (int d = 0; d < num_dsts; ++d) {
    p.dsts[d] = static_cast<T*>(dsts[d]);
    aligned &= reinterpret_cast<uintptr_t>(dsts[d]) % 16 == 0;
  }
  // cudaGetLastError() below reports what these launches did, not an error left on this thread
  // by earlier, unrelated runtime calls.
  (void)cudaGetLastError();
  constexpr int kThreads = 512;
  int64_t vector_count = aligned ? count / kVec * kVec : 0;
  if (vector_count > 0) {
    const int64_t blocks = (vector_count / kVec + kThreads - 1) / kThreads;
    ReduceKernel<T, kOp, kVec><<<static_cast<int>(blocks < 65535 ? blocks : 65535), kThreads, 0,
                                  stream>>>(p, num_srcs, num_dsts, vector_count, divisor);
  }
  const int64_t tail = count - vector_count;
  if (tail > 0) {
    for (int s = 0; s < num_srcs; ++s) p.srcs[s] += vector_count;
    for (int d = 0; d < num_dsts; ++d) p.dsts[d] += vector_count;
    const int64_t blocks = (tail + kThreads - 1) / kThreads;
    ReduceKernel<T, kOp, 1><<<static_cast<int>(blocks < 65535 ? blocks : 65535), kThreads, 0,
                              stream>>>(p, num_srcs, num_dsts, tail, divisor);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchOp(ReduceOp op, const void* const* srcs, int num_srcs, void* const* dsts,
                     int num_dsts, int64_t count, int64_t divisor, cudaStream_t stream) {
  switch (op) {
    case ReduceOp::kSum:
      return LaunchTyped<T, ReduceOp::kSum>(srcs, num_srcs, dsts, num_dsts, count, 0, stream);
    case ReduceOp::kMean:
      return LaunchTyped<T, ReduceOp::kMean>(srcs, num_srcs, dsts, num_dsts, count, divisor,
                                             stream);
    case ReduceOp::kMax:
      return LaunchTyped<T, ReduceOp::kMax>(srcs, num_srcs, dsts, num_dsts, count, 0, stream);
    case ReduceOp::kMin:
      return LaunchTyped<T, ReduceOp::kMin>(srcs, num_srcs, dsts, num_dsts, count, 0, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace jaxring

// dst_d[i] = op(src_0[i], ..., src_{n-1}[i]) on `stream`, for every target d. Up to 16 operands.
extern "C" cudaError_t JaxringCudaReduce(uint8_t dtype, uint8_t op, const void* const* srcs,
                                         int num_srcs, void* const* dsts, int num_dsts,
                                         int64_t count, int64_t mean_divisor,
                                         cudaStream_t stream) {
  using namespace jaxring;
  using namespace jaxring::cuda;
  if (num_srcs < 1 || num_srcs > kMaxOperands || num_dsts < 1 || num_dsts > kMaxOperands)
    return cudaErrorInvalidValue;
  if (count <= 0) return cudaSuccess;
  const ReduceOp reduce_op = static_cast<ReduceOp>(op);
  switch (static_cast<DType>(dtype)) {
    case DType::kF32:
      return LaunchOp<float>(reduce_op, srcs, num_srcs, dsts, num_dsts, count, mean_divisor, stream);
    case DType::kF64:
      return LaunchOp<double>(reduce_op, srcs, num_srcs, dsts, num_dsts, count, mean_divisor,
                              stream);
    case DType::kF16:
      return LaunchOp<__half>(reduce_op, srcs, num_srcs, dsts, num_dsts, count, mean_divisor,
                              stream);
    case DType::kBF16:
      return LaunchOp<__nv_bfloat16>(reduce_op, srcs, num_srcs, dsts, num_dsts, count,
                                     mean_divisor, stream);
    case DType::kS32:
      return LaunchOp<int32_t>(reduce_op, srcs, num_srcs, dsts, num_dsts, count, mean_divisor,
                               stream);
    case DType::kS64:
      return LaunchOp<int64_t>(reduce_op, srcs, num_srcs, dsts, num_dsts, count, mean_divisor,
                               stream);
  }
  return cudaErrorInvalidValue;
}
