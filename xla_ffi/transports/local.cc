#include "transports/local.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace jaxring {

struct PeerSlot {
  Header header;
  const void* input = nullptr;
  std::unique_ptr<unsigned char[]> input_copy;  // Join's copy_input
  bool copied = false;                           // `input` points into this meeting
  void* output = nullptr;
  bool output_uncached = false;
  void* scratch = nullptr;
  Flag progress;
  std::atomic<bool> arrived{false};
  std::atomic<bool> finished{false};
  alignas(64) std::atomic<int64_t> next_piece{0};  // Share(): this rank's next piece to claim
  // Between BeginPeerAccess and EndPeerAccess; apart from `progress`, which the right neighbour
  // polls, and from `next_piece`, which every rank claims from.
  alignas(64) std::atomic<bool> accessing{false};
};

class Meeting {
 public:
  Meeting(int size, const Config& config) : size(size), config(config), peers(new PeerSlot[size]) {}
  const int size;
  const Config config;  // LocalTransport::Entry::config
  std::unique_ptr<PeerSlot[]> peers;
  Flag arrivals;
  Flag pieces_done;  // Share()
  alignas(64) std::atomic<bool> closed{false};  // a rank gave up (LocalTransport::Close)
  // The first rank to give up and its error, told to the peers that find the meeting given up.
  // A rank holds the mutex from before it marks the meeting until it has recorded why, so a peer
  // that sees the mark and then takes the mutex finds the reason.
  std::mutex giving_up;
  int gave_up = -1;
  std::string why;
};

namespace {

// Records `error` as why `rank` gave up on `meeting`, unless a peer gave up first; returns it.
// The caller holds the meeting's giving_up mutex from before it marks the meeting given up, so a
// peer that sees the mark and then takes the mutex finds the reason.
std::string RecordGivingUp(Meeting& meeting, int rank, std::string error) {
  if (meeting.gave_up < 0) {
    meeting.gave_up = rank;
    meeting.why = error;
  }
  return error;
}

bool Arrived(const Meeting& m, int peer) { return m.peers[peer].arrived.load(); }
bool Finished(const Meeting& m, int peer) { return m.peers[peer].finished.load(); }

std::atomic<int> stall_rank{-1};
std::atomic<uint64_t> stall_comm{0};
CountedStall piece_stalls;
std::atomic<int64_t> stalls_taken{0};

// StallNextPieceForTest's stalls, taken by the next pieces or slices of `rank` of `comm` once
// armed.
inline void StallIfArmed(uint64_t comm, int rank) {
  if (stall_rank.load(std::memory_order_acquire) != rank || stall_comm.load() != comm) return;
  if (piece_stalls.TakeIfArmed()) stalls_taken.fetch_add(1);
}

}  // namespace

