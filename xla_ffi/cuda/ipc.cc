#include "cuda/ipc.h"

#include <unistd.h>

#include <cstring>
#include <utility>

#include "gpu/plan.h"

namespace jaxring {
namespace gpu {
namespace {

constexpr uint32_t kIpcMagic = 0x4a584950;  // "JXIP"
constexpr uint32_t kIpcVersion = 1;

char* At(void* base, int64_t elements, size_t width) {
  return static_cast<char*>(base) + elements * static_cast<int64_t>(width);
}
const char* At(const void* base, int64_t elements, size_t width) {
  return static_cast<const char*>(base) + elements * static_cast<int64_t>(width);
}

std::string Hex(const char* bytes, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    s += digits[(bytes[i] >> 4) & 15];
    s += digits[bytes[i] & 15];
  }
  return s;
}

}  // namespace

IpcCommunicator::IpcCommunicator(int rank, int size, int device, int64_t slot_bytes,
                                 std::string name)
    : rank_(rank),
      size_(size),
      device_(device),
      slot_bytes_(slot_bytes),
      name_(std::move(name)),
      bases_(size, nullptr),
      events_(size) {}

Status IpcCommunicator::Create(int rank, int size, int device, int64_t slot_bytes,
                               std::string name, std::unique_ptr<IpcCommunicator>* out,
                               IpcHandles* mine) {
  const std::string where = "jaxring.mpi: setting up cuda-ipc for " + name + " (rank " +
                            std::to_string(rank) + " of " + std::to_string(size) + ")";
  const std::string bad = CheckSlotBytes(Transport::kIpc, slot_bytes, size);
  if (!bad.empty()) return Status::Error(where + ": " + bad);
  if (size > kIpcMaxRanks)
    return Status::Error(where + ": cuda-ipc takes at most " + std::to_string(kIpcMaxRanks) +
                         " ranks (one reduce kernel reads them all); use gpu_transport='staged'");
  Status status = UseDevice(device, where);
  if (!status.ok()) return status;
  std::unique_ptr<IpcCommunicator> comm(
      new IpcCommunicator(rank, size, device, slot_bytes, std::move(name)));
  std::memset(mine, 0, sizeof(*mine));
  mine->magic = kIpcMagic;
  mine->version = kIpcVersion;
  mine->rank = rank;
  mine->device = device;
  mine->slot_bytes = slot_bytes;
  mine->pid = static_cast<int64_t>(getpid());
  cudaDeviceProp properties;
  JAXRING_CUDA_RETURN(where + ": reading the device's properties",
                      cudaGetDeviceProperties(&properties, device));
  std::memcpy(mine->uuid, properties.uuid.bytes, sizeof(mine->uuid));
  void* workspace = nullptr;
  JAXRING_CUDA_RETURN(where + ": allocating the " + std::to_string(2 * slot_bytes) +
                          "-byte workspace (lower gpu_workspace_bytes?)",
                      cudaMalloc(&workspace, 2 * slot_bytes));
  comm->bases_[rank] = static_cast<char*>(workspace);
  JAXRING_CUDA_RETURN(where + ": exporting the workspace",
                      cudaIpcGetMemHandle(&mine->memory, workspace));
  for (int kind = 0; kind < kIpcEventKinds; ++kind) {
    for (int parity = 0; parity < 2; ++parity) {
      cudaEvent_t& event = comm->events_[rank][kind][parity];
      JAXRING_CUDA_RETURN(where + ": creating an interprocess event",
                          cudaEventCreateWithFlags(
                              &event, cudaEventInterprocess | cudaEventDisableTiming));
      JAXRING_CUDA_RETURN(where + ": exporting an interprocess event",
                          cudaIpcGetEventHandle(&mine->events[kind][parity], event));
    }
  }
  *out = std::move(comm);
  return Status();
}

Status IpcCommunicator::Open(const IpcHandles* all) {
  const std::string where = "jaxring.mpi: setting up cuda-ipc for " + name_ + " (rank " +
                            std::to_string(rank_) + " of " + std::to_string(size_) + ")";
  Status status = UseDevice(device_, where);
  if (!status.ok()) return status;
  for (int peer = 0; peer < size_; ++peer) {
    const IpcHandles& h = all[peer];
    const std::string from = where + ": rank " + std::to_string(peer);
    if (h.magic != kIpcMagic || h.version != kIpcVersion || h.rank != peer)
      return Status::Error(from + " sent a malformed cuda-ipc handle (another jaxring build?)");
    if (h.slot_bytes != slot_bytes_)
      return Status::Error(from + " has gpu_workspace_bytes=" + std::to_string(h.slot_bytes) +
                           ", this rank " + std::to_string(slot_bytes_) +
                           "; every rank must pass the same");
    if (peer == rank_) continue;
    if (h.pid == static_cast<int64_t>(getpid()))
      return Status::Error(from + " is this very process; cuda-ipc needs one process per rank");
    void* base = nullptr;
    const cudaError_t error =
        cudaIpcOpenMemHandle(&base, h.memory, cudaIpcMemLazyEnablePeerAccess);
    if (error != cudaSuccess)
      return CudaError(from + "'s workspace cannot be mapped (GPU " + Hex(h.uuid, 16) +
                           ", device " + std::to_string(h.device) + " in its process; GPUs "
                           "without peer access cannot share memory: use "
                           "gpu_transport='staged')",
                       error);
    bases_[peer] = static_cast<char*>(base);
    for (int kind = 0; kind < kIpcEventKinds; ++kind)
      for (int parity = 0; parity < 2; ++parity)
        JAXRING_CUDA_RETURN(from + "'s interprocess event cannot be opened",
                            cudaIpcOpenEventHandle(&events_[peer][kind][parity],
                                                   h.events[kind][parity]));
  }
  return Status();
}

Status IpcCommunicator::Agree(const JaxringHostCall& call) {
  JaxringHostCall agree = call;
  agree.rank = rank_;  // the handler does not read the rank operand back from the device
  agree.group = 0;
  agree.role = kJaxringHostAgree;
  agree.input = nullptr;
  agree.output = nullptr;
  return RunOnHost(agree);
}

Status IpcCommunicator::WaitForPeers(cudaStream_t stream, IpcEvent kind, int parity,
                                     int only_rank, const std::string& where) {
  for (int peer = 0; peer < size_; ++peer) {
    // This rank's own `done` too: XLA may run the next call on another of its streams.
    if ((peer == rank_ && kind != kDoneEvent) || (only_rank >= 0 && peer != only_rank)) continue;
    JAXRING_CUDA_RETURN(where + ": waiting for rank " + std::to_string(peer) + "'s event",
                        cudaStreamWaitEvent(stream, events_[peer][kind][parity], 0));
  }
  return Status();
}

Status IpcCommunicator::Record(cudaStream_t stream, IpcEvent kind, int parity,
                               const std::string& where) {
  JAXRING_CUDA_RETURN(where + ": recording an event",
                      cudaEventRecord(events_[rank_][kind][parity], stream));
  return Status();
}

Status IpcCommunicator::Run(cudaStream_t stream, const JaxringHostCall& call, const void* x,
                            void* y) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Header h = HeaderOf(call);
  const std::string where = "jaxring (cuda-ipc) " + Where(h, name_, rank_, size_);
  if (!broken_.empty())
    return Status::Error(where + ": this communicator failed earlier and can no longer be used; "
                         "the first error was: " + broken_);
  Status status = CheckCall(call, rank_, size_, where);
  if (!status.ok()) return status;
  status = UseDevice(device_, where);
  if (!status.ok()) return status;
  const size_t width = ByteWidth(h.dtype);
  const int64_t block = BlockCount(h.kind, h.count, size_);
  const std::vector<Step> steps =
      PlanSteps(block, StepElements(Transport::kIpc, h.kind, size_, slot_bytes_, width));
  for (const Step& step : steps) {
    status = RunStep(stream, call, h, x, y, block, step.first, step.count, where);
    if (!status.ok()) {
      broken_ = status.message();
      return status;
    }
  }
  return Status();
}

