#include "cuda/staged.h"

#include <utility>
#include <vector>

#include "gpu/plan.h"

namespace jaxring {
namespace gpu {
namespace {

char* At(void* base, int64_t elements, size_t width) {
  return static_cast<char*>(base) + elements * static_cast<int64_t>(width);
}
const char* At(const void* base, int64_t elements, size_t width) {
  return static_cast<const char*>(base) + elements * static_cast<int64_t>(width);
}

}  // namespace

// XLA's stream as gpu/direct.h's device.
class StreamMemory final : public DeviceOps {
 public:
  StreamMemory(cudaStream_t stream, const std::string& where) : stream_(stream), where_(where) {}
  Status Copy(void* dst, const void* src, size_t bytes) override {
    JAXRING_CUDA_RETURN(where_ + ": copying on the device",
                        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
    return Status();
  }
  Status Reduce(DType dtype, ReduceOp op, const void* const* srcs, int n, void* dst,
                int64_t count, int64_t divisor) override {
    void* dsts[1] = {dst};
    JAXRING_CUDA_RETURN(where_ + ": launching the reduce kernel",
                        JaxringCudaReduce(static_cast<uint8_t>(dtype), static_cast<uint8_t>(op),
                                          srcs, n, dsts, 1, count, divisor, stream_));
    return Status();
  }
  Status Synchronize() override {
    JAXRING_CUDA_RETURN(where_ + ": waiting for the device", cudaStreamSynchronize(stream_));
    return Status();
  }

 private:
  cudaStream_t stream_;
  const std::string& where_;
};

StagedCommunicator::StagedCommunicator(int rank, int size, int device, int64_t chunk_bytes,
                                       const JaxringMessageOps* messages, std::string name)
    : rank_(rank),
      size_(size),
      device_(device),
      chunk_bytes_(chunk_bytes),
      messages_(messages),
      name_(std::move(name)) {}

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
  if (messages != nullptr) {
    JAXRING_CUDA_RETURN(where + ": allocating the device scratch",
                        cudaMalloc(&comm->device_scratch_, chunk_bytes));
    JAXRING_CUDA_RETURN(where + ": creating events",
                        cudaEventCreateWithFlags(&comm->scratch_free_, cudaEventDisableTiming));
  }
  for (int b = 0; b < 2; ++b) {
    void* in = nullptr;
    void* result = nullptr;
    JAXRING_CUDA_RETURN(where + ": allocating pinned staging memory",
                        cudaHostAlloc(&in, chunk_bytes, cudaHostAllocDefault));
    JAXRING_CUDA_RETURN(where + ": allocating pinned staging memory",
                        cudaHostAlloc(&result, chunk_bytes, cudaHostAllocDefault));
    comm->to_host_[b] = static_cast<char*>(in);
    comm->from_host_[b] = static_cast<char*>(result);
    JAXRING_CUDA_RETURN(where + ": creating events",
                        cudaEventCreateWithFlags(&comm->copied_in_[b], cudaEventDisableTiming));
    JAXRING_CUDA_RETURN(where + ": creating events",
                        cudaEventCreateWithFlags(&comm->copied_out_[b], cudaEventDisableTiming));
  }
  JAXRING_CUDA_RETURN(where + ": creating events",
                      cudaEventCreateWithFlags(&comm->call_start_, cudaEventDisableTiming));
  JAXRING_CUDA_RETURN(where + ": creating events",
                      cudaEventCreateWithFlags(&comm->call_end_, cudaEventDisableTiming));
  JAXRING_CUDA_RETURN(where + ": creating the copy stream",
                      cudaStreamCreateWithFlags(&comm->copy_out_, cudaStreamNonBlocking));
  *out = std::move(comm);
  return Status();
}

Status StagedCommunicator::Run(cudaStream_t stream, const JaxringHostCall& call, const void* x,
                               void* y) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Header h = HeaderOf(call);
  const std::string where = "jaxring (staged GPU) " + Where(h, name_, rank_, size_);
  if (!broken_.empty())
    return Status::Error(where + ": this communicator failed earlier and can no longer be used; "
                         "the first error was: " + broken_);
  Status status = CheckCall(call, rank_, size_, where);
  if (!status.ok()) return status;
  status = UseDevice(device_, where);
  if (!status.ok()) return status;
  status = messages_ != nullptr ? RunCudaAware(stream, call, h, x, y, where)
                                : RunPipelined(stream, call, h, x, y, where);
  if (!status.ok()) broken_ = status.message();
  return status;
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
  // XLA may run this call on another stream than the last one, whose kernels may still read the
  // scratch that MPI is about to write.
  JAXRING_CUDA_RETURN(where + ": waiting for the previous call",
                      cudaEventSynchronize(scratch_free_));
  StreamMemory memory(stream, where);
  status = RunDirect(h, x, y, rank_, size_, device_scratch_, chunk_bytes_, memory, *messages_,
                     HostTimeoutSeconds(), where);
  if (status.ok())
    JAXRING_CUDA_RETURN(where + ": recording an event", cudaEventRecord(scratch_free_, stream));
  return status;
}

Status StagedCommunicator::RunPipelined(cudaStream_t stream, const JaxringHostCall& call,
                                        const Header& h, const void* x, void* y,
                                        const std::string& where) {
  const int n = size_;
  const size_t width = ByteWidth(h.dtype);
  const int64_t block = BlockCount(h.kind, h.count, n);
  const int64_t step_elements = StepElements(Transport::kStaged, h.kind, n, chunk_bytes_, width);
  const std::vector<Step> steps = PlanSteps(block, step_elements);
  const bool root_only = h.kind == Collective::kBroadcast;
  Status status;
  auto pipeline = [&]() -> Status {
    // The result copies must not start before XLA's stream reaches this call: the output buffer
    // may still be in use by earlier work on it.
    JAXRING_CUDA_RETURN(where + ": recording an event", cudaEventRecord(call_start_, stream));
    JAXRING_CUDA_RETURN(where + ": ordering the copy stream",
                        cudaStreamWaitEvent(copy_out_, call_start_, 0));

    // Step k's input chunk into to_host_[k % 2], on XLA's stream (after the producers of x).
    auto copy_in = [&](size_t k) -> Status {
      const Step& s = steps[k];
      const int b = static_cast<int>(k & 1);
      const size_t bytes = static_cast<size_t>(s.count) * width;
      if (bytes > 0 && !(root_only && rank_ != h.root)) {
        if (h.kind == Collective::kReduceScatter) {
          JAXRING_CUDA_RETURN(where + ": copying the input to the host",
                              cudaMemcpy2DAsync(to_host_[b], bytes, At(x, s.first, width),
                                                block * width, bytes, n, cudaMemcpyDeviceToHost,
                                                stream));
        } else {
          JAXRING_CUDA_RETURN(where + ": copying the input to the host",
                              cudaMemcpyAsync(to_host_[b], At(x, s.first, width), bytes,
                                              cudaMemcpyDeviceToHost, stream));
        }
      }
      JAXRING_CUDA_RETURN(where + ": recording an event", cudaEventRecord(copied_in_[b], stream));
      return Status();
    };

    status = copy_in(0);
    if (!status.ok()) return status;
    for (size_t k = 0; k < steps.size(); ++k) {
      const Step& s = steps[k];
      const int b = static_cast<int>(k & 1);
      // to_host_[(k+1) % 2] was last read by host call k-1, which has returned.
      if (k + 1 < steps.size()) {
        status = copy_in(k + 1);
        if (!status.ok()) return status;
      }
      JAXRING_CUDA_RETURN(where + ": waiting for the input copy",
                          cudaEventSynchronize(copied_in_[b]));
      if (copying_out_[b]) {
        JAXRING_CUDA_RETURN(where + ": waiting for a result copy",
                            cudaEventSynchronize(copied_out_[b]));
        copying_out_[b] = false;
      }
      JaxringHostCall chunk = call;
      chunk.rank = rank_;
      chunk.group = 0;
      chunk.input = to_host_[b];
      chunk.output = from_host_[b];
      chunk.input_count = h.kind == Collective::kReduceScatter ? s.count * n : s.count;
      chunk.output_count = h.kind == Collective::kAllGather ? s.count * n : s.count;
      status = RunOnHost(chunk);
      if (!status.ok()) return status;
      const size_t bytes = static_cast<size_t>(s.count) * width;
      if (bytes > 0) {
        if (h.kind == Collective::kAllGather) {
          JAXRING_CUDA_RETURN(where + ": copying the result to the device",
                              cudaMemcpy2DAsync(At(y, s.first, width), block * width,
                                                from_host_[b], bytes, bytes, n,
                                                cudaMemcpyHostToDevice, copy_out_));
        } else {
          JAXRING_CUDA_RETURN(where + ": copying the result to the device",
                              cudaMemcpyAsync(At(y, s.first, width), from_host_[b], bytes,
                                              cudaMemcpyHostToDevice, copy_out_));
        }
      }
      JAXRING_CUDA_RETURN(where + ": recording an event",
                          cudaEventRecord(copied_out_[b], copy_out_));
      copying_out_[b] = true;
    }
    JAXRING_CUDA_RETURN(where + ": recording an event", cudaEventRecord(call_end_, copy_out_));
    JAXRING_CUDA_RETURN(where + ": ordering XLA's stream after the result copies",
                        cudaStreamWaitEvent(stream, call_end_, 0));
    return Status();
  };
  return pipeline();
}

}  // namespace gpu
}  // namespace jaxring
