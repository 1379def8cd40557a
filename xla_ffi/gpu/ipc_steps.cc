#include "gpu/ipc_steps.h"

#include "gpu/plan.h"

namespace jaxring {
namespace gpu {
namespace {

char* At(void* base, int64_t elements, size_t width) {
  return static_cast<char*>(base) + elements * static_cast<int64_t>(width);
}
const char* At(const void* base, int64_t elements, size_t width) {
  return static_cast<const char*>(base) + elements * static_cast<int64_t>(width);
}

#define JAXRING_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::jaxring::Status jaxring_status_ = (expr);        \
    if (!jaxring_status_.ok()) return jaxring_status_; \
  } while (0)

// One step: elements [first, first + count) of every block, on parity step % 2.
Status RunStep(const Header& h, const void* x, void* y, int me, int n, int64_t slot_bytes,
               int64_t block, int64_t first, int64_t count, uint64_t* step, IpcOps& ops) {
  const size_t width = ByteWidth(h.dtype);
  const int parity = static_cast<int>(*step & 1);
  const int64_t step_elements = StepElements(Transport::kIpc, h.kind, n, slot_bytes, width);
  const size_t bytes = static_cast<size_t>(count) * width;
  const int root = static_cast<int>(h.root);
  const int64_t divisor = h.op == ReduceOp::kMean ? n : 0;
  ++*step;

  // 1. Stage this rank's piece once every reader of this parity (two steps ago) is done.
  if (*step > 2) JAXRING_RETURN_IF_ERROR(ops.Wait(kDoneEvent, parity, -1, true));
  if (count > 0) {
    if (h.kind == Collective::kReduceScatter) {
      // n pieces, one per destination block, `step_elements` apart in the slot.
      JAXRING_RETURN_IF_ERROR(ops.Copy2D(ops.Slot(me, parity), step_elements * width,
                                         At(x, first, width), block * width, bytes, n));
    } else if (h.kind != Collective::kBroadcast || me == root) {
      JAXRING_RETURN_IF_ERROR(ops.Copy(ops.Slot(me, parity), At(x, first, width), bytes));
    }
  }
  JAXRING_RETURN_IF_ERROR(ops.Record(kStagedEvent, parity));
  // 2. Every rank has recorded its `staged` event once every rank has arrived here.
  JAXRING_RETURN_IF_ERROR(ops.Agree());
  // 3. Read the peers' pieces.
  JAXRING_RETURN_IF_ERROR(
      ops.Wait(kStagedEvent, parity, h.kind == Collective::kBroadcast ? root : -1, false));
  const void* srcs[kIpcMaxRanks];
  if (count > 0) {
    switch (h.kind) {
      case Collective::kAllReduce: {
        if (ChooseIpcAlgorithm(static_cast<int64_t>(bytes), n) == IpcAlgorithm::kOneShot) {
          for (int r = 0; r < n; ++r) srcs[r] = ops.Slot(r, parity);
          JAXRING_RETURN_IF_ERROR(
              ops.Reduce(h.dtype, h.op, srcs, n, At(y, first, width), count, divisor));
          break;
        }
        // Two-shot: reduce this rank's share in place (only this rank reads it before the
        // second exchange), then copy every rank's reduced share out.
        const Partition share = ShareOf(count, n, width);
        for (int r = 0; r < n; ++r) srcs[r] = At(ops.Slot(r, parity), share.Begin(me), width);
        JAXRING_RETURN_IF_ERROR(ops.Reduce(h.dtype, h.op, srcs, n,
                                           At(ops.Slot(me, parity), share.Begin(me), width),
                                           share.Size(me), divisor));
        JAXRING_RETURN_IF_ERROR(ops.Record(kReducedEvent, parity));
        JAXRING_RETURN_IF_ERROR(ops.Agree());
        JAXRING_RETURN_IF_ERROR(ops.Wait(kReducedEvent, parity, -1, false));
        for (int r = 0; r < n; ++r) {
          if (share.Size(r) == 0) continue;
          JAXRING_RETURN_IF_ERROR(ops.Copy(At(y, first + share.Begin(r), width),
                                           At(ops.Slot(r, parity), share.Begin(r), width),
                                           share.Size(r) * width));
        }
        break;
      }
      case Collective::kReduceScatter:
        for (int r = 0; r < n; ++r) srcs[r] = At(ops.Slot(r, parity), me * step_elements, width);
        JAXRING_RETURN_IF_ERROR(
            ops.Reduce(h.dtype, h.op, srcs, n, At(y, first, width), count, divisor));
        break;
      case Collective::kAllGather:
        for (int r = 0; r < n; ++r)
          JAXRING_RETURN_IF_ERROR(
              ops.Copy(At(y, r * block + first, width), ops.Slot(r, parity), bytes));
        break;
      case Collective::kBroadcast:
        JAXRING_RETURN_IF_ERROR(ops.Copy(At(y, first, width), ops.Slot(root, parity), bytes));
        break;
      default:
        break;  // refused by RunIpcSteps
    }
  }
  // 4. This rank is done reading parity `parity` of every workspace.
  return ops.Record(kDoneEvent, parity);
}

}  // namespace

Status RunIpcSteps(const Header& h, const void* x, void* y, int rank, int size,
                   int64_t slot_bytes, uint64_t* step, IpcOps& ops, const std::string& where) {
  if (size > kIpcMaxRanks)
    return Status::Error(where + ": cuda-ipc takes at most " + std::to_string(kIpcMaxRanks) +
                         " ranks");
  if (h.kind != Collective::kAllReduce && h.kind != Collective::kReduceScatter &&
      h.kind != Collective::kAllGather && h.kind != Collective::kBroadcast)
    return Status::Error(where + ": not a cuda-ipc collective");
  const size_t width = ByteWidth(h.dtype);
  const int64_t block = BlockCount(h.kind, h.count, size);
  for (const Step& s :
       PlanSteps(block, StepElements(Transport::kIpc, h.kind, size, slot_bytes, width))) {
    Status status = RunStep(h, x, y, rank, size, slot_bytes, block, s.first, s.count, step, ops);
    if (!status.ok()) return status;
  }
  return Status();
}

}  // namespace gpu
}  // namespace jaxring
