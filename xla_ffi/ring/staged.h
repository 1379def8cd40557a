// The collectives over the shared-memory transport (processes on one node): each chunk is staged
// once into the rank's slot, reduced or copied by its readers, and copied out.
#pragma once

#include "common/config.h"
#include "common/status.h"
#include "common/types.h"
#include "ring/algorithms.h"
#include "transports/shm.h"

namespace jaxring {

Status RunStaged(ShmCommunicator& comm, const Header& header, const CollectiveBuffers& buffers,
                 const Config& config);

// One step that moves no data: every rank posts `header`, all wait for all, and the headers
// must agree (the header exchange of RunStaged, on its own).
Status RunAgree(ShmCommunicator& comm, const Header& header, const Config& config);

// The least data movement of any all-reduce between processes (benchmarks/allreduce_mpi.py's
// exchange floor), `loops` times, `chunk_bytes` (at most a slot) per step: each rank stages
// `bytes` of `input` in its slot with `stores`, then copies its left neighbour's staged bytes into
// `output`, adding its second left neighbour's over the last (n - 2)/n of the float32 elements.
// So every rank writes S (= `bytes`) into shared memory and reads 2(n - 1)/n S from it, besides
// reading its input and writing its output: no all-reduce through shared memory does less. Each
// rank must write every element there, since no other can read its input; and of the reads, the
// first rank to hold an element's total needs n - 1 to gather the n inputs into it, which come
// before it holds the total, while each of the other n - 1 ranks needs one more that completes
// its own total, which cannot come before: 2(n - 1) reads of each element over the n ranks.
Status RunExchange(ShmCommunicator& comm, void* output, const void* input, int64_t bytes,
                   int64_t chunk_bytes, ShmStores stores, int64_t loops, const Config& config);

// For tests: this process's next `steps` steps of shared-memory collectives each sleep `seconds`
// before they begin, as a rank does that the scheduler leaves without a core; 0 steps disarms.
// `after_staging`: instead, once every rank has staged the step, before this rank checks that
// none has left.
void StallNextStepsForTest(double seconds, int64_t steps, bool after_staging);

}  // namespace jaxring
