// XLA FFI handlers for CPU devices: the shared handler bodies (common/handlers.h) with a Runner
// that reads rank and data in place and runs the call through cpu/host.cc.
#include <sys/mman.h>

#include <cstdint>

#include "common/config.h"
#include "common/handlers.h"
#include "cpu/host.h"

namespace jaxring {
namespace {

namespace ffi = xla::ffi;

// Large outputs from XLA's CPU allocator are usually fresh anonymous mappings (glibc maps every
// block over 32 MiB), and each 4 KiB page then faults on its first write: about 2.7 us a page on
// this VM, 48 ms for 64 MiB, more than the all-reduce itself. Asking for transparent huge pages on
// the buffer's 2 MiB-aligned interior cuts that to 10 ms. The call is advice: it changes no data,
// and a kernel without THP ignores it. Every device advises its own output before it joins the
// rendezvous, so before any peer writes to it.
void AdviseHugePages(const ffi::AnyBuffer& y) {
  const int64_t threshold = CurrentConfig().huge_page_bytes;
  const size_t bytes = y.size_bytes();
  if (threshold <= 0 || bytes < static_cast<size_t>(threshold)) return;
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  const uintptr_t start = reinterpret_cast<uintptr_t>(y.untyped_data());
  const uintptr_t begin = (start + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (start + bytes) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

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
      AdviseHugePages(*y);
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
