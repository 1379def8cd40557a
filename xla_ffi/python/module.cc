// The Python extension: hands XLA the FFI handlers (as capsules) and exposes the configuration.
#include <nanobind/nanobind.h>

#include <stdexcept>
#include <nanobind/stl/string.h>

#include "common/config.h"
#include "common/host_call.h"
#include "kernels/reduce_cpu.h"
#include "models/targets.h"
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
}

namespace {

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
         int64_t mpi_ring_threshold_bytes, int64_t mpi_direct_header_ranks) {
        jaxring::Config config;
        config.timeout_seconds = timeout_seconds;
        config.ring_threshold_bytes = ring_threshold_bytes;
        config.algorithm = ParseAlgorithm(algorithm);
        config.pipeline_slice_bytes = pipeline_slice_bytes;
        config.spin_iterations = spin_iterations;
        config.p2p_eager_bytes = p2p_eager_bytes;
        config.mpi_ring_threshold_bytes = mpi_ring_threshold_bytes;
        config.mpi_direct_header_ranks = mpi_direct_header_ranks;
        jaxring::SetConfig(config);
      },
      nb::arg("timeout_seconds"), nb::arg("ring_threshold_bytes"), nb::arg("algorithm"),
      nb::arg("pipeline_slice_bytes"), nb::arg("spin_iterations"), nb::arg("p2p_eager_bytes"),
      nb::arg("mpi_ring_threshold_bytes"), nb::arg("mpi_direct_header_ranks"));

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
    return d;
  });

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
  m.def("shm_detach", &jaxring::ShmCommunicator::Detach, nb::arg("key"));
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

  m.def("host_call_address", []() { return reinterpret_cast<uintptr_t>(&JaxringRunHostCall); },
        "Address of JaxringRunHostCall, which the CUDA library calls on staged host buffers.");

  m.def("reset_point_to_point", &jaxring::LocalPointToPoint::ResetAll,
        "Empties every point-to-point mailbox (after an error).");

  // Exposed so tests can check the kernels' rounding against numpy bit for bit.
  m.def("half_to_float", &jaxring::HalfToFloat);
  m.def("float_to_half", &jaxring::FloatToHalf);
  m.def("bfloat16_to_float", &jaxring::BFloat16ToFloat);
  m.def("float_to_bfloat16", &jaxring::FloatToBFloat16);
}
