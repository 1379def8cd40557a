// The staged transport's pipeline (the file comment of cuda/staged.h explains it), written
// against an interface so that CPU tests run the same chunking, buffer rotation and host calls on
// host memory (python/module.cc), and cuda/staged.cc with pinned buffers, streams and events.
#pragma once

#include <cstddef>
#include <string>

#include "common/host_call.h"
#include "common/status.h"
#include "common/types.h"

namespace jaxring {
namespace gpu {

class StagingOps {
 public:
  virtual ~StagingOps() = default;
  // Host buffers b = 0, 1 (chunk_bytes each): input chunks, result chunks.
  virtual char* ToHost(int b) = 0;
  virtual char* FromHost(int b) = 0;
  virtual Status Begin() = 0;  // before the first copy of a call
  // Queues `rows` rows of `row_bytes` from `src` (`src_pitch` apart) into ToHost(b), packed.
  virtual Status CopyIn(int b, const void* src, size_t src_pitch, size_t row_bytes,
                        size_t rows) = 0;
  virtual Status WaitIn(int b) = 0;   // ToHost(b) holds its chunk
  virtual Status WaitOut(int b) = 0;  // FromHost(b) may be written again
  // Queues FromHost(b) (rows packed) out to `dst` (`dst_pitch` apart).
  virtual Status CopyOut(int b, void* dst, size_t dst_pitch, size_t row_bytes, size_t rows) = 0;
  virtual Status End() = 0;  // after the last copy of a call
  virtual Status RunOnHost(const JaxringHostCall& chunk) = 0;
};

// Runs one collective (all_reduce, reduce_scatter, all_gather, broadcast) as chunks of the host
// collective `call` (rank, group and counts are set per chunk).
Status RunStagedSteps(const Header& h, const JaxringHostCall& call, const void* x, void* y,
                      int rank, int size, int64_t chunk_bytes, StagingOps& ops);

}  // namespace gpu
}  // namespace jaxring
