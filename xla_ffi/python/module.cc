// The Python extension: hands XLA the FFI handlers (as capsules) and exposes the configuration.
#include <nanobind/nanobind.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "common/config.h"
#include "common/host_call.h"
#include "common/types.h"
#include "cpu/handoff.h"
#include "cpu/host.h"
#include "gpu/host_memory.h"
#include "gpu/ipc_steps.h"
#include "gpu/plan.h"
#include "gpu/staged_steps.h"
#include "kernels/reduce_cpu.h"
#include "models/targets.h"
#include "ring/staged.h"
#include "transports/local.h"
#include "transports/mailbox.h"
#include "transports/process.h"
#include "transports/shm.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

extern "C" {
XLA_FFI_Error* JaxringAllReduceCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxringReduceScatterCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxringAllGatherCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxringBroadcastCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxringBarrierCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxringPpermuteCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxringSendCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxringRecvCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxringBenchmarkNativeFloorCpu(XLA_FFI_CallFrame*);
}

namespace {

jaxring::Status RunOnHost(const JaxringHostCall& call) {
  char error[4096];
  if (JaxringRunHostCall(&call, error, sizeof(error)) != 0) return jaxring::Status::Error(error);
  return jaxring::Status();
}

// A call on process communicator `key` as the tests describe it.
JaxringHostCall TestCall(uint64_t key, const std::string& name, int rank, int size,
                         JaxringHostRole role, int kind, int op, int dtype, int64_t input_count,
                         int64_t output_count, int64_t root, int64_t op_id) {
  JaxringHostCall call{};
  call.comm = key;
  call.comm_name = name.data();
  call.comm_name_size = name.size();
  call.rank = rank;
  call.size = size;
  call.op_id = op_id;
  call.role = role;
  call.kind = static_cast<uint8_t>(kind);
  call.op = static_cast<uint8_t>(op);
  call.dtype = static_cast<uint8_t>(dtype);
  call.root = root;
  call.input_count = input_count;
  call.output_count = output_count;
  return call;
}

size_t Width(int dtype) { return jaxring::ByteWidth(static_cast<jaxring::DType>(dtype)); }

// What the GPU-step test bindings share: the call for one collective on `input`, its header, and
// an output buffer of `output_count` elements.
struct StepsTest {
  StepsTest(uint64_t key, const std::string& name, int rank, int size, int kind, int op,
            int dtype, const nb::bytes& input, int64_t output_count, int64_t root, int64_t op_id)
      : call(TestCall(key, name, rank, size, kJaxringHostCollective, kind, op, dtype,
                      static_cast<int64_t>(input.size() / Width(dtype)), output_count, root,
                      op_id)),
        header(jaxring::gpu::HeaderOf(call)),
        output(output_count * Width(dtype)) {}
  JaxringHostCall call;
  jaxring::Header header;
  std::vector<char> output;
};

// cuda-ipc's steps on host memory that every process of a communicator maps (CPU tests): copies
// are memcpy, reductions the CPU kernels, and events nothing, since every operation is done
// when it returns; the header exchange is the real one. Every operation is also written to
// `trace` (the slots it reads and writes, the events it records and waits for), so that tests
// can check the ordering a GPU's streams need, which the host's synchronous copies never show.
class HostIpcOps final : public jaxring::gpu::IpcOps {
 public:
  // `fail_operation` >= 0: that copy or reduction (counted from 0) fails, as a CUDA launch may.
  HostIpcOps(const JaxringHostCall& call, char* shared, int64_t slot_bytes,
             std::vector<std::string>* trace, int fail_operation)
      : call_(call), shared_(shared), slot_bytes_(slot_bytes), trace_(trace),
        fail_operation_(fail_operation) {}
  char* Slot(int rank, int parity) override {
    return shared_ + (2 * static_cast<int64_t>(rank) + parity) * slot_bytes_;
  }
  jaxring::Status Copy(void* dst, const void* src, size_t bytes) override {
    if (Fails()) return Injected();
    Touch("read", src);
    Touch("write", dst);
    return jaxring::gpu::HostCopyRows(dst, bytes, src, bytes, bytes, 1);
  }
  jaxring::Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                         size_t row_bytes, size_t height) override {
    if (Fails()) return Injected();
    Touch("read", src);
    Touch("write", dst);
    return jaxring::gpu::HostCopyRows(dst, dst_pitch, src, src_pitch, row_bytes, height);
  }
  jaxring::Status Reduce(jaxring::DType dtype, jaxring::ReduceOp op, const void* const* srcs,
                         int n, void* dst, int64_t count, int64_t divisor) override {
    if (Fails()) return Injected();
    for (int i = 0; i < n; ++i) Touch("read", srcs[i]);
    Touch("write", dst);
    return jaxring::gpu::HostReduce(dtype, op, srcs, n, dst, count, divisor);
  }
  jaxring::Status Synchronize() override { return jaxring::Status(); }
  jaxring::Status Record(jaxring::gpu::IpcEvent kind, int parity) override {
    trace_->push_back("record " + std::to_string(kind) + " " + std::to_string(parity));
    return jaxring::Status();
  }
  jaxring::Status Wait(jaxring::gpu::IpcEvent kind, int parity, int only_rank,
                       bool include_self) override {
    trace_->push_back("wait " + std::to_string(kind) + " " + std::to_string(parity) + " " +
                      std::to_string(only_rank) + " " + std::to_string(include_self));
    return jaxring::Status();
  }
  jaxring::Status Agree() override {
    trace_->push_back("agree");
    JaxringHostCall agree = call_;
    agree.role = kJaxringHostAgree;
    return RunOnHost(agree);
  }

