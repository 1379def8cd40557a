// The shared-memory transport: processes on one node (one JAX device each, launched by mpiexec)
// meet in a segment that every rank of a communicator maps at set-up. Each rank stages its data
// in its own slot; peers reduce or copy from the slots; results are copied out. Unlike MPI's
// shared-memory path there is no sender-to-receiver double copy per peer: every byte is staged
// once and read once per reader.
//
// Work proceeds in steps (one chunk of one collective call). Each rank owns one progress counter
// in the segment, advanced through three phases per step: staged, reduced, copied. Buffers
// alternate between two sets by step parity, so a rank only waits for peers to have finished
// the step before last before it reuses a slot.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "common/config.h"
#include "common/status.h"
#include "common/types.h"
#include "common/wait.h"

namespace jaxring {

struct ShmSegment;

enum class Phase : uint32_t { kStaged = 1, kReduced = 2, kCopied = 3 };

class ShmCommunicator {
 public:
  // Maps the segment `path` (created by rank 0 with `create`) for communicator `key`.
  static Status Attach(uint64_t key, const std::string& path, bool create, int rank, int size,
                       int64_t slot_bytes, const std::string& name);
  // Unregisters `key`'s communicator; its segment stays mapped until no call of this process
  // runs on it. `alone`: this rank closes it while its peers may go on calling (its
  // jaxring.mpi.Communicator was collected, or the process exits, without a free() on every
  // rank), so it then leaves the communicator as after an error, and their calls fail at once,
  // quoting why, instead of waiting out their timeout. After a free() every rank's calls are
  // done, and none is left to tell.
  static void Detach(uint64_t key, bool alone);
  static void Unlink(const std::string& path);
  // The communicator registered under `key`, or null (then `key` names mesh axes). The caller's
  // reference keeps the segment mapped for the call even if its communicator is collected.
  static std::shared_ptr<ShmCommunicator> Find(uint64_t key);
  ~ShmCommunicator();

  int rank() const { return rank_; }
  int size() const { return size_; }
  int64_t slot_bytes() const { return slot_bytes_; }
  const std::string& name() const { return name_; }

  // ---- one step ---------------------------------------------------------------------------
  // Starts the next step: waits until every peer has copied out of this parity's buffers.
  Status BeginStep(const Header& header, const Deadline& deadline, int64_t spin);
  void* Slot(int peer) const;  // this step's staging slot of `peer`
  void* Result() const;        // this step's shared result area (slot_bytes)
  // Copies `bytes` into this rank's shared memory (its slot or the result area) the way that is
  // faster now. Every store into shared memory goes through it (the all-reduce reduces into the
  // rank's own output and copies that into the result area, RunStaged). Plain stores must first
  // take each cache line from the core that last read it. Where that core shares this one's
  // last-level cache they win: the reader then finds the data in that cache. Where the two cores
  // sit on different dies of the host, taking a line costs a cross-die round trip (350 ns
  // against 75 ns; this VM's vCPUs move between such placements every few minutes). In some such
  // placements plain stores ran at 2.2 GB/s against 27 GB/s for non-temporal ones: a 1 MiB
  // all-reduce at 2 ranks took 540 us with plain stores and 120 us streamed, but 90 us plain
  // against 120-140 us streamed on one die. So every rank times its plain copies and streams
  // once kSlowInARow in a row ran below kSlowPlainBytesPerSecond, then tries a plain copy again
  // every kProbeEvery copies to see whether the placement has changed back. (In others a plain
  // copy stayed fast, and only stores mixed with reads, a block at a time, were slow.)
  // `mode` (Config::shm_stores) may force one kind.
  void CopyIn(void* dst, const void* src, size_t bytes, ShmStores mode);
  void PostHeader(const Header& header);  // before Publish(kStaged) on a call's first step
  Status CheckHeaders(const Header& mine) const;  // after WaitAll(kStaged) on the first step
  // After WaitAll(kStaged) (and CheckHeaders): an error if a peer has left the communicator
  // before it finished this step. A peer that staged this step and then gave up waiting for this
  // rank still counts as staged (so that every rank reaches the header check); its data is
  // there, but the call failed on that peer, so a rank that comes later fails too, as
  // in-process (LocalTransport). A peer that finished the step and left afterwards (it closed
  // the communicator, or failed in a later call) does not fail it. A peer that gives up just as
  // the last rank stages can still leave after this check, and a rank whose step then waits for
  // nobody else (broadcast, all-gather, barrier) completes.
  Status CheckNoPeerLeft(const Header& header);
  void Publish(Phase phase);
  Status WaitAll(Phase phase, const Header& header, const Deadline& deadline, int64_t spin);
  Status WaitFor(int peer, Phase phase, const Header& header, const Deadline& deadline,
                 int64_t spin);
  // Marks this rank as gone after an error, so that peers fail at once instead of timing out,
  // and leaves them `why` (its error) to quote.
  void Abandon(const std::string& why);
  std::string Where(const Header& header) const;

 private:
  ShmCommunicator(ShmSegment* segment, size_t mapped_bytes, int rank, int size,
                  int64_t slot_bytes, std::string name);
  uint32_t Target(uint64_t step, Phase phase) const;
  bool StreamStores(ShmStores mode) const {
    return mode == ShmStores::kStreaming || (mode == ShmStores::kAuto && streaming_);
  }
  Status WaitFor(int peer, Phase phase, const Header& header, const Deadline& deadline,
                 int64_t spin, uint64_t step);
  // Leaves after `peer` did, passing on its error, and returns the error naming it.
  Status PeerLeft(const Header& header, int peer);

  ShmSegment* segment_;
  size_t mapped_bytes_;
  int rank_;
  int size_;
  int64_t slot_bytes_;
  std::string name_;
  uint64_t step_ = 0;  // steps this rank has begun (the same on every rank)
  bool broken_ = false;
  bool closed_alone_ = false;  // Detach(alone): leave once the last reference goes
  bool streaming_ = false;          // CopyIn streams
  int64_t streamed_since_probe_ = 0;
  int64_t slow_in_a_row_ = 0;  // timed plain copies that ran slow, in a row
};

}  // namespace jaxring
