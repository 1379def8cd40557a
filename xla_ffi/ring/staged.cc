#include "ring/staged.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/wait.h"
#include "kernels/reduce_cpu.h"
#include "ring/schedule.h"

namespace jaxring {
namespace {

char* At(void* base, int64_t elements, size_t width) {
  return static_cast<char*>(base) + elements * static_cast<int64_t>(width);
}
const char* At(const void* base, int64_t elements, size_t width) {
  return static_cast<const char*>(base) + elements * static_cast<int64_t>(width);
}

CountedStall step_stalls;     // StallNextStepsForTest's
CountedStall staged_stalls;   // and with `after_staging`

// Runs `steps` steps of `body(step_index)`, each framed by BeginStep and the header exchange.
// The first step also checks every rank's header. On error the communicator is abandoned, so
// that peers fail at once instead of waiting for the timeout. Each step's waits get the whole
// timeout, not what is left of the call's: a large call that keeps moving may take longer.
template <typename Stage, typename Finish>
Status Steps(ShmCommunicator& comm, const Header& header, const Config& config, int64_t steps,
             Stage stage, Finish finish) {
  const int64_t spin = config.spin_iterations;
  for (int64_t step = 0; step < steps; ++step) {
    step_stalls.TakeIfArmed();
    const Deadline deadline(config.timeout_seconds);
    Status status = comm.BeginStep(header, deadline, spin);
    if (status.ok()) {
      stage(step);
      comm.PostHeader(header);
      comm.Publish(Phase::kStaged);
      status = comm.WaitAll(Phase::kStaged, header, deadline, spin);
      if (status.ok()) staged_stalls.TakeIfArmed();
    }
    if (status.ok() && step == 0) status = comm.CheckHeaders(header);
    if (status.ok()) status = comm.CheckNoPeerLeft(header);
    if (status.ok()) status = finish(step, deadline, spin);
    if (!status.ok()) {
      comm.Abandon(status.message());
      return status;
    }
    comm.Publish(Phase::kCopied);
  }
  return Status();
}

// All-reduce steps up to this many bytes per rank are reduced by every rank on its own; larger
// ones are shared out (each rank reduces 1/n into the result area, then all copy it out).
// Measured with benchmarks/allreduce_mpi.py (the in-a-loop rows).
constexpr int64_t kReduceEverywhereBytes = 16 * 1024;

int64_t StepCount(int64_t elements, int64_t per_step) {
  return std::max<int64_t>(1, (elements + per_step - 1) / per_step);
}

}  // namespace

Status RunStaged(ShmCommunicator& comm, const Header& h, const CollectiveBuffers& b,
                 const Config& config) {
  const int n = comm.size();
  const int me = comm.rank();
  const size_t width = ByteWidth(h.dtype);
  const int64_t slot_elements = comm.slot_bytes() / static_cast<int64_t>(width);
  auto none = [](int64_t) {};
  auto copy_in = [&](void* dst, const void* src, int64_t bytes) {
    comm.CopyIn(dst, src, static_cast<size_t>(bytes), config.shm_stores);
  };
  switch (h.kind) {
    case Collective::kAllReduce: {
      const int64_t chunk = slot_elements;
      auto span = [&](int64_t step) { return std::min(chunk, h.count - step * chunk); };
      auto everywhere = [&](int64_t len) {
        return len * static_cast<int64_t>(width) <= kReduceEverywhereBytes;
      };
      auto shares = [&](int64_t len) {
        return Partition{len, n, std::max<int64_t>(1, 64 / static_cast<int64_t>(width))};
      };
      return Steps(
          comm, h, config, StepCount(h.count, chunk),
          [&](int64_t step) {
            const int64_t len = h.count ? span(step) : 0;
            if (!len) return;
            const char* input = At(b.input, step * chunk, width);
            if (everywhere(len)) {
              copy_in(comm.Slot(me), input, len * width);
              return;
            }
            // Peers read only the shares they reduce; this rank reads its own from its input.
            const Partition share = shares(len);
            const int64_t begin = share.Begin(me), end = begin + share.Size(me);
            copy_in(comm.Slot(me), input, begin * width);
            copy_in(At(comm.Slot(me), end, width), At(input, end, width), (len - end) * width);
          },
          [&](int64_t step, const Deadline& deadline, int64_t spin) {
            const int64_t len = h.count ? span(step) : 0;
            std::vector<Operand> srcs(n);
            if (everywhere(len)) {
              // Small: every rank reduces the whole step itself (in the same order, so the bits
              // agree), which saves the second round of waiting.
              for (int peer = 0; peer < n; ++peer) srcs[peer] = Operand{comm.Slot(peer)};
              const Target dst{At(b.output, step * chunk, width)};
              Reduce(h.dtype, h.op, srcs.data(), n, &dst, 1, len, n);
              return Status();
            }
            // Each rank reduces its share into its own output, copies it into the result area,
            // then copies the other shares out. Reducing straight into the result area as well
            // (a second target) saves a read of the share but stores into lines that the peers
            // read last, block by block: on this VM, with its two cores on different dies, a
            // 1 MiB all-reduce at 2 ranks then took 103-124 us in a loop, against 71-90 us with
            // the copy, which takes those lines in one long run; on one die the copy costs 4-5%.
            // With 4 ranks it gained nothing at 256 KiB-1 MiB and cost 4% at 4 MiB.
            const Partition share = shares(len);
            const int64_t begin = share.Begin(me);
            const int64_t end = begin + share.Size(me);
            char* output = At(b.output, step * chunk, width);
            for (int peer = 0; peer < n; ++peer)
              srcs[peer] = Operand{At(comm.Slot(peer), begin, width)};
            srcs[me] = Operand{At(b.input, step * chunk + begin, width)};
            const Target dst{At(output, begin, width)};
            Reduce(h.dtype, h.op, srcs.data(), n, &dst, 1, end - begin, n);
            copy_in(At(comm.Result(), begin, width), dst.data, (end - begin) * width);
            comm.Publish(Phase::kReduced);
            // Copies each peer's share out as soon as that peer has reduced it, the next rank's
            // first, rather than after all have: 1-3% faster in a loop at 256 KiB-4 MiB with 4
            // ranks on 2 cores, bound or not, as a rank then waits only for what it reads.
            for (int k = 1; k < n; ++k) {
              const int peer = (me + k) % n;
              Status status = comm.WaitFor(peer, Phase::kReduced, h, deadline, spin);
              if (!status.ok()) return status;
              const int64_t at = share.Begin(peer);
              std::memcpy(At(output, at, width), At(comm.Result(), at, width),
                          share.Size(peer) * width);
            }
            return Status();
          });
    }
    case Collective::kReduceScatter: {
      // Each slot holds n pieces of `chunk` elements, one per destination block.
      const int64_t block = b.output_count;
      const int64_t chunk = std::max<int64_t>(1, slot_elements / n);
      auto span = [&](int64_t step) { return std::min(chunk, block - step * chunk); };
      return Steps(
          comm, h, config, StepCount(block, chunk),
          [&](int64_t step) {
            if (!block) return;
            for (int dest = 0; dest < n; ++dest)  // this rank reduces its own piece from its input
              if (dest != me)
                copy_in(At(comm.Slot(me), dest * chunk, width),
                        At(b.input, dest * block + step * chunk, width), span(step) * width);
          },
          [&](int64_t step, const Deadline&, int64_t) {
            if (!block) return Status();
            std::vector<Operand> srcs(n);
            for (int peer = 0; peer < n; ++peer)
              srcs[peer] = Operand{At(comm.Slot(peer), me * chunk, width)};
            srcs[me] = Operand{At(b.input, me * block + step * chunk, width)};
            const Target dst{At(b.output, step * chunk, width)};
            Reduce(h.dtype, h.op, srcs.data(), n, &dst, 1, span(step), n);
            return Status();
          });
    }
    case Collective::kAllGather: {
      const int64_t block = h.count;
      const int64_t chunk = slot_elements;
      auto span = [&](int64_t step) { return std::min(chunk, block - step * chunk); };
      return Steps(
          comm, h, config, StepCount(block, chunk),
          [&](int64_t step) {
            if (block) copy_in(comm.Slot(me), At(b.input, step * chunk, width), span(step) * width);
          },
          [&](int64_t step, const Deadline&, int64_t) {
            if (!block) return Status();
            for (int peer = 0; peer < n; ++peer)
              std::memcpy(At(b.output, peer * block + step * chunk, width), comm.Slot(peer),
                          span(step) * width);
            return Status();
          });
    }
    case Collective::kBroadcast: {
      const int root = static_cast<int>(h.root);
      const int64_t chunk = slot_elements;
      auto span = [&](int64_t step) { return std::min(chunk, h.count - step * chunk); };
      return Steps(
          comm, h, config, StepCount(h.count, chunk),
          [&](int64_t step) {
            if (me == root && h.count)
              copy_in(comm.Slot(root), At(b.input, step * chunk, width), span(step) * width);
          },
          [&](int64_t step, const Deadline&, int64_t) {
            if (h.count) std::memcpy(At(b.output, step * chunk, width), comm.Slot(root),
                                     span(step) * width);
            return Status();
          });
    }
    case Collective::kBarrier:
      return Steps(comm, h, config, 1, none,
                   [](int64_t, const Deadline&, int64_t) { return Status(); });
    default:
      return Status::Error(comm.Where(h) + ": not available on a process communicator yet");
  }
}

Status RunAgree(ShmCommunicator& comm, const Header& header, const Config& config) {
  return Steps(comm, header, config, 1, [](int64_t) {},
               [](int64_t, const Deadline&, int64_t) { return Status(); });
}

Status RunExchange(ShmCommunicator& comm, void* output, const void* input, int64_t bytes,
                   int64_t chunk_bytes, ShmStores stores, int64_t loops, const Config& config) {
  Header header;  // names the exchange in a timeout's error: an all_gather of float32
  header.kind = Collective::kAllGather;
  header.count = bytes / 4;
  const Deadline deadline(config.timeout_seconds);
  const int n = comm.size();
  const int left = (comm.rank() + n - 1) % n;
  const int second = (comm.rank() + 2 * n - 2) % n;
  const int64_t chunk = std::max<int64_t>(1, std::min(chunk_bytes, comm.slot_bytes()));
  for (int64_t loop = 0; loop < loops; ++loop) {
    for (int64_t at = 0; at < bytes; at += chunk) {
      const int64_t len = std::min(chunk, bytes - at);
      // The step's last (n - 2)/n float32 elements are read from the second neighbour too.
      const int64_t twice = n > 2 ? (len / 4) * (n - 2) / n * 4 : 0;
      Status status = comm.BeginStep(header, deadline, config.spin_iterations);
      if (status.ok()) {
        comm.CopyIn(comm.Slot(comm.rank()), At(input, at, 1), static_cast<size_t>(len), stores);
        comm.Publish(Phase::kStaged);
        status = comm.WaitFor(left, Phase::kStaged, header, deadline, config.spin_iterations);
      }
      if (status.ok() && twice)
        status = comm.WaitFor(second, Phase::kStaged, header, deadline, config.spin_iterations);
      if (!status.ok()) {
        comm.Abandon(status.message());
        return status;
      }
      const int64_t once = len - twice;
      std::memcpy(At(output, at, 1), comm.Slot(left), static_cast<size_t>(once));
      if (twice) {
        const Operand srcs[2] = {Operand{At(comm.Slot(left), once, 1)},
                                 Operand{At(comm.Slot(second), once, 1)}};
        const Target dst{At(output, at + once, 1)};
        Reduce(DType::kF32, ReduceOp::kSum, srcs, 2, &dst, 1, twice / 4, 1);
      }
      comm.Publish(Phase::kCopied);
    }
  }
  return Status();
}

void StallNextStepsForTest(double seconds, int64_t steps, bool after_staging) {
  (after_staging ? staged_stalls : step_stalls).Arm(seconds, steps);
}

}  // namespace jaxring