 private:
  bool Fails() { return operations_++ == fail_operation_; }
  jaxring::Status Injected() const {
    return jaxring::Status::Error("device operation " + std::to_string(fail_operation_) +
                                  " failed (injected)");
  }
  // "read R P" or "write R P" where `at` lies in rank R's slot of parity P.
  void Touch(const char* what, const void* at) {
    const int64_t offset = static_cast<const char*>(at) - shared_;
    if (offset < 0 || offset >= 2 * static_cast<int64_t>(call_.size) * slot_bytes_) return;
    const int64_t slot = offset / slot_bytes_;
    trace_->push_back(std::string(what) + " " + std::to_string(slot / 2) + " " +
                      std::to_string(slot % 2));
  }

  const JaxringHostCall& call_;
  char* shared_;
  int64_t slot_bytes_;
  std::vector<std::string>* trace_;
  const int fail_operation_;
  int operations_ = 0;
};

// The staged transport's pipeline on host memory (CPU tests): "device" and pinned buffers are
// all host memory, and the chunks run on the real host transport. Copies run at once, or, with
// `deferred`, as late as a GPU stream may run them: a chunk's copy into ToHost(b) only when
// WaitIn(b) waits for it, a result's copy out of FromHost(b) only when WaitOut(b) waits for the
// buffer, and whatever is left at End(). A pipeline that reads a staging buffer before waiting
// for its copy, or writes one before its last copy out, then gets wrong results, where copies
// run at once would hide it; copies run at once catch a copy issued into a buffer still in use.
class HostStagingOps final : public jaxring::gpu::StagingOps {
 public:
  // `fail_copy_out` >= 0: that result copy (counted from 0) fails, as a CUDA copy may on a GPU.
  HostStagingOps(int64_t chunk_bytes, int fail_copy_out, bool deferred)
      : in_{jaxring::gpu::HostStream(deferred), jaxring::gpu::HostStream(deferred)},
        out_{jaxring::gpu::HostStream(deferred), jaxring::gpu::HostStream(deferred)},
        fail_copy_out_(fail_copy_out) {
    for (auto& b : to_host_) b.resize(chunk_bytes);
    for (auto& b : from_host_) b.resize(chunk_bytes);
  }
  char* ToHost(int b) override { return to_host_[b].data(); }
  char* FromHost(int b) override { return from_host_[b].data(); }
  jaxring::Status Begin() override {
    began_ = true;
    return jaxring::Status();
  }
  jaxring::Status CopyIn(int b, const void* src, size_t src_pitch, size_t row_bytes,
                         size_t rows) override {
    if (row_bytes * rows > to_host_[b].size()) return Overflow();
    char* dst = to_host_[b].data();
    return in_[b].Queue([=] {
      return jaxring::gpu::HostCopyRows(dst, row_bytes, src, src_pitch, row_bytes, rows);
    });
  }
  jaxring::Status WaitIn(int b) override { return in_[b].Run(); }
  jaxring::Status WaitOut(int b) override { return out_[b].Run(); }
  jaxring::Status CopyOut(int b, void* dst, size_t dst_pitch, size_t row_bytes,
                          size_t rows) override {
    if (row_bytes * rows > from_host_[b].size()) return Overflow();
    if (copies_out_++ == fail_copy_out_)
      return jaxring::Status::Error("copying result chunk " + std::to_string(fail_copy_out_) +
                                    " to the device failed (injected)");
    const char* src = from_host_[b].data();
    return out_[b].Queue([=] {
      return jaxring::gpu::HostCopyRows(dst, dst_pitch, src, row_bytes, row_bytes, rows);
    });
  }
  jaxring::Status End() override {
    ended_ = true;
    jaxring::Status status;
    for (jaxring::gpu::HostStream* stream : {&in_[0], &in_[1], &out_[0], &out_[1]}) {
      const jaxring::Status ran = stream->Run();
      if (status.ok()) status = ran;
    }
    return status;
  }
  jaxring::Status RunOnHost(const JaxringHostCall& chunk) override {
    return ::RunOnHost(chunk);
  }
  // Whether a call that began also ended (on a GPU, End() orders XLA's stream after the result
  // copies, which must happen after an error too).
  bool Ended() const { return ended_ || !began_; }