// The calls of one group of one communicator: the call each rank makes next in each of its
// recent XLA runs, and the meetings that not every rank has reached yet. Each group has its own
// lock, which only its ranks take; once they have all called, a call allocates nothing here but
// its meeting.
class GroupCalls {
 public:
  // Returns the meeting for `rank`'s next call in run `run_id`, and its place in the run. The
  // rank that makes the meeting gives it the configuration in force.
  std::shared_ptr<Meeting> Enter(int size, int64_t run_id, int rank, uint64_t* sequence) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (static_cast<size_t>(rank) >= ranks_.size()) ranks_.resize(rank + 1);
    *sequence = ranks_[rank].Next(run_id);
    for (const Open& open : open_)
      if (open.run_id == run_id && open.sequence == *sequence) return open.meeting;
    open_.push_back({run_id, *sequence, std::make_shared<Meeting>(size, CurrentConfig())});
    return open_.back().meeting;
  }

  size_t OpenForTest() {
    std::lock_guard<std::mutex> lock(mutex_);
    return open_.size();
  }

  // Drops the meetings a rank gave up on before every rank arrived, and restarts the count of
  // calls of their runs: the ranks of a failed run may have made different numbers of calls in
  // it, and should its run id come again (XLA's run ids are launch ids, counted per
  // executable), their calls would otherwise meet none of each other's. Returns how many.
  size_t ForgetGivenUp() {
    std::lock_guard<std::mutex> lock(mutex_);
    const size_t before = open_.size();
    std::vector<int64_t> failed_runs;
    open_.erase(std::remove_if(open_.begin(), open_.end(),
                               [&](const Open& open) {
                                 if ((open.meeting->arrivals.Load() & Flag::kAbandoned) == 0)
                                   return false;
                                 failed_runs.push_back(open.run_id);
                                 return true;
                               }),
                open_.end());
    for (RankRuns& runs : ranks_)
      for (int64_t run_id : failed_runs) runs.Restart(run_id);
    return before - open_.size();
  }

  // Once every rank holds the meeting, it leaves the group.
  void Leave(int64_t run_id, uint64_t sequence) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (Open& open : open_) {
      if (open.run_id != run_id || open.sequence != sequence) continue;
      open = std::move(open_.back());
      open_.pop_back();
      return;
    }
  }

 private:
  // A rank's calls in its last kRuns runs. A device runs one program at a time (jaxring's token
  // hands a program to the devices once the previous one has finished), so a rank is in one or
  // two runs at once (more only where several threads dispatch programs at once); the runs it
  // left long ago are forgotten, the oldest first.
  struct RankRuns {
    static constexpr int kRuns = 64;
    int64_t run_ids[kRuns];
    uint64_t calls[kRuns];
    int used = 0;
    int oldest = 0;

    uint64_t Next(int64_t run_id) {
      for (int i = 0; i < used; ++i)
        if (run_ids[i] == run_id) return calls[i]++;
      int slot = used < kRuns ? used++ : std::exchange(oldest, (oldest + 1) % kRuns);
      run_ids[slot] = run_id;
      calls[slot] = 1;
      return 0;
    }

    void Restart(int64_t run_id) {
      for (int i = 0; i < used; ++i)
        if (run_ids[i] == run_id) calls[i] = 0;
    }
  };
  struct Open {
    int64_t run_id;
    uint64_t sequence;
    std::shared_ptr<Meeting> meeting;
  };

  std::mutex mutex_;
  std::vector<RankRuns> ranks_;
  // Few: the calls in progress, and the ones a rank gave up on, which stay until their last rank
  // arrives (so that every late rank finds them and fails at once, not after a timeout of its own
  // in a fresh meeting), or until LocalTransport::ForgetGivenUp if it never comes.
  std::vector<Open> open_;
};

namespace {

// Where ranks find each other: every group's calls, by (comm, group). Groups live for good, so
// each device thread keeps the last one it used and takes the registry's lock only to change it.
struct GroupRegistry {
  struct KeyHash {
    size_t operator()(const std::pair<uint64_t, int64_t>& key) const {
      return std::hash<uint64_t>()(key.first ^
                                   (static_cast<uint64_t>(key.second) * 0x9e3779b97f4a7c15ULL));
    }
  };
  std::mutex mutex;
  std::unordered_map<std::pair<uint64_t, int64_t>, std::unique_ptr<GroupCalls>, KeyHash> groups;
};

GroupRegistry& Registry() {
  static auto* registry = new GroupRegistry();  // never destroyed: device threads may outlive exit
  return *registry;
}

GroupCalls& Calls(const CommunicatorId& comm) {
  struct Last {
    uint64_t comm;
    int64_t group;
    GroupCalls* calls = nullptr;
  };
  thread_local Last last;
  if (last.calls != nullptr && last.comm == comm.comm && last.group == comm.group)
    return *last.calls;
  GroupRegistry& registry = Registry();
  std::lock_guard<std::mutex> lock(registry.mutex);
  std::unique_ptr<GroupCalls>& calls = registry.groups[{comm.comm, comm.group}];
  if (!calls) calls = std::make_unique<GroupCalls>();
  last = {comm.comm, comm.group, calls.get()};
  return *calls;
}

}  // namespace

