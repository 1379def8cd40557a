// XLA FFI handlers for CPU devices. A handler only decodes XLA's buffers and attributes into a
// JaxringHostCall; cpu/host.cc finds the peers and runs the algorithm.
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "common/host_call.h"
#include "common/types.h"
#include "cpu/host.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxring {
namespace {

DType ToDType(ffi::DataType type) { return static_cast<DType>(static_cast<uint8_t>(type)); }

// The attributes and operands every handler has, in a host call with no data yet.
JaxringHostCall Call(ffi::AnyBuffer rank, ffi::AnyBuffer group, int64_t comm,
                     const std::string& comm_name, int64_t size, int64_t op_id, Collective kind,
                     JaxringHostRole role) {
  JaxringHostCall call{};
  call.comm = static_cast<uint64_t>(comm);
  call.comm_name = comm_name.c_str();
  call.rank = *static_cast<const int32_t*>(rank.untyped_data());
  call.group = *static_cast<const int32_t*>(group.untyped_data());
  call.size = static_cast<int32_t>(size);
  call.op_id = op_id;
  call.kind = static_cast<uint8_t>(kind);
  call.role = role;
  call.dtype = static_cast<uint8_t>(DType::kS32);
  return call;
}

void SetInput(JaxringHostCall* call, ffi::AnyBuffer x) {
  call->input = x.untyped_data();
  call->input_count = static_cast<int64_t>(x.element_count());
  call->dtype = static_cast<uint8_t>(ToDType(x.element_type()));
}

void SetOutput(JaxringHostCall* call, ffi::AnyBuffer& y) {
  call->output = y.untyped_data();
  call->output_count = static_cast<int64_t>(y.element_count());
  call->dtype = static_cast<uint8_t>(ToDType(y.element_type()));
}

void SetPerm(JaxringHostCall* call, ffi::Span<const int64_t> perm) {
  call->perm = perm.begin();
  call->perm_size = static_cast<int64_t>(perm.size());
}

ffi::Error Run(const JaxringHostCall& call) {
  const HostResult result = RunHostCall(call);
  if (result.status.ok()) return ffi::Error::Success();
  return result.invalid_argument ? ffi::Error::InvalidArgument(result.status.message())
                                 : ffi::Error::Internal(result.status.message());
}

ffi::Error RunCollective(ffi::RunId run_id, ffi::AnyBuffer rank, ffi::AnyBuffer group,
                         ffi::AnyBuffer x, ffi::AnyBuffer* y, int64_t comm,
                         std::string_view comm_name, int64_t size, int64_t op_id,
                         Collective kind, int64_t op, int64_t root) {
  const std::string name(comm_name);
  JaxringHostCall call = Call(rank, group, comm, name, size, op_id, kind, kJaxringHostCollective);
  call.run_id = run_id.run_id;
  call.op = static_cast<uint8_t>(op);
  call.root = root;
  SetInput(&call, x);
  if (y != nullptr) {
    call.output = y->untyped_data();
    call.output_count = static_cast<int64_t>(y->element_count());
  }
  return Run(call);
}

ffi::Error AllReduceImpl(ffi::RunId run_id, ffi::Token, ffi::AnyBuffer rank, ffi::AnyBuffer group,
                         ffi::AnyBuffer x, ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y,
                         int64_t comm, std::string_view comm_name, int64_t size, int64_t op_id,
                         int64_t op) {
  return RunCollective(run_id, rank, group, x, &*y, comm, comm_name, size, op_id,
                       Collective::kAllReduce, op, 0);
}

ffi::Error ReduceScatterImpl(ffi::RunId run_id, ffi::Token, ffi::AnyBuffer rank,
                             ffi::AnyBuffer group, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                             ffi::Result<ffi::AnyBuffer> y, int64_t comm,
                             std::string_view comm_name, int64_t size, int64_t op_id, int64_t op) {
  return RunCollective(run_id, rank, group, x, &*y, comm, comm_name, size, op_id,
                       Collective::kReduceScatter, op, 0);
}

ffi::Error AllGatherImpl(ffi::RunId run_id, ffi::Token, ffi::AnyBuffer rank, ffi::AnyBuffer group,
                         ffi::AnyBuffer x, ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y,
                         int64_t comm, std::string_view comm_name, int64_t size, int64_t op_id) {
  return RunCollective(run_id, rank, group, x, &*y, comm, comm_name, size, op_id,
                       Collective::kAllGather, 0, 0);
}

ffi::Error BroadcastImpl(ffi::RunId run_id, ffi::Token, ffi::AnyBuffer rank, ffi::AnyBuffer group,
                         ffi::AnyBuffer x, ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y,
                         int64_t comm, std::string_view comm_name, int64_t size, int64_t op_id,
                         int64_t root) {
  return RunCollective(run_id, rank, group, x, &*y, comm, comm_name, size, op_id,
                       Collective::kBroadcast, 0, root);
}

ffi::Error BarrierImpl(ffi::RunId run_id, ffi::Token, ffi::AnyBuffer rank, ffi::AnyBuffer group,
                       ffi::Result<ffi::Token>, int64_t comm, std::string_view comm_name,
                       int64_t size, int64_t op_id) {
  const std::string name(comm_name);
  JaxringHostCall call =
      Call(rank, group, comm, name, size, op_id, Collective::kBarrier, kJaxringHostCollective);
  call.run_id = run_id.run_id;
  return Run(call);
}

// ---- point-to-point ----------------------------------------------------------------------------

ffi::Error PermuteImpl(ffi::Token, ffi::AnyBuffer rank, ffi::AnyBuffer group, ffi::AnyBuffer x,
                       ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y, int64_t comm,
                       std::string_view comm_name, int64_t size, int64_t op_id,
                       ffi::Span<const int64_t> perm) {
  const std::string name(comm_name);
  JaxringHostCall call =
      Call(rank, group, comm, name, size, op_id, Collective::kPermute, kJaxringHostPermute);
  SetInput(&call, x);
  SetOutput(&call, *y);
  SetPerm(&call, perm);
  return Run(call);
}

ffi::Error SendImpl(ffi::Token, ffi::AnyBuffer rank, ffi::AnyBuffer group, ffi::AnyBuffer x,
                    ffi::Result<ffi::Token>, int64_t comm, std::string_view comm_name,
                    int64_t size, int64_t op_id, ffi::Span<const int64_t> perm) {
  const std::string name(comm_name);
  JaxringHostCall call =
      Call(rank, group, comm, name, size, op_id, Collective::kSendRecv, kJaxringHostSend);
  SetInput(&call, x);
  SetPerm(&call, perm);
  return Run(call);
}

ffi::Error RecvImpl(ffi::Token, ffi::AnyBuffer rank, ffi::AnyBuffer group,
                    ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y, int64_t comm,
                    std::string_view comm_name, int64_t size, int64_t op_id,
                    ffi::Span<const int64_t> perm) {
  const std::string name(comm_name);
  JaxringHostCall call =
      Call(rank, group, comm, name, size, op_id, Collective::kSendRecv, kJaxringHostRecv);
  SetOutput(&call, *y);
  SetPerm(&call, perm);
  return Run(call);
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
