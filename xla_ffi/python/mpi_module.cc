// The MPI transport's extension module. It is separate from _jaxring because it links the MPI
// library: jaxring imports it only after mpi4py has loaded that library, and checks that both
// are the same one. It hands each transport to _jaxring as a capsule.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <mpi.h>
#if defined(OPEN_MPI) && OPEN_MPI
#include <mpi-ext.h>  // Open MPI's MPIX_Query_cuda_support lives in its extensions header
#endif

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "common/config.h"
#include "gpu/direct.h"
#include "gpu/host_memory.h"
#include "transports/mpi.h"
#include "transports/mpi_messages.h"

namespace nb = nanobind;

namespace {

// The MPI implementation whose mpi.h this module was compiled with.
std::string HeaderFamily() {
#if defined(MPICH_VERSION)
  return "MPICH " MPICH_VERSION;
#elif defined(OMPI_MAJOR_VERSION)
  return "Open MPI " + std::to_string(OMPI_MAJOR_VERSION) + "." +
         std::to_string(OMPI_MINOR_VERSION) + "." + std::to_string(OMPI_RELEASE_VERSION);
#else
  return "MPI " + std::to_string(MPI_VERSION) + "." + std::to_string(MPI_SUBVERSION);
#endif
}

// Whether the MPI library accepts CUDA device pointers, and how that was found out. MPICH (4.0+)
// declares MPIX_Query_cuda_support in mpi.h; Open MPI in mpi-ext.h, when its CUDA extension is
// built (OMPI_HAVE_MPI_EXT_CUDA). Both must be asked after MPI_Init, which mpi4py has done.
std::pair<bool, std::string> CudaAware() {
#if defined(MPICH_NUMVERSION) && MPICH_NUMVERSION >= 40000000
  return {MPIX_Query_cuda_support() != 0, "MPIX_Query_cuda_support (MPICH)"};
#elif defined(OMPI_HAVE_MPI_EXT_CUDA) && OMPI_HAVE_MPI_EXT_CUDA
  return {MPIX_Query_cuda_support() != 0, "MPIX_Query_cuda_support (Open MPI)"};
#else
  return {false, "this MPI has no MPIX_Query_cuda_support"};
#endif
}

// Host memory in place of the device: the CUDA-aware path's algorithm, tested on CPU processes.
// Copies and reductions run at once, or, with `deferred`, as late as a stream may run them
// (gpu::HostStream): at the next Synchronize(), or at the harness's last one after the call, as
// XLA's stream runs what the handler queued. Then an exchange that lets MPI touch memory before
// synchronising with the kernels that write or read it gets wrong results.
class HostMemory final : public jaxring::gpu::DeviceOps {
 public:
  // `fail_reduce`: the reduction that fails instead, as a kernel launch may (-1: none).
  HostMemory(int fail_reduce, bool deferred) : fail_reduce_(fail_reduce), stream_(deferred) {}
  jaxring::Status Copy(void* dst, const void* src, size_t bytes) override {
    return stream_.Queue(
        [=] { return jaxring::gpu::HostCopyRows(dst, bytes, src, bytes, bytes, 1); });
  }
  jaxring::Status Reduce(jaxring::DType dtype, jaxring::ReduceOp op, const void* const* srcs,
                         int n, void* dst, int64_t count, int64_t divisor) override {
    if (reduces_++ == fail_reduce_)
      return jaxring::Status::Error("reduction " + std::to_string(fail_reduce_) +
                                    " failed (injected)");
    std::vector<const void*> sources(srcs, srcs + n);
    return stream_.Queue([=] {
      return jaxring::gpu::HostReduce(dtype, op, sources.data(), n, dst, count, divisor);
    });
  }
  jaxring::Status Synchronize() override { return stream_.Run(); }

 private:
  int fail_reduce_;
  int reduces_ = 0;
  jaxring::gpu::HostStream stream_;
};

}  // namespace

