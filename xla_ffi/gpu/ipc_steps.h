// cuda-ipc's protocol, step by step (the file comment of cuda/ipc.h explains it), written against
// an interface so that CPU tests run the very same steps on host memory shared between processes
// (python/module.cc), and cuda/ipc.cc on device memory mapped with cudaIpc handles.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/status.h"
#include "common/types.h"
#include "gpu/direct.h"

namespace jaxring {
namespace gpu {

enum IpcEvent { kStagedEvent = 0, kReducedEvent = 1, kDoneEvent = 2, kIpcEventKinds = 3 };

class IpcOps : public DeviceOps {
 public:
  // Rank `rank`'s workspace of parity `parity`, as mapped into this process.
  virtual char* Slot(int rank, int parity) = 0;
  // `height` rows of `row_bytes`, `src_pitch` and `dst_pitch` bytes apart.
  virtual Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                        size_t row_bytes, size_t height) = 0;
  // Marks this rank's progress (an interprocess event on the device; nothing on the host).
  virtual Status Record(IpcEvent kind, int parity) = 0;
  // Orders what follows after every rank's `kind` event of `parity` (only `only_rank`'s when
  // it is >= 0; this rank's own only when `include_self`).
  virtual Status Wait(IpcEvent kind, int parity, int only_rank, bool include_self) = 0;
  // The host transport's header exchange: a barrier with the checks of a collective.
  virtual Status Agree() = 0;
};

// Runs one collective (all_reduce, reduce_scatter, all_gather, broadcast) as the steps of
// gpu/plan.h; `step` counts the steps taken on this communicator (the same on every rank).
Status RunIpcSteps(const Header& h, const void* x, void* y, int rank, int size,
                   int64_t slot_bytes, uint64_t* step, IpcOps& ops, const std::string& where);

}  // namespace gpu
}  // namespace jaxring