const Config& LocalTransport::Entry::config() const { return meeting_->config; }

LocalTransport::Entry::~Entry() {
  if (meeting_)
    GiveUp("jaxring: rank " + std::to_string(rank_) +
           " left a collective before publishing its call (an internal error)");
}

void LocalTransport::Entry::GiveUp(const std::string& why) {
  if (!meeting_) return;
  Meeting& meeting = *meeting_;
  {
    std::lock_guard<std::mutex> lock(meeting.giving_up);
    meeting.arrivals.AbandonBelow(static_cast<uint32_t>(meeting.size));  // this rank is missing
    RecordGivingUp(meeting, rank_, why);
  }
  // Counted as arrived, so that the meeting leaves the group once its last rank has come.
  if ((meeting.arrivals.Add(1) & ~Flag::kAbandoned) == static_cast<uint32_t>(meeting.size))
    calls_->Leave(run_id_, sequence_);
  meeting_.reset();
}

LocalTransport::Entry LocalTransport::Enter(const CommunicatorId& comm, int64_t run_id, int rank) {
  Entry entry;
  entry.run_id_ = run_id;
  entry.rank_ = rank;
  entry.calls_ = &Calls(comm);
  entry.meeting_ = entry.calls_->Enter(comm.size, run_id, rank, &entry.sequence_);
  return entry;
}

std::unique_ptr<LocalTransport> LocalTransport::Join(Entry entry, const CommunicatorId& comm,
                                                     const Header& header, const void* input,
                                                     void* output, void* scratch, bool copy_input,
                                                     const std::function<bool()>& output_uncached) {
  const int rank = entry.rank_;
  const uint64_t sequence = entry.sequence_;
  std::shared_ptr<Meeting> meeting = std::move(entry.meeting_);
  PeerSlot& me = meeting->peers[rank];
  me.header = header;
  const size_t input_bytes = header.count * ByteWidth(header.dtype);
  if (copy_input && input_bytes > 0) {
    // Without memory for the copy (copy_input_bytes set large), peers read the input in place.
    me.input_copy.reset(new (std::nothrow) unsigned char[input_bytes]);
    copy_input = me.input_copy != nullptr;
    if (copy_input) {
      std::memcpy(me.input_copy.get(), input, input_bytes);
      input = me.input_copy.get();
    }
  }
  me.copied = copy_input;
  me.input = input;
  me.output = output;
  me.output_uncached = sequence == 0 && output_uncached();
  me.scratch = scratch;
  me.arrived.store(true, std::memory_order_release);
  if ((meeting->arrivals.Add(1) & ~Flag::kAbandoned) == static_cast<uint32_t>(comm.size))
    entry.calls_->Leave(entry.run_id_, sequence);
  const Config& config = meeting->config;
  return std::unique_ptr<LocalTransport>(new LocalTransport(
      comm, rank, header, std::move(meeting), config.timeout_seconds, config.spin_iterations));
}

LocalTransport::LocalTransport(CommunicatorId comm, int rank, Header header,
                               std::shared_ptr<Meeting> meeting, double timeout_seconds,
                               int64_t spin_iterations)
    : comm_(std::move(comm)),
      rank_(rank),
      header_(header),
      meeting_(std::move(meeting)),
      timeout_seconds_(timeout_seconds),
      spin_iterations_(spin_iterations) {}

LocalTransport::~LocalTransport() = default;

std::string LocalTransport::Where() const {
  return jaxring::Where(header_, comm_.name, rank_, comm_.size);
}

std::string LocalTransport::MissingPeers(const char* what,
                                         bool (*done)(const Meeting&, int)) const {
  std::ostringstream s;
  s << Where() << ": timed out after " << timeout_seconds_ << " s waiting for rank(s) [";
  bool first = true;
  for (int peer = 0; peer < comm_.size; ++peer) {
    if (done(*meeting_, peer)) continue;
    s << (first ? "" : ", ") << peer;
    first = false;
  }
  s << "] to " << what
    << ". A peer that never calls this collective (a rank-dependent branch, or a crashed "
       "device) cannot be waited for; raise jaxring.config timeout_seconds if it is just slow.";
  return s.str();
}

