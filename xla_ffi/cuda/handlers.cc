// XLA FFI handlers for CUDA devices, for processes with one GPU each (jaxring.mpi communicators).
//
// all_reduce, reduce_scatter, all_gather and broadcast run on the communicator's GPU transport
// when it has one (cuda/ipc.h: device memory shared between the processes of one node;
// cuda/staged.h: pipelined pinned staging through the host transport between nodes). Everything
// else (barrier, point-to-point), and every call on a communicator set up with
// gpu_transport="host", takes the host-staged path below: the baseline the GPU transports are
// measured against. It copies the input to pinned host memory on XLA's stream, waits for it, runs
// the call on the host through the host library (which owns the communicators: shared memory on
// one node, MPI between nodes), and copies the result back. Its pinned buffers are allocated on
// first use and grown, never per call. Handlers block the stream's host thread, so they are not
// marked CUDA-graph compatible. Collectives over several GPUs of one process are refused at
// lowering time (jaxring/_src/common.py), so these handlers only ever see process communicators.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "common/config.h"
#include "common/handlers.h"
#include "common/host_call.h"
#include "cuda/device.h"
#include "cuda/ipc.h"
#include "cuda/staged.h"

namespace jaxring {
namespace {

namespace ffi = xla::ffi;

// Pinned host memory that only grows. Never freed: a process-wide buffer outlives the CUDA
// context at exit, and freeing it then would fail.
class PinnedBuffer {
 public:
  cudaError_t Reserve(size_t bytes) {
    if (bytes <= bytes_) return cudaSuccess;
    if (data_ != nullptr) cudaFreeHost(data_);
    data_ = nullptr;
    bytes_ = 0;
    const cudaError_t error = cudaHostAlloc(&data_, bytes, cudaHostAllocDefault);
    if (error == cudaSuccess) bytes_ = bytes;
    return error;
  }
  char* data() const { return static_cast<char*>(data_); }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

struct Staging {
  std::mutex mutex;
  PinnedBuffer ids;  // rank and group, which live in device memory like any operand
  PinnedBuffer input;
  PinnedBuffer output;
};

Staging& staging() {
  static auto* s = new Staging();
  return *s;
}

bool HasGpuTransport(const JaxringHostCall& call) {
  if (call.role != kJaxringHostCollective) return false;
  switch (static_cast<Collective>(call.kind)) {
    case Collective::kAllReduce:
    case Collective::kReduceScatter:
    case Collective::kAllGather:
    case Collective::kBroadcast:
      return true;
    default:
      return false;
  }
}

ffi::Error HostStaged(cudaStream_t stream, JaxringHostCall call, ffi::AnyBuffer rank,
                      ffi::AnyBuffer group, const ffi::AnyBuffer* x, ffi::AnyBuffer* y) {
  if (gpu::HostCall() == nullptr)
    return ffi::Error::Internal("jaxring (CUDA): the CUDA library was loaded without "
                                "jaxring's host library; import jaxring to register it");
  const size_t in_bytes = x != nullptr ? x->size_bytes() : 0;
  const size_t out_bytes = y != nullptr ? y->size_bytes() : 0;
  // A CUDA failure on this side of the host call leaves a process communicator, so that peers
  // waiting for this rank in it fail at once (gpu::LeaveAfterFailure).
  auto fail = [&](cudaError_t error, const char* what) {
    const std::string why = std::string("jaxring (CUDA): ") + what + ": " +
                            cudaGetErrorString(error);
    gpu::LeaveAfterFailure(gpu::HostCall(), call, call.rank, why);
    return ffi::Error::Internal(why);
  };
  Staging& s = staging();
  std::lock_guard<std::mutex> lock(s.mutex);
  cudaError_t error = s.ids.Reserve(2 * sizeof(int32_t));
  if (error == cudaSuccess) error = s.input.Reserve(std::max<size_t>(in_bytes, 1));
  if (error == cudaSuccess) error = s.output.Reserve(std::max<size_t>(out_bytes, 1));
  if (error != cudaSuccess) return fail(error, "allocating pinned staging memory");
  int32_t* ids = reinterpret_cast<int32_t*>(s.ids.data());
  error = cudaMemcpyAsync(&ids[0], rank.untyped_data(), sizeof(int32_t),
                          cudaMemcpyDeviceToHost, stream);
  if (error == cudaSuccess)
    error = cudaMemcpyAsync(&ids[1], group.untyped_data(), sizeof(int32_t),
                            cudaMemcpyDeviceToHost, stream);
  if (error == cudaSuccess && in_bytes > 0)
    error = cudaMemcpyAsync(s.input.data(), x->untyped_data(), in_bytes,
                            cudaMemcpyDeviceToHost, stream);
  if (error == cudaSuccess) error = cudaStreamSynchronize(stream);
  if (error != cudaSuccess) return fail(error, "copying the input to the host");

  call.rank = ids[0];
  call.group = ids[1];
  call.input = s.input.data();
  call.output = s.output.data();
  Status status = gpu::RunOnHost(call);
  if (!status.ok()) return ffi::Error::Internal(status.message());

  if (out_bytes > 0) {
    error = cudaMemcpyAsync(y->untyped_data(), s.output.data(), out_bytes,
                            cudaMemcpyHostToDevice, stream);
    // The staging buffer is reused by the next call: the copy must be done with it.
    if (error == cudaSuccess) error = cudaStreamSynchronize(stream);
    if (error != cudaSuccess) return fail(error, "copying the result to the device");
  }
  return ffi::Error::Success();
}

struct CudaRunner {
  using Ctx = ffi::PlatformStream<cudaStream_t>;
  using CtxValue = cudaStream_t;

