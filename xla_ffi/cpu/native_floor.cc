// A benchmark-only FFI target (benchmarks/allreduce.py's native floor): the local part of a lone
// reduce_scatter or all_gather with the communication taken out. It takes the ordered effect's
// token as jaxring's collectives do, and writes its output as they do (advised onto huge pages,
// with jaxring's reduction kernels or copies), from this device's input alone:
//   reduce_scatter: the sum of the input's n blocks, reading every input byte once and writing
//                   one block, as every reduce-scatter must at least;
//   all_gather:     n copies of the input, reading n x its bytes and writing as many, as every
//                   all-gather must at least, over no more memory than the collective reads.
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/types.h"
#include "cpu/host.h"
#include "kernels/reduce_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace jaxring {
namespace {

namespace ffi = xla::ffi;

ffi::Error NativeFloor(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                      ffi::Result<ffi::AnyBuffer> y, int64_t collective, int64_t size,
                      int64_t streamed) {
  if (x.element_type() != ffi::DataType::F32 || size < 1)
    return ffi::Error::InvalidArgument("jaxring_benchmark_native_floor: float32 input, size >= 1");
  AdviseHugePages(y->untyped_data(), y->size_bytes());
  const auto* in = static_cast<const float*>(x.untyped_data());
  auto* out = static_cast<float*>(y->untyped_data());
  const int64_t count = static_cast<int64_t>(x.element_count());
  if (collective == static_cast<int64_t>(Collective::kReduceScatter)) {
    if (count % size != 0 || static_cast<int64_t>(y->element_count()) != count / size)
      return ffi::Error::InvalidArgument("jaxring_benchmark_native_floor: reduce_scatter shapes");
    const int64_t block = count / size;
    std::vector<Operand> blocks(static_cast<size_t>(size));
    for (int64_t i = 0; i < size; ++i) blocks[static_cast<size_t>(i)] = Operand{in + i * block};
    Target dst{out};
    dst.streaming = streamed != 0;
    Reduce(DType::kF32, ReduceOp::kSum, blocks.data(), static_cast<int>(size), &dst, 1, block, 1);
    return ffi::Error::Success();
  }
  if (collective == static_cast<int64_t>(Collective::kAllGather)) {
    if (static_cast<int64_t>(y->element_count()) != count * size)
      return ffi::Error::InvalidArgument("jaxring_benchmark_native_floor: all_gather shapes");
    const size_t bytes = static_cast<size_t>(count) * sizeof(float);
    for (int64_t i = 0; i < size; ++i) {
      if (streamed)
        CopyStreamed(out + i * count, in, bytes);
      else
        std::memcpy(out + i * count, in, bytes);
    }
    return ffi::Error::Success();
  }
  return ffi::Error::InvalidArgument("jaxring_benchmark_native_floor: reduce_scatter or all_gather");
}

}  // namespace
}  // namespace jaxring

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringBenchmarkNativeFloorCpu, ::jaxring::NativeFloor,
                              ::xla::ffi::Ffi::Bind()
                                  .Arg<::xla::ffi::Token>()
                                  .Arg<::xla::ffi::AnyBuffer>()
                                  .Ret<::xla::ffi::Token>()
                                  .Ret<::xla::ffi::AnyBuffer>()
                                  .Attr<int64_t>("collective")
                                  .Attr<int64_t>("size")
                                  .Attr<int64_t>("streamed"));
