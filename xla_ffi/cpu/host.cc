#include "cpu/host.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

#include "common/config.h"
#include "common/types.h"
#include "common/wait.h"
#include "cpu/handoff.h"
#include "gpu/plan.h"
#include "kernels/reduce_cpu.h"
#include "p2p/protocol.h"
#include "ring/algorithms.h"
#include "ring/staged.h"
#include "transports/local.h"
#include "transports/mailbox.h"
#include "transports/process.h"
#include "transports/shm.h"

namespace jaxring {
namespace {

HostResult Invalid(std::string message) { return {Status::Error(std::move(message)), true}; }

// What every call must satisfy before any peer is contacted.
HostResult Check(const JaxringHostCall& c, Collective kind) {
  // Named only on failure: a string built here on every call would cost a heap allocation.
  auto name = [&] { return "jaxring " + std::string(CollectiveName(kind)); };
  if (c.rank < 0 || c.rank >= c.size)
    return Invalid(name() + ": rank " + std::to_string(c.rank) + " is outside [0, " +
                   std::to_string(c.size) + ")");
  if (!IsSupported(static_cast<DType>(c.dtype)))
    return Invalid(name() + ": unsupported element type");
  if (kind == Collective::kReduceScatter && c.output_count * c.size != c.input_count)
    return Invalid(name() + ": output size times world size must equal the input size");
  if (kind == Collective::kAllGather && c.input_count * c.size != c.output_count)
    return Invalid(name() + ": output size must be the input size times world size");
  if (kind == Collective::kBroadcast && (c.root < 0 || c.root >= c.size))
    return Invalid(name() + ": root " + std::to_string(c.root) + " is outside [0, " +
                   std::to_string(c.size) + ")");
  return {};
}

std::string CommName(const JaxringHostCall& c) {
  return NameInGroup(std::string_view(c.comm_name, c.comm_name_size), c.group);
}

// jaxring.mpi marks its communicators' keys with this bit and mesh axes' keys never carry it
// (common.PROCESS_KEY_BIT). So an in-process call looks up no process communicator (each lookup
// takes a lock that every device thread takes), and a call on a process communicator that no
// longer exists fails at once instead of waiting, as if in-process, for peers that are in other
// processes.
constexpr uint64_t kProcessKeyBit = uint64_t{1} << 62;
bool OfProcesses(const JaxringHostCall& c) { return (c.comm & kProcessKeyBit) != 0; }

Status ProcessCommunicatorGone(const JaxringHostCall& c, const Header& header) {
  return Status::Error(Where(header, CommName(c), c.rank, c.size) +
                       ": this process communicator is closed (its jaxring.mpi.Communicator was "
                       "freed or garbage-collected); keep it alive while programs that use it "
                       "run");
}

// A process transport compiled for one rank must be run by that rank.
template <typename Transport>
Status CheckProcess(const Transport& processes, const Header& header, int rank, int size) {
  if (processes.rank() == rank && processes.size() == size) return Status();
  return Status::Error(processes.Where(header) + ": compiled for rank " + std::to_string(rank) +
                       " of " + std::to_string(size));
}

// Hands `rest` of a call to a jaxring thread, which reports its status to `complete`.
HostResult GoOnElsewhere(HostCompletion* complete, std::function<Status()> rest) {
  try {
    HandOff([rest, complete = std::move(*complete)] { complete(HostResult{rest()}); });
  } catch (...) {
    // No thread (or memory for the task) to be had, and the task was not queued: wait here
    // instead (XLA's thread may then wait for a peer queued behind it, up to the timeout). The
    // call has met its peers, so it must run to its end: an error now would let XLA free
    // buffers that they go on using.
    return {rest()};
  }
  HostResult result;
  result.handed_off = true;
  return result;
}

// A process communicator's failed call makes this rank leave all of it and the communicators
// linked to it (ProcessTransport::CallFailed). `held`: the process transport that ran the call,
// whose mutex this thread holds, or null (its shared memory ran it).
Status LeaveIfFailed(const JaxringHostCall& c, const ProcessTransport* held, Status status) {
  if (!status.ok()) ProcessTransport::CallFailed(c.comm, held, status.message());
  return status;
}

HostResult RunCollectiveCall(const JaxringHostCall& c, const Header& header,
                             HostCompletion* complete) {
  const CollectiveBuffers buffers{c.input, c.output, c.output_count};
  if (OfProcesses(c)) {
    // Each process its own configuration: the headers carry what of it ranks must share.
    const Config config = CurrentConfig();
    if (auto processes = ShmCommunicator::Find(c.comm)) {
      Status status = CheckProcess(*processes, header, c.rank, c.size);
      return {status.ok()
                  ? LeaveIfFailed(c, nullptr, RunStaged(*processes, header, buffers, config))
                  : status};
    }
    if (auto processes = ProcessTransport::Find(c.comm)) {
      Status status = CheckProcess(*processes, header, c.rank, c.size);
      if (!status.ok()) return {status};
      std::lock_guard<std::mutex> lock(processes->mutex());
      return {LeaveIfFailed(c, processes.get(),
                            processes->RunCollective(header, buffers, config))};
    }
    return {ProcessCommunicatorGone(c, header)};
  }
  CommunicatorId comm{c.comm, c.group, c.size, CommName(c)};
  LocalTransport::Entry entry = LocalTransport::Enter(comm, c.run_id, c.rank);
  const Config config = entry.config();  // the call's, the same on every device
  const Algorithm algorithm = ChooseAlgorithm(header, c.size, config);
  const size_t scratch_bytes = ScratchBytes(header, c.size, algorithm);
  ScratchLease scratch = ScratchLease::Acquire(scratch_bytes);
  if (scratch_bytes > 0 && (scratch.data() == nullptr || ScratchFailsForTest(c.comm, c.rank))) {
    const std::string error = Where(header, CommName(c), c.rank, c.size) + ": out of memory for " +
                              std::to_string(scratch_bytes) + " bytes of scratch";
    entry.GiveUp(error);
    return {Status::Error(error)};
  }
  const bool copy_input =
      algorithm == Algorithm::kDirect &&
      header.count * static_cast<int64_t>(ByteWidth(header.dtype)) <= config.copy_input_bytes;
  // Streaming stores into an output the cache does not hold (OutputLooksUncached) pay for a
  // program's first collective, whose buffers most often come from outside the program; later
  // ones work on what the program has just written, or run in a loop, where streaming would
  // keep evicting the output that the next pass reads. In place, the reads bring every output
  // line into the cache before it is written, so those are probed as 0 bytes (never uncached).
  // Two words of capture, which std::function holds without allocating on every call.
  const int64_t probed_bytes = algorithm == Algorithm::kDirect && c.output != c.input
                                   ? c.output_count * static_cast<int64_t>(ByteWidth(header.dtype))
                                   : 0;
  const auto output_uncached = [output = c.output, probed_bytes] {
    return OutputLooksUncached(output, probed_bytes);
  };
  std::shared_ptr<LocalTransport> transport =
      LocalTransport::Join(std::move(entry), comm, header, c.input, c.output, scratch.data(),
                           copy_input, output_uncached);
  auto rest = [transport, algorithm, config, buffers] {
    Status status = transport->WaitForPeers();
    return status.ok() ? RunCollective(*transport, algorithm, config, buffers) : status;
  };
  if (complete == nullptr || transport->PeersArrived(Deadline(config.hand_off_after_seconds)))
    return {rest()};
  // A peer is late, and its call may be queued behind this thread (cpu/handoff.h).
  auto lease = std::make_shared<ScratchLease>(std::move(scratch));
  return GoOnElsewhere(complete, [rest, lease] { return rest(); });
}

// The header exchange alone, on a process communicator (kJaxringHostAgree).
Status RunAgreeCall(const JaxringHostCall& c, const Header& header) {
  const Config config = CurrentConfig();
  if (auto processes = ShmCommunicator::Find(c.comm)) {
    Status status = CheckProcess(*processes, header, c.rank, c.size);
    return status.ok() ? LeaveIfFailed(c, nullptr, RunAgree(*processes, header, config)) : status;
  }
  if (auto processes = ProcessTransport::Find(c.comm)) {
    Status status = CheckProcess(*processes, header, c.rank, c.size);
    if (!status.ok()) return status;
    std::lock_guard<std::mutex> lock(processes->mutex());
    return LeaveIfFailed(c, processes.get(), processes->Agree(header, config));
  }
  if (OfProcesses(c)) return ProcessCommunicatorGone(c, header);
  return Status::Error(Where(header, CommName(c), c.rank, c.size) +
                       ": a header exchange needs a process communicator (jaxring.mpi)");
}

// This rank's partner in `perm` (flattened (source, destination) pairs): whom it sends to, or
// whom it receives from; -1 if none.
int Partner(const JaxringHostCall& c, bool sending) {
  for (int64_t i = 0; i + 1 < c.perm_size; i += 2) {
    if (sending && c.perm[i] == c.rank) return static_cast<int>(c.perm[i + 1]);
    if (!sending && c.perm[i + 1] == c.rank) return static_cast<int>(c.perm[i]);
  }
  return -1;
}

HostResult RunPointToPointCall(const JaxringHostCall& c, const Header& header,
                               HostCompletion* complete) {
  const Config config = CurrentConfig();
  const size_t bytes = header.count * ByteWidth(header.dtype);
  const int dest = c.role == kJaxringHostRecv ? -1 : Partner(c, true);
  const int source = c.role == kJaxringHostSend ? -1 : Partner(c, false);
  const uint8_t role = c.role;
  const void* input = c.input;
  void* output = c.output;
  // By value: a call handed off runs after the handler has returned.
  auto run = [=](PointToPoint& transport) {
    switch (role) {
      case kJaxringHostPermute:
        return Permute(transport, header, dest, source, input, output, bytes, config);
      case kJaxringHostSend:
        return Send(transport, header, dest, input, bytes);
      default:
        return Receive(transport, header, source, output, bytes);
    }
  };
  if (OfProcesses(c)) {
    if (auto processes = ProcessTransport::Find(c.comm)) {
      Status status = CheckProcess(*processes, header, c.rank, c.size);
      if (!status.ok()) return {status};
      std::lock_guard<std::mutex> lock(processes->mutex());
      processes->Configure(config);
      return {LeaveIfFailed(c, processes.get(), run(*processes))};
    }
    // Tracing refuses point-to-point where there is no MPI transport (jaxring.mpi's
    // point_to_point_unavailable), so here the communicator is gone, or being freed: its
    // shared memory may outlive its process transport for a moment (jaxring.mpi's _detach).
    return {ProcessCommunicatorGone(c, header)};
  }
  auto transport = std::make_shared<LocalPointToPoint>(
      CommunicatorId{c.comm, c.group, c.size, CommName(c)}, c.rank, c.run_id, header.kind,
      config.timeout_seconds, config.spin_iterations);
  if (complete == nullptr) return {run(*transport)};
  // As for collectives (cpu/handoff.h): each step that waits (for a free mailbox slot, for the
  // message, for the receiver to read a message lent in place) must end its wait in time, or it
  // and the steps after it go on on a jaxring thread.
  const Deadline hand_off(config.hand_off_after_seconds);
  auto whole_call = [transport, run] { return run(*transport); };
  const bool copy = dest == c.rank && source == c.rank;  // PostPermute only copies
  if (!copy && dest >= 0 && !transport->SlotFree(dest, hand_off))
    return GoOnElsewhere(complete, whole_call);
  if (role != kJaxringHostPermute) {
    if (source >= 0 && !transport->MessageReady(source, hand_off))
      return GoOnElsewhere(complete, whole_call);
    return {run(*transport)};
  }
  bool in_place = false;
  Status status =
      PostPermute(*transport, header, dest, source, input, output, bytes, config, &in_place);
  if (!status.ok()) return {status};  // nothing was lent
  if (!copy && source >= 0 && !transport->MessageReady(source, hand_off)) {
    return GoOnElsewhere(complete, [=] {
      return SettleLent(*transport, dest, in_place,
                        ReceivePermute(*transport, header, dest, source, output, bytes));
    });
  }
  status = ReceivePermute(*transport, header, dest, source, output, bytes);
  if (status.ok() && in_place && !transport->SentRead(hand_off))
    return GoOnElsewhere(complete, [transport, dest] { return transport->WaitSent(dest); });
  return {SettleLent(*transport, dest, in_place, status)};
}

}  // namespace

HostResult RunHostCall(const JaxringHostCall& c, HostCompletion* complete) {
  if (c.role == kJaxringHostLeave) {
    ProcessTransport::Leave(
        c.comm, std::string(static_cast<const char*>(c.input), static_cast<size_t>(c.input_count)));
    return {};
  }
  const Collective kind = static_cast<Collective>(c.kind);
  HostResult result = Check(c, kind);
  if (!result.status.ok()) return result;
  Header header = gpu::HeaderOf(c);  // the GPU transports post the same for their steps
  if (c.role == kJaxringHostCollective || c.role == kJaxringHostAgree) {
    if (c.role == kJaxringHostAgree) {
      header.root |= kGpuStepTag;
      return {RunAgreeCall(c, header)};
    }
    return RunCollectiveCall(c, header, complete);
  }
  header.op = ReduceOp::kSum;
  header.count = c.role == kJaxringHostRecv ? c.output_count : c.input_count;
  // A message and the receive that takes it must share a perm. Across processes each passes its
  // own; in one process a send and a recv of different perms may still meet (messages between a
  // pair are taken in order).
  header.root = PermDigest(c.perm, c.perm_size);
  return RunPointToPointCall(c, header, complete);
}

void AdviseHugePages(void* data, size_t bytes) {
  const int64_t threshold = CurrentConfig().huge_page_bytes;
  if (threshold <= 0 || bytes < static_cast<size_t>(threshold)) return;
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  const uintptr_t start = reinterpret_cast<uintptr_t>(data);
  const uintptr_t begin = (start + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (start + bytes) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

}  // namespace jaxring

extern "C" double JaxringHostTimeoutSeconds(void) {
  return jaxring::CurrentConfig().timeout_seconds;
}

extern "C" size_t JaxringHostCallSite(int64_t op_id, char* site, size_t bytes) {
  const std::string name = jaxring::NamedCallSite(op_id);
  if (bytes > 0) std::memcpy(site, name.data(), std::min(name.size(), bytes));
  return name.size();
}

extern "C" int JaxringRunHostCall(const JaxringHostCall* call, char* error, size_t error_bytes) {
  const jaxring::HostResult result = jaxring::RunHostCall(*call);
  if (result.status.ok()) return 0;
  if (error_bytes > 0) {
    const std::string& message = result.status.message();
    const size_t n = std::min(message.size(), error_bytes - 1);
    std::memcpy(error, message.data(), n);
    error[n] = '\0';
  }
  return 1;
}
