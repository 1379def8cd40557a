// XLA FFI handlers for CPU devices: the shared handler bodies (common/handlers.h) with a Runner
// that reads rank and data in place and runs the call through cpu/host.cc. A call that completes
// on XLA's thread returns its error or success as any handler does; one that goes on on a jaxring
// thread (cpu/handoff.h) returns a future, which that thread completes.
#include <cstdint>
#include <variant>

#include "common/config.h"
#include "common/handlers.h"
#include "cpu/host.h"

namespace jaxring {

namespace ffi = xla::ffi;

// What a CPU handler returns: a result now, or a future result.
struct ErrorOrFuture {
  std::variant<ffi::Error, ffi::Future> value;
};

namespace {

ffi::Error ToError(const HostResult& result) {
  if (result.status.ok()) return ffi::Error::Success();
  return result.invalid_argument ? ffi::Error::InvalidArgument(result.status.message())
                                 : ffi::Error::Internal(result.status.message());
}

struct CpuRunner {
  using Ctx = ffi::RunId;
  using CtxValue = ffi::RunId;

  static ErrorOrFuture Run(ffi::RunId run_id, JaxringHostCall call, ffi::AnyBuffer rank,
                           ffi::AnyBuffer group, const ffi::AnyBuffer* x, ffi::AnyBuffer* y) {
    call.run_id = run_id.run_id;
    call.rank = *static_cast<const int32_t*>(rank.untyped_data());
    call.group = *static_cast<const int32_t*>(group.untyped_data());
    if (x != nullptr) call.input = x->untyped_data();
    if (y != nullptr) {
      AdviseHugePages(y->untyped_data(), y->size_bytes());
      call.output = y->untyped_data();
    }
    // The future first: its constructor asserts that only it and the promise share their state
    // (the handed-off task holds a copy of the promise before a later future could be made).
    ffi::Promise promise;
    ffi::Future future(promise);
    HostCompletion complete = [promise = std::move(promise)](const HostResult& result) mutable {
      if (result.status.ok()) {
        promise.SetAvailable();
      } else {
        promise.SetError(ToError(result));
      }
    };
    const HostResult result = RunHostCall(call, &complete);
    if (result.handed_off) return {std::move(future)};
    return {ToError(result)};
  }
};

}  // namespace
}  // namespace jaxring

namespace xla::ffi {

// Encodes a CPU handler's result as an error (or success) now, or as a future.
template <ExecutionStage stage>
struct ResultEncoding<stage, ::jaxring::ErrorOrFuture> {
  // Context: XLA_FFI_ExecutionContext in jaxlib 0.10, XLA_FFI_InvokeContext in 0.11.
  template <typename Context>
  static std::variant<XLA_FFI_Error*, XLA_FFI_Future*> Encode(const XLA_FFI_Api* api,
                                                             Context* ctx,
                                                             ::jaxring::ErrorOrFuture result) {
    if (auto* error = std::get_if<Error>(&result.value))
      return ResultEncoding<stage, Error>::Encode(api, ctx, std::move(*error));
    return ResultEncoding<stage, Future>::Encode(api, ctx,
                                                 std::move(std::get<Future>(result.value)));
  }
};

}  // namespace xla::ffi

JAXRING_DEFINE_HANDLERS(Cpu, ::jaxring::CpuRunner);
