// Host-side dispatch of one jaxring call: validate it, find its communicator (a process
// transport, or the in-process local transport and mailboxes) and run the algorithm. CPU FFI
// handlers call it after decoding XLA's buffers; the CUDA library calls it, through the C ABI of
// common/host_call.h, on buffers staged in host memory.
#pragma once

#include "common/host_call.h"
#include "common/status.h"

namespace jaxring {

// Whether the error is the caller's (bad rank, dtype, size): XLA reports it as invalid argument.
struct HostResult {
  Status status;
  bool invalid_argument = false;
};

HostResult RunHostCall(const JaxringHostCall& call);

}  // namespace jaxring
