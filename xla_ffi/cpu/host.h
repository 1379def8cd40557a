// Host-side dispatch of one jaxring call: validate it, find its communicator (a process
// transport, or the in-process local transport and mailboxes) and run the algorithm. CPU FFI
// handlers call it after decoding XLA's buffers; the CUDA library calls it, through the C ABI of
// common/host_call.h, on buffers staged in host memory.
#pragma once

#include <cstddef>
#include <functional>

#include "common/host_call.h"
#include "common/status.h"

namespace jaxring {

// Whether the error is the caller's (bad rank, dtype, size): XLA reports it as invalid argument.
// `handed_off`: the call goes on on a jaxring thread, which reports its result later.
struct HostResult {
  Status status;
  bool invalid_argument = false;
  bool handed_off = false;
};

// Receives the result of a call that went on on a jaxring thread (cpu/handoff.h).
using HostCompletion = std::function<void(const HostResult&)>;

// Runs `call` on this thread. With `complete`, a call on the local transports whose peers (or
// messages) are not there within Config::hand_off_after_seconds (cpu/handoff.h) is not waited
// for here: the rest of it goes to a jaxring thread, which calls `complete` with its result, and
// the returned result says handed_off. CPU handlers pass one; the CUDA library's calls (which
// have their own thread and stream) and process transports (one device per process) always run
// here.
HostResult RunHostCall(const JaxringHostCall& call, HostCompletion* complete = nullptr);

// Large outputs from XLA's CPU allocator are usually fresh anonymous mappings (glibc maps every
// block over 32 MiB), and each 4 KiB page then faults on its first write: about 2.7 us a page on
// this VM, 48 ms for 64 MiB, more than the all-reduce itself. From Config::huge_page_bytes this
// asks for transparent huge pages on the buffer's 2 MiB-aligned interior, which cut that to 10 ms.
// The call is advice: it changes no data, and a kernel without THP ignores it. The CPU handlers
// advise every device's output before it joins the rendezvous, so before any peer writes to it.
void AdviseHugePages(void* data, size_t bytes);

}  // namespace jaxring
