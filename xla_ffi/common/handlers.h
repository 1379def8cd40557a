// The FFI handler bodies and bindings shared by the CPU and CUDA handlers. A handler decodes
// XLA's attributes and buffers into a JaxringHostCall and hands it, with the buffers, to its
// platform's Runner, which reads the rank and data where that platform keeps them:
//
//   struct Runner {
//     using Ctx = ...;       // what the binding asks XLA for (ffi::RunId, a platform stream)
//     using CtxValue = ...;  // what the handler receives for it
//     static Result Run(CtxValue ctx, JaxringHostCall call, ffi::AnyBuffer rank,
//                       ffi::AnyBuffer group, const ffi::AnyBuffer* x, ffi::AnyBuffer* y);
//   };
//
// where Result (HandlerResult below) is what the handlers return: ffi::Error, or a type of the
// platform's own that XLA's ResultEncoding knows (the CPU handlers may return a future).
#pragma once

#include <cstdint>
#include <string_view>
#include <utility>

#include "common/host_call.h"
#include "common/types.h"
#include "xla/ffi/api/ffi.h"

namespace jaxring {
namespace handlers {

namespace ffi = xla::ffi;

inline uint8_t ToDType(ffi::DataType type) { return static_cast<uint8_t>(type); }

template <typename Runner>
using HandlerResult =
    decltype(Runner::Run(std::declval<typename Runner::CtxValue>(), JaxringHostCall{},
                         std::declval<ffi::AnyBuffer>(), std::declval<ffi::AnyBuffer>(), nullptr,
                         nullptr));

template <typename Runner>
HandlerResult<Runner> RunCall(typename Runner::CtxValue ctx, Collective kind, JaxringHostRole role,
                              ffi::AnyBuffer rank, ffi::AnyBuffer group, const ffi::AnyBuffer* x,
                              ffi::AnyBuffer* y, int64_t comm, std::string_view comm_name,
                              int64_t size, int64_t op_id, int64_t op = 0, int64_t root = 0,
                              ffi::Span<const int64_t> perm = {}) {
  JaxringHostCall call{};
  call.comm = static_cast<uint64_t>(comm);
  call.comm_name = comm_name.data();
  call.comm_name_size = comm_name.size();
  call.size = static_cast<int32_t>(size);
  call.op_id = op_id;
  call.role = role;
  call.kind = static_cast<uint8_t>(kind);
  call.op = static_cast<uint8_t>(op);
  call.root = root;
  call.dtype = static_cast<uint8_t>(DType::kS32);
  if (y != nullptr) {
    call.output_count = static_cast<int64_t>(y->element_count());
    call.dtype = ToDType(y->element_type());
  }
  if (x != nullptr) {
    call.input_count = static_cast<int64_t>(x->element_count());
    call.dtype = ToDType(x->element_type());
  }
  call.perm = perm.begin();
  call.perm_size = static_cast<int64_t>(perm.size());
  return Runner::Run(ctx, call, rank, group, x, y);
}

// all_reduce and reduce_scatter: the same binding, told apart by their kind.
template <typename R, Collective kKind>
HandlerResult<R> Reduction(typename R::CtxValue ctx, ffi::Token, ffi::AnyBuffer rank,
                           ffi::AnyBuffer group, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                           ffi::Result<ffi::AnyBuffer> y, int64_t comm, std::string_view comm_name,
                           int64_t size, int64_t op_id, int64_t op) {
  return RunCall<R>(ctx, kKind, kJaxringHostCollective, rank, group, &x, &*y, comm, comm_name,
                    size, op_id, op);
}

template <typename R>
HandlerResult<R> AllGather(typename R::CtxValue ctx, ffi::Token, ffi::AnyBuffer rank,
                           ffi::AnyBuffer group, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                           ffi::Result<ffi::AnyBuffer> y, int64_t comm, std::string_view comm_name,
                           int64_t size, int64_t op_id) {
  return RunCall<R>(ctx, Collective::kAllGather, kJaxringHostCollective, rank, group, &x, &*y,
                    comm, comm_name, size, op_id);
}

template <typename R>
HandlerResult<R> Broadcast(typename R::CtxValue ctx, ffi::Token, ffi::AnyBuffer rank,
                           ffi::AnyBuffer group, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                           ffi::Result<ffi::AnyBuffer> y, int64_t comm, std::string_view comm_name,
                           int64_t size, int64_t op_id, int64_t root) {
  return RunCall<R>(ctx, Collective::kBroadcast, kJaxringHostCollective, rank, group, &x, &*y,
                    comm, comm_name, size, op_id, 0, root);
}

template <typename R>
HandlerResult<R> Barrier(typename R::CtxValue ctx, ffi::Token, ffi::AnyBuffer rank,
                         ffi::AnyBuffer group, ffi::Result<ffi::Token>, int64_t comm,
                         std::string_view comm_name, int64_t size, int64_t op_id) {
  return RunCall<R>(ctx, Collective::kBarrier, kJaxringHostCollective, rank, group, nullptr,
                    nullptr, comm, comm_name, size, op_id);
}

template <typename R>
HandlerResult<R> Permute(typename R::CtxValue ctx, ffi::Token, ffi::AnyBuffer rank,
                         ffi::AnyBuffer group, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                         ffi::Result<ffi::AnyBuffer> y, int64_t comm, std::string_view comm_name,
                         int64_t size, int64_t op_id, ffi::Span<const int64_t> perm) {
  return RunCall<R>(ctx, Collective::kPermute, kJaxringHostPermute, rank, group, &x, &*y, comm,
                    comm_name, size, op_id, 0, 0, perm);
}

template <typename R>
HandlerResult<R> Send(typename R::CtxValue ctx, ffi::Token, ffi::AnyBuffer rank,
                      ffi::AnyBuffer group, ffi::AnyBuffer x, ffi::Result<ffi::Token>, int64_t comm,
                      std::string_view comm_name, int64_t size, int64_t op_id,
                      ffi::Span<const int64_t> perm) {
  return RunCall<R>(ctx, Collective::kSendRecv, kJaxringHostSend, rank, group, &x, nullptr, comm,
                    comm_name, size, op_id, 0, 0, perm);
}

template <typename R>
HandlerResult<R> Recv(typename R::CtxValue ctx, ffi::Token, ffi::AnyBuffer rank,
                      ffi::AnyBuffer group, ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y,
                      int64_t comm, std::string_view comm_name, int64_t size, int64_t op_id,
                      ffi::Span<const int64_t> perm) {
  return RunCall<R>(ctx, Collective::kSendRecv, kJaxringHostRecv, rank, group, nullptr, &*y,
                    comm, comm_name, size, op_id, 0, 0, perm);
}

// Binding shared by every handler: context, token, rank, group, [x] -> token, [y], then the
// communicator attributes; handler-specific attributes are appended after these.
template <typename Binding>
auto WithCommunicator(Binding&& binding) {
  return std::move(binding)
      .template Attr<int64_t>("comm")
      .template Attr<std::string_view>("comm_name")
      .template Attr<int64_t>("size")
      .template Attr<int64_t>("op_id");
}

template <typename Ctx, bool kInput, bool kOutput>
auto Bind() {
  auto prefix = ffi::Ffi::Bind()
                    .Ctx<Ctx>()
                    .template Arg<ffi::Token>()
                    .template Arg<ffi::AnyBuffer>()   // rank along the communicator
                    .template Arg<ffi::AnyBuffer>();  // group: index along the other mesh axes
  if constexpr (kInput && kOutput) {
    return WithCommunicator(std::move(prefix)
                                .template Arg<ffi::AnyBuffer>()
                                .template Ret<ffi::Token>()
                                .template Ret<ffi::AnyBuffer>());
  } else if constexpr (kInput) {
    return WithCommunicator(
        std::move(prefix).template Arg<ffi::AnyBuffer>().template Ret<ffi::Token>());
  } else if constexpr (kOutput) {
    return WithCommunicator(
        std::move(prefix).template Ret<ffi::Token>().template Ret<ffi::AnyBuffer>());
  } else {
    return WithCommunicator(std::move(prefix).template Ret<ffi::Token>());
  }
}

}  // namespace handlers
}  // namespace jaxring

