// The staged transport's path for a CUDA-aware MPI: device pointers go to MPI directly, with no
// pinned copy. Host code over two small interfaces, so that the algorithm is tested on CPU
// processes (host memory, plain MPI) exactly as it runs on GPUs (cuda/staged.cc).
//
// Per step (gpu/plan.h), the exchange of cuda-ipc's two-shot all-reduce, with MPI moving the
// pieces: every rank sends piece q of its input to rank q and reduces the n pieces it received
// (ranks 0..n-1 in order, one kernel: 16-bit types in float32, rounded once) straight into its
// output; then every rank sends its reduced piece to all others. Each rank sends and receives
// 2(n-1)/n of the data, as in the ring, in two rounds instead of 2(n-1). reduce_scatter is the
// first round alone; all_gather the second; broadcast a flat send from the root.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/status.h"
#include "common/types.h"

extern "C" {
// Non-blocking point-to-point between the ranks of one communicator (a CUDA-aware MPI), as a C
// table so that the CUDA library can use the MPI extension's messages without linking MPI.
// Functions return 0 on success, or nonzero with a message in `error`.
struct JaxringMessageOps {
  void* context;
  int (*post_send)(void* context, const void* data, size_t bytes, int peer, char* error,
                   size_t error_bytes);
  int (*post_receive)(void* context, void* data, size_t bytes, int peer, char* error,
                      size_t error_bytes);
  // Waits for every posted message, at most `timeout_seconds`; a timeout names the peers.
  int (*wait_all)(void* context, double timeout_seconds, char* error, size_t error_bytes);
  // This rank failed outside these messages (`why`, NUL-terminated): peers waiting for its
  // messages fail at once quoting it, and its later exchanges fail. A rank that gave up already
  // stays as it was.
  void (*give_up)(void* context, const char* why);
};
}

namespace jaxring {
namespace gpu {

// Where the data lives: device memory (on XLA's stream) or host memory (tests).
class DeviceOps {
 public:
  virtual ~DeviceOps() = default;
  virtual Status Copy(void* dst, const void* src, size_t bytes) = 0;
  // dst[i] = op(srcs[0][i], ..., srcs[n-1][i]) (divided by `divisor` for kMean), in order.
  virtual Status Reduce(DType dtype, ReduceOp op, const void* const* srcs, int n, void* dst,
                        int64_t count, int64_t divisor) = 0;
  // Returns once everything queued is done, so that MPI may read or write the memory.
  virtual Status Synchronize() = 0;
};

// `scratch`: at least `size` x StepElements(kStaged, kReduceScatter, ...) elements of device
// memory, allocated once. Every rank must make the same calls; the caller exchanges headers. A
// failure gives up on `messages`, so that peers do not wait out their timeout for this rank.
Status RunDirect(const Header& h, const void* x, void* y, int rank, int size, void* scratch,
                 int64_t scratch_bytes, DeviceOps& device, const JaxringMessageOps& messages,
                 double timeout_seconds, const std::string& where);

}  // namespace gpu
}  // namespace jaxring