Status LocalTransport::WaitForPeers() {
  const uint32_t size = static_cast<uint32_t>(comm_.size);
  if (!meeting_->arrivals.WaitAtLeast(size, Deadline(timeout_seconds_), spin_iterations_)) {
    std::string missing = GiveUpBelow(meeting_->arrivals, size, "arrive", Arrived);
    if (!missing.empty()) return Status::Error(missing);
  }
  if (meeting_->arrivals.Load() & Flag::kAbandoned)
    return Status::Error(Where() + ": " + WhoGaveUp("on this collective before every rank "
                                                    "arrived, so it cannot run"));
  // Every rank checks every header, so a mismatch is reported on every rank.
  const Header& reference = meeting_->peers[0].header;
  for (int peer = 1; peer < comm_.size; ++peer) {
    const Header& other = meeting_->peers[peer].header;
    if (!(other == reference)) {
      std::ostringstream s;
      s << Where() << ": mismatched collectives: rank 0 called " << Describe(reference)
        << " but rank " << peer << " called " << Describe(other)
        << ". Every rank must make the same collective calls in the same order.";
      return Status::Error(s.str());
    }
  }
  // Every rank reads the same flags, so all take the same way out (had one rank left early while
  // another still wrote a share into its output, the write would land in a freed buffer).
  inputs_copied_ = true;
  for (int peer = 0; peer < comm_.size; ++peer)
    inputs_copied_ = inputs_copied_ && meeting_->peers[peer].copied;
  return Status();
}

bool LocalTransport::PeersArrived(const Deadline& by) const {
  return meeting_->arrivals.WaitAtLeast(static_cast<uint32_t>(comm_.size), by, spin_iterations_);
}

Status LocalTransport::Share(int per_rank, const std::function<void(int, int)>& body) {
  const int n = comm_.size;
  uint32_t done = 0;
  if (Admitted()) {
    const std::atomic<bool>& closed = meeting_->closed;
    for (int k = 0; k < n; ++k) {
      const int owner = (rank_ + k) % n;
      std::atomic<int64_t>& next = meeting_->peers[owner].next_piece;
      while (!closed.load(std::memory_order_relaxed)) {
        const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
        if (i >= per_rank) break;
        StallIfArmed(comm_.comm, rank_);
        body(owner, static_cast<int>(i));
        ++done;
      }
    }
    EndPeerAccess();
  }
  meeting_->peers[rank_].finished.store(true, std::memory_order_release);
  meeting_->pieces_done.Add(done);
  return WaitCount(meeting_->pieces_done, static_cast<uint32_t>(n * per_rank), "finish",
                   Finished);
}

Status LocalTransport::WaitCount(Flag& count, uint32_t target, const char* what,
                                 bool (*done)(const Meeting&, int)) {
  if (!count.WaitAtLeast(target, Deadline(timeout_seconds_), spin_iterations_)) {
    // Named before Close(), which may wait for the very ranks named.
    std::string missing = GiveUpBelow(count, target, what, done);
    if (!missing.empty()) {
      Close();
      return Status::Error(missing);
    }
  }
  if (count.Load() & Flag::kAbandoned) return PeerGaveUp();
  return Status();
}

bool LocalTransport::BeginPeerAccess() {
  if (!Admitted()) return false;
  StallIfArmed(comm_.comm, rank_);
  return true;
}

bool LocalTransport::Admitted() {
  // Dekker's handshake with Close(), both sides sequentially consistent: either this rank sees
  // `closed` and keeps out, or the rank closing sees `accessing` and waits for EndPeerAccess.
  PeerSlot& me = meeting_->peers[rank_];
  me.accessing.store(true, std::memory_order_seq_cst);
  if (!meeting_->closed.load(std::memory_order_seq_cst)) return true;
  me.accessing.store(false, std::memory_order_release);
  return false;
}

