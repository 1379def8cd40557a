#include "gpu/direct.h"

#include <algorithm>
#include <vector>

#include "gpu/plan.h"

namespace jaxring {
namespace gpu {
namespace {

constexpr size_t kErrorBytes = 4096;

char* At(void* base, int64_t elements, size_t width) {
  return static_cast<char*>(base) + elements * static_cast<int64_t>(width);
}
const char* At(const void* base, int64_t elements, size_t width) {
  return static_cast<const char*>(base) + elements * static_cast<int64_t>(width);
}

class Messages {
 public:
  Messages(const JaxringMessageOps& ops, double timeout, const std::string& where)
      : ops_(ops), timeout_(timeout), where_(where) {}
  Status Send(const void* data, size_t bytes, int peer) {
    return Check(ops_.post_send(ops_.context, data, bytes, peer, error_, kErrorBytes));
  }
  Status Receive(void* data, size_t bytes, int peer) {
    return Check(ops_.post_receive(ops_.context, data, bytes, peer, error_, kErrorBytes));
  }
  Status WaitAll() { return Check(ops_.wait_all(ops_.context, timeout_, error_, kErrorBytes)); }

 private:
  Status Check(int code) {
    return code == 0 ? Status() : Status::Error(where_ + ": " + std::string(error_));
  }
  const JaxringMessageOps& ops_;
  double timeout_;
  const std::string& where_;
  char error_[kErrorBytes] = {0};
};

Status Exchange(const Header& h, const void* x, void* y, int rank, int size, void* scratch,
                int64_t scratch_bytes, DeviceOps& device, const JaxringMessageOps& ops,
                double timeout_seconds, const std::string& where) {
  const int n = size;
  const int me = rank;
  const size_t width = ByteWidth(h.dtype);
  const int64_t divisor = h.op == ReduceOp::kMean ? n : 0;
  Messages messages(ops, timeout_seconds, where);
  // One slot of `slot` elements per peer in the scratch.
  const int64_t slot = StepElements(Transport::kStaged, Collective::kReduceScatter, n,
                                    scratch_bytes, width);
  std::vector<const void*> srcs(n);
  Status status;
  auto check = [&](Status s) {
    if (!s.ok() && status.ok()) status = s;
    return status.ok();
  };

  switch (h.kind) {
    case Collective::kAllReduce: {
      // A step's n shares each fit a slot: ShareOf rounds every boundary up to a vector, so a
      // share holds at most step / n + a vector's elements.
      const int64_t vector = std::max<int64_t>(1, kVectorBytes / static_cast<int64_t>(width));
      const int64_t step_elements = slot > vector ? n * (slot - vector) : slot;
      for (const Step& step : PlanSteps(h.count, step_elements)) {
        if (step.count == 0) break;
        const Partition share = ShareOf(step.count, n, width);
        const int64_t mine = step.first + share.Begin(me);
        // The scratch is free (the previous step's kernel is done) and x is ready.
        if (!check(device.Synchronize())) return status;
        for (int q = 0; q < n && status.ok(); ++q)
          if (q != me) check(messages.Receive(At(scratch, q * slot, width), share.Size(me) * width, q));
        for (int q = 0; q < n && status.ok(); ++q)
          if (q != me)
            check(messages.Send(At(x, step.first + share.Begin(q), width), share.Size(q) * width,
                                q));
        if (!check(messages.WaitAll())) return status;
        for (int q = 0; q < n; ++q)
          srcs[q] = q == me ? At(x, mine, width) : At(scratch, q * slot, width);
        if (!check(device.Reduce(h.dtype, h.op, srcs.data(), n, At(y, mine, width),
                                 share.Size(me), divisor)))
          return status;
        if (!check(device.Synchronize())) return status;  // the reduced piece, before it is sent
        for (int q = 0; q < n && status.ok(); ++q)
          if (q != me)
            check(messages.Receive(At(y, step.first + share.Begin(q), width),
                                   share.Size(q) * width, q));
        for (int q = 0; q < n && status.ok(); ++q)
          if (q != me) check(messages.Send(At(y, mine, width), share.Size(me) * width, q));
        if (!check(messages.WaitAll())) return status;
      }
      return status;
    }
    case Collective::kReduceScatter: {
      const int64_t block = h.count / n;
      for (const Step& step : PlanSteps(block, slot)) {
        if (step.count == 0) break;
        if (!check(device.Synchronize())) return status;
        for (int q = 0; q < n && status.ok(); ++q)
          if (q != me) check(messages.Receive(At(scratch, q * slot, width), step.count * width, q));
        for (int q = 0; q < n && status.ok(); ++q)
          if (q != me)
            check(messages.Send(At(x, q * block + step.first, width), step.count * width, q));
        if (!check(messages.WaitAll())) return status;
        for (int q = 0; q < n; ++q)
          srcs[q] = q == me ? At(x, me * block + step.first, width) : At(scratch, q * slot, width);
        if (!check(device.Reduce(h.dtype, h.op, srcs.data(), n, At(y, step.first, width),
                                 step.count, divisor)))
          return status;
      }
      return status;
    }
    case Collective::kAllGather: {
      const size_t bytes = static_cast<size_t>(h.count) * width;
      if (bytes == 0) return status;
      if (!check(device.Synchronize())) return status;
      for (int q = 0; q < n && status.ok(); ++q)
        if (q != me) check(messages.Receive(At(y, q * h.count, width), bytes, q));
      for (int q = 0; q < n && status.ok(); ++q)
        if (q != me) check(messages.Send(x, bytes, q));
      if (status.ok()) check(device.Copy(At(y, me * h.count, width), x, bytes));
      check(messages.WaitAll());  // also after a failed post: the others write into y
      return status;
    }
    case Collective::kBroadcast: {
      const size_t bytes = static_cast<size_t>(h.count) * width;
      const int root = static_cast<int>(h.root);
      if (bytes == 0) return status;
      if (!check(device.Synchronize())) return status;
      if (me == root) {
        for (int q = 0; q < n && status.ok(); ++q)
          if (q != me) check(messages.Send(x, bytes, q));
        if (status.ok()) check(device.Copy(y, x, bytes));
      } else {
        check(messages.Receive(y, bytes, root));
      }
      check(messages.WaitAll());  // also after a failed post: a receive writes into y
      return status;
    }
    default:
      return Status::Error(where + ": not a collective of the CUDA-aware path");
  }
}

}  // namespace

Status RunDirect(const Header& h, const void* x, void* y, int rank, int size, void* scratch,
                 int64_t scratch_bytes, DeviceOps& device, const JaxringMessageOps& ops,
                 double timeout_seconds, const std::string& where) {
  const Status status =
      Exchange(h, x, y, rank, size, scratch, scratch_bytes, device, ops, timeout_seconds, where);
  if (!status.ok()) ops.give_up(ops.context, status.message().c_str());
  return status;
}

}  // namespace gpu
}  // namespace jaxring
