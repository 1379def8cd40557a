// The local transport: the devices of one process meet in shared memory. Each collective call is
// one Meeting, which the ranks of a communicator group find by (XLA run id, call sequence).
// Peers publish a header and their buffer pointers; algorithms then read and write peers' buffers
// directly (no staging copy) and hand off work through per-rank progress flags.
//
// The transport knows nothing about which collective it serves: it moves no bytes itself.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/config.h"
#include "common/status.h"
#include "common/types.h"
#include "common/wait.h"

namespace jaxring {

// Identifies a set of devices that talk to each other: a hash of the mesh axes reduced over
// (`comm`), and which group of those axes this is (`group`, the index along all other axes).
struct CommunicatorId {
  uint64_t comm = 0;
  int64_t group = 0;
  int size = 1;
  std::string name;  // for error messages, e.g. "axis 'data'"
};

class Meeting;
class GroupCalls;

class LocalTransport {
 public:
  // The meeting of `rank`'s next collective in `comm` during XLA run `run_id`, before the rank
  // publishes anything there (Join). Calls of one rank are matched with its peers' in program
  // order; the header check then proves they are the same call.
  class Entry {
   public:
    Entry() = default;
    Entry(Entry&& other) noexcept = default;  // leaves `other` without a meeting
    Entry& operator=(Entry&&) = delete;
    // An entry dropped without Join or GiveUp gives up, so that its peers fail at once.
    ~Entry();
    // The configuration in force when the meeting's first rank entered it, the same for every
    // rank: a call's devices choose its algorithm, slices and copies from this, so that
    // jaxring.config changing while a program runs (an update from another thread) cannot split
    // one call between two algorithms, which waited for each other until the timeout.
    const Config& config() const;
    // For a rank that entered but cannot join (it found no memory for its scratch): marks the
    // meeting given up, with `why` as this rank's error, and counts this rank as arrived, so that
    // its peers fail at once, naming it and quoting `why`, instead of waiting out their timeout
    // for a call it will never publish. The entry is spent afterwards.
    void GiveUp(const std::string& why);

   private:
    friend class LocalTransport;
    int64_t run_id_ = 0;
    int rank_ = 0;
    uint64_t sequence_ = 0;
    GroupCalls* calls_ = nullptr;
    std::shared_ptr<Meeting> meeting_;
  };
  static Entry Enter(const CommunicatorId& comm, int64_t run_id, int rank);

  // Publishes this rank's call in the meeting it entered. With `copy_input`, the rank first
  // copies its input (header.count elements) into the meeting, which lives until the last rank
  // lets go of it: peers then read the copy, never this rank's buffer, and once every rank did
  // so nobody has to wait for the others to finish reading (inputs_copied()). For the first call
  // of an XLA run on this communicator only, `output_uncached` is asked whether this rank's
  // output is out of the cache, and its answer is published with the pointers
  // (PeerOutputUncached); later calls of the run answer false.
  static std::unique_ptr<LocalTransport> Join(Entry entry, const CommunicatorId& comm,
                                              const Header& header, const void* input,
                                              void* output, void* scratch, bool copy_input,
                                              const std::function<bool()>& output_uncached);
  ~LocalTransport();

  int rank() const { return rank_; }
  int size() const { return comm_.size; }
  const Header& header() const { return header_; }

  // Waits until every peer has published, then checks that all headers agree.
  Status WaitForPeers();
  // The same wait, given up (false) when `by` passes first; true also when a peer gave up, which
  // WaitForPeers then reports at once.
  bool PeersArrived(const Deadline& by) const;
  // Work sharing, for the direct algorithms: the call's work is cut into `per_rank` pieces for
  // each rank, the same on every rank. Each rank runs body(owner, part) on its own pieces (owner =
  // its rank, part = 0, 1, ...), then on the pieces of the ranks after it that nobody has begun
  // yet, and returns once every piece is done: no rank touches this rank's buffers after that.
  // With more devices than cores, a device thread that the scheduler leaves waiting for a core no
  // longer holds back the call with a share that only it can do; whoever runs does the work.
  // Which rank runs a piece never changes its result, so results stay bit-identical.
  // Algorithms whose ranks only read the meeting's copies (inputs_copied()) and write their own
  // output need neither this nor any wait after WaitForPeers.
  Status Share(int per_rank, const std::function<void(int owner, int part)>& body);

  // Brackets a stretch of work that touches peers' buffers and never waits (a ring slice; Share
  // brackets its pieces itself). Begin returns false, and the stretch must not start, once a
  // rank has given up on the call; every rank that gives up (any error after WaitForPeers) first
  // waits until no peer is inside such a stretch, so that nothing reads or writes its buffers
  // after it returns and XLA frees them.
  bool BeginPeerAccess();
  void EndPeerAccess();

  // Whether every rank joined with copy_input (valid after WaitForPeers): then PeerInput()
  // returns copies owned by the meeting.
  bool inputs_copied() const { return inputs_copied_; }

