// XLA FFI handlers for CPU devices. A handler only decodes buffers and attributes, finds its
// peers through the local transport and dispatches to an algorithm.
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "common/config.h"
#include "common/types.h"
#include "p2p/protocol.h"
#include "ring/algorithms.h"
#include "ring/staged.h"
#include "transports/local.h"
#include "transports/process.h"
#include "transports/shm.h"
#include "transports/mailbox.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxring {
namespace {

struct CallAttributes {
  int64_t comm;
  std::string_view comm_name;
  int64_t size;
  int64_t op_id;
};

ffi::Error ToFfi(const Status& status) {
  return status.ok() ? ffi::Error::Success() : ffi::Error::Internal(status.message());
}

// Checks what every handler receives, and fills in the header peers will compare.
ffi::Error CheckCall(Collective kind, int rank, int size, DType dtype) {
  if (rank < 0 || rank >= size)
    return ffi::Error::InvalidArgument("jaxring " + std::string(CollectiveName(kind)) + ": rank " +
                                       std::to_string(rank) + " is outside [0, " +
                                       std::to_string(size) + ")");
  if (!IsSupported(dtype))
    return ffi::Error::InvalidArgument("jaxring " + std::string(CollectiveName(kind)) +
                                       ": unsupported element type");
  return ffi::Error::Success();
}

// A process transport compiled for one rank must be run by that rank.
template <typename Transport>
ffi::Error CheckProcess(const Transport& processes, const Header& header, int rank, int size) {
  if (processes.rank() == rank && processes.size() == size) return ffi::Error::Success();
  return ffi::Error::Internal(processes.Where(header) + ": compiled for rank " +
                              std::to_string(rank) + " of " + std::to_string(size));
}

ffi::Error Run(Collective kind, ReduceOp op, int64_t root, ffi::RunId run_id,
               ffi::AnyBuffer rank_buffer, ffi::AnyBuffer group_buffer, const void* input,
               int64_t input_count, DType dtype, void* output, int64_t output_count,
               const CallAttributes& attrs) {
  const int rank = *static_cast<const int32_t*>(rank_buffer.untyped_data());
  const int64_t group = *static_cast<const int32_t*>(group_buffer.untyped_data());
  const int size = static_cast<int>(attrs.size);
  ffi::Error error = CheckCall(kind, rank, size, dtype);
  if (error.failure()) return error;
  Header header;
  header.kind = kind;
  header.op = op;
  header.dtype = dtype;
  header.op_id = attrs.op_id;
  header.count = input_count;
  header.root = root;

  const Config config = CurrentConfig();
  const CollectiveBuffers buffers{input, output, output_count};
  const uint64_t key = static_cast<uint64_t>(attrs.comm);
  if (ShmCommunicator* processes = ShmCommunicator::Find(key)) {
    error = CheckProcess(*processes, header, rank, size);
    return error.failure() ? std::move(error) : ToFfi(RunStaged(*processes, header, buffers, config));
  }
  if (ProcessTransport* processes = ProcessTransport::Find(key)) {
    error = CheckProcess(*processes, header, rank, size);
    if (error.failure()) return error;
    std::lock_guard<std::mutex> lock(processes->mutex());
    return ToFfi(processes->RunCollective(header, buffers, config));
  }
  const Algorithm algorithm = ChooseAlgorithm(header, size, config);
  ScratchLease scratch = ScratchLease::Acquire(ScratchBytes(header, size, algorithm));
  CommunicatorId comm{key, group, size, std::string(attrs.comm_name)};
  auto transport = LocalTransport::Join(comm, run_id.run_id, rank, header, input, output,
                                        scratch.data(), config.timeout_seconds,
                                        config.spin_iterations);
  Status status = transport->WaitForPeers();
  if (!status.ok()) return ToFfi(status);
  return ToFfi(RunCollective(*transport, algorithm, config, buffers));
}

DType ToDType(ffi::DataType type) { return static_cast<DType>(static_cast<uint8_t>(type)); }

// ---- point-to-point ----------------------------------------------------------------------------

// This rank's partner in `perm` (flattened (source, destination) pairs): whom it sends to, or
// whom it receives from; -1 if none.
int Partner(ffi::Span<const int64_t> perm, int rank, bool sending) {
  for (size_t i = 0; i + 1 < perm.size(); i += 2) {
    if (sending && perm[i] == rank) return static_cast<int>(perm[i + 1]);
    if (!sending && perm[i + 1] == rank) return static_cast<int>(perm[i]);
  }
  return -1;
}

template <typename Body>
ffi::Error RunPointToPoint(Collective kind, ffi::AnyBuffer rank_buffer,
                           ffi::AnyBuffer group_buffer, DType dtype, int64_t count,
                           const CallAttributes& attrs, Body body) {
  const int rank = *static_cast<const int32_t*>(rank_buffer.untyped_data());
  const int64_t group = *static_cast<const int32_t*>(group_buffer.untyped_data());
  const int size = static_cast<int>(attrs.size);
  ffi::Error error = CheckCall(kind, rank, size, dtype);
  if (error.failure()) return error;
  Header header;
  header.kind = kind;
  header.dtype = dtype;
  header.op_id = attrs.op_id;
  header.count = count;
  const Config config = CurrentConfig();
  const size_t bytes = count * ByteWidth(dtype);
  const uint64_t key = static_cast<uint64_t>(attrs.comm);
  if (ProcessTransport* processes = ProcessTransport::Find(key)) {
    error = CheckProcess(*processes, header, rank, size);
    if (error.failure()) return error;
    std::lock_guard<std::mutex> lock(processes->mutex());
    processes->Configure(config);
    return ToFfi(body(*processes, header, rank, config, bytes));
  }
  if (ShmCommunicator* processes = ShmCommunicator::Find(key))
    return ffi::Error::Internal(processes->Where(header) + ": this process communicator has no "
                                "point-to-point transport (jaxring was built without MPI)");
  LocalPointToPoint transport(CommunicatorId{key, group, size, std::string(attrs.comm_name)}, rank,
                              config.timeout_seconds, config.spin_iterations);
  return ToFfi(body(transport, header, rank, config, bytes));
}

ffi::Error PermuteImpl(ffi::Token, ffi::AnyBuffer rank, ffi::AnyBuffer group, ffi::AnyBuffer x,
                       ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y, int64_t comm,
                       std::string_view comm_name, int64_t size, int64_t op_id,
                       ffi::Span<const int64_t> perm) {
  return RunPointToPoint(
      Collective::kPermute, rank, group, ToDType(x.element_type()), x.element_count(),
      CallAttributes{comm, comm_name, size, op_id},
      [&](PointToPoint& transport, const Header& header, int me, const Config& config,
          size_t bytes) {
        return Permute(transport, header, Partner(perm, me, true), Partner(perm, me, false),
                       x.untyped_data(), y->untyped_data(), bytes, config);
      });
}

ffi::Error SendImpl(ffi::Token, ffi::AnyBuffer rank, ffi::AnyBuffer group, ffi::AnyBuffer x,
                    ffi::Result<ffi::Token>, int64_t comm, std::string_view comm_name,
                    int64_t size, int64_t op_id, ffi::Span<const int64_t> perm) {
  return RunPointToPoint(
      Collective::kSendRecv, rank, group, ToDType(x.element_type()), x.element_count(),
      CallAttributes{comm, comm_name, size, op_id},
      [&](PointToPoint& transport, const Header& header, int me, const Config&, size_t bytes) {
        return Send(transport, header, Partner(perm, me, true), x.untyped_data(), bytes);
      });
}

ffi::Error RecvImpl(ffi::Token, ffi::AnyBuffer rank, ffi::AnyBuffer group,
                    ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y, int64_t comm,
                    std::string_view comm_name, int64_t size, int64_t op_id,
                    ffi::Span<const int64_t> perm) {
  return RunPointToPoint(
      Collective::kSendRecv, rank, group, ToDType(y->element_type()), y->element_count(),
      CallAttributes{comm, comm_name, size, op_id},
      [&](PointToPoint& transport, const Header& header, int me, const Config&, size_t bytes) {
        return Receive(transport, header, Partner(perm, me, false), y->untyped_data(), bytes);
      });
}

ffi::Error AllReduceImpl(ffi::RunId run_id, ffi::Token, ffi::AnyBuffer rank, ffi::AnyBuffer group,
                         ffi::AnyBuffer x, ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y,
                         int64_t comm, std::string_view comm_name, int64_t size, int64_t op_id,
                         int64_t op) {
  return Run(Collective::kAllReduce, static_cast<ReduceOp>(op), 0, run_id, rank, group,
             x.untyped_data(), x.element_count(), ToDType(x.element_type()), y->untyped_data(),
             y->element_count(), CallAttributes{comm, comm_name, size, op_id});
}

ffi::Error ReduceScatterImpl(ffi::RunId run_id, ffi::Token, ffi::AnyBuffer rank,
                             ffi::AnyBuffer group, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                             ffi::Result<ffi::AnyBuffer> y, int64_t comm,
                             std::string_view comm_name, int64_t size, int64_t op_id, int64_t op) {
  if (static_cast<int64_t>(y->element_count()) * size != static_cast<int64_t>(x.element_count()))
    return ffi::Error::InvalidArgument("jaxring reduce_scatter: output size times world size "
                                       "must equal the input size");
  return Run(Collective::kReduceScatter, static_cast<ReduceOp>(op), 0, run_id, rank, group,
             x.untyped_data(), x.element_count(), ToDType(x.element_type()), y->untyped_data(),
             y->element_count(), CallAttributes{comm, comm_name, size, op_id});
}

ffi::Error AllGatherImpl(ffi::RunId run_id, ffi::Token, ffi::AnyBuffer rank, ffi::AnyBuffer group,
                         ffi::AnyBuffer x, ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y,
                         int64_t comm, std::string_view comm_name, int64_t size, int64_t op_id) {
  if (static_cast<int64_t>(x.element_count()) * size != static_cast<int64_t>(y->element_count()))
    return ffi::Error::InvalidArgument("jaxring all_gather: output size must be the input size "
                                       "times world size");
  return Run(Collective::kAllGather, ReduceOp::kSum, 0, run_id, rank, group, x.untyped_data(),
             x.element_count(), ToDType(x.element_type()), y->untyped_data(), y->element_count(),
             CallAttributes{comm, comm_name, size, op_id});
}

ffi::Error BroadcastImpl(ffi::RunId run_id, ffi::Token, ffi::AnyBuffer rank, ffi::AnyBuffer group,
                         ffi::AnyBuffer x, ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y,
                         int64_t comm, std::string_view comm_name, int64_t size, int64_t op_id,
                         int64_t root) {
  if (root < 0 || root >= size)
    return ffi::Error::InvalidArgument("jaxring broadcast: root " + std::to_string(root) +
                                       " is outside [0, " + std::to_string(size) + ")");
  return Run(Collective::kBroadcast, ReduceOp::kSum, root, run_id, rank, group, x.untyped_data(),
             x.element_count(), ToDType(x.element_type()), y->untyped_data(), y->element_count(),
             CallAttributes{comm, comm_name, size, op_id});
}

ffi::Error BarrierImpl(ffi::RunId run_id, ffi::Token, ffi::AnyBuffer rank, ffi::AnyBuffer group,
                       ffi::Result<ffi::Token>, int64_t comm, std::string_view comm_name,
                       int64_t size, int64_t op_id) {
  return Run(Collective::kBarrier, ReduceOp::kSum, 0, run_id, rank, group, nullptr, 0,
             DType::kS32, nullptr, 0, CallAttributes{comm, comm_name, size, op_id});
}

// Binding shared by every handler: run id, token, rank, group, [x] -> token, [y], then the
// communicator attributes. Handler-specific attributes are appended after these.
template <typename Binding>
auto WithCommunicator(Binding&& binding) {
  return std::move(binding)
      .template Attr<int64_t>("comm")
      .template Attr<std::string_view>("comm_name")
      .template Attr<int64_t>("size")
      .template Attr<int64_t>("op_id");
}

template <bool kHasData>
auto Bind() {
  auto prefix = ffi::Ffi::Bind()
                    .Ctx<ffi::RunId>()
                    .Arg<ffi::Token>()
                    .Arg<ffi::AnyBuffer>()   // rank along the communicator
                    .Arg<ffi::AnyBuffer>();  // group: index along the mesh axes not reduced over
  if constexpr (kHasData) {
    return WithCommunicator(std::move(prefix)
                                .template Arg<ffi::AnyBuffer>()
                                .template Ret<ffi::Token>()
                                .template Ret<ffi::AnyBuffer>());
  } else {
    return WithCommunicator(std::move(prefix).template Ret<ffi::Token>());
  }
}

}  // namespace
}  // namespace jaxring