 private:
  static jaxring::Status Overflow() {
    return jaxring::Status::Error("a chunk overflows its host buffer");
  }
  std::vector<char> to_host_[2], from_host_[2];
  // Copies queued into ToHost(b), and out of FromHost(b).
  jaxring::gpu::HostStream in_[2], out_[2];
  bool began_ = false, ended_ = false;
  const int fail_copy_out_;
  int copies_out_ = 0;
};

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

jaxring::Algorithm ParseAlgorithm(const std::string& name) {
  if (name == "auto") return jaxring::Algorithm::kAuto;
  if (name == "direct") return jaxring::Algorithm::kDirect;
  if (name == "ring") return jaxring::Algorithm::kRing;
  throw nb::value_error(("algorithm must be one of 'auto', 'direct', 'ring'; got '" + name + "'")
                            .c_str());
}

jaxring::ShmStores ParseShmStores(const std::string& name) {
  if (name == "auto") return jaxring::ShmStores::kAuto;
  if (name == "plain") return jaxring::ShmStores::kPlain;
  if (name == "streaming") return jaxring::ShmStores::kStreaming;
  throw nb::value_error(
      ("shm_stores must be one of 'auto', 'plain', 'streaming'; got '" + name + "'").c_str());
}

constexpr jaxring::CpuKernels kAllCpuKernels[] = {
    jaxring::CpuKernels::kAuto, jaxring::CpuKernels::kBaseline, jaxring::CpuKernels::kAvx2,
    jaxring::CpuKernels::kAvx512};

jaxring::CpuKernels ParseCpuKernels(const std::string& name) {
  for (jaxring::CpuKernels k : kAllCpuKernels)
    if (name == jaxring::CpuKernelsName(k) && jaxring::CpuKernelsSupported(k)) return k;
  throw nb::value_error(("cpu_kernels: '" + name + "' is not a build of the reduction kernels "
                         "that this CPU runs (see cpu_kernels_supported())").c_str());
}

}  // namespace

