// The cuda-ipc transport: GPU processes on one node reduce in device memory, with no host copy
// (the Baidu point).
//
// Set-up (collective, at communicator creation): every rank cudaMallocs one workspace of two
// parities of `slot_bytes` and creates interprocess events; their cudaIpc handles are exchanged
// over MPI (jaxring/_src/gpu.py) and every peer's workspace and events are opened once. Nothing
// is allocated inside a collective.
//
// A collective runs as the steps of gpu/plan.h. Step s (parity p = s % 2) on XLA's stream:
//
//   1. wait for every rank's `done[p]` event (it finished reading this rank's parity p in step
//      s - 2; this rank's own too, as XLA may use another stream for the next call), then copy
//      this rank's piece of the input into its workspace; record `staged[p]`;
//   2. host: agree on the header with every rank (the host transport's header exchange, so a
//      mismatch or a missing rank is the same error as on CPU; it is the barrier that tells each
//      rank that every peer has *recorded* `staged[p]`);
//   3. wait for every peer's `staged[p]`, then read the peers' workspaces directly: reduce
//      kernels (all_reduce, reduce_scatter) or copies (all_gather, broadcast) into the output;
//      a two-shot all_reduce reduces its share in place, records `reduced[p]`, agrees again,
//      waits for the peers' `reduced[p]` and copies their shares out;
//   4. record `done[p]`.
//
// Processes may share one GPU without MPS, so no kernel ever waits for another process's kernel:
// cross-process ordering is only cudaStreamWaitEvent on interprocess events, whose record the
// host exchange has ordered before the wait. An event of parity p is recorded again two steps
// later, after the next step's exchange, which every peer reaches only after issuing its waits on
// the earlier record: a wait never sees a newer record than the one it is meant for. The handler
// never waits for the device; XLA's stream carries the whole call.
//
// Determinism: every element is reduced by one kernel, over ranks 0..n-1 in order, and every rank
// copies the same bits (one-shot: every rank runs the same reduction of the same data).
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/device.h"
#include "gpu/ipc_steps.h"

namespace jaxring {
namespace gpu {

// What each rank publishes at set-up; plain bytes, exchanged by the Python side.
struct IpcHandles {
  uint32_t magic;
  uint32_t version;
  int32_t rank;
  int32_t device;
  int64_t slot_bytes;
  int64_t process;  // ProcessId(): a rank in this very process cannot map its memory
  char uuid[16];  // the GPU, so that ranks on different GPUs are reported, not mis-mapped
  cudaIpcMemHandle_t memory;
  cudaIpcEventHandle_t events[kIpcEventKinds][2];
};

class IpcCommunicator final : public GpuCommunicator {
 public:
  // Allocates this rank's workspace and events on `device` and fills `mine`.
  static Status Create(int rank, int size, int device, int64_t slot_bytes, std::string name,
                       std::unique_ptr<IpcCommunicator>* out, IpcHandles* mine);
  // Opens every peer's workspace and events (`all`: `size` handles in rank order).
  Status Open(const IpcHandles* all);

  const char* transport() const override { return "cuda-ipc"; }

 protected:
  Status RunChecked(cudaStream_t stream, const JaxringHostCall& call, const Header& h,
                    const void* x, void* y, const std::string& where) override;

 private:
  IpcCommunicator(int rank, int size, int device, int64_t slot_bytes, std::string name);
  friend class DeviceIpcOps;
  // Create's allocations and exports into `mine`; on failure Create frees what they made (no
  // peer has its handles yet).
  Status Allocate(IpcHandles* mine, const std::string& where);
  void FreeAllocations();

  int64_t slot_bytes_;
  std::vector<char*> bases_;  // every rank's workspace, mapped into this process
  // events_[rank][kind][parity]; this rank's are its own, the others opened from handles
  std::vector<std::array<std::array<cudaEvent_t, 2>, kIpcEventKinds>> events_;
  uint64_t step_ = 0;         // steps begun on this communicator (the same on every rank)
};

}  // namespace gpu
}  // namespace jaxring