  // Peers' published buffers (valid after WaitForPeers).
  const void* PeerInput(int peer) const;
  void* PeerOutput(int peer) const;
  void* PeerScratch(int peer) const;
  // Whether `peer` found its output out of the cache when it joined (Join's output_uncached).
  bool PeerOutputUncached(int peer) const;

  // Pairwise hand-off: this rank has completed `units` units of work (monotone).
  void PublishProgress(uint32_t units);
  // Waits until `peer` has published at least `units`. An error (a timeout, or a peer that gave
  // up) closes the meeting as giving up does (BeginPeerAccess).
  Status WaitForProgress(int peer, uint32_t units);
  // Leaves a call that a peer gave up on (say, BeginPeerAccess refused a stretch): closes the
  // meeting as giving up does, since peers may still be inside stretches on this rank's
  // buffers, and returns the error.
  Status PeerGaveUp();

  // Error text prefix naming the call, the communicator and this rank.
  std::string Where() const;

  // Drops, in every group, the meetings that a rank gave up on before every rank arrived, which
  // otherwise stay for the late ranks to find (and fail at once): for when no device is inside a
  // jaxring call, so that no rank of them is still to come. Returns how many it dropped.
  static size_t ForgetGivenUp();

 private:
  LocalTransport(CommunicatorId comm, int rank, Header header, std::shared_ptr<Meeting> meeting,
                 double timeout_seconds, int64_t spin_iterations);
  std::string MissingPeers(const char* what, bool (*done)(const Meeting&, int)) const;
  // Waits until `count` reaches `target`; on timeout abandons it and names the ranks for which
  // `done` does not hold.
  Status WaitCount(Flag& count, uint32_t target, const char* what,
                   bool (*done)(const Meeting&, int));
  // Giving up: refuses every later BeginPeerAccess, marks this rank's progress abandoned (so that
  // its neighbours fail at once), then waits, with no limit, until no peer is inside a stretch
  // between BeginPeerAccess and EndPeerAccess. Such a stretch never waits, so only a thread the
  // scheduler stalls in it (a test does, StallNextPieceForTest) keeps this rank here.
  void Close();
  // After a wait for `count` to reach `target` timed out: marks `count` abandoned unless it got
  // there meanwhile (then returns ""), and returns the error naming the ranks for which `done`
  // does not hold, recorded as why this rank gave up.
  std::string GiveUpBelow(Flag& count, uint32_t target, const char* what,
                          bool (*done)(const Meeting&, int));
  // "rank R gave up <what>. The error on rank R: ...", for the peers of the first rank to give up.
  std::string WhoGaveUp(const char* what) const;
  // BeginPeerAccess without the test's stall (Share stalls in a piece, not before its first).
  bool Admitted();

  CommunicatorId comm_;
  int rank_;
  Header header_;
  std::shared_ptr<Meeting> meeting_;
  bool inputs_copied_ = false;
  // Each wait gives up after this long without what it waits for: a call that keeps making
  // progress may take longer.
  double timeout_seconds_;
  int64_t spin_iterations_;
};

// For tests: the next `pieces` pieces of shared work (Share) or ring slices that `rank` of
// in-process communicator `comm` begins first sleep `seconds` each, inside their BeginPeerAccess
// stretch, as a device thread does that the scheduler leaves without a core; rank -1 disarms it.
// StallsTakenForTest counts the stalls slept so far.
void StallNextPieceForTest(uint64_t comm, int rank, double seconds, int64_t pieces = 1);
int64_t StallsTakenForTest();
// For tests: the next call of `rank` of in-process communicator `comm` that needs scratch finds
// none, as when its allocation fails; rank -1 disarms it. ScratchFailsForTest takes the failure.
void FailNextScratchForTest(uint64_t comm, int rank);
bool ScratchFailsForTest(uint64_t comm, int rank);
// For tests: the meetings of group `group` of in-process communicator `comm` that not every rank
// has reached yet (those given up stay until their last rank comes, or ForgetGivenUp).
size_t OpenMeetingsForTest(uint64_t comm, int64_t group);

// Reusable scratch memory (the ring's float32 partial sums, copies of eager messages), so that a
// call does not allocate and fault in fresh pages every time. A lease comes from the pool when a
// pooled buffer fits it without being more than twice its size; a released lease goes back to
// the pool, which keeps at most Config::scratch_pool_bytes (and 64 buffers), freeing the largest
// beyond that.
class ScratchLease {
 public:
  // data() is null where `bytes` > 0 could not be allocated.
  static ScratchLease Acquire(size_t bytes);
  // Frees pooled buffers, the largest first, until at most `bytes` stay pooled (a lowered
  // scratch_pool_bytes takes effect at once, not at the next release).
  static void TrimPool(size_t bytes);
  // The buffers and bytes pooled now.
  static std::pair<size_t, size_t> PooledForTest();
  ScratchLease() = default;
  ScratchLease(ScratchLease&& other) noexcept;
  ScratchLease& operator=(ScratchLease&& other) noexcept;
  ~ScratchLease();
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace jaxring