NB_MODULE(_jaxring_mpi, m) {
  m.doc() = "jaxring's MPI transport (links the MPI library)";

  m.def(
      "set_call_site_source",
      [](uintptr_t address) {
        jaxring::SetCallSiteSource(
            reinterpret_cast<size_t (*)(int64_t, char*, size_t)>(address));
      },
      nb::arg("address"), "Names call sites in errors as _jaxring does (its call_site_address).");
  m.def("build_id", &jaxring::BuildId, "A hash of the native sources this library was built from.");
  m.def("built_with", &HeaderFamily, "The MPI implementation of the mpi.h used at build time.");
  m.def("library_version", []() {
    char text[MPI_MAX_LIBRARY_VERSION_STRING];
    int length = 0;
    MPI_Get_library_version(text, &length);
    return std::string(text, length);
  }, "MPI_Get_library_version of the MPI library this module is linked with.");

  m.def("stall_next_data", &jaxring::StallNextDataForTest, nb::arg("seconds"),
        "For tests: the next collective of this process's MPI transports sleeps `seconds` after "
        "its header exchange, and the next in-place point-to-point receive after its ready "
        "message (transports/mpi.h, StallNextDataForTest).");
  m.def("stall_next_ring_slices", &jaxring::StallNextRingSlicesForTest, nb::arg("seconds"),
        nb::arg("slices"),
        "For tests: the next `slices` slices of this process's MPI rings each sleep `seconds` "
        "once handled (transports/mpi.h).");

  m.def("stall_next_receive", &jaxring::StallNextReceiveForTest, nb::arg("seconds"),
        "For tests: the next point-to-point receive of this process's MPI transports sleeps "
        "`seconds` before it looks for its message (transports/mpi.h).");

  m.def("set_max_piece", &jaxring::SetMaxPieceForTest, nb::arg("bytes"),
        "For tests: MPI messages travel as pieces of at most `bytes` (0: 1 GiB, the default), "
        "so that small messages take the paths of those over 1 GiB. Set the same on every rank.");

  m.def("slice_bytes", &jaxring::SliceBytes, nb::arg("bytes"), nb::arg("pipeline_slice_bytes"),
        "The slices the MPI ring's steps and broadcast chain cut `bytes` into (transports/mpi.h).");

  m.def("notice", [](const std::string& why, size_t bytes) { return jaxring::Notice(why, bytes); },
        nb::arg("why"), nb::arg("bytes"),
        "A gave-up notice's text: `why` cut to `bytes` by dropping its middle (common/types.h).");

  m.def("cuda_aware", &CudaAware,
        "(whether the MPI library takes CUDA device pointers, how that was determined).");

  m.def(
      "message_ops",
      [](uintptr_t comm_address, const std::string& name) {
        const MPI_Comm parent = *reinterpret_cast<const MPI_Comm*>(comm_address);
        JaxringMessageOps* ops = nullptr;
        jaxring::Status status = jaxring::CreateMpiMessages(parent, name, &ops);
        if (!status.ok()) throw std::runtime_error(status.message());
        return reinterpret_cast<uintptr_t>(ops);
      },
      nb::arg("comm_address"), nb::arg("name"),
      "Duplicates the communicator (collective) and returns the address of a JaxringMessageOps "
      "table over it, for the staged GPU transport on a CUDA-aware MPI.");
  m.def(
      "direct_collective",
      [](uintptr_t ops_address, int rank, int size, int kind, int op, int dtype,
         const nb::bytes& input, int64_t output_count, int64_t root, int64_t scratch_bytes,
         double timeout_seconds, int fail_reduce, bool deferred) {
        jaxring::Header h;
        h.kind = static_cast<jaxring::Collective>(kind);
        h.op = static_cast<jaxring::ReduceOp>(op);
        h.dtype = static_cast<jaxring::DType>(dtype);
        h.root = root;
        const size_t width = jaxring::ByteWidth(h.dtype);
        h.count = static_cast<int64_t>(input.size() / width);
        std::vector<char> output(output_count * width), scratch(scratch_bytes);
        HostMemory memory(fail_reduce, deferred);
        // x as a kernel queued before the call leaves it: deferred, not there until the call
        // synchronises, as on a GPU, where XLA's stream has only queued what computes x.
        std::vector<char> x(input.size(), '\x7f');
        memory.Copy(x.data(), input.c_str(), x.size());
        jaxring::Status status;
        {
          nb::gil_scoped_release release;
          status = jaxring::gpu::RunDirect(
              h, x.data(), output.data(), rank, size, scratch.data(), scratch_bytes, memory,
              *reinterpret_cast<const JaxringMessageOps*>(ops_address), timeout_seconds,
              "jaxring direct " + jaxring::Describe(h));
          const jaxring::Status finished = memory.Synchronize();  // what the stream still held
          if (status.ok()) status = finished;
        }
        if (!status.ok()) throw std::runtime_error(status.message());
        return nb::bytes(output.data(), output.size());
      },
      nb::arg("ops_address"), nb::arg("rank"), nb::arg("size"), nb::arg("kind"), nb::arg("op"),
      nb::arg("dtype"), nb::arg("input"), nb::arg("output_count"), nb::arg("root"),
      nb::arg("scratch_bytes"), nb::arg("timeout_seconds"), nb::arg("fail_reduce") = -1,
      nb::arg("deferred") = false,
      "Runs the CUDA-aware path's algorithm (gpu/direct.h) on host memory (tests); with "
      "`deferred`, copies and reductions run as late as a stream may run them (HostMemory).");

  m.def(
      "create",
      [](uintptr_t comm_address, const std::string& name, bool direct_headers) {
        // mpi4py's MPI._addressof(comm): the address of its MPI_Comm handle, whatever its type.
        const MPI_Comm parent = *reinterpret_cast<const MPI_Comm*>(comm_address);
        std::unique_ptr<jaxring::MpiTransport> transport;
        jaxring::Status status =
            jaxring::MpiTransport::Create(parent, name, direct_headers, &transport);
        if (!status.ok()) throw std::runtime_error(status.message());
        jaxring::ProcessTransport* owned = transport.release();
        return nb::capsule(owned, "jaxring.ProcessTransport");
      },
      nb::arg("comm_address"), nb::arg("name"), nb::arg("direct_headers"),
      "Duplicates the communicator at `comm_address` (collective) and returns its transport for "
      "_jaxring.process_register; `direct_headers`: its header exchange's method, the same on "
      "every rank.");
}
