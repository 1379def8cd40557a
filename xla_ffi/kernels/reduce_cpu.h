// CPU reduction kernels. Every algorithm funnels its arithmetic through Reduce(), so rounding
// rules live here once: 16-bit floats accumulate in float32 and are rounded once on store.
#pragma once

#include <cstdint>

#include "common/config.h"
#include "common/types.h"

namespace jaxring {

// The accumulator type of a dtype: float for float16/bfloat16, the dtype itself otherwise.
size_t AccumulatorWidth(DType dtype);

// A source or destination array: either in the dtype itself or in its accumulator type (the
// ring keeps 16-bit partial sums in float32 scratch so that they are rounded only once).
struct Operand {
  const void* data;
  bool is_accumulator = false;
};
struct Target {
  void* data;
  bool is_accumulator = false;
  // Write with non-temporal (streaming) stores, which skip reading the destination's lines into
  // the cache first: for outputs too large to be read back from the cache anyway
  // (StreamingPays). Only dtypes stored as they are accumulated stream; 16-bit floats do not.
  bool streaming = false;
};

// Whether a collective that writes `total_output_bytes` over all its ranks should stream its
// stores: when they exceed the last-level cache, so that nothing written would still be cached.
bool StreamingPays(int64_t total_output_bytes);

// Whether one rank's output of `bytes` at `output` should take streaming stores although
// StreamingPays does not hold for the whole collective: an output from kProbeOutputBytes up to
// 8 MiB whose lines are not in the cache (LooksUncached). Such an output is typically a lone
// call's, recycled by the allocator from memory last written long ago: plain stores would first
// read every line back from memory. One inside a compiled loop, the same buffer every pass or the
// carry itself, is still cached and takes plain stores, so that the next pass reads it from there.
bool OutputLooksUncached(const void* output, int64_t bytes);
// How often OutputLooksUncached has said yes in this process (for tests).
int64_t UncachedOutputCount();

// Whether dependent loads from a few lines spread over the `bytes` at `data` take more than 70 ns
// a line, as loads from memory do, where cached lines take 10-25 ns on the machines measured
// (also from the other core's cache). Needs 8 pages at least; false for less.
bool LooksUncached(const void* data, size_t bytes);

// Writes the lines of the `bytes` at `data` back to memory and drops them from every cache in the
// machine (clflush), for tests of LooksUncached: unlike reading something larger than the cache,
// this does not depend on the cache's size or on which core's cache holds the lines. False where
// the instruction set has no such instruction (only x86 has one here).
bool EvictFromCaches(const void* data, size_t bytes);

// Copies with non-temporal (streaming) stores, then fences, so that the data is visible before
// any flag set afterwards. For memory another core reads next (see ShmCommunicator::CopyIn).
void CopyStreamed(void* dst, const void* src, size_t bytes);

// For i in [0, count): v = op(srcs[0][i], srcs[1][i], ...) folded left to right, divided by
// mean_divisor when op is kMean and mean_divisor > 0, then written to every target. Reading each
// source once and writing each target once is what makes the direct all-reduce memory-optimal.
void Reduce(DType dtype, ReduceOp op, const Operand* srcs, int num_srcs, const Target* dsts,
            int num_dsts, int64_t count, int64_t mean_divisor);

// Which build of the kernels Reduce() runs (reduce_cpu_impl.inc). Every build writes the same
// bits; the wider ones are faster, float16/bfloat16 reductions most of all (they convert every
// element). kAuto, chosen when the library loads, takes the widest build, except for the
// reductions of the other dtypes whose targets stream (Target::streaming), which memory bounds
// and which ran slower with it: those take the baseline. Any other choice applies to every call.
bool CpuKernelsSupported(CpuKernels kernels);
bool UseCpuKernels(CpuKernels kernels);  // false, changing nothing, if not supported here
// The build that reduces `dtype` now (never kAuto) into targets that stream or not.
CpuKernels CpuKernelsFor(DType dtype, bool streaming);

// Bit-exact conversions used by the kernels (and tested against numpy's).
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);  // round to nearest even
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);  // round to nearest even

}  // namespace jaxring