void LocalTransport::EndPeerAccess() {
  meeting_->peers[rank_].accessing.store(false, std::memory_order_release);
}

Status LocalTransport::PeerGaveUp() {
  Close();
  return Status::Error(Where() + ": " +
                       WhoGaveUp("on this collective, so this rank's result cannot be trusted"));
}

std::string LocalTransport::GiveUpBelow(Flag& count, uint32_t target, const char* what,
                                        bool (*done)(const Meeting&, int)) {
  std::lock_guard<std::mutex> lock(meeting_->giving_up);
  if (!count.AbandonBelow(target)) return std::string();
  return RecordGivingUp(*meeting_, rank_, MissingPeers(what, done));
}

std::string LocalTransport::WhoGaveUp(const char* what) const {
  std::lock_guard<std::mutex> lock(meeting_->giving_up);
  if (meeting_->gave_up < 0) return "a peer gave up " + std::string(what);  // every rank says why
  return PeerError(meeting_->gave_up, "gave up " + std::string(what), meeting_->why);
}

void LocalTransport::Close() {
  meeting_->closed.store(true, std::memory_order_seq_cst);
  meeting_->peers[rank_].progress.Abandon();
  for (int peer = 0; peer < comm_.size; ++peer) {
    const std::atomic<bool>& accessing = meeting_->peers[peer].accessing;
    for (int i = 0; accessing.load(std::memory_order_seq_cst); ++i) {
      if (i < 64) YieldCore();
      else std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
}

const void* LocalTransport::PeerInput(int peer) const { return meeting_->peers[peer].input; }
void* LocalTransport::PeerOutput(int peer) const { return meeting_->peers[peer].output; }
bool LocalTransport::PeerOutputUncached(int peer) const {
  return meeting_->peers[peer].output_uncached;
}
void* LocalTransport::PeerScratch(int peer) const { return meeting_->peers[peer].scratch; }

void LocalTransport::PublishProgress(uint32_t units) {
  meeting_->peers[rank_].progress.Store(units);
}

Status LocalTransport::WaitForProgress(int peer, uint32_t units) {
  const Flag& progress = meeting_->peers[peer].progress;
  if (progress.WaitAtLeast(units, Deadline(timeout_seconds_), spin_iterations_)) {
    if (!(progress.Load() & Flag::kAbandoned)) return Status();
    return PeerGaveUp();
  }
  std::ostringstream s;
  s << Where() << ": timed out after " << timeout_seconds_ << " s waiting for rank " << peer
    << " to reach ring step unit " << units << " (it reached " << progress.Load() << ")";
  {
    std::lock_guard<std::mutex> lock(meeting_->giving_up);
    RecordGivingUp(*meeting_, rank_, s.str());
  }
  Close();
  return Status::Error(s.str());
}

void StallNextPieceForTest(uint64_t comm, int rank, double seconds, int64_t pieces) {
  stall_rank.store(-1);
  stall_comm.store(comm);
  piece_stalls.Arm(seconds, pieces);
  stall_rank.store(rank, std::memory_order_release);
}

int64_t StallsTakenForTest() { return stalls_taken.load(); }

namespace {
std::atomic<int> scratch_failure_rank{-1};
std::atomic<uint64_t> scratch_failure_comm{0};
}  // namespace

void FailNextScratchForTest(uint64_t comm, int rank) {
  scratch_failure_rank.store(-1);
  scratch_failure_comm.store(comm);
  scratch_failure_rank.store(rank, std::memory_order_release);
}

bool ScratchFailsForTest(uint64_t comm, int rank) {
  int armed = rank;
  return scratch_failure_rank.load(std::memory_order_acquire) == rank &&
         scratch_failure_comm.load() == comm &&
         scratch_failure_rank.compare_exchange_strong(armed, -1);
}

size_t LocalTransport::ForgetGivenUp() {
  GroupRegistry& registry = Registry();
  std::lock_guard<std::mutex> lock(registry.mutex);
  size_t forgotten = 0;
  for (auto& [key, calls] : registry.groups) forgotten += calls->ForgetGivenUp();
  return forgotten;
}

size_t OpenMeetingsForTest(uint64_t comm, int64_t group) {
  return Calls(CommunicatorId{comm, group, 0, ""}).OpenForTest();
}

// ---- scratch pool ------------------------------------------------------------------------------

namespace {
struct ScratchPool {
  static constexpr size_t kMaxPooled = 64;
  std::mutex mutex;
  std::multimap<size_t, void*> free_buffers;  // capacity -> buffer
  size_t pooled_bytes = 0;

  // Takes the largest buffers out until at most `bytes` and kMaxPooled stay (the caller holds
  // the mutex and frees them after releasing it).
  std::vector<void*> TakeBeyond(size_t bytes) {
    std::vector<void*> taken;
    while (!free_buffers.empty() && (pooled_bytes > bytes || free_buffers.size() > kMaxPooled)) {
      auto largest = std::prev(free_buffers.end());
      pooled_bytes -= largest->first;
      taken.push_back(largest->second);
      free_buffers.erase(largest);
    }
    return taken;
  }
};
ScratchPool& Pool() {
  static ScratchPool* pool = new ScratchPool();
  return *pool;
}
void FreeAll(const std::vector<void*>& buffers) {
  for (void* buffer : buffers) std::free(buffer);
}
}  // namespace

ScratchLease ScratchLease::Acquire(size_t bytes) {
  ScratchLease lease;
  if (bytes == 0) return lease;
  {
    ScratchPool& pool = Pool();
    std::lock_guard<std::mutex> lock(pool.mutex);
    // The smallest pooled buffer that fits, unless it would waste more than it serves: a small
    // lease must not take the buffer a large one will want next.
    auto it = pool.free_buffers.lower_bound(bytes);
    if (it != pool.free_buffers.end() && it->first / 2 <= bytes) {
      lease.capacity_ = it->first;
      lease.data_ = it->second;
      pool.pooled_bytes -= it->first;
      pool.free_buffers.erase(it);
      return lease;
    }
  }
  lease.capacity_ = (bytes + 63) / 64 * 64;
  lease.data_ = std::aligned_alloc(64, lease.capacity_);
  return lease;
}

void ScratchLease::TrimPool(size_t bytes) {
  ScratchPool& pool = Pool();
  std::vector<void*> taken;
  {
    std::lock_guard<std::mutex> lock(pool.mutex);
    taken = pool.TakeBeyond(bytes);
  }
  FreeAll(taken);
}

std::pair<size_t, size_t> ScratchLease::PooledForTest() {
  ScratchPool& pool = Pool();
  std::lock_guard<std::mutex> lock(pool.mutex);
  return {pool.free_buffers.size(), pool.pooled_bytes};
}

ScratchLease::ScratchLease(ScratchLease&& other) noexcept
    : data_(other.data_), capacity_(other.capacity_) {
  other.data_ = nullptr;
  other.capacity_ = 0;
}

ScratchLease& ScratchLease::operator=(ScratchLease&& other) noexcept {
  std::swap(data_, other.data_);
  std::swap(capacity_, other.capacity_);
  return *this;
}

ScratchLease::~ScratchLease() {
  if (!data_) return;
  const size_t limit = static_cast<size_t>(CurrentConfig().scratch_pool_bytes);
  ScratchPool& pool = Pool();
  std::vector<void*> taken;
  {
    std::lock_guard<std::mutex> lock(pool.mutex);
    pool.free_buffers.emplace(capacity_, data_);
    pool.pooled_bytes += capacity_;
    taken = pool.TakeBeyond(limit);
  }
  FreeAll(taken);
}

}  // namespace jaxring
