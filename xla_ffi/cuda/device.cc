#include "cuda/device.h"

#include <map>
#include <mutex>

#include "gpu/plan.h"

namespace jaxring {
namespace gpu {
namespace {

JaxringHostCallFn host_call = nullptr;
double (*host_timeout)() = nullptr;
std::mutex registry_mutex;

std::map<uint64_t, std::unique_ptr<GpuCommunicator>>& Registry() {
  static auto* registry = new std::map<uint64_t, std::unique_ptr<GpuCommunicator>>();
  return *registry;
}

}  // namespace

JaxringHostCallFn HostCall() { return host_call; }
double HostTimeoutSeconds() { return host_timeout != nullptr ? host_timeout() : 300.0; }
void SetHostTimeout(double (*fn)()) { host_timeout = fn; }
void SetHostCall(JaxringHostCallFn fn) { host_call = fn; }

Status RunOnHost(const JaxringHostCall& call) {
  if (host_call == nullptr)
    return Status::Error("jaxring (CUDA): the CUDA library was loaded without jaxring's host "
                         "library; import jaxring to register it");
  char message[4096];
  if (host_call(&call, message, sizeof(message)) != 0) return Status::Error(message);
  return Status();
}

Status CudaError(const std::string& where, cudaError_t error) {
  return Status::Error(where + ": CUDA error " + cudaGetErrorName(error) + ": " +
                       cudaGetErrorString(error));
}

cudaError_t CopyRows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                     size_t row_bytes, size_t rows, cudaMemcpyKind kind, cudaStream_t stream) {
  constexpr size_t kMaxPitch = size_t{1} << 31;  // below cudaDevAttrMaxPitch on sm_80/sm_90
  if (rows == 1) return cudaMemcpyAsync(dst, src, row_bytes, kind, stream);
  if (src_pitch < kMaxPitch && dst_pitch < kMaxPitch)
    return cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows, kind, stream);
  for (size_t row = 0; row < rows; ++row) {
    const cudaError_t error =
        cudaMemcpyAsync(static_cast<char*>(dst) + row * dst_pitch,
                        static_cast<const char*>(src) + row * src_pitch, row_bytes, kind, stream);
    if (error != cudaSuccess) return error;
  }
  return cudaSuccess;
}

Status StreamCopy(cudaStream_t stream, void* dst, const void* src, size_t bytes,
                  const std::string& where) {
  JAXRING_CUDA_RETURN(where + ": copying on the device",
                      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
  return Status();
}

Status StreamReduce(cudaStream_t stream, DType dtype, ReduceOp op, const void* const* srcs,
                    int n, void* dst, int64_t count, int64_t divisor, const std::string& where) {
  void* dsts[1] = {dst};
  JAXRING_CUDA_RETURN(where + ": launching the reduce kernel",
                      JaxringCudaReduce(static_cast<uint8_t>(dtype), static_cast<uint8_t>(op),
                                        srcs, n, dsts, 1, count, divisor, stream));
  return Status();
}

Status StreamSynchronize(cudaStream_t stream, const std::string& where) {
  JAXRING_CUDA_RETURN(where + ": waiting for the device", cudaStreamSynchronize(stream));
  return Status();
}

Status UseDevice(int device, const std::string& where) {
  int current = -1;
  JAXRING_CUDA_RETURN(where + ": querying the current device", cudaGetDevice(&current));
  if (current != device)
    JAXRING_CUDA_RETURN(where + ": selecting device " + std::to_string(device),
                        cudaSetDevice(device));
  return Status();
}

Status GpuCommunicator::CheckStreamDevice(cudaStream_t stream, const std::string& where) const {
#if CUDART_VERSION >= 12080
  int device = -1;
  JAXRING_CUDA_RETURN(where + ": querying the stream's device",
                      cudaStreamGetDevice(stream, &device));
  if (device != device_)
    return Status::Error(where + ": this call runs on CUDA device " + std::to_string(device) +
                         ", but its communicator's workspace and events are on device " +
                         std::to_string(device_) + " (the process's first GPU). jaxring runs one "
                         "process per GPU: launch one per device, or make it the only one "
                         "visible (CUDA_VISIBLE_DEVICES).");
#else
  (void)stream;
  (void)where;
#endif
  return Status();
}

Status CheckCall(const JaxringHostCall& call, int size, const std::string& where) {
  const Collective kind = static_cast<Collective>(call.kind);
  if (call.size != size)
    return Status::Error(where + ": compiled for " + std::to_string(call.size) +
                         " ranks, but the communicator has " + std::to_string(size));
  if (!IsSupported(static_cast<DType>(call.dtype)))
    return Status::Error(where + ": unsupported element type");
  const int64_t expected_output =
      kind == Collective::kReduceScatter ? call.input_count / size
      : kind == Collective::kAllGather   ? call.input_count * size
                                         : call.input_count;
  if (kind == Collective::kReduceScatter && call.input_count % size != 0)
    return Status::Error(where + ": input size " + std::to_string(call.input_count) +
                         " is not divisible by the world size " + std::to_string(size));
  if (call.output_count != expected_output)
    return Status::Error(where + ": output has " + std::to_string(call.output_count) +
                         " elements, expected " + std::to_string(expected_output));
  if (kind == Collective::kBroadcast && (call.root < 0 || call.root >= size))
    return Status::Error(where + ": root " + std::to_string(call.root) + " is outside [0, " +
                         std::to_string(size) + ")");
  return Status();
}

Status GpuCommunicator::Run(cudaStream_t stream, const JaxringHostCall& call, const void* x,
                            void* y) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Header h = HeaderOf(call);
  const std::string where =
      std::string("jaxring (") + transport() + ") " + Where(h, name_, rank_, size_);
  if (!broken_.empty())
    return Status::Error(where + ": this communicator failed earlier and can no longer be used; "
                         "the first error was: " + broken_);
  Status status = CheckCall(call, size_, where);
  if (status.ok()) status = CheckStreamDevice(stream, where);
  if (status.ok()) status = UseDevice(device_, where);
  if (status.ok()) status = RunChecked(stream, call, h, x, y, where);
  if (!status.ok()) {
    broken_ = status.message();
    LeaveAfterFailure(host_call, call, rank_, broken_);
  }
  return status;
}

void Register(uint64_t key, std::unique_ptr<GpuCommunicator> comm) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  std::unique_ptr<GpuCommunicator>& slot = Registry()[key];
  if (slot) (void)slot.release();  // leaked on purpose, see Unregister
  slot = std::move(comm);
}

void Unregister(uint64_t key) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = Registry().find(key);
  if (it == Registry().end()) return;
  (void)it->second.release();
  Registry().erase(it);
}

GpuCommunicator* Find(uint64_t key) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = Registry().find(key);
  return it == Registry().end() ? nullptr : it->second.get();
}

}  // namespace gpu
}  // namespace jaxring