  static ffi::Error Run(cudaStream_t stream, JaxringHostCall call, ffi::AnyBuffer rank,
                        ffi::AnyBuffer group, const ffi::AnyBuffer* x, ffi::AnyBuffer* y) {
    // A process communicator's rank operand is the constant process rank (common.py), so the GPU
    // transports take it from their communicator instead of reading it back from the device.
    if (HasGpuTransport(call)) {
      if (gpu::GpuCommunicator* comm = gpu::Find(call.comm)) {
        Status status = comm->Run(stream, call, x->untyped_data(), y->untyped_data());
        if (!status.ok()) return ffi::Error::Internal(status.message());
        return ffi::Error::Success();
      }
    }
    return HostStaged(stream, call, rank, group, x, y);
  }
};

template <typename T>
int Report(const Status& status, T* error, size_t error_bytes) {
  if (status.ok()) return 0;
  if (error_bytes > 0) {
    const size_t n = std::min(status.message().size(), error_bytes - 1);
    std::memcpy(error, status.message().data(), n);
    error[n] = '\0';
  }
  return 1;
}

}  // namespace
}  // namespace jaxring

// ---- the C ABI that jaxring/_src/native.py and gpu.py call through ctypes ----------------------

// Called once by jaxring (native.py) with _jaxring's JaxringRunHostCall.
extern "C" const char* JaxringCudaBuildId() { return jaxring::BuildId(); }
extern "C" void JaxringCudaSetHostCall(JaxringHostCallFn fn) { jaxring::gpu::SetHostCall(fn); }
extern "C" void JaxringCudaSetHostTimeout(double (*fn)()) { jaxring::gpu::SetHostTimeout(fn); }
extern "C" void JaxringCudaSetCallSiteSource(size_t (*fn)(int64_t, char*, size_t)) {
  jaxring::SetCallSiteSource(fn);
}

extern "C" size_t JaxringCudaIpcHandleBytes() { return sizeof(jaxring::gpu::IpcHandles); }

// Pending cuda-ipc communicators: created, handles not yet opened (set-up is two collective
// rounds: create everywhere, exchange, open everywhere).
namespace {
std::mutex pending_mutex;
std::map<uint64_t, std::unique_ptr<jaxring::gpu::IpcCommunicator>>& Pending() {
  static auto* pending = new std::map<uint64_t, std::unique_ptr<jaxring::gpu::IpcCommunicator>>();
  return *pending;
}
}  // namespace

// Allocates this rank's workspace and events; writes its handles (JaxringCudaIpcHandleBytes()).
extern "C" int JaxringCudaIpcCreate(uint64_t key, int rank, int size, int device,
                                    int64_t slot_bytes, const char* name, void* handles,
                                    char* error, size_t error_bytes) {
  std::unique_ptr<jaxring::gpu::IpcCommunicator> comm;
  jaxring::Status status = jaxring::gpu::IpcCommunicator::Create(
      rank, size, device, slot_bytes, name, &comm,
      static_cast<jaxring::gpu::IpcHandles*>(handles));
  if (status.ok()) {
    std::lock_guard<std::mutex> lock(pending_mutex);
    Pending()[key] = std::move(comm);
  }
  return jaxring::Report(status, error, error_bytes);
}

// Opens every rank's handles (`size` of them, in rank order) and registers the communicator.
extern "C" int JaxringCudaIpcOpen(uint64_t key, const void* all_handles, char* error,
                                  size_t error_bytes) {
  std::unique_ptr<jaxring::gpu::IpcCommunicator> comm;
  {
    std::lock_guard<std::mutex> lock(pending_mutex);
    auto it = Pending().find(key);
    if (it != Pending().end()) {
      comm = std::move(it->second);
      Pending().erase(it);
    }
  }
  if (!comm)
    return jaxring::Report(jaxring::Status::Error("jaxring: no cuda-ipc communicator is being "
                                                  "set up under this key"),
                           error, error_bytes);
  jaxring::Status status =
      comm->Open(static_cast<const jaxring::gpu::IpcHandles*>(all_handles));
  if (status.ok()) {
    jaxring::gpu::Register(key, std::move(comm));
  } else {
    (void)comm.release();  // its workspace may already be mapped by peers: leaked on purpose
  }
  return jaxring::Report(status, error, error_bytes);
}

// `message_ops`: a JaxringMessageOps over a CUDA-aware MPI (from _jaxring_mpi.message_ops), or
// null to stage through pinned memory.
extern "C" int JaxringCudaStagedCreate(uint64_t key, int rank, int size, int device,
                                       int64_t chunk_bytes, const void* message_ops,
                                       const char* name, char* error, size_t error_bytes) {
  std::unique_ptr<jaxring::gpu::StagedCommunicator> comm;
  jaxring::Status status = jaxring::gpu::StagedCommunicator::Create(
      rank, size, device, chunk_bytes, static_cast<const JaxringMessageOps*>(message_ops), name,
      &comm);
  if (status.ok()) jaxring::gpu::Register(key, std::move(comm));
  return jaxring::Report(status, error, error_bytes);
}

// Forgets the communicator (registered or still being set up); its memory is leaked on purpose
// (see gpu::Unregister).
extern "C" void JaxringCudaDetach(uint64_t key) {
  {
    std::lock_guard<std::mutex> lock(pending_mutex);
    auto it = Pending().find(key);
    if (it != Pending().end()) {
      (void)it->second.release();
      Pending().erase(it);
    }
  }
  jaxring::gpu::Unregister(key);
}

JAXRING_DEFINE_HANDLERS(Cuda, ::jaxring::CudaRunner);
