// A benchmark-only FFI target (benchmarks/allreduce.py's native floor): the local part of a lone
// reduce_scatter or all_gather with the communication taken out. It takes the ordered effect's
// token as jaxring's collectives do, and writes its output as they do (advised onto huge pages,
// with jaxring's reduction kernels or copies), from this device's input alone:
//   reduce_scatter: the sum of the input's n blocks, reading every input byte once and writing
//                   one block, as every reduce-scatter must at least;
//   all_gather:     n copies of the input, each kDirectPieceBytes piece of it read once and
//                   written n times, as the in-process all-gather does where it streams
//                   (DirectAllGather): every all-gather reads its n inputs and writes n blocks
//                   to each of n outputs at least, and n devices of this floor do just that;
//   reads_only:     (with reduce_scatter's shapes) every input byte read once and nothing written
//                   but the first two elements of the output: less than any reduce-scatter does.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/types.h"
#include "cpu/host.h"
#include "kernels/reduce_cpu.h"
#include "ring/algorithms.h"
#include "xla/ffi/api/ffi.h"

namespace jaxring {
namespace {

namespace ffi = xla::ffi;

// The sum (mod 2^64) of `count` floats' bytes read as 64-bit words, a last half word byte by byte.
// The whole 64-byte lines are cut into kReadStreams equal runs read side by side, a line of each in
// turn, into four independent vector sums (the compiler's vector extension: SSE2 on x86-64).
// Several runs keep more of the memory's reads in flight than one: in a C++ microbenchmark on this
// VM (threads each summing their own buffer, medians of 40), 8 threads of 16 MiB on 2 cores took
// 4.09 ms with one run, 3.42 ms with 2, 3.39 ms with 4, 3.54 ms with 8 and 4.04 ms with 16;
// 2 threads of 64 MiB 2.70-2.80, 2.50, 2.37-2.46, 2.67-2.97 and 2.92-3.12 ms. (The first version
// of the read floor read one run, and so overstated what reading the bytes takes by up to 17%.)
constexpr size_t kReadStreams = 4;

uint64_t SumOfWords(const float* in, int64_t count) {
  using Words = uint64_t __attribute__((vector_size(16), aligned(1), may_alias));
  constexpr size_t kLine = 4 * sizeof(Words);
  const auto* bytes = reinterpret_cast<const unsigned char*>(in);
  const size_t size = static_cast<size_t>(count) * sizeof(float);
  const size_t lines = size / kLine;
  const size_t per_run = (lines + kReadStreams - 1) / kReadStreams;
  Words s0{}, s1{}, s2{}, s3{};
  for (size_t i = 0; i < per_run; ++i) {
    for (size_t line = i; line < lines; line += per_run) {  // line i of each run
      const auto* v = reinterpret_cast<const Words*>(bytes + line * kLine);
      s0 += v[0];
      s1 += v[1];
      s2 += v[2];
      s3 += v[3];
    }
  }
  const Words sums = s0 + s1 + s2 + s3;
  uint64_t total = sums[0] + sums[1];
  size_t at = lines * kLine;
  for (; at + sizeof(uint64_t) <= size; at += sizeof(uint64_t)) {
    uint64_t word;
    std::memcpy(&word, bytes + at, sizeof(word));
    total += word;
  }
  for (; at < size; ++at) total += bytes[at];  // a last half word, byte by byte
  return total;
}

ffi::Error NativeFloor(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                      ffi::Result<ffi::AnyBuffer> y, int64_t collective, int64_t size,
                      int64_t streamed, int64_t reads_only) {
  if (x.element_type() != ffi::DataType::F32 || size < 1)
    return ffi::Error::InvalidArgument("jaxring_benchmark_native_floor: float32 input, size >= 1");
  if (!reads_only) AdviseHugePages(y->untyped_data(), y->size_bytes());
  const auto* in = static_cast<const float*>(x.untyped_data());
  auto* out = static_cast<float*>(y->untyped_data());
  const int64_t count = static_cast<int64_t>(x.element_count());
  if (collective == static_cast<int64_t>(Collective::kReduceScatter)) {
    if (count % size != 0 || static_cast<int64_t>(y->element_count()) != count / size)
      return ffi::Error::InvalidArgument("jaxring_benchmark_native_floor: reduce_scatter shapes");
    if (reads_only) {
      const uint64_t sum = SumOfWords(in, count);  // its bits into the first two elements
      std::memcpy(out, &sum, std::min(sizeof(sum), y->size_bytes()));
      return ffi::Error::Success();
    }
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
    // DirectAllGather's pieces, small enough that one read once stays in the core's cache for
    // its n - 1 further copies.
    constexpr int64_t kPiece = kDirectPieceBytes / sizeof(float);
    for (int64_t begin = 0; begin < count; begin += kPiece) {
      const size_t bytes = static_cast<size_t>(std::min(kPiece, count - begin)) * sizeof(float);
      for (int64_t i = 0; i < size; ++i) {
        if (streamed)
          CopyStreamed(out + i * count + begin, in + begin, bytes);
        else
          std::memcpy(out + i * count + begin, in + begin, bytes);
      }
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
                                  .Attr<int64_t>("streamed")
                                  .Attr<int64_t>("reads_only"));
