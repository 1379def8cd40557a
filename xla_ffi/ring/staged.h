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

// The least data movement of any collective between processes in which every output byte
// depends on another rank's input (benchmarks/allreduce_mpi.py's exchange floor), `loops` times:
// each rank stages `bytes` of `input` in its slot with `stores` and copies its left neighbour's
// staged bytes into `output`, `chunk_bytes` (at most a slot) per step.
Status RunExchange(ShmCommunicator& comm, void* output, const void* input, int64_t bytes,
                   int64_t chunk_bytes, ShmStores stores, int64_t loops, const Config& config);

}  // namespace jaxring
