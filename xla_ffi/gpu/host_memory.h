// The operations of gpu/direct.h's DeviceOps and gpu/ipc_steps.h's IpcOps on host memory, for the
// CPU tests that run the GPU transports' algorithms (python/module.cc, python/mpi_module.cc).
#pragma once

#include <cstddef>
#include <cstring>
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

}  // namespace gpu
}  // namespace jaxring
