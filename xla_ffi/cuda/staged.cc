#include "cuda/staged.h"

#include <utility>
#include <vector>

#include "gpu/plan.h"
#include "gpu/staged_steps.h"

namespace jaxring {
namespace gpu {

// XLA's stream as gpu/direct.h's device.
class StreamMemory final : public DeviceOps {
 public:
  StreamMemory(cudaStream_t stream, const std::string& where) : stream_(stream), where_(where) {}
  Status Copy(void* dst, const void* src, size_t bytes) override {
    return StreamCopy(stream_, dst, src, bytes, where_);
  }
  Status Reduce(DType dtype, ReduceOp op, const void* const* srcs, int n, void* dst,
                int64_t count, int64_t divisor) override {
    return StreamReduce(stream_, dtype, op, srcs, n, dst, count, divisor, where_);
  }
  Status Synchronize() override { return StreamSynchronize(stream_, where_); }

 private:
  cudaStream_t stream_;
  const std::string& where_;
};

StagedCommunicator::StagedCommunicator(int rank, int size, int device, int64_t chunk_bytes,
                                       const JaxringMessageOps* messages, std::string name)
    : GpuCommunicator(rank, size, device, std::move(name)),
      chunk_bytes_(chunk_bytes),
      messages_(messages) {}

Status StagedCommunicator::Create(int rank, int size, int device, int64_t chunk_bytes,
                                  const JaxringMessageOps* messages, std::string name,
                                  std::unique_ptr<StagedCommunicator>* out) {
  const std::string where = "jaxring.mpi: setting up the staged GPU transport for " + name +
                            " (rank " + std::to_string(rank) + " of " + std::to_string(size) +
                            ")";
  const std::string bad = CheckSlotBytes(Transport::kStaged, chunk_bytes, size);
  if (!bad.empty()) return Status::Error(where + ": " + bad);
  Status status = UseDevice(device, where);
  if (!status.ok()) return status;
  std::unique_ptr<StagedCommunicator> comm(
      new StagedCommunicator(rank, size, device, chunk_bytes, messages, std::move(name)));
  if (messages != nullptr && size > kIpcMaxRanks)
    return Status::Error(where + ": the CUDA-aware path reduces every rank in one kernel, at most " +
                         std::to_string(kIpcMaxRanks) + " ranks; set JAXRING_CUDA_AWARE_MPI=0");
  status = comm->Allocate(where);
  if (!status.ok()) {
    comm->FreeAllocations();  // a set-up that fails (and may be retried) leaks nothing
    return status;
  }
  *out = std::move(comm);
  return Status();
}

Status StagedCommunicator::Allocate(const std::string& where) {
  if (messages_ != nullptr) {
    JAXRING_CUDA_RETURN(where + ": allocating the device scratch",
                        cudaMalloc(&device_scratch_, chunk_bytes_));
    JAXRING_CUDA_RETURN(where + ": creating events",
                        cudaEventCreateWithFlags(&scratch_free_, cudaEventDisableTiming));
  }
  for (int b = 0; b < 2; ++b) {
    JAXRING_CUDA_RETURN(where + ": allocating pinned staging memory",
                        cudaHostAlloc(reinterpret_cast<void**>(&to_host_[b]), chunk_bytes_,
                                      cudaHostAllocDefault));
    JAXRING_CUDA_RETURN(where + ": allocating pinned staging memory",
                        cudaHostAlloc(reinterpret_cast<void**>(&from_host_[b]), chunk_bytes_,
                                      cudaHostAllocDefault));
    JAXRING_CUDA_RETURN(where + ": creating events",
                        cudaEventCreateWithFlags(&copied_in_[b], cudaEventDisableTiming));
    JAXRING_CUDA_RETURN(where + ": creating events",
                        cudaEventCreateWithFlags(&copied_out_[b], cudaEventDisableTiming));
  }
  JAXRING_CUDA_RETURN(where + ": creating events",
                      cudaEventCreateWithFlags(&call_start_, cudaEventDisableTiming));
  JAXRING_CUDA_RETURN(where + ": creating events",
                      cudaEventCreateWithFlags(&call_end_, cudaEventDisableTiming));
  JAXRING_CUDA_RETURN(where + ": creating the copy stream",
                      cudaStreamCreateWithFlags(&copy_out_, cudaStreamNonBlocking));
  return Status();
}

void StagedCommunicator::FreeAllocations() {
  if (device_scratch_ != nullptr) cudaFree(device_scratch_);
  for (int b = 0; b < 2; ++b) {
    if (to_host_[b] != nullptr) cudaFreeHost(to_host_[b]);
    if (from_host_[b] != nullptr) cudaFreeHost(from_host_[b]);
  }
  for (cudaEvent_t event : {scratch_free_, copied_in_[0], copied_in_[1], copied_out_[0],
                            copied_out_[1], call_start_, call_end_})
    if (event != nullptr) cudaEventDestroy(event);
  if (copy_out_ != nullptr) cudaStreamDestroy(copy_out_);
  cudaGetLastError();  // the error being reported is the set-up's, not these
}

Status StagedCommunicator::RunChecked(cudaStream_t stream, const JaxringHostCall& call,
                                      const Header& h, const void* x, void* y,
                                      const std::string& where) {
  return messages_ != nullptr ? RunCudaAware(stream, call, h, x, y, where)
                              : RunPipelined(stream, call, h, x, y, where);
}

Status StagedCommunicator::RunCudaAware(cudaStream_t stream, const JaxringHostCall& call,
                                        const Header& h, const void* x, void* y,
                                        const std::string& where) {
  JaxringHostCall agree = call;
  agree.rank = rank_;
  agree.group = 0;
  agree.role = kJaxringHostAgree;
  agree.input = nullptr;
  agree.output = nullptr;
  Status status = RunOnHost(agree);
  if (!status.ok()) return status;
  // Its CUDA errors, like RunDirect's own failures, give up on the messages: peers that passed
  // the agree wait for this rank's messages there, not in a host call.
  auto cuda = [&](const char* what, cudaError_t error) {
    if (error == cudaSuccess) return true;
    status = CudaError(where + ": " + what, error);
    messages_->give_up(messages_->context, status.message().c_str());
    return false;
  };
  // XLA may run this call on another stream than the last one, whose kernels may still read the
  // scratch that MPI is about to write.
  if (!cuda("waiting for the previous call", cudaEventSynchronize(scratch_free_))) return status;
  StreamMemory memory(stream, where);
  status = RunDirect(h, x, y, rank_, size_, device_scratch_, chunk_bytes_, memory, *messages_,
                     HostTimeoutSeconds(), where);
  if (status.ok()) cuda("recording an event", cudaEventRecord(scratch_free_, stream));
  return status;
}

// gpu/staged_steps.h's operations: pinned buffers, input copies on XLA's stream, result copies
// on the communicator's copy stream.
class PinnedStagingOps final : public StagingOps {
 public:
  PinnedStagingOps(StagedCommunicator& comm, cudaStream_t stream, const std::string& where)
      : c_(comm), stream_(stream), where_(where) {}
  char* ToHost(int b) override { return c_.to_host_[b]; }
  char* FromHost(int b) override { return c_.from_host_[b]; }
  Status Begin() override {
    // The result copies must not start before XLA's stream reaches this call: the output buffer
    // may still be in use by earlier work on it.
    JAXRING_CUDA_RETURN(where_ + ": recording an event", cudaEventRecord(c_.call_start_, stream_));
    JAXRING_CUDA_RETURN(where_ + ": ordering the copy stream",
                        cudaStreamWaitEvent(c_.copy_out_, c_.call_start_, 0));
    return Status();
  }
  Status CopyIn(int b, const void* src, size_t src_pitch, size_t row_bytes,
                size_t rows) override {
    if (row_bytes > 0)
      JAXRING_CUDA_RETURN(where_ + ": copying the input to the host",
                          CopyRows(c_.to_host_[b], row_bytes, src, src_pitch, row_bytes, rows,
                                   cudaMemcpyDeviceToHost, stream_));
    JAXRING_CUDA_RETURN(where_ + ": recording an event",
                        cudaEventRecord(c_.copied_in_[b], stream_));
    return Status();
  }
  Status WaitIn(int b) override {
    JAXRING_CUDA_RETURN(where_ + ": waiting for the input copy",
                        cudaEventSynchronize(c_.copied_in_[b]));
    return Status();
  }
  Status WaitOut(int b) override {
    if (!c_.copying_out_[b]) return Status();
    JAXRING_CUDA_RETURN(where_ + ": waiting for a result copy",
                        cudaEventSynchronize(c_.copied_out_[b]));
    c_.copying_out_[b] = false;
    return Status();
  }
  Status CopyOut(int b, void* dst, size_t dst_pitch, size_t row_bytes, size_t rows) override {
    if (row_bytes > 0)
      JAXRING_CUDA_RETURN(where_ + ": copying the result to the device",
                          CopyRows(dst, dst_pitch, c_.from_host_[b], row_bytes, row_bytes, rows,
                                   cudaMemcpyHostToDevice, c_.copy_out_));
    JAXRING_CUDA_RETURN(where_ + ": recording an event",
                        cudaEventRecord(c_.copied_out_[b], c_.copy_out_));
    c_.copying_out_[b] = true;
    return Status();
  }
  Status End() override {
    JAXRING_CUDA_RETURN(where_ + ": recording an event",
                        cudaEventRecord(c_.call_end_, c_.copy_out_));
    JAXRING_CUDA_RETURN(where_ + ": ordering XLA's stream after the result copies",
                        cudaStreamWaitEvent(stream_, c_.call_end_, 0));
    return Status();
  }
  Status RunOnHost(const JaxringHostCall& chunk) override { return gpu::RunOnHost(chunk); }

 private:
  StagedCommunicator& c_;
  cudaStream_t stream_;
  const std::string& where_;
};

Status StagedCommunicator::RunPipelined(cudaStream_t stream, const JaxringHostCall& call,
                                        const Header& h, const void* x, void* y,
                                        const std::string& where) {
  PinnedStagingOps ops(*this, stream, where);
  return RunStagedSteps(h, call, x, y, rank_, size_, chunk_bytes_, ops);
}

}  // namespace gpu
}  // namespace jaxring
