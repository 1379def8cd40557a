// How the GPU transports cut a collective into steps (host-only code, so that CPU tests check it):
// the constants of both transports live here, and nowhere else.
//
//   * cuda-ipc (cuda/ipc.cc): each rank owns a device workspace of two parities of `slot_bytes`,
//     mapped by every peer. One step stages at most a slot; step s uses parity s % 2, so staging
//     step s+1 overlaps the readers of step s.
//   * staged (cuda/staged.cc): two pinned host buffers per direction of `chunk_bytes`; chunk k+1
//     is copied to the host while the host transport runs chunk k, and chunk k-1 goes back.
//
// A "block" is what a step slices: the whole vector for all_reduce and broadcast, one rank's
// piece for reduce_scatter (the output) and all_gather (the input). Step k covers elements
// [first, first + count) of every block.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/host_call.h"
#include "common/types.h"
#include "ring/schedule.h"

namespace jaxring {
namespace gpu {

// cuda-ipc all_reduce steps up to this many bytes are reduced whole by every rank (one-shot: one
// synchronisation, every rank reads n times the step); larger ones are shared out (two-shot: a
// reduce-scatter into the workspace and an all-gather out of it, each rank reads 2(n-1)/n of the
// step, at the price of a second synchronisation). To be measured on a GPU with
// benchmarks/allreduce_gpu.py; 256 KiB is where NCCL-style custom all-reduces usually switch.
constexpr int64_t kIpcOneShotBytes = 256 * 1024;
// Default workspace per rank and parity (cuda-ipc) and pinned chunk (staged).
constexpr int64_t kDefaultIpcSlotBytes = 32 << 20;
constexpr int64_t kDefaultStagingBytes = 4 << 20;
// Smallest accepted slot/chunk: a 16-byte vector for each of up to 64 ranks.
constexpr int64_t kMinSlotBytes = 4096;
// cuda-ipc reduces all ranks' pieces in one kernel, which takes at most this many operands
// (kMaxOperands in cuda/reduce_kernels.cu); larger node communicators use the staged transport.
constexpr int kIpcMaxRanks = 16;
// Reduce kernels move 16 bytes per load: step and share boundaries fall on 16 bytes.
constexpr int64_t kVectorBytes = 16;

enum class Transport : uint8_t { kIpc = 0, kStaged = 1 };
enum class IpcAlgorithm : uint8_t { kOneShot = 0, kTwoShot = 1 };

struct Step {
  int64_t first = 0;  // element offset within each block
  int64_t count = 0;  // elements of each block in this step
};

// Elements of each block that one step moves through a slot (or chunk) of `bytes`, a multiple of
// 16 bytes where that leaves at least one vector; 0 when not even one element fits.
int64_t StepElements(Transport transport, Collective kind, int size, int64_t bytes,
                     size_t width);
// The steps over `block_count` elements: always at least one (an empty call still exchanges
// headers once), every element in exactly one step, in order.
std::vector<Step> PlanSteps(int64_t block_count, int64_t step_elements);
IpcAlgorithm ChooseIpcAlgorithm(int64_t step_bytes, int size);
// Two-shot: rank r reduces elements [Begin(r), Begin(r+1)) of a step of `count`.
Partition ShareOf(int64_t count, int size, size_t width);
// Elements per block for a call with `input_count` elements: all_reduce, broadcast and
// all_gather slice the input, reduce_scatter one n-th of it.
int64_t BlockCount(Collective kind, int64_t input_count, int size);

// The header every rank posts for `call` (its count is the input's).
Header HeaderOf(const JaxringHostCall& call);

// After one of its GPU collectives failed with `why`, rank `rank` leaves `call`'s process
// communicator through the host library's `host_call` (kJaxringHostLeave): peers waiting for it
// in a host call of the same collective (a CUDA error came between two of them) fail at once,
// quoting `why`. Failures of the host calls themselves have left it already; then it does nothing.
void LeaveAfterFailure(JaxringHostCallFn host_call, const JaxringHostCall& call, int rank,
                       const std::string& why);

// "" when `bytes` is a usable slot/chunk size for `size` ranks, else why not.
std::string CheckSlotBytes(Transport transport, int64_t bytes, int size);

}  // namespace gpu
}  // namespace jaxring
