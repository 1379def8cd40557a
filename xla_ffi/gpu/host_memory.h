// The operations of gpu/direct.h's DeviceOps and gpu/ipc_steps.h's IpcOps on host memory, for the
// CPU tests that run the GPU transports' algorithms (python/module.cc, python/mpi_module.cc).
#pragma once

#include <cstddef>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#include "common/status.h"
#include "common/types.h"
#include "kernels/reduce_cpu.h"

namespace jaxring {
namespace gpu {

inline Status HostCopyRows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                           size_t row_bytes, size_t rows) {
  for (size_t row = 0; row < rows; ++row)
    std::memcpy(static_cast<char*>(dst) + row * dst_pitch,
                static_cast<const char*>(src) + row * src_pitch, row_bytes);
  return Status();
}

inline Status HostReduce(DType dtype, ReduceOp op, const void* const* srcs, int n, void* dst,
                         int64_t count, int64_t divisor) {
  std::vector<Operand> operands(n);
  for (int i = 0; i < n; ++i) operands[i] = Operand{srcs[i]};
  const Target target{dst};
  Reduce(dtype, op, operands.data(), n, &target, 1, count, divisor);
  return Status();
}

// Work queued on a stream, on the host: each piece runs at once, or, `deferred`, only at Run(),
// as late as a GPU stream may run what was queued on it before the next wait. Deferred, a caller
// that reads or writes memory before waiting for the work that touches it sees the wrong bytes,
// where work run at once would hide the slip.
class HostStream {
 public:
  explicit HostStream(bool deferred) : deferred_(deferred) {}
  Status Queue(std::function<Status()> work) {
    if (!deferred_) return work();
    queued_.push_back(std::move(work));
    return Status();
  }
  // Runs what is queued, in order; returns the first error.
  Status Run() {
    Status status;
    for (const auto& work : queued_) {
      const Status ran = work();
      if (status.ok()) status = ran;
    }
    queued_.clear();
    return status;
  }

 private:
  bool deferred_;
  std::vector<std::function<Status()>> queued_;
};

}  // namespace gpu
}  // namespace jaxring
