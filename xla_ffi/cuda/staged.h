// The staged transport: GPU processes on different nodes (or wherever cuda-ipc is not wanted)
// run each collective on the host transport (MPI between nodes, shared memory or hierarchical),
// in chunks, through pinned host buffers allocated once at set-up.
//
// A call is cut into the steps of gpu/plan.h, pipelined over two buffers per direction:
//
//   XLA's stream:   D2H chunk 0 | D2H chunk 1 | D2H chunk 2 | ...
//   host thread:                | host call 0 | host call 1 | host call 2 | ...
//   copy stream:                              | H2D chunk 0 | H2D chunk 1 | ...
//
// Chunk k+1 is copied to the host while the host transport runs chunk k and chunk k-1 is copied
// back, so for large messages the copies hide behind the network. The host thread waits only
// for the events of the chunk it needs (never drains the device); the result copies run on a
// stream of their own that XLA's stream waits for at the end, and a buffer still being copied
// out by the previous call is waited for before it is written again.
//
// With a CUDA-aware MPI (MPIX_Query_cuda_support, or JAXRING_CUDA_AWARE_MPI=1) the calls skip
// the pinned copies: gpu/direct.h hands device pointers to MPI and reduces with the GPU kernels;
// the header exchange is still the host transport's, once per call.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "cuda/device.h"
#include "gpu/direct.h"

namespace jaxring {
namespace gpu {

class StagedCommunicator final : public GpuCommunicator {
 public:
  // `messages`: point-to-point over a CUDA-aware MPI (gpu/direct.h), or null. With them, calls
  // hand device pointers to MPI (RunDirect, through a device scratch of `chunk_bytes`) instead of
  // staging through pinned memory.
  static Status Create(int rank, int size, int device, int64_t chunk_bytes,
                       const JaxringMessageOps* messages, std::string name,
                       std::unique_ptr<StagedCommunicator>* out);
  const char* transport() const override { return "staged GPU"; }

 protected:
  Status RunChecked(cudaStream_t stream, const JaxringHostCall& call, const Header& h,
                    const void* x, void* y, const std::string& where) override;

 private:
  friend class PinnedStagingOps;
  StagedCommunicator(int rank, int size, int device, int64_t chunk_bytes,
                     const JaxringMessageOps* messages, std::string name);
  // Create's allocations; on failure Create frees what they made (nothing else has seen it yet).
  Status Allocate(const std::string& where);
  void FreeAllocations();
  Status RunPipelined(cudaStream_t stream, const JaxringHostCall& call, const Header& h,
                      const void* x, void* y, const std::string& where);
  Status RunCudaAware(cudaStream_t stream, const JaxringHostCall& call, const Header& h,
                      const void* x, void* y, const std::string& where);

  int64_t chunk_bytes_;
  const JaxringMessageOps* messages_;  // CUDA-aware MPI, or null
  void* device_scratch_ = nullptr;      // RunDirect's, with `messages_`
  cudaEvent_t scratch_free_ = nullptr;  // the last call's kernels are done with the scratch
  char* to_host_[2] = {nullptr, nullptr};    // pinned: input chunks
  char* from_host_[2] = {nullptr, nullptr};  // pinned: result chunks
  cudaStream_t copy_out_ = nullptr;          // result chunks go back on this stream
  cudaEvent_t copied_in_[2] = {};            // to_host_[b] holds its chunk
  cudaEvent_t copied_out_[2] = {};           // from_host_[b] is free again
  bool copying_out_[2] = {false, false};     // copied_out_[b] is pending
  cudaEvent_t call_start_ = nullptr;         // XLA's stream reached this call
  cudaEvent_t call_end_ = nullptr;           // the last result chunk is on the device
};

}  // namespace gpu
}  // namespace jaxring
