// XLA FFI handlers for CPU devices: the shared handler bodies (common/handlers.h) with a Runner
// that reads rank and data in place and runs the call through cpu/host.cc.
#include <cstdint>

#include "common/config.h"
#include "common/handlers.h"
#include "cpu/host.h"

namespace jaxring {
namespace {

namespace ffi = xla::ffi;

struct CpuRunner {
  using Ctx = ffi::RunId;
  using CtxValue = ffi::RunId;

  static ffi::Error Run(ffi::RunId run_id, JaxringHostCall call, ffi::AnyBuffer rank,
                        ffi::AnyBuffer group, const ffi::AnyBuffer* x, ffi::AnyBuffer* y) {
    call.run_id = run_id.run_id;
    call.rank = *static_cast<const int32_t*>(rank.untyped_data());
    call.group = *static_cast<const int32_t*>(group.untyped_data());
    if (x != nullptr) call.input = x->untyped_data();
    if (y != nullptr) {
      AdviseHugePages(y->untyped_data(), y->size_bytes());
      call.output = y->untyped_data();
    }
    const HostResult result = RunHostCall(call);
    if (result.status.ok()) return ffi::Error::Success();
    return result.invalid_argument ? ffi::Error::InvalidArgument(result.status.message())
                                   : ffi::Error::Internal(result.status.message());
  }
};

}  // namespace
}  // namespace jaxring

JAXRING_DEFINE_HANDLERS(Cpu, ::jaxring::CpuRunner);
