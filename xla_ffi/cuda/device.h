// What the CUDA library's transports share: the host library's entry point, CUDA error text,
// the reduce kernels' launcher, and the registry of GPU communicators by communicator key.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "common/host_call.h"
#include "common/status.h"
#include "common/types.h"
#include "gpu/plan.h"

extern "C" cudaError_t JaxringCudaReduce(uint8_t dtype, uint8_t op, const void* const* srcs,
                                         int num_srcs, void* const* dsts, int num_dsts,
                                         int64_t count, int64_t mean_divisor,
                                         cudaStream_t stream);

namespace jaxring {
namespace gpu {

// Set once by jaxring (native.py) to _jaxring's JaxringRunHostCall.
JaxringHostCallFn HostCall();
void SetHostCall(JaxringHostCallFn fn);

// jaxring.config's timeout_seconds, which lives in the host library.
double HostTimeoutSeconds();
void SetHostTimeout(double (*fn)());

// Runs `call` on the host library; its error message as a Status.
Status RunOnHost(const JaxringHostCall& call);

// `where`: what failed, e.g. "copying the input to the workspace".
Status CudaError(const std::string& where, cudaError_t error);
#define JAXRING_CUDA_RETURN(where, expr)                         \
  do {                                                           \
    const cudaError_t jaxring_error_ = (expr);                   \
    if (jaxring_error_ != cudaSuccess)                           \
      return ::jaxring::gpu::CudaError((where), jaxring_error_); \
  } while (0)

// `rows` rows of `row_bytes`, `src_pitch` and `dst_pitch` apart, on `stream`: one plain copy for
// one row, a 2D copy for several, or a copy per row where a pitch exceeds what 2D copies take.
cudaError_t CopyRows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                     size_t row_bytes, size_t rows, cudaMemcpyKind kind, cudaStream_t stream);

// gpu/direct.h's DeviceOps on `stream` (shared by the transports' operation tables).
Status StreamCopy(cudaStream_t stream, void* dst, const void* src, size_t bytes,
                  const std::string& where);
Status StreamReduce(cudaStream_t stream, DType dtype, ReduceOp op, const void* const* srcs,
                    int n, void* dst, int64_t count, int64_t divisor, const std::string& where);
Status StreamSynchronize(cudaStream_t stream, const std::string& where);

// Makes `device` current on this thread (XLA's threads may have another one current).
Status UseDevice(int device, const std::string& where);

// The checks every GPU collective makes before touching data (the host library's, for the
// calls that do not reach it): rank, size, counts.
Status CheckCall(const JaxringHostCall& call, int size, const std::string& where);

// A GPU communicator: runs all_reduce, reduce_scatter, all_gather and broadcast for one process
// communicator on XLA's stream. Everything else goes through the host-staged path.
class GpuCommunicator {
 public:
  GpuCommunicator(int rank, int size, int device, std::string name)
      : rank_(rank), size_(size), device_(device), name_(std::move(name)) {}
  virtual ~GpuCommunicator() = default;
  // Checks the call and runs it; after a failure, refuses every later call with the first error.
  Status Run(cudaStream_t stream, const JaxringHostCall& call, const void* x, void* y);
  // For error messages: "cuda-ipc" or "staged GPU".
  virtual const char* transport() const = 0;

 protected:
  // A call that passed the checks, on this communicator's device; `where` prefixes errors.
  virtual Status RunChecked(cudaStream_t stream, const JaxringHostCall& call, const Header& h,
                            const void* x, void* y, const std::string& where) = 0;
  const int rank_;
  const int size_;
  const int device_;  // jax.local_devices("cuda")[0] of this process (jaxring/_src/gpu.py)
  const std::string name_;

 private:
  // An error unless `stream` belongs to device_ (where the CUDA runtime can tell).
  Status CheckStreamDevice(cudaStream_t stream, const std::string& where) const;
  std::mutex mutex_;
  std::string broken_;  // the first error
};

// Takes ownership of `comm` under `key`, replacing any earlier one.
void Register(uint64_t key, std::unique_ptr<GpuCommunicator> comm);
// Forgets `key`. Its device and pinned memory is leaked on purpose: peers may still have work
// queued that reads it, and nothing orders a free after that work.
void Unregister(uint64_t key);
GpuCommunicator* Find(uint64_t key);

}  // namespace gpu
}  // namespace jaxring
