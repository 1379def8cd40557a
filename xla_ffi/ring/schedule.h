// What goes where in the ring, written once (NCCL's all_reduce.h plays this role). A schedule is
// a list of steps; step g of rank r may read what its left neighbour produced in step g-1, so the
// only synchronisation the ring needs is a pairwise "left has finished slice k of step g-1".
#pragma once

#include <cstdint>
#include <vector>

#include "common/types.h"

namespace jaxring {

// Splits `count` elements into `parts` contiguous pieces. Boundaries fall on multiples of `align`
// elements (a cache line) so that two ranks never write the same line; pieces may be empty.
struct Partition {
  int64_t count = 0;
  int parts = 1;
  int64_t align = 1;
  int64_t Begin(int part) const;
  int64_t Size(int part) const { return Begin(part + 1) - Begin(part); }
};

enum class Buffer : uint8_t { kInput, kOutput, kScratch };

struct RingStep {
  bool reduce;          // reduce (left's source, own input) into dst; otherwise copy source to dst
  bool from_left;       // source is the left neighbour's buffer (else this rank's own input)
  bool waits_for_left;  // source was produced by left in the previous step
  Buffer source;
  int64_t source_offset;
  int64_t own_input_offset;  // reduce steps: where this rank's own contribution lives
  Buffer dst;
  int64_t dst_offset;
  int64_t count;        // elements in this step
};

// Ring all-reduce (reduce-scatter then all-gather, 2(n-1) steps) for rank `rank` of `size`, on
// `count` elements. After the reduce-scatter rank r holds the reduced chunk r; nobody reduces a
// chunk twice, so every rank ends with identical bits.
std::vector<RingStep> RingAllReduceSchedule(int rank, int size, int64_t count, int64_t align);
// Reduce-scatter half: input has size*chunk elements, rank r's output is the reduced chunk r.
std::vector<RingStep> RingReduceScatterSchedule(int rank, int size, int64_t chunk);
// All-gather half: input has `chunk` elements, output size*chunk, rank r's input lands at chunk r.
std::vector<RingStep> RingAllGatherSchedule(int rank, int size, int64_t chunk);

}  // namespace jaxring
