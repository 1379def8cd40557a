#include "cuda/ipc.h"

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <exception>
#include <random>
#include <utility>

#include "gpu/plan.h"

namespace jaxring {
namespace gpu {
namespace {

constexpr uint32_t kIpcMagic = 0x4a584950;  // "JXIP"
constexpr uint32_t kIpcVersion = 1;

// Tells this process from every other, where a PID would not: processes in containers on one
// node, each with its own PID namespace, can have the same PID.
int64_t ProcessId() {
  static const int64_t id = [] {
    int64_t bits = std::chrono::steady_clock::now().time_since_epoch().count();
    try {  // std::random_device throws where the system has no entropy source
      std::random_device random;
      bits ^= static_cast<int64_t>(random()) << 32 ^ random();
    } catch (const std::exception&) {
    }
    return bits ^ getpid();
  }();
  return id;
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
    : GpuCommunicator(rank, size, device, std::move(name)),
      slot_bytes_(slot_bytes),
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
  mine->process = ProcessId();
  cudaDeviceProp properties;
  JAXRING_CUDA_RETURN(where + ": reading the device's properties",
                      cudaGetDeviceProperties(&properties, device));
  std::memcpy(mine->uuid, properties.uuid.bytes, sizeof(mine->uuid));
  status = comm->Allocate(mine, where);
  if (!status.ok()) {
    comm->FreeAllocations();  // a set-up that fails (and may be retried) leaks nothing
    return status;
  }
  *out = std::move(comm);
  return Status();
}

Status IpcCommunicator::Allocate(IpcHandles* mine, const std::string& where) {
  JAXRING_CUDA_RETURN(where + ": allocating the " + std::to_string(2 * slot_bytes_) +
                          "-byte workspace (lower gpu_workspace_bytes?)",
                      cudaMalloc(reinterpret_cast<void**>(&bases_[rank_]), 2 * slot_bytes_));
  JAXRING_CUDA_RETURN(where + ": exporting the workspace",
                      cudaIpcGetMemHandle(&mine->memory, bases_[rank_]));
  for (int kind = 0; kind < kIpcEventKinds; ++kind) {
    for (int parity = 0; parity < 2; ++parity) {
      cudaEvent_t& event = events_[rank_][kind][parity];
      JAXRING_CUDA_RETURN(where + ": creating an interprocess event",
                          cudaEventCreateWithFlags(
                              &event, cudaEventInterprocess | cudaEventDisableTiming));
      JAXRING_CUDA_RETURN(where + ": exporting an interprocess event",
                          cudaIpcGetEventHandle(&mine->events[kind][parity], event));
    }
  }
  return Status();
}

void IpcCommunicator::FreeAllocations() {
  if (bases_[rank_] != nullptr) cudaFree(bases_[rank_]);
  bases_[rank_] = nullptr;
  for (auto& kind : events_[rank_])
    for (cudaEvent_t& event : kind)
      if (event != nullptr) cudaEventDestroy(event);
  cudaGetLastError();  // the error being reported is the set-up's, not these
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
    if (h.process == ProcessId())
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

// gpu/ipc_steps.h's operations on XLA's stream, this process's mapping of the workspaces and
// the interprocess events.
class DeviceIpcOps final : public IpcOps {
 public:
  DeviceIpcOps(IpcCommunicator& comm, cudaStream_t stream, const JaxringHostCall& call,
               const std::string& where)
      : comm_(comm), stream_(stream), call_(call), where_(where) {}

  char* Slot(int rank, int parity) override {
    return comm_.bases_[rank] + static_cast<int64_t>(parity) * comm_.slot_bytes_;
  }
  Status Copy(void* dst, const void* src, size_t bytes) override {
    return StreamCopy(stream_, dst, src, bytes, where_);
  }
  Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                size_t row_bytes, size_t height) override {
    JAXRING_CUDA_RETURN(where_ + ": staging the input",
                        CopyRows(dst, dst_pitch, src, src_pitch, row_bytes, height,
                                 cudaMemcpyDeviceToDevice, stream_));
    return Status();
  }
  Status Reduce(DType dtype, ReduceOp op, const void* const* srcs, int n, void* dst,
                int64_t count, int64_t divisor) override {
    return StreamReduce(stream_, dtype, op, srcs, n, dst, count, divisor, where_);
  }
  Status Synchronize() override { return StreamSynchronize(stream_, where_); }
  Status Record(IpcEvent kind, int parity) override {
    JAXRING_CUDA_RETURN(where_ + ": recording an event",
                        cudaEventRecord(comm_.events_[comm_.rank_][kind][parity], stream_));
    return Status();
  }
  Status Wait(IpcEvent kind, int parity, int only_rank, bool include_self) override {
    for (int peer = 0; peer < comm_.size_; ++peer) {
      if ((peer == comm_.rank_ && !include_self) || (only_rank >= 0 && peer != only_rank))
        continue;
      JAXRING_CUDA_RETURN(where_ + ": waiting for rank " + std::to_string(peer) + "'s event",
                          cudaStreamWaitEvent(stream_, comm_.events_[peer][kind][parity], 0));
    }
    return Status();
  }
  Status Agree() override {
    JaxringHostCall agree = call_;
    agree.rank = comm_.rank_;  // the handler does not read the rank operand back from the device
    agree.group = 0;
    agree.role = kJaxringHostAgree;
    agree.input = nullptr;
    agree.output = nullptr;
    return RunOnHost(agree);
  }

 private:
  IpcCommunicator& comm_;
  cudaStream_t stream_;
  const JaxringHostCall& call_;
  const std::string& where_;
};

Status IpcCommunicator::RunChecked(cudaStream_t stream, const JaxringHostCall& call,
                                   const Header& h, const void* x, void* y,
                                   const std::string& where) {
  DeviceIpcOps ops(*this, stream, call, where);
  return RunIpcSteps(h, x, y, rank_, size_, slot_bytes_, &step_, ops, where);
}

}  // namespace gpu
}  // namespace jaxring
