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

}  // namespace jaxring