// Defines the exported handler symbols Jaxring<Name><SUFFIX> for one platform's Runner.
#define JAXRING_DEFINE_HANDLERS(SUFFIX, RUNNER)                                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                                  \
      JaxringAllReduce##SUFFIX,                                                                   \
      (::jaxring::handlers::Reduction<RUNNER, ::jaxring::Collective::kAllReduce>),               \
      (::jaxring::handlers::Bind<RUNNER::Ctx, true, true>().Attr<int64_t>("op")));               \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                                  \
      JaxringReduceScatter##SUFFIX,                                                               \
      (::jaxring::handlers::Reduction<RUNNER, ::jaxring::Collective::kReduceScatter>),           \
      (::jaxring::handlers::Bind<RUNNER::Ctx, true, true>().Attr<int64_t>("op")));               \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringAllGather##SUFFIX,                                         \
                                ::jaxring::handlers::AllGather<RUNNER>,                           \
                                (::jaxring::handlers::Bind<RUNNER::Ctx, true, true>()));          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                                  \
      JaxringBroadcast##SUFFIX, ::jaxring::handlers::Broadcast<RUNNER>,                          \
      (::jaxring::handlers::Bind<RUNNER::Ctx, true, true>().Attr<int64_t>("root")));             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxringBarrier##SUFFIX, ::jaxring::handlers::Barrier<RUNNER>,     \
                                (::jaxring::handlers::Bind<RUNNER::Ctx, false, false>()));        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                                  \
      JaxringPpermute##SUFFIX, ::jaxring::handlers::Permute<RUNNER>,                             \
      (::jaxring::handlers::Bind<RUNNER::Ctx, true, true>()                                      \
           .Attr<::xla::ffi::Span<const int64_t>>("perm")));                                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                                  \
      JaxringSend##SUFFIX, ::jaxring::handlers::Send<RUNNER>,                                    \
      (::jaxring::handlers::Bind<RUNNER::Ctx, true, false>()                                     \
           .Attr<::xla::ffi::Span<const int64_t>>("perm")));                                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                                  \
      JaxringRecv##SUFFIX, ::jaxring::handlers::Recv<RUNNER>,                                    \
      (::jaxring::handlers::Bind<RUNNER::Ctx, false, true>()                                     \
           .Attr<::xla::ffi::Span<const int64_t>>("perm")))