using namespace jaxring;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringAllReduceCpu, AllReduceImpl, Bind<true>().Attr<int64_t>("op"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringReduceScatterCpu, ReduceScatterImpl,
                              Bind<true>().Attr<int64_t>("op"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringAllGatherCpu, AllGatherImpl, Bind<true>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringBroadcastCpu, BroadcastImpl,
                              Bind<true>().Attr<int64_t>("root"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringBarrierCpu, BarrierImpl, Bind<false>());

// Point-to-point handlers need no run id: messages are matched in order per (source, destination).
namespace {
auto BindPointToPoint() {
  return ffi::Ffi::Bind().Arg<ffi::Token>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringPpermuteCpu, PermuteImpl,
                              WithCommunicator(BindPointToPoint()
                                                   .Arg<ffi::AnyBuffer>()
                                                   .Ret<ffi::Token>()
                                                   .Ret<ffi::AnyBuffer>())
                                  .Attr<ffi::Span<const int64_t>>("perm"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringSendCpu, SendImpl,
                              WithCommunicator(
                                  BindPointToPoint().Arg<ffi::AnyBuffer>().Ret<ffi::Token>())
                                  .Attr<ffi::Span<const int64_t>>("perm"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringRecvCpu, RecvImpl,
                              WithCommunicator(
                                  BindPointToPoint().Ret<ffi::Token>().Ret<ffi::AnyBuffer>())
                                  .Attr<ffi::Span<const int64_t>>("perm"));
