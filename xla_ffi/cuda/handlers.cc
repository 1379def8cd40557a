// XLA FFI handlers for CUDA devices, for processes with one GPU each (jaxring.mpi communicators).
//
// This is the host-staged path, the baseline the GPU transports are measured against: a call
// copies its input to pinned host memory on XLA's stream, waits for it, runs the call on the
// host through the host library (which owns the communicators: shared memory on one node, MPI
// between nodes), and copies the result back. The pinned buffers are allocated on first use and
// grown, never per call. Handlers block the stream's host thread, so they are not marked
// CUDA-graph compatible. Collectives over several GPUs of one process are refused at lowering
// time (jaxring/_src/common.py), so these handlers only ever see process communicators.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>

#include "common/handlers.h"
#include "common/host_call.h"

namespace jaxring {
namespace {

namespace ffi = xla::ffi;

JaxringHostCallFn host_call = nullptr;

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

ffi::Error CudaFailure(cudaError_t error, const char* what) {
  return ffi::Error::Internal(std::string("jaxring (CUDA): ") + what + ": " +
                              cudaGetErrorString(error));
}

struct CudaRunner {
  using Ctx = ffi::PlatformStream<cudaStream_t>;
  using CtxValue = cudaStream_t;

  static ffi::Error Run(cudaStream_t stream, JaxringHostCall call, ffi::AnyBuffer rank,
                        ffi::AnyBuffer group, const ffi::AnyBuffer* x, ffi::AnyBuffer* y) {
    if (host_call == nullptr)
      return ffi::Error::Internal("jaxring (CUDA): the CUDA library was loaded without "
                                  "jaxring's host library; import jaxring to register it");
    const size_t in_bytes = x != nullptr ? x->size_bytes() : 0;
    const size_t out_bytes = y != nullptr ? y->size_bytes() : 0;
    Staging& s = staging();
    std::lock_guard<std::mutex> lock(s.mutex);
    cudaError_t error = s.ids.Reserve(2 * sizeof(int32_t));
    if (error == cudaSuccess) error = s.input.Reserve(std::max<size_t>(in_bytes, 1));
    if (error == cudaSuccess) error = s.output.Reserve(std::max<size_t>(out_bytes, 1));
    if (error != cudaSuccess) return CudaFailure(error, "allocating pinned staging memory");
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
    if (error != cudaSuccess) return CudaFailure(error, "copying the input to the host");

    call.rank = ids[0];
    call.group = ids[1];
    call.input = s.input.data();
    call.output = s.output.data();
    char message[4096];
    if (host_call(&call, message, sizeof(message)) != 0) return ffi::Error::Internal(message);

    if (out_bytes > 0) {
      error = cudaMemcpyAsync(y->untyped_data(), s.output.data(), out_bytes,
                              cudaMemcpyHostToDevice, stream);
      // The staging buffer is reused by the next call: the copy must be done with it.
      if (error == cudaSuccess) error = cudaStreamSynchronize(stream);
      if (error != cudaSuccess) return CudaFailure(error, "copying the result to the device");
    }
    return ffi::Error::Success();
  }
};

}  // namespace
}  // namespace jaxring

// Called once by jaxring (native.py) with _jaxring's JaxringRunHostCall.
extern "C" void JaxringCudaSetHostCall(JaxringHostCallFn fn) { jaxring::host_call = fn; }

JAXRING_DEFINE_HANDLERS(Cuda, ::jaxring::CudaRunner);
