#include "gpu/staged_steps.h"

#include <vector>

#include "gpu/plan.h"

namespace jaxring {
namespace gpu {

Status RunStagedSteps(const Header& h, const JaxringHostCall& call, const void* x, void* y,
                      int rank, int size, int64_t chunk_bytes, StagingOps& ops) {
  const int n = size;
  const size_t width = ByteWidth(h.dtype);
  const int64_t block = BlockCount(h.kind, h.count, n);
  const std::vector<Step> steps =
      PlanSteps(block, StepElements(Transport::kStaged, h.kind, n, chunk_bytes, width));
  const bool scatter = h.kind == Collective::kReduceScatter;
  const bool gather = h.kind == Collective::kAllGather;
  const bool reads_input = h.kind != Collective::kBroadcast || rank == h.root;
  const size_t pitch = static_cast<size_t>(block) * width;  // between blocks of x (or y)
  auto in = [&](size_t k) -> Status {
    const size_t bytes = static_cast<size_t>(steps[k].count) * width;
    const char* src = static_cast<const char*>(x) + steps[k].first * static_cast<int64_t>(width);
    return ops.CopyIn(static_cast<int>(k & 1), src, pitch, reads_input ? bytes : 0,
                      scatter ? n : 1);
  };

  Status status = ops.Begin();
  if (!status.ok()) return status;
  status = in(0);
  for (size_t k = 0; k < steps.size() && status.ok(); ++k) {
    const int b = static_cast<int>(k & 1);
    const Step& s = steps[k];
    // ToHost(other) was last read by host call k - 1, which has returned.
    if (k + 1 < steps.size()) status = in(k + 1);
    if (status.ok()) status = ops.WaitIn(b);
    if (status.ok()) status = ops.WaitOut(b);
    if (!status.ok()) break;
    JaxringHostCall chunk = call;
    chunk.rank = rank;
    chunk.group = 0;
    chunk.input = ops.ToHost(b);
    chunk.output = ops.FromHost(b);
    chunk.input_count = scatter ? s.count * n : s.count;
    chunk.whole_count = call.input_count;
    chunk.output_count = gather ? s.count * n : s.count;
    status = ops.RunOnHost(chunk);
    if (!status.ok()) break;
    const size_t bytes = static_cast<size_t>(s.count) * width;
    status = ops.CopyOut(b, static_cast<char*>(y) + s.first * static_cast<int64_t>(width), pitch,
                         bytes, gather ? n : 1);
  }
  // End() also after an error: result copies of earlier chunks may still be queued, writing into
  // y, and XLA's stream must not go on (and free or reuse y) before they are done.
  const Status end = ops.End();
  return status.ok() ? end : status;
}

}  // namespace gpu
}  // namespace jaxring
