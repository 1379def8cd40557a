// Point-to-point messages on a private duplicate of an MPI communicator, behind the C table of
// gpu/direct.h (JaxringMessageOps): the staged GPU transport hands device pointers to them when
// MPI is CUDA-aware, and CPU tests run the same algorithm on host memory.
#pragma once

#include <mpi.h>

#include <string>

#include "common/status.h"
#include "gpu/direct.h"

namespace jaxring {

// Duplicates `parent` (collective). The table and its context live until the process exits.
Status CreateMpiMessages(MPI_Comm parent, const std::string& name, JaxringMessageOps** out);

}  // namespace jaxring