// One step of gpu/plan.h; see the file comment of ipc.h for the protocol.
Status IpcCommunicator::RunStep(cudaStream_t stream, const JaxringHostCall& call,
                                const Header& h, const void* x, void* y, int64_t block,
                                int64_t first, int64_t count, const std::string& where) {
  const int n = size_;
  const int me = rank_;
  const size_t width = ByteWidth(h.dtype);
  const int parity = static_cast<int>(step_ & 1);
  const int64_t step_elements = StepElements(Transport::kIpc, h.kind, n, slot_bytes_, width);
  const size_t bytes = static_cast<size_t>(count) * width;
  const int root = static_cast<int>(h.root);
  const int64_t divisor = h.op == ReduceOp::kMean ? n : 0;
  ++step_;
  Status status;

  // 1. Stage this rank's piece once every reader of this parity (step - 2) is done with it.
  if (step_ > 2) {
    status = WaitForPeers(stream, kDoneEvent, parity, -1, where);
    if (!status.ok()) return status;
  }
  if (count > 0) {
    switch (h.kind) {
      case Collective::kReduceScatter:
        // n pieces, one per destination block, `step_elements` apart in the slot.
        JAXRING_CUDA_RETURN(where + ": staging the input",
                            cudaMemcpy2DAsync(Slot(me, parity), step_elements * width,
                                              At(x, first, width), block * width, bytes, n,
                                              cudaMemcpyDeviceToDevice, stream));
        break;
      case Collective::kBroadcast:
        if (me != root) break;
        [[fallthrough]];
      default:
        JAXRING_CUDA_RETURN(where + ": staging the input",
                            cudaMemcpyAsync(Slot(me, parity), At(x, first, width), bytes,
                                            cudaMemcpyDeviceToDevice, stream));
    }
  }
  status = Record(stream, kStagedEvent, parity, where);
  // 2. Every rank has recorded its `staged` event once every rank has arrived here.
  if (status.ok()) status = Agree(call);
  if (!status.ok()) return status;
  // 3. Read the peers' pieces.
  status = WaitForPeers(stream, kStagedEvent, parity,
                        h.kind == Collective::kBroadcast ? root : -1, where);
  if (!status.ok()) return status;
  const void* srcs[kIpcMaxRanks];
  void* dsts[1];
  if (count > 0) {
    switch (h.kind) {
      case Collective::kAllReduce: {
        if (ChooseIpcAlgorithm(static_cast<int64_t>(bytes), n) == IpcAlgorithm::kOneShot) {
          for (int r = 0; r < n; ++r) srcs[r] = Slot(r, parity);
          dsts[0] = At(y, first, width);
          JAXRING_CUDA_RETURN(where + ": launching the reduce kernel",
                              JaxringCudaReduce(static_cast<uint8_t>(h.dtype),
                                                static_cast<uint8_t>(h.op), srcs, n, dsts, 1,
                                                count, divisor, stream));
          break;
        }
        // Two-shot: reduce this rank's share in place (only this rank reads it before the
        // second exchange), then copy every rank's reduced share out.
        const Partition share = ShareOf(count, n, width);
        for (int r = 0; r < n; ++r) srcs[r] = At(Slot(r, parity), share.Begin(me), width);
        dsts[0] = At(Slot(me, parity), share.Begin(me), width);
        JAXRING_CUDA_RETURN(where + ": launching the reduce kernel",
                            JaxringCudaReduce(static_cast<uint8_t>(h.dtype),
                                              static_cast<uint8_t>(h.op), srcs, n, dsts, 1,
                                              share.Size(me), divisor, stream));
        status = Record(stream, kReducedEvent, parity, where);
        if (status.ok()) status = Agree(call);
        if (status.ok()) status = WaitForPeers(stream, kReducedEvent, parity, -1, where);
        if (!status.ok()) return status;
        for (int r = 0; r < n; ++r) {
          if (share.Size(r) == 0) continue;
          JAXRING_CUDA_RETURN(where + ": copying a reduced share",
                              cudaMemcpyAsync(At(y, first + share.Begin(r), width),
                                              At(Slot(r, parity), share.Begin(r), width),
                                              share.Size(r) * width, cudaMemcpyDeviceToDevice,
                                              stream));
        }
        break;
      }
      case Collective::kReduceScatter:
        for (int r = 0; r < n; ++r) srcs[r] = At(Slot(r, parity), me * step_elements, width);
        dsts[0] = At(y, first, width);
        JAXRING_CUDA_RETURN(where + ": launching the reduce kernel",
                            JaxringCudaReduce(static_cast<uint8_t>(h.dtype),
                                              static_cast<uint8_t>(h.op), srcs, n, dsts, 1,
                                              count, divisor, stream));
        break;
      case Collective::kAllGather:
        for (int r = 0; r < n; ++r)
          JAXRING_CUDA_RETURN(where + ": copying rank " + std::to_string(r) + "'s piece",
                              cudaMemcpyAsync(At(y, r * block + first, width), Slot(r, parity),
                                              bytes, cudaMemcpyDeviceToDevice, stream));
        break;
      case Collective::kBroadcast:
        JAXRING_CUDA_RETURN(where + ": copying the root's piece",
                            cudaMemcpyAsync(At(y, first, width), Slot(root, parity), bytes,
                                            cudaMemcpyDeviceToDevice, stream));
        break;
      default:
        return Status::Error(where + ": not a cuda-ipc collective");
    }
  }
  // 4. This rank is done reading parity `parity` of every workspace.
  return Record(stream, kDoneEvent, parity, where);
}

}  // namespace gpu
}  // namespace jaxring
