// The one place for jaxring's tunables (NCCL keeps its tuning numbers apart from the algorithms;
// so do we). Python's jaxring.config writes these through the extension module; environment
// variables are read there, not here.
#pragma once

#include <cstdint>

namespace jaxring {

// A hash of every native source this library was built from (build_id.cmake). Libraries that
// share C structs (common/host_call.h, gpu/direct.h), and ranks that send each other headers,
// must carry the same one.
const char* BuildId();

enum class Algorithm : uint8_t { kAuto = 0, kDirect = 1, kRing = 2 };
const char* AlgorithmName(Algorithm a);

// How a rank writes into the shared-memory transport's segment (ShmCommunicator::CopyIn).
enum class ShmStores : uint8_t { kAuto = 0, kPlain = 1, kStreaming = 2 };
const char* ShmStoresName(ShmStores s);

// The instruction set of the CPU reduction kernels (UseCpuKernels in kernels/reduce_cpu.h);
// kAuto: the widest this CPU supports, except where memory-bound reductions stream.
enum class CpuKernels : uint8_t { kAuto = 0, kBaseline = 1, kAvx2 = 2, kAvx512 = 3 };
const char* CpuKernelsName(CpuKernels k);

struct Config {
  // Every wait gives up after this long and names the peers that never arrived.
  double timeout_seconds = 300.0;
  // kAuto picks the direct (one-shot) path for messages up to this many bytes per rank and the
  // pipelined ring above it. The default comes from benchmarks/allreduce.py on CPU devices.
  int64_t ring_threshold_bytes = int64_t{1} << 62;
  // Forces one algorithm for every call when not kAuto (tests and benchmarks use this).
  Algorithm algorithm = Algorithm::kAuto;
  // Ring pipelining: each ring chunk moves in slices of about this many bytes, so a neighbour
  // can reduce slice k while slice k+1 is being produced.
  int64_t pipeline_slice_bytes = 256 * 1024;
  // Busy-poll iterations before a waiter sleeps in the kernel. With more devices than cores,
  // spinning steals the core a late peer needs, so keep this small.
  int64_t spin_iterations = 256;
  // Point-to-point: messages up to this many bytes are copied into the receiver's mailbox and
  // the sender moves on (eager, NCCL LL-style); larger ppermute messages are copied once, straight
  // from the sender's buffer, while the sender waits (rendezvous). Measured in benchmarks/p2p.py.
  int64_t p2p_eager_bytes = 64 * 1024;
  // The MPI transport's kAuto switch: all_reduce by recursive doubling up to this many bytes per
  // rank, the pipelined ring above it (broadcast: binomial tree, then a chain). Measured in
  // benchmarks/allreduce_mpi.py.
  int64_t mpi_ring_threshold_bytes = 64 * 1024;
  // The MPI transport's header exchange: communicators up to this size exchange headers
  // directly (one round, n-1 messages per rank; a timeout names exactly the absent ranks);
  // larger ones by Bruck's all-gather (log2 n rounds).
  int64_t mpi_direct_header_ranks = 64;
  // CPU outputs of at least this many bytes ask the kernel for transparent huge pages before
  // their first write (madvise on the 2 MiB-aligned interior); 0 turns it off. Large outputs are
  // fresh mappings whose 4 KiB page faults cost more than the collective itself.
  int64_t huge_page_bytes = int64_t{8} << 20;
  // Writes into shared memory (process communicators on one node): kAuto times plain copies and
  // streams (non-temporal stores) while they run slow, which is when the reading core sits on
  // another die; kPlain and kStreaming force one kind. See ShmCommunicator::CopyIn.
  ShmStores shm_stores = ShmStores::kAuto;
  // Devices of one process: direct collectives up to this many input bytes per device copy their
  // input into the rendezvous as they arrive; each device then writes only its own output from
  // the copies and leaves without waiting for its peers (LocalTransport::Join's copy_input).
  int64_t copy_input_bytes = 16 * 1024;
  // Devices of one process (CPU): how long a call waits for its peers on XLA's thread (spinning,
  // yielding, then asleep, as every wait does) before it hands the wait, and the rest of the
  // call, to a jaxring thread (cpu/handoff.h). Peers that run are there well within the default
  // (a ring pass hop takes 5 us on 2 devices here and 10-15 us on 8), so calls in step never hand
  // off; a hand-off costs a thread wake-up or two, and a call whose peer is queued behind it on
  // XLA's threads loses this much once. 0 hands off every call whose peers are not all there
  // after the spin and yield phases every wait begins with (SpinThenYield).
  double hand_off_after_seconds = 1e-3;
  // The CPU reduction kernels' instruction set. Python's jaxring.config passes it on to the
  // kernels (UseCpuKernels) in every extension module that carries a copy of them.
  CpuKernels cpu_kernels = CpuKernels::kAuto;
  // Scratch memory that calls reuse instead of allocating and faulting in fresh pages every time
  // (the ring's float32 partial sums, copies of eager messages too large for a mailbox slot):
  // at most this many bytes stay pooled between calls (ScratchLease); 0 pools none.
  int64_t scratch_pool_bytes = int64_t{1} << 30;
};

// A snapshot of the current configuration; cheap enough to take once per collective.
Config CurrentConfig();
void SetConfig(const Config& config);

}  // namespace jaxring