NB_MODULE(_jaxring, m) {
  m.doc() = "jaxring native library: XLA FFI collectives";

  m.def("cpu_targets", []() {
    nb::dict targets;
    targets["jaxring_all_reduce"] = Capsule(JaxringAllReduceCpu);
    targets["jaxring_reduce_scatter"] = Capsule(JaxringReduceScatterCpu);
    targets["jaxring_all_gather"] = Capsule(JaxringAllGatherCpu);
    targets["jaxring_broadcast"] = Capsule(JaxringBroadcastCpu);
    targets["jaxring_barrier"] = Capsule(JaxringBarrierCpu);
    targets["jaxring_ppermute"] = Capsule(JaxringPpermuteCpu);
    targets["jaxring_send"] = Capsule(JaxringSendCpu);
    targets["jaxring_recv"] = Capsule(JaxringRecvCpu);
    return targets;
  });

  // The values of common/types.h's enums by name, the one table of them: the Python side and the
  // tests that call the native code directly take their codes from here.
  m.def("codes", []() {
    nb::dict collectives, ops, dtypes;
    for (int code = 0; code <= 255; ++code) {
      const auto value = static_cast<uint8_t>(code);
      const char* collective = jaxring::CollectiveName(static_cast<jaxring::Collective>(value));
      if (std::strcmp(collective, "unknown") != 0) collectives[collective] = code;
      const char* op = jaxring::ReduceOpName(static_cast<jaxring::ReduceOp>(value));
      if (std::strcmp(op, "unknown") != 0) ops[op] = code;
      const auto dtype = static_cast<jaxring::DType>(value);
      if (jaxring::IsSupported(dtype)) dtypes[jaxring::DTypeName(dtype)] = code;
    }
    nb::dict codes;
    codes["collective"] = collectives;
    codes["reduce_op"] = ops;
    codes["dtype"] = dtypes;
    return codes;
  });

  // benchmarks/allreduce.py's native floor (cpu/native_floor.cc); registered by the benchmark.
  m.def("benchmark_cpu_targets", []() {
    nb::dict targets;
    targets["jaxring_benchmark_native_floor"] = Capsule(JaxringBenchmarkNativeFloorCpu);
    return targets;
  });

  m.def("model_cpu_targets", []() {
    nb::dict targets;
    for (const jaxring::models::FfiTarget& target : jaxring::models::CpuTargets()) {
      targets[target.name] = nb::capsule(target.handler);
    }
    return targets;
  });

  m.def(
      "set_config",
      [](double timeout_seconds, int64_t ring_threshold_bytes, const std::string& algorithm,
         int64_t pipeline_slice_bytes, int64_t spin_iterations, int64_t p2p_eager_bytes,
         int64_t mpi_ring_threshold_bytes, int64_t mpi_direct_header_ranks,
         int64_t huge_page_bytes, const std::string& shm_stores, int64_t copy_input_bytes,
         double hand_off_after_seconds, const std::string& cpu_kernels,
         int64_t scratch_pool_bytes) {
        jaxring::Config config;
        config.timeout_seconds = timeout_seconds;
        config.ring_threshold_bytes = ring_threshold_bytes;
        config.algorithm = ParseAlgorithm(algorithm);
        config.pipeline_slice_bytes = pipeline_slice_bytes;
        config.spin_iterations = spin_iterations;
        config.p2p_eager_bytes = p2p_eager_bytes;
        config.mpi_ring_threshold_bytes = mpi_ring_threshold_bytes;
        config.mpi_direct_header_ranks = mpi_direct_header_ranks;
        config.huge_page_bytes = huge_page_bytes;
        config.shm_stores = ParseShmStores(shm_stores);
        config.copy_input_bytes = copy_input_bytes;
        config.hand_off_after_seconds = hand_off_after_seconds;
        config.cpu_kernels = ParseCpuKernels(cpu_kernels);
        config.scratch_pool_bytes = scratch_pool_bytes;
        jaxring::UseCpuKernels(config.cpu_kernels);
        jaxring::SetConfig(config);
        jaxring::ScratchLease::TrimPool(static_cast<size_t>(scratch_pool_bytes));
      },
      nb::arg("timeout_seconds"), nb::arg("ring_threshold_bytes"), nb::arg("algorithm"),
      nb::arg("pipeline_slice_bytes"), nb::arg("spin_iterations"), nb::arg("p2p_eager_bytes"),
      nb::arg("mpi_ring_threshold_bytes"), nb::arg("mpi_direct_header_ranks"),
      nb::arg("huge_page_bytes"), nb::arg("shm_stores"), nb::arg("copy_input_bytes"),
      nb::arg("hand_off_after_seconds"), nb::arg("cpu_kernels"), nb::arg("scratch_pool_bytes"));

  m.def("hand_off_count", []() { return jaxring::HandOffCount(); });

  m.def("get_config", []() {
    const jaxring::Config config = jaxring::CurrentConfig();
    nb::dict d;
    d["timeout_seconds"] = config.timeout_seconds;
    d["ring_threshold_bytes"] = config.ring_threshold_bytes;
    d["algorithm"] = std::string(jaxring::AlgorithmName(config.algorithm));
    d["pipeline_slice_bytes"] = config.pipeline_slice_bytes;
    d["spin_iterations"] = config.spin_iterations;
    d["p2p_eager_bytes"] = config.p2p_eager_bytes;
    d["mpi_ring_threshold_bytes"] = config.mpi_ring_threshold_bytes;
    d["mpi_direct_header_ranks"] = config.mpi_direct_header_ranks;
    d["huge_page_bytes"] = config.huge_page_bytes;
    d["shm_stores"] = std::string(jaxring::ShmStoresName(config.shm_stores));
    d["copy_input_bytes"] = config.copy_input_bytes;
    d["hand_off_after_seconds"] = config.hand_off_after_seconds;
    d["cpu_kernels"] = std::string(jaxring::CpuKernelsName(config.cpu_kernels));
    d["scratch_pool_bytes"] = config.scratch_pool_bytes;
    return d;
  });

  m.def("cpu_kernels_supported", []() {
    nb::list names;
    for (jaxring::CpuKernels k : kAllCpuKernels)
      if (jaxring::CpuKernelsSupported(k)) names.append(jaxring::CpuKernelsName(k));
    return names;
  });
  m.def(
      "cpu_kernels_in_use",
      [](bool streaming) {
        nb::dict builds;
        for (jaxring::DType dtype :
             {jaxring::DType::kF32, jaxring::DType::kF64, jaxring::DType::kF16,
              jaxring::DType::kBF16, jaxring::DType::kS32, jaxring::DType::kS64})
          builds[jaxring::DTypeName(dtype)] =
              jaxring::CpuKernelsName(jaxring::CpuKernelsFor(dtype, streaming));
        return builds;
      },
      nb::arg("streaming") = false);

  m.def(
      "shm_attach",
      [](uint64_t key, const std::string& path, bool create, int rank, int size,
         int64_t slot_bytes, const std::string& name) {
        jaxring::Status status =
            jaxring::ShmCommunicator::Attach(key, path, create, rank, size, slot_bytes, name);
        if (!status.ok()) throw std::runtime_error(status.message());
      },
      nb::arg("key"), nb::arg("path"), nb::arg("create"), nb::arg("rank"), nb::arg("size"),
      nb::arg("slot_bytes"), nb::arg("name"),
      "Maps the shared-memory segment of a process communicator (rank 0 creates it).");
  m.def(
      "shm_detach", [](uint64_t key) { jaxring::ShmCommunicator::Detach(key, false); },
      nb::arg("key"), "After a free() on every rank.");
  m.def(
      "shm_leave", [](uint64_t key) { jaxring::ShmCommunicator::Detach(key, true); },
      nb::arg("key"), "Detaches, leaving the communicator for peers that may go on calling.");
  m.def("shm_unlink", &jaxring::ShmCommunicator::Unlink, nb::arg("path"));

  m.def(
      "process_register",
      [](uint64_t key, nb::capsule transport) {
        if (std::string(transport.name()) != "jaxring.ProcessTransport")
          throw nb::type_error("expected a capsule from jaxring._jaxring_mpi.create");
        jaxring::ProcessTransport::Register(
            key, std::unique_ptr<jaxring::ProcessTransport>(
                     static_cast<jaxring::ProcessTransport*>(transport.data())));
      },
      nb::arg("key"), nb::arg("transport"),
      "Adopts a process transport (from another extension module) for communicator `key`.");
  m.def("process_unregister", &jaxring::ProcessTransport::Unregister, nb::arg("key"));
  m.def("link_failures", &jaxring::ProcessTransport::LinkFailures, nb::arg("keys"),
        "A failed call on any of these process communicators makes this rank leave the others.");
  m.def("unlink_failures", &jaxring::ProcessTransport::UnlinkFailures, nb::arg("key"));

  m.def("name_call_site", &jaxring::NameCallSite, nb::arg("op_id"), nb::arg("site"),
        "Names the source line of op_id's calls in this library's errors.");
  m.def("call_site", &jaxring::CallSite, nb::arg("op_id"));
  m.def("build_id", &jaxring::BuildId, "A hash of the native sources this library was built from.");
  m.def("jaxlib_version", []() { return std::string(JAXRING_JAXLIB_VERSION); },
        "The version of the jaxlib whose FFI headers this library was compiled against.");
  m.def("host_call_address", []() { return reinterpret_cast<uintptr_t>(&JaxringRunHostCall); },
        "Address of JaxringRunHostCall, which the CUDA library calls on staged host buffers.");
  m.def("host_timeout_address",
        []() { return reinterpret_cast<uintptr_t>(&JaxringHostTimeoutSeconds); },
        "Address of JaxringHostTimeoutSeconds (jaxring.config's timeout, for the CUDA library).");
  m.def("call_site_address", []() { return reinterpret_cast<uintptr_t>(&JaxringHostCallSite); },
        "Address of JaxringHostCallSite, which the MPI and CUDA libraries name call sites with.");

  // The GPU transports' host side, exposed so that CPU tests check it: the header exchange
  // they synchronise with, and how they cut a call into steps (gpu/plan.h).
  m.def(
      "host_agree",
      [](uint64_t key, const std::string& name, int rank, int size, int kind, int op, int dtype,
         int64_t count, int64_t op_id, int64_t root) {
        const int64_t output_count =
            kind == static_cast<int>(jaxring::Collective::kReduceScatter) ? count / std::max(size, 1)
            : kind == static_cast<int>(jaxring::Collective::kAllGather)   ? count * size
                                                                           : count;
        const JaxringHostCall call = TestCall(key, name, rank, size, kJaxringHostAgree, kind, op,
                                              dtype, count, output_count, root, op_id);
        char error[4096];
        int failed;
        {
          nb::gil_scoped_release release;
          failed = JaxringRunHostCall(&call, error, sizeof(error));
        }
        if (failed) throw std::runtime_error(error);
      },
      nb::arg("key"), nb::arg("name"), nb::arg("rank"), nb::arg("size"), nb::arg("kind"),
      nb::arg("op"), nb::arg("dtype"), nb::arg("count"), nb::arg("op_id"), nb::arg("root") = 0,
      "Runs the header exchange alone (kJaxringHostAgree) on process communicator `key`.");
  m.def(
      "gpu_plan",
      [](const std::string& transport, int kind, int size, int64_t input_count, int64_t bytes,
         int dtype) {
        namespace gpu = jaxring::gpu;
        const gpu::Transport t = transport == "ipc" ? gpu::Transport::kIpc : gpu::Transport::kStaged;
        if (transport != "ipc" && transport != "staged")
          throw nb::value_error("transport must be 'ipc' or 'staged'");
        const jaxring::Collective k = static_cast<jaxring::Collective>(kind);
        const size_t width = jaxring::ByteWidth(static_cast<jaxring::DType>(dtype));
        const std::string bad = gpu::CheckSlotBytes(t, bytes, size);
        if (!bad.empty()) throw nb::value_error(bad.c_str());
        const int64_t block = gpu::BlockCount(k, input_count, size);
        std::vector<std::tuple<int64_t, int64_t, std::string>> steps;
        for (const gpu::Step& s : gpu::PlanSteps(block, gpu::StepElements(t, k, size, bytes, width))) {
          std::string algorithm;
          if (t == gpu::Transport::kIpc && k == jaxring::Collective::kAllReduce)
            algorithm = gpu::ChooseIpcAlgorithm(s.count * static_cast<int64_t>(width), size) ==
                                gpu::IpcAlgorithm::kOneShot
                            ? "one-shot"
                            : "two-shot";
          steps.emplace_back(s.first, s.count, algorithm);
        }
        return steps;
      },
      nb::arg("transport"), nb::arg("kind"), nb::arg("size"), nb::arg("input_count"),
      nb::arg("bytes"), nb::arg("dtype"),
      "The steps (first, count, algorithm) a GPU transport cuts a call into (gpu/plan.h).");
  m.def("gpu_share", [](int64_t count, int size, int dtype) {
    const jaxring::Partition p = jaxring::gpu::ShareOf(
        count, size, jaxring::ByteWidth(static_cast<jaxring::DType>(dtype)));
    std::vector<int64_t> begins;
    for (int r = 0; r <= size; ++r) begins.push_back(p.Begin(r));
    return begins;
  }, nb::arg("count"), nb::arg("size"), nb::arg("dtype"),
     "Two-shot all_reduce: where each rank's share of a step begins (size + 1 offsets).");
  m.def(
      "ipc_steps_on_host",
      [](uint64_t key, const std::string& name, int rank, int size, uintptr_t shared,
         int64_t slot_bytes, uint64_t step, int kind, int op, int dtype, const nb::bytes& input,
         int64_t output_count, int64_t root, int64_t op_id, int fail_operation) {
        StepsTest t(key, name, rank, size, kind, op, dtype, input, output_count, root, op_id);
        std::vector<std::string> trace;
        HostIpcOps ops(t.call, reinterpret_cast<char*>(shared), slot_bytes, &trace,
                       fail_operation);
        jaxring::Status status;
        {
          nb::gil_scoped_release release;
          status = jaxring::gpu::RunIpcSteps(t.header, input.c_str(), t.output.data(), rank, size,
                                             slot_bytes, &step, ops, "ipc steps on the host");
          // As GpuCommunicator::Run (cuda/device.cc) after a failure.
          if (!status.ok())
            jaxring::gpu::LeaveAfterFailure(&JaxringRunHostCall, t.call, rank, status.message());
        }
        if (!status.ok()) throw std::runtime_error(status.message());
        return std::make_tuple(nb::bytes(t.output.data(), t.output.size()), step, trace);
      },
      nb::arg("key"), nb::arg("name"), nb::arg("rank"), nb::arg("size"), nb::arg("shared"),
      nb::arg("slot_bytes"), nb::arg("step"), nb::arg("kind"), nb::arg("op"), nb::arg("dtype"),
      nb::arg("input"), nb::arg("output_count"), nb::arg("root"), nb::arg("op_id"),
      nb::arg("fail_operation") = -1,
      "Runs cuda-ipc's steps (gpu/ipc_steps.h) on host memory shared by the processes of "
      "process communicator `key` (2 * size slots of slot_bytes at `shared`); returns the output, "
      "the step counter to pass to the next call, and the trace of its operations (HostIpcOps). "
      "Copy or reduction `fail_operation` (if >= 0) fails; this rank then leaves the "
      "communicator, as a GPU communicator does.");
  m.def(
      "staged_steps_on_host",
      [](uint64_t key, const std::string& name, int rank, int size, int64_t chunk_bytes,
         int kind, int op, int dtype, const nb::bytes& input, int64_t output_count, int64_t root,
         int64_t op_id, int fail_copy_out, bool deferred_copies) {
        StepsTest t(key, name, rank, size, kind, op, dtype, input, output_count, root, op_id);
        const std::string bad =
            jaxring::gpu::CheckSlotBytes(jaxring::gpu::Transport::kStaged, chunk_bytes, size);
        if (!bad.empty()) throw nb::value_error(bad.c_str());
        HostStagingOps ops(chunk_bytes, fail_copy_out, deferred_copies);
        jaxring::Status status;
        {
          nb::gil_scoped_release release;
          status = jaxring::gpu::RunStagedSteps(t.header, t.call, input.c_str(), t.output.data(),
                                                rank, size, chunk_bytes, ops);
          // As GpuCommunicator::Run (cuda/device.cc) after a failure.
          if (!status.ok())
            jaxring::gpu::LeaveAfterFailure(&JaxringRunHostCall, t.call, rank, status.message());
        }
        if (!ops.Ended())
          throw std::runtime_error("the staged pipeline returned without End(): " +
                                   (status.ok() ? std::string("no error") : status.message()));
        if (!status.ok()) throw std::runtime_error(status.message());
        return nb::bytes(t.output.data(), t.output.size());
      },
      nb::arg("key"), nb::arg("name"), nb::arg("rank"), nb::arg("size"), nb::arg("chunk_bytes"),
      nb::arg("kind"), nb::arg("op"), nb::arg("dtype"), nb::arg("input"), nb::arg("output_count"),
      nb::arg("root"), nb::arg("op_id"), nb::arg("fail_copy_out") = -1,
      nb::arg("deferred_copies") = false,
      "Runs the staged transport's pipeline (gpu/staged_steps.h) on host memory, each chunk on "
      "process communicator `key`'s host transport; result copy `fail_copy_out` (if >= 0) fails; "
      "with `deferred_copies` every copy runs as late as a GPU stream may run it (HostStagingOps). "
      "After a failure this rank leaves the communicator, as a GPU communicator does.");
  // For tests of what a rank that gives up leaves behind (LocalTransport::Close): one rank's call
  // on an in-process communicator, on host arrays the test owns, so that it sees whether anyone
  // wrote into this rank's output after the call returned.
  using HostArray = nb::ndarray<nb::c_contig, nb::device::cpu>;
  m.def(
      "collective_on_host",
      [](uint64_t key, const std::string& name, int rank, int size, int kind, int op, int dtype,
         HostArray input, HostArray output, int64_t run_id, int64_t op_id) -> std::string {
        JaxringHostCall call =
            TestCall(key, name, rank, size, kJaxringHostCollective, kind, op, dtype,
                     static_cast<int64_t>(input.nbytes() / Width(dtype)),
                     static_cast<int64_t>(output.nbytes() / Width(dtype)), 0, op_id);
        call.input = input.data();
        call.output = output.data();
        call.run_id = run_id;
        nb::gil_scoped_release release;
        const jaxring::Status status = RunOnHost(call);
        return status.ok() ? std::string() : status.message();
      },
      nb::arg("key"), nb::arg("name"), nb::arg("rank"), nb::arg("size"), nb::arg("kind"),
      nb::arg("op"), nb::arg("dtype"), nb::arg("input"), nb::arg("output"), nb::arg("run_id"),
      nb::arg("op_id"),
      "Runs rank `rank`'s collective on in-process communicator `key` over host arrays; returns "
      "the error message, empty on success.");
  m.def("stall_next_shm_steps", &jaxring::StallNextStepsForTest, nb::arg("seconds"),
        nb::arg("steps"), nb::arg("after_staging") = false,
        "For tests: this process's next `steps` steps of shared-memory collectives each sleep "
        "`seconds` before they begin, or with `after_staging` once every rank has staged the "
        "step (ring/staged.h).");
  m.def("stall_next_piece", &jaxring::StallNextPieceForTest, nb::arg("comm"), nb::arg("rank"),
        nb::arg("seconds"), nb::arg("pieces") = 1,
        "The next `pieces` pieces of shared work or ring slices of `rank` of in-process "
        "communicator `comm` sleep `seconds` first (tests); rank -1 disarms it.");
  m.def("stalls_taken", &jaxring::StallsTakenForTest);
  m.def("fail_next_scratch", &jaxring::FailNextScratchForTest, nb::arg("comm"), nb::arg("rank"),
        "The next call of `rank` of in-process communicator `comm` that needs scratch finds "
        "none, as when its allocation fails (tests); rank -1 disarms it.");
  m.def("pooled_scratch", &jaxring::ScratchLease::PooledForTest,
        "The buffers and bytes of scratch pooled between calls (tests).");
  m.def("open_meetings", &jaxring::OpenMeetingsForTest, nb::arg("comm"), nb::arg("group") = 0,
        "The meetings of in-process communicator `comm` that not every rank has reached (tests).");

  m.def("gpu_defaults", []() {
    nb::dict d;
    d["ipc_slot_bytes"] = jaxring::gpu::kDefaultIpcSlotBytes;
    d["staging_bytes"] = jaxring::gpu::kDefaultStagingBytes;
    d["ipc_one_shot_bytes"] = jaxring::gpu::kIpcOneShotBytes;
    d["min_slot_bytes"] = jaxring::gpu::kMinSlotBytes;
    d["ipc_max_ranks"] = jaxring::gpu::kIpcMaxRanks;
    return d;
  });

  m.def("reset_point_to_point", &jaxring::LocalPointToPoint::ResetAll,
        "Empties every point-to-point mailbox (after an error).");
  m.def("forget_given_up_meetings", &jaxring::LocalTransport::ForgetGivenUp,
        "Drops the in-process meetings that a device gave up on before every device arrived "
        "(after an error, when no device is inside a jaxring call); returns how many.");

  // Exposed so tests can check the kernels' rounding against numpy bit for bit.
  m.def("half_to_float", &jaxring::HalfToFloat);
  m.def("float_to_half", &jaxring::FloatToHalf);
  m.def("bfloat16_to_float", &jaxring::BFloat16ToFloat);
  m.def("float_to_bfloat16", &jaxring::FloatToBFloat16);

  // For the benchmarks' copy floors: from 16 MiB a copy with non-temporal stores moves a third
  // less through memory than glibc's memcpy, which here streams only above 288 MiB.
  using Float32Array = nb::ndarray<float, nb::c_contig, nb::device::cpu>;
  m.def(
      "copy_streamed",
      [](HostArray dst, HostArray src) {
        const size_t bytes = src.size() * src.itemsize();
        if (dst.size() * dst.itemsize() != bytes)
          throw std::invalid_argument("copy_streamed: dst and src differ in size");
        nb::gil_scoped_release release;
        jaxring::CopyStreamed(dst.data(), src.data(), bytes);
      },
      nb::arg("dst"), nb::arg("src"),
      "Copies src into dst (C-contiguous host arrays of equal size) with non-temporal stores.");

  // For tests of the probe that lets a program's first collective stream into an uncached
  // output (OutputLooksUncached).
  m.def(
      "looks_uncached",
      [](HostArray data) {
        return jaxring::LooksUncached(data.data(), data.size() * data.itemsize());
      },
      nb::arg("data"), "Whether the lines of a C-contiguous host array look out of the cache.");
  m.def(
      "evict_from_caches",
      [](HostArray data) {
        return jaxring::EvictFromCaches(data.data(), data.size() * data.itemsize());
      },
      nb::arg("data"),
      "Drops the lines of a C-contiguous host array from every cache (clflush); False where the "
      "machine has no such instruction.");
  m.def("uncached_output_count", &jaxring::UncachedOutputCount);

  // For allreduce_mpi.py's exchange floor (jaxring::RunExchange).
  m.def(
      "shm_exchange",
      [](uint64_t key, Float32Array dst, Float32Array src, int64_t chunk_bytes, bool streamed,
         int64_t loops) {
        const size_t bytes = src.size() * sizeof(float);
        if (dst.size() != src.size())
          throw std::invalid_argument("shm_exchange: dst and src differ in size");
        auto comm = jaxring::ShmCommunicator::Find(key);
        if (!comm) throw std::invalid_argument("shm_exchange: no shared-memory communicator");
        const jaxring::ShmStores stores =
            streamed ? jaxring::ShmStores::kStreaming : jaxring::ShmStores::kPlain;
        jaxring::Status status;
        {
          nb::gil_scoped_release release;
          status = jaxring::RunExchange(*comm, dst.data(), src.data(), static_cast<int64_t>(bytes),
                                        chunk_bytes, stores, loops, jaxring::CurrentConfig());
        }
        if (!status.ok()) throw std::runtime_error(status.message());
      },
      nb::arg("key"), nb::arg("dst"), nb::arg("src"), nb::arg("chunk_bytes"), nb::arg("streamed"),
      nb::arg("loops"),
      "Runs `loops` exchanges through communicator `key`'s shared memory (float32 arrays): every "
      "rank stages src and copies its left neighbour's into dst, adding its second left "
      "neighbour's over the last (n - 2)/n of each step's elements, chunk_bytes per step.");
  m.def(
      "advise_huge_pages",
      [](HostArray a) { jaxring::AdviseHugePages(a.data(), a.size() * a.itemsize()); },
      nb::arg("array"),
      "Advises `array` onto transparent huge pages as jaxring advises its CPU outputs "
      "(huge_page_bytes): for benchmarks that compare against a fresh output.");
}
