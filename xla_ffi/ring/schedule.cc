#include "ring/schedule.h"

#include <algorithm>

namespace jaxring {
namespace {

int Mod(int64_t a, int n) { return static_cast<int>(((a % n) + n) % n); }

// Reduce-scatter steps s = 0..n-2: rank r reduces chunk (r - s - 2) mod n, so that after the
// last step it owns chunk r. Partial sums travel in the accumulator-typed scratch buffer; the
// final step writes the dtype itself into `final_dst` at `final_offset(c)`.
template <typename BeginFn, typename FinalOffsetFn>
void AppendReduceScatter(int rank, int size, BeginFn begin, FinalOffsetFn final_offset,
                         std::vector<RingStep>* steps) {
  for (int s = 0; s + 1 < size; ++s) {
    const int chunk = Mod(rank - s - 2, size);
    const bool last = s + 2 == size;
    RingStep step;
    step.reduce = true;
    step.from_left = true;
    step.waits_for_left = s > 0;
    step.source = s == 0 ? Buffer::kInput : Buffer::kScratch;
    step.source_offset = begin(chunk);
    step.own_input_offset = begin(chunk);
    step.dst = last ? Buffer::kOutput : Buffer::kScratch;
    step.dst_offset = last ? final_offset(chunk) : begin(chunk);
    step.count = begin(chunk + 1) - begin(chunk);
    steps->push_back(step);
  }
}

// All-gather steps t = 0..n-2: rank r copies chunk (r - 1 - t) mod n from its left neighbour's
// output, which left received (or reduced) in the step before.
template <typename BeginFn>
void AppendAllGather(int rank, int size, BeginFn begin, std::vector<RingStep>* steps) {
  for (int t = 0; t + 1 < size; ++t) {
    const int chunk = Mod(rank - 1 - t, size);
    RingStep step;
    step.reduce = false;
    step.from_left = true;
    step.waits_for_left = true;
    step.source = Buffer::kOutput;
    step.source_offset = begin(chunk);
    step.own_input_offset = 0;
    step.dst = Buffer::kOutput;
    step.dst_offset = begin(chunk);
    step.count = begin(chunk + 1) - begin(chunk);
    steps->push_back(step);
  }
}

}  // namespace

int64_t Partition::Begin(int part) const {
  if (part >= parts) return count;
  const int64_t even = count / parts * part + std::min<int64_t>(part, count % parts);
  const int64_t aligned = (even + align - 1) / align * align;
  return std::min(aligned, count);
}

std::vector<RingStep> RingAllReduceSchedule(int rank, int size, int64_t count, int64_t align) {
  const Partition partition{count, size, align};
  auto begin = [&](int chunk) { return partition.Begin(chunk); };
  std::vector<RingStep> steps;
  AppendReduceScatter(rank, size, begin, begin, &steps);
  AppendAllGather(rank, size, begin, &steps);
  return steps;
}

std::vector<RingStep> RingReduceScatterSchedule(int rank, int size, int64_t chunk_count) {
  auto begin = [&](int chunk) { return chunk * chunk_count; };
  auto final_offset = [](int) { return int64_t{0}; };
  std::vector<RingStep> steps;
  AppendReduceScatter(rank, size, begin, final_offset, &steps);
  return steps;
}

std::vector<RingStep> RingAllGatherSchedule(int rank, int size, int64_t chunk_count) {
  auto begin = [&](int chunk) { return chunk * chunk_count; };
  std::vector<RingStep> steps;
  RingStep own;  // step 0: place this rank's own input at its chunk
  own.reduce = false;
  own.from_left = false;
  own.waits_for_left = false;
  own.source = Buffer::kInput;
  own.source_offset = 0;
  own.own_input_offset = 0;
  own.dst = Buffer::kOutput;
  own.dst_offset = begin(rank);
  own.count = chunk_count;
  steps.push_back(own);
  AppendAllGather(rank, size, begin, &steps);
  return steps;
}

}  // namespace jaxring
