#include "ring/algorithms.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/reduce_cpu.h"
#include "ring/schedule.h"

namespace jaxring {
namespace {

constexpr int64_t kCacheLineBytes = 64;

int64_t AlignElements(DType dtype) {
  return std::max<int64_t>(1, kCacheLineBytes / static_cast<int64_t>(ByteWidth(dtype)));
}

const char* Offset(const void* base, int64_t elements, size_t width) {
  return static_cast<const char*>(base) + elements * static_cast<int64_t>(width);
}
char* Offset(void* base, int64_t elements, size_t width) {
  return static_cast<char*>(base) + elements * static_cast<int64_t>(width);
}

bool IsReduction(Collective kind) {
  return kind == Collective::kAllReduce || kind == Collective::kReduceScatter;
}

// ---- direct (one-shot) algorithms --------------------------------------------------------------
// Every rank handles 1/n of the data, reading every peer's input once and writing every peer's
// output once: the least memory traffic possible in shared memory, and two hand-offs in all
// (arrival and the end of the shared work). Each rank's work is cut into pieces of about
// kDirectPieceBytes that other ranks take over once their own are done (LocalTransport::Share).
// Small messages (Config::copy_input_bytes) need only the first hand-off: every rank copies its
// input into the meeting as it arrives, then writes only its own output from the copies, so no
// rank waits for the others to finish reading its buffers.

// Pieces in a rank's share of `bytes`: whole pieces of about kDirectPieceBytes, at least one.
int PiecesPerRank(int64_t bytes) {
  return static_cast<int>(std::clamp<int64_t>(bytes / kDirectPieceBytes, 1, 1 << 16));
}

Status DirectAllReduce(LocalTransport& t, const CollectiveBuffers& b) {
  const Header& h = t.header();
  const int n = t.size();
  const size_t width = ByteWidth(h.dtype);
  if (t.inputs_copied()) {
    // A small message: every rank reduces all of it into its own output, folding the ranks in
    // the same order (so the bits agree), and need not wait for the others.
    std::vector<Operand> srcs(n);
    for (int peer = 0; peer < n; ++peer) srcs[peer] = Operand{t.PeerInput(peer)};
    const Target dst{b.output};
    Reduce(h.dtype, h.op, srcs.data(), n, &dst, 1, h.count, n);
    return Status();
  }
  const int per_rank = PiecesPerRank(h.count * static_cast<int64_t>(width) / n);
  const Partition pieces{h.count, n * per_rank, AlignElements(h.dtype)};
  const bool streaming = StreamingPays(h.count * static_cast<int64_t>(width) * n);
  std::vector<Operand> srcs(n);
  std::vector<Target> dsts(n);
  return t.Share(per_rank, [&](int owner, int part) {
    const int piece = owner * per_rank + part;
    const int64_t begin = pieces.Begin(piece);
    for (int peer = 0; peer < n; ++peer) {
      srcs[peer] = Operand{Offset(t.PeerInput(peer), begin, width)};
      dsts[peer] = Target{Offset(t.PeerOutput(peer), begin, width), false,
                          streaming || t.PeerOutputUncached(peer)};
    }
    Reduce(h.dtype, h.op, srcs.data(), n, dsts.data(), n, pieces.Size(piece), n);
  });
}

Status DirectReduceScatter(LocalTransport& t, const CollectiveBuffers& b) {
  const Header& h = t.header();
  const int n = t.size();
  const size_t width = ByteWidth(h.dtype);
  std::vector<Operand> srcs(n);
  if (t.inputs_copied()) {
    // A small message: every rank reduces its own block from the copies, folding the ranks in
    // the order the pieces below fold them (so the bits agree), and need not wait for the others.
    for (int peer = 0; peer < n; ++peer)
      srcs[peer] = Operand{Offset(t.PeerInput(peer), t.rank() * b.output_count, width)};
    const Target dst{b.output};
    Reduce(h.dtype, h.op, srcs.data(), n, &dst, 1, b.output_count, n);
    return Status();
  }
  // Rank r's pieces cut its output block (block r of every input).
  const int per_rank = PiecesPerRank(b.output_count * static_cast<int64_t>(width));
  const Partition pieces{b.output_count, per_rank, AlignElements(h.dtype)};
  // Streaming stores by the all-reduce's rule (all the ranks' outputs together). Against plain
  // stores, lone reduce-scatters of 16 MiB took 0.88-0.91x the time with them on 2 devices and
  // 0.96-0.99x on 4 (two rounds in turns; on 8 one round gained 6%, the other lost 4%), and
  // 0.95-1.02x inside a loop.
  const bool streaming = StreamingPays(b.output_count * static_cast<int64_t>(width) * n);
  return t.Share(per_rank, [&](int owner, int part) {
    const int64_t begin = pieces.Begin(part);
    for (int peer = 0; peer < n; ++peer)
      srcs[peer] = Operand{Offset(t.PeerInput(peer), owner * b.output_count + begin, width)};
    const Target dst{Offset(t.PeerOutput(owner), begin, width), false,
                     streaming || t.PeerOutputUncached(owner)};
    Reduce(h.dtype, h.op, srcs.data(), n, &dst, 1, pieces.Size(part), n);
  });
}

Status DirectAllGather(LocalTransport& t, const CollectiveBuffers& b) {
  const Header& h = t.header();
  const size_t width = ByteWidth(h.dtype);
  const int64_t bytes = h.count * static_cast<int64_t>(width);
  // Streaming stores skip reading each output line before writing it, a third of the traffic,
  // when each device's output is too large to stay cached (StreamingPays). With 16 MiB outputs on
  // 2, 4 and 8 devices they cut a lone all-gather by 10-39% and one inside a loop by 6-30% (two
  // alternations of each); with 4 MiB outputs they gained nothing, and inside a loop on 8 devices
  // lost 5-20%, the next pass reading what was still cached.
  const int n = t.size();
  if (t.inputs_copied()) {
    // A small message: every rank fills its own output from the copies, its own input first,
    // and need not wait for the others.
    for (int k = 0; bytes && k < n; ++k) {
      const int peer = (t.rank() + k) % n;
      std::memcpy(Offset(b.output, peer * h.count, width), t.PeerInput(peer), bytes);
    }
    return Status();
  }
  const bool streaming = StreamingPays(bytes * n);
  const int per_input = PiecesPerRank(bytes);
  const Partition pieces{h.count, per_input, AlignElements(h.dtype)};
  if (streaming) {
    // Outputs too large to stay cached: rank r's pieces cut its input, and each is read once and
    // written into every rank's output (its own first), so that no input is read from memory
    // more than once. Against the by-output order below, in turns in one process on 2, 4 and 8
    // devices (16 MiB outputs in three processes, 64 MiB in one): lone all-gathers took
    // 0.92-0.95x the time at 16 MiB in 8 of 9 pairs (0.76x in the ninth) and 0.93-0.96x at
    // 64 MiB; inside a loop 1.00-1.03x at 16 MiB in 8 of 9 (0.83x; the loop's input is still
    // cached from the pass that wrote it) and 0.94-0.96x at 64 MiB.
    return t.Share(per_input, [&](int owner, int part) {
      const int64_t begin = pieces.Begin(part);
      const size_t size = static_cast<size_t>(pieces.Size(part)) * width;
      const char* src = Offset(t.PeerInput(owner), begin, width);
      for (int k = 0; size && k < n; ++k) {
        const int to = (owner + k) % n;
        CopyStreamed(Offset(t.PeerOutput(to), owner * h.count + begin, width), src, size);
      }
    });
  }
  // Rank r's pieces fill its output: first from its own input, then its right neighbour's, and
  // so on, so that no two ranks read the same input at once and each first copies what is in
  // its own core's cache. Against every rank copying inputs 0, 1, ... in turn, a loop of 2-device
  // all-gathers of 4 MiB outputs took 0.79-0.81x the time (0.93-0.99x on 4 devices, 0.96-1.01x
  // on 8, 1 to 16 MiB). Read once and written n times, as above, inputs into cached outputs took
  // 1.04-1.15x the time in a loop at 4 MiB: the copies then leave the outputs' lines in the
  // writer's cache, not in their owner's, where the next pass reads them.
  return t.Share(n * per_input, [&](int owner, int mine) {
    const int peer = (owner + mine / per_input) % n;
    const int part = mine % per_input;
    const int64_t begin = pieces.Begin(part);
    const size_t size = static_cast<size_t>(pieces.Size(part)) * width;
    char* dst = Offset(t.PeerOutput(owner), peer * h.count + begin, width);
    const char* src = Offset(t.PeerInput(peer), begin, width);
    if (!size) return;
    if (t.PeerOutputUncached(owner)) CopyStreamed(dst, src, size);
    else std::memcpy(dst, src, size);
  });
}

Status DirectBroadcast(LocalTransport& t, const CollectiveBuffers& b) {
  const Header& h = t.header();
  const size_t width = ByteWidth(h.dtype);
  const void* root = t.PeerInput(static_cast<int>(h.root));
  if (t.inputs_copied()) {
    if (h.count) std::memcpy(b.output, root, h.count * width);
    return Status();
  }
  // Rank r's pieces fill its output from the root's input.
  const int per_rank = PiecesPerRank(h.count * static_cast<int64_t>(width));
  const Partition pieces{h.count, per_rank, AlignElements(h.dtype)};
  return t.Share(per_rank, [&](int owner, int part) {
    const int64_t begin = pieces.Begin(part);
    const size_t size = static_cast<size_t>(pieces.Size(part)) * width;
    if (size) std::memcpy(Offset(t.PeerOutput(owner), begin, width), Offset(root, begin, width),
                          size);
  });
}

// ---- the ring ----------------------------------------------------------------------------------
// Each step is cut into `slices` pieces; slice k of step g waits only for the left neighbour's
// slice k of step g-1, so reduction of one slice overlaps production of the next (pipelining)
// and there is no global barrier anywhere in the ring.

Status RunRing(LocalTransport& t, const std::vector<RingStep>& steps, int64_t slices,
               int64_t mean_divisor) {
  const Header& h = t.header();
  const int n = t.size();
  const int left = (t.rank() + n - 1) % n;
  const int right = (t.rank() + 1) % n;
  const size_t width = ByteWidth(h.dtype);
  const size_t acc_width = AccumulatorWidth(h.dtype);
  auto locate = [&](Buffer buffer, int owner, int64_t offset) -> char* {
    switch (buffer) {
      case Buffer::kInput:
        return const_cast<char*>(Offset(t.PeerInput(owner), offset, width));
      case Buffer::kOutput:
        return Offset(t.PeerOutput(owner), offset, width);
      case Buffer::kScratch:
        return Offset(t.PeerScratch(owner), offset, acc_width);
    }
    return nullptr;
  };
  for (size_t g = 0; g < steps.size(); ++g) {
    const RingStep& step = steps[g];
    const int source_owner = step.from_left ? left : t.rank();
    // Only the left neighbour's buffers are a peer's; this rank's own need no guard.
    const bool from_peer = source_owner != t.rank();
    for (int64_t k = 0; k < slices; ++k) {
      if (step.waits_for_left) {
        Status status = t.WaitForProgress(left, static_cast<uint32_t>((g - 1) * slices + k + 1));
        if (!status.ok()) return status;
      }
      // In 128 bits: a count of 2^33 elements times up to 2^31 slices overflows 64.
      const int64_t lo = static_cast<int64_t>(__int128{step.count} * k / slices);
      const int64_t hi = static_cast<int64_t>(__int128{step.count} * (k + 1) / slices);
      if (hi > lo) {
        if (from_peer && !t.BeginPeerAccess()) return t.PeerGaveUp();
        const bool source_acc = step.source == Buffer::kScratch;
        const bool dst_acc = step.dst == Buffer::kScratch;
        const size_t source_width = source_acc ? acc_width : width;
        const size_t dst_width = dst_acc ? acc_width : width;
        char* source = locate(step.source, source_owner, step.source_offset) + lo * source_width;
        char* dst = locate(step.dst, t.rank(), step.dst_offset) + lo * dst_width;
        if (step.reduce) {
          const Operand srcs[2] = {
              Operand{source, source_acc},
              Operand{locate(Buffer::kInput, t.rank(), step.own_input_offset) + lo * width}};
          const Target target{dst, dst_acc};
          Reduce(h.dtype, h.op, srcs, 2, &target, 1, hi - lo, dst_acc ? 0 : mean_divisor);
        } else {
          std::memcpy(dst, source, (hi - lo) * width);
        }
        if (from_peer) t.EndPeerAccess();
      }
      t.PublishProgress(static_cast<uint32_t>(g * slices + k + 1));
    }
  }
  // The right neighbour is the only reader of this rank's buffers; once it is done we may leave.
  return t.WaitForProgress(right, static_cast<uint32_t>(steps.size() * slices));
}

Status RingCollective(LocalTransport& t, const Config& config, const CollectiveBuffers& b) {
  const Header& h = t.header();
  const int n = t.size();
  std::vector<RingStep> steps;
  int64_t chunk = 0;
  switch (h.kind) {
    case Collective::kAllReduce:
      steps = RingAllReduceSchedule(t.rank(), n, h.count, AlignElements(h.dtype));
      chunk = (h.count + n - 1) / n;
      break;
    case Collective::kReduceScatter:
      steps = RingReduceScatterSchedule(t.rank(), n, b.output_count);
      chunk = b.output_count;
      break;
    case Collective::kAllGather:
      steps = RingAllGatherSchedule(t.rank(), n, h.count);
      chunk = h.count;
      break;
    default:
      return Status::Error(t.Where() + ": no ring algorithm for this collective");
  }
  const int64_t slice_elements =
      std::max<int64_t>(1, config.pipeline_slice_bytes / static_cast<int64_t>(ByteWidth(h.dtype)));
  // Progress counts a rank's slices in 31 bits (the top one marks a give-up): a tiny
  // pipeline_slice_bytes on a huge message gets slices large enough to stay below that.
  const int64_t steps_count = static_cast<int64_t>(std::max<size_t>(1, steps.size()));
  const int64_t most_slices = std::max<int64_t>(1, ((int64_t{1} << 31) - 1) / steps_count);
  const int64_t slices = std::clamp<int64_t>((chunk + slice_elements - 1) / slice_elements, 1,
                                             most_slices);
  return RunRing(t, steps, slices, n);
}

}  // namespace

Algorithm ChooseAlgorithm(const Header& header, int size, const Config& config) {
  const bool has_ring = header.kind == Collective::kAllReduce ||
                        header.kind == Collective::kReduceScatter ||
                        header.kind == Collective::kAllGather;
  if (!has_ring || size == 1) return Algorithm::kDirect;
  if (config.algorithm != Algorithm::kAuto) return config.algorithm;
  const int64_t bytes = header.count * static_cast<int64_t>(ByteWidth(header.dtype));
  return bytes > config.ring_threshold_bytes ? Algorithm::kRing : Algorithm::kDirect;
}

size_t ScratchBytes(const Header& header, int size, Algorithm algorithm) {
  if (algorithm != Algorithm::kRing || !IsReduction(header.kind) || size < 3) return 0;
  return header.count * AccumulatorWidth(header.dtype);
}

Status RunCollective(LocalTransport& t, Algorithm algorithm, const Config& config,
                     const CollectiveBuffers& b) {
  const Header& h = t.header();
  if (h.kind == Collective::kBarrier) return Status();  // arriving was the barrier
  if (algorithm == Algorithm::kRing) return RingCollective(t, config, b);
  switch (h.kind) {
    case Collective::kAllReduce: return DirectAllReduce(t, b);
    case Collective::kReduceScatter: return DirectReduceScatter(t, b);
    case Collective::kAllGather: return DirectAllGather(t, b);
    case Collective::kBroadcast: return DirectBroadcast(t, b);
    case Collective::kBarrier: return Status();
    case Collective::kPermute:
    case Collective::kSendRecv: break;  // point-to-point calls take the mailboxes
  }
  return Status::Error(t.Where() + ": not a collective");
}

}  // namespace jaxring
