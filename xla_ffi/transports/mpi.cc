#include "transports/mpi.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <iterator>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "kernels/reduce_cpu.h"
#include "ring/schedule.h"

namespace jaxring {
namespace {

constexpr int kHeaderTag = 0x6a72;  // the header all-gather that opens every collective
constexpr int kDataTag = 0x6a73;    // collective payloads
constexpr int kP2PTag = 0x6a74;     // ppermute's messages (matched in order per pair)
constexpr int kPayloadTag = 0x6a75; // ... the payloads sent straight from the caller's buffer
constexpr int kReadyTag = 0x6a76;   // ... and their receivers' word that they may come
constexpr int kGaveUpTag = 0x6a77;  // a rank's notice that it gave up on the communicator
constexpr int kSendRecvTag = 0x6a78;  // send/recv's messages, a channel apart from ppermute's

// The tag of a point-to-point message and of the pieces that follow it: send/recv and ppermute
// each have their own channel (as their in-process mailboxes do, transports/mailbox.h). Only
// ppermute lends its buffer (kPayloadInPlace), so the in-place tags serve it alone.
int PointToPointTag(const Header& h) {
  return h.kind == Collective::kSendRecv ? kSendRecvTag : kP2PTag;
}

// What a collective's header exchange waits for (TimedOut).
constexpr char kArriveAtCollective[] = "arrive at this collective";

// Waits look for a gave-up notice once every this many polls (a wait that ends sooner never
// looks).
constexpr int64_t kPollsPerNoticeProbe = 64;
// A message of at least this many bytes may be read out of its sender's buffer only as its
// receiver takes it (MPI's rendezvous), so after its sender has given up and XLA has freed that
// buffer. With MPICH 5 from PyPI on one node (whose shared-memory path then reads the sender's
// memory with process_vm_readv), a send of 8192 bytes waited for its receiver and one of 8100
// completed without it. Other MPIs get the lowest eager limit known to us (Open MPI's shared
// memory, 4 KiB by default), unmeasured: a lower value costs a look for notices on receipt of
// messages between it and the true limit, a higher one could read a freed buffer.
#if defined(MPICH_VERSION)
constexpr size_t kRendezvousBytes = 8192;
#else
constexpr size_t kRendezvousBytes = 4096;
#endif
// MPI_Improbe looks at what MPI has already taken in before it makes progress, one message at a
// time, so a notice that came while this rank was out of MPI shows only on a later look: in
// tests/mpi, the second with 2 ranks, the third with 3 and 4 (one message more came first). So
// a rank looks at least this many times, and once per rank of its communicator where that is
// more (each peer may have a message ahead of the notice: its own notice, say).
constexpr int kLooksForNotice = 3;
// How long a wait whose requests MPI failed looks for a notice that explains why.
constexpr double kNoticeAfterFailureSeconds = 0.1;
// How long DropRequests lets requests complete after a failure, and then how long more a
// receive under way (matched, so not cancelled) may take: 1 GiB at this VM's 10 GB/s from
// process to process took 0.1 s. Longer would buy little: a receive that has not finished by
// then has a sender that stalled mid-message, and each failure waits it out (after its notices
// went out: MpiTransport::Fail, mpi_messages.cc's GiveUpThenDrop).
constexpr double kDropGraceSeconds = 0.1;
constexpr double kReceiveUnderWaySeconds = 1;

// The test hooks' stalls: StallNextDataForTest's and StallNextReceiveForTest's (one each, once
// armed), StallNextRingSlicesForTest's.
CountedStall data_stall;
CountedStall receive_stall;
CountedStall ring_slice_stalls;

// MPI counts are ints: larger messages travel as several pieces of at most this many bytes
// (SetMaxPieceForTest lowers it, so that tests reach the paths of messages over 1 GiB).
constexpr size_t kMaxPiece = size_t{1} << 30;
std::atomic<size_t> max_piece{kMaxPiece};
size_t MaxPiece() { return max_piece.load(std::memory_order_relaxed); }
// Ring slices in flight to the right neighbour before a rank waits for its oldest to arrive.
constexpr size_t kRingSendsInFlight = 8;
// The most slices a ring step or the broadcast chain cuts its data into (SliceBytes).
constexpr int64_t kMaxSlices = 1024;
// Eager point-to-point sends in flight before a sender waits for its oldest to be received.
constexpr size_t kMaxEagerInFlight = 64;
// A copied point-to-point payload up to this many bytes (with its header) travels in its
// header's message; a larger one follows as a message of its own, which the receiver can wait for
// with a timeout (MPI_Mrecv of the whole message blocks). The receiver takes either into a buffer
// of its own (kept up to kKeptReceiveBytes: a 500 MB `send` once left one that large behind) and
// copies it out.
constexpr size_t kMaxInlineBytes = 64 * 1024;
// The receive buffer of copies stays allocated between calls up to this size; a larger one is
// freed after its message.
constexpr size_t kKeptReceiveBytes = 64 << 20;

// How a point-to-point message's payload travels (WireHeader::payload).
enum Payload : uint32_t {
  kPayloadInline = 0,    // in the header's message
  kPayloadInPlace = 1,   // from the sender's buffer once the receiver is ready (kReadyTag, then
                         // kPayloadTag)
  kPayloadSeparate = 2,  // a copy over kMaxInlineBytes: its pieces follow the header, under its
                         // tag (PointToPointTag)
};

// Prefix of every point-to-point message.
struct WireHeader {
  Header header;
  uint32_t payload;  // Payload
  uint32_t reserved;
};

// Polls `done` until it holds or `deadline` passes: spin, then yield the core (a peer rank may
// be waiting for it when ranks outnumber cores), then nap. MPI offers nothing to sleep on, so
// the naps stay short; they only begin after the yield phase, when a wait is already long.
template <typename Done>
bool Poll(Done done, const Deadline& deadline, int64_t spin) {
  if (SpinThenYield(done, spin, std::chrono::microseconds(200))) return true;
  auto nap = std::chrono::microseconds(2);
  while (!done()) {
    if (deadline.Expired()) return done();
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::microseconds(50));
  }
  return true;
}

// How a rank of `size` moves collective `h`'s data between processes under `config`.
enum class Method : int64_t {
  kNone = 0,
  kRecursiveDoubling,
  kRing,
  kBroadcastTree,
  kBroadcastChain,
};

Method MethodOf(const Header& h, int size, const Config& config) {
  if (size == 1 || h.kind == Collective::kBarrier) return Method::kNone;
  const int64_t bytes = h.count * static_cast<int64_t>(ByteWidth(h.dtype));
  if (h.kind == Collective::kBroadcast)
    return bytes <= config.mpi_ring_threshold_bytes ? Method::kBroadcastTree
                                                    : Method::kBroadcastChain;
  if (h.kind == Collective::kAllReduce &&
      (config.algorithm == Algorithm::kDirect ||
       (config.algorithm == Algorithm::kAuto && bytes <= config.mpi_ring_threshold_bytes)))
    return Method::kRecursiveDoubling;
  return Method::kRing;
}

// Header::plan: a digest (FNV-1a) of the method and, where it slices the data, the slice size.
// Ranks whose configurations differ there would pair messages of different sizes.
uint32_t Plan(Method method, const Config& config) {
  const bool sliced = method == Method::kRing || method == Method::kBroadcastChain;
  const int64_t fields[] = {static_cast<int64_t>(method),
                            sliced ? config.pipeline_slice_bytes : 0};
  return static_cast<uint32_t>(Fnv1a(fields, std::size(fields)));
}

std::string ErrorText(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(text, length);
}

std::string Ranks(const std::set<int>& ranks) {
  std::ostringstream s;
  s << "[";
  bool first = true;
  for (int r : ranks) {
    s << (first ? "" : ", ") << r;
    first = false;
  }
  s << "]";
  return s.str();
}

const char* At(const void* base, int64_t elements, size_t width) {
  return static_cast<const char*>(base) + elements * static_cast<int64_t>(width);
}
char* At(void* base, int64_t elements, size_t width) {
  return static_cast<char*>(base) + elements * static_cast<int64_t>(width);
}

}  // namespace

int64_t SliceBytes(int64_t bytes, int64_t pipeline_slice_bytes) {
  const int64_t fewest = (bytes + kMaxSlices - 1) / kMaxSlices;
  return std::clamp<int64_t>(std::max(pipeline_slice_bytes, fewest), 1,
                             static_cast<int64_t>(MaxPiece()));
}

// ---- set-up ----------------------------------------------------------------------------------

MpiTransport::MpiTransport(MPI_Comm comm, std::string name, bool direct_headers)
    : comm_(comm), name_(std::move(name)), direct_headers_(direct_headers) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  in_place_.resize(size_);
}

Status MpiTransport::Create(MPI_Comm parent, std::string name, bool direct_headers,
                            std::unique_ptr<MpiTransport>* out) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized)
    return Status::Error("jaxring.mpi: the MPI library jaxring's MPI transport is linked with "
                         "is not initialised in this process; mpi4py is using a different MPI "
                         "library (rebuild jaxring against the MPI mpi4py uses)");
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  if (provided < MPI_THREAD_MULTIPLE)
    return Status::Error("jaxring.mpi: MPI was initialised without MPI_THREAD_MULTIPLE; jaxring "
                         "calls MPI from XLA's threads (leave mpi4py.rc.thread_level at its "
                         "default, 'multiple')");
  MPI_Comm dup;
  if (MPI_Comm_dup(parent, &dup) != MPI_SUCCESS)
    return Status::Error("jaxring.mpi: MPI_Comm_dup failed for " + name);
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  out->reset(new MpiTransport(dup, std::move(name), direct_headers));
  return Status();
}

MpiTransport::~MpiTransport() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  // Eager sends are the receivers' data: give them a bounded time to be picked up. One still
  // under way after that (a large one MPI sends only once its receiver comes, or one queued
  // behind a full FIFO) is freed as a request but keeps running, and reads its bytes whenever
  // the receiver comes: those bytes stay allocated for the life of the process.
  static std::mutex stranded_mutex;
  static auto* stranded = new std::vector<std::vector<char>>();  // never freed, on purpose
  const Deadline deadline(std::min(config_.timeout_seconds, 10.0));
  for (Eager& message : eager_) {
    Requests& r = message.requests;
    auto done = [&] {
      int flag = 0;
      MPI_Testall(static_cast<int>(r.requests.size()), r.requests.data(), &flag,
                  MPI_STATUSES_IGNORE);
      return flag != 0;
    };
    if (Poll(done, deadline, 0)) continue;
    for (MPI_Request& request : r.requests)
      if (request != MPI_REQUEST_NULL) MPI_Request_free(&request);
    std::lock_guard<std::mutex> lock(stranded_mutex);
    stranded->push_back(std::move(message.bytes));
  }
  eager_.clear();
  // After a failure the scratch stays allocated too: a receive left running (DropRequests) may
  // still write into it, and a send from it (recursive doubling sends from scratch, and sends are
  // never cancelled) may still be read by a peer that comes late, which would otherwise get
  // freed memory as its data.
  if (receives_left_running_ || !broken_.empty()) {
    std::lock_guard<std::mutex> lock(stranded_mutex);
    for (std::vector<char>& scratch : scratch_) stranded->push_back(std::move(scratch));
    stranded->push_back(std::move(message_));  // a separate copy's receive buffer
  }
  // A communicator on which a rank failed (this one, or a peer whose notice is here) is left
  // allocated. Messages its ranks had under way when they gave up (sends are freed, never
  // cancelled, and notices go out as a rank leaves) may still arrive, and MPICH hands a freed
  // communicator's context id to the next one of the same ranks, whose receives would match
  // them: a notice sent as a hierarchical communicator's levels failed together once arrived on
  // the next split of the same ranks, and failed its first call with the old communicator's
  // error. So is one with any message still unreceived (a send nobody received): the next
  // communicator would receive it as its own, wrong data if its shape matched.
  Status unread;
  if (!broken_.empty() || PeerGaveUp(Header{}, MPI_ANY_SOURCE, &unread)) return;
  for (int look = 0; look < LooksForNotice(); ++look) {  // MPICH may need more than one probe
    int pending = 0;
    if (MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_, &pending, MPI_STATUS_IGNORE) !=
            MPI_SUCCESS || pending)
      return;
  }
  MPI_Comm_free(&comm_);
}

std::string MpiTransport::Where(const Header& header) const {
  return jaxring::Where(header, name_, rank_, size_);
}

char* MpiTransport::Scratch(int which, size_t bytes) {
  std::vector<char>& buffer = scratch_[which];
  if (buffer.size() < bytes) buffer.resize(bytes);
  return buffer.data();
}

// ---- messages and waiting --------------------------------------------------------------------

Status MpiTransport::Call(const Header& h, int code, const char* what) {
  if (code == MPI_SUCCESS) return Status();
  return Status::Error(Where(h) + ": MPI failed to " + what + ": " + ErrorText(code));
}

// Starts `bytes` as pieces of at most MaxPiece() bytes (a zero-byte message is still one
// message): start(offset, piece bytes, request) posts one and returns its MPI code.
template <typename Start>
Status MpiTransport::Pieces(const Header& h, size_t bytes, int peer, bool sending, Requests* r,
                            const char* what, Start start) {
  size_t done = 0;
  do {
    const size_t piece = std::min(bytes - done, MaxPiece());
    r->requests.push_back(MPI_REQUEST_NULL);
    r->peers.push_back(peer);
    r->sending.push_back(sending);
    Status status = Call(h, start(done, static_cast<int>(piece), &r->requests.back()), what);
    if (!status.ok()) return status;
    done += piece;
  } while (done < bytes);
  return Status();
}

Status MpiTransport::Isend(const Header& h, const void* data, size_t bytes, int peer, int tag,
                           Requests* r) {
  return Pieces(h, bytes, peer, true, r, "send", [&](size_t offset, int n, MPI_Request* request) {
    return MPI_Isend(static_cast<const char*>(data) + offset, n, MPI_BYTE, peer, tag, comm_,
                     request);
  });
}

Status MpiTransport::Irecv(const Header& h, void* data, size_t bytes, int peer, int tag,
                           Requests* r) {
  return Pieces(h, bytes, peer, false, r, "receive",
                [&](size_t offset, int n, MPI_Request* request) {
                  return MPI_Irecv(static_cast<char*>(data) + offset, n, MPI_BYTE, peer, tag,
                                   comm_, request);
                });
}

Status MpiTransport::Wait(const Header& h, Requests* r, int index, const Deadline& deadline,
                          const char* what, int notices_from) {
  const int first = index < 0 ? 0 : index;
  const int count = index < 0 ? static_cast<int>(r->requests.size()) : 1;
  if (count == 0) return Status();
  MPI_Request* requests = r->requests.data() + first;
  int code = MPI_SUCCESS;
  Status sending;
  int64_t polls = 0;
  // MPI leaves MPI_ERROR unset for requests that were already null, so start from success.
  statuses_.resize(count);
  for (MPI_Status& status : statuses_) status.MPI_ERROR = MPI_SUCCESS;
  auto done = [&] {
    if (in_place_pending_ > 0 && !(sending = SendReadyPayloads()).ok()) return true;
    int flag = 0;
    code = MPI_Testall(count, requests, &flag, statuses_.data());
    if (code != MPI_SUCCESS || flag != 0) return true;
    return PeerGaveUpEvery(&polls, h, notices_from, &sending);
  };
  if (!Poll(done, deadline, config_.spin_iterations)) {
    std::set<int> missing;
    for (int i = 0; i < count; ++i) {
      int flag = 0;
      const int tested = MPI_Test(&requests[i], &flag, MPI_STATUS_IGNORE);
      if (tested != MPI_SUCCESS) return Call(h, tested, what);
      if (!flag) missing.insert(r->peers[first + i]);
    }
    // Everything completed as the deadline passed: done, not a timeout naming nobody.
    if (missing.empty()) return Status();
    return TimedOut(h, deadline, missing, what);
  }
  if (!sending.ok()) return sending;
  if (code == MPI_SUCCESS) return Status();
  // A peer that gave up may have left MPI to read a buffer XLA has since freed (SendersStayed):
  // its own error says more than MPI's. Its notice may come after messages that MPI still has to
  // take in (each failing as it does), so the look goes on for a while.
  Status gave_up;
  if (PeerGaveUpLooking(h, notices_from, &gave_up, kNoticeAfterFailureSeconds)) return gave_up;
  if (code != MPI_ERR_IN_STATUS) return Call(h, code, what);
  // Some requests failed (a peer's process died, say): name their ranks and MPI's errors.
  std::ostringstream s;
  s << Where(h) << ": MPI failed while waiting for rank(s) ";
  std::set<int> failed;
  std::string errors;
  for (int i = 0; i < count; ++i) {
    const int error = statuses_[i].MPI_ERROR;
    if (error == MPI_SUCCESS || error == MPI_ERR_PENDING) continue;
    failed.insert(r->peers[first + i]);
    const std::string text = ErrorText(error);
    if (errors.find(text) == std::string::npos) errors += (errors.empty() ? "" : "; ") + text;
  }
  if (failed.empty()) return Call(h, code, what);
  s << Ranks(failed) << " to " << what << ": " << errors
    << " (a rank whose process died or lost its connection makes MPI fail so)";
  return Status::Error(s.str());
}

Status MpiTransport::TimedOut(const Header& h, const Deadline& deadline,
                              const std::set<int>& missing, const char* what) const {
  std::ostringstream s;
  s << Where(h) << ": timed out after " << deadline.seconds() << " s waiting for rank(s) "
    << Ranks(missing) << " to " << what;
  // Past a collective's header exchange every rank has made the call, so a rank waited for
  // there is stalled or waits for another (in a ring or recursive doubling, a rank's peer may
  // be the one waiting for the rank that stalled).
  const bool collective = h.kind != Collective::kPermute && h.kind != Collective::kSendRecv;
  if (collective && std::strcmp(what, kArriveAtCollective) != 0)
    s << " (every rank made this call, so it is stalled, has died, or is itself waiting for "
         "another; raise jaxring.config timeout_seconds if it is only slow)";
  else
    s << " (a rank that never makes this call, has died, or is itself waiting for one that "
         "does not; raise jaxring.config timeout_seconds if it is only slow)";
  return Status::Error(s.str());
}

bool MpiTransport::PeerGaveUp(const Header& h, int source, Status* error) {
  int flag = 0;
  MPI_Message message = MPI_MESSAGE_NULL;
  MPI_Status probed;
  if (MPI_Improbe(source, kGaveUpTag, comm_, &flag, &message, &probed) != MPI_SUCCESS || !flag)
    return false;
  int bytes = 0;
  if (MPI_Get_count(&probed, MPI_CHAR, &bytes) != MPI_SUCCESS || bytes < 0) bytes = 0;
  std::string why(static_cast<size_t>(bytes), '\0');
  if (MPI_Mrecv(why.data(), bytes, MPI_CHAR, &message, MPI_STATUS_IGNORE) != MPI_SUCCESS)
    why = "(its notice could not be received)";
  *error = Status::Error(Where(h) + ": " +
                         PeerError(probed.MPI_SOURCE, "gave up on this communicator (in this "
                                   "collective or an earlier one), so this call cannot complete",
                                   why));
  return true;
}

bool MpiTransport::PeerGaveUpEvery(int64_t* polls, const Header& h, int source, Status* error) {
  return ++*polls % kPollsPerNoticeProbe == 0 && PeerGaveUp(h, source, error);
}

int MpiTransport::LooksForNotice() const { return std::max(kLooksForNotice, size_); }

bool MpiTransport::PeerGaveUpLooking(const Header& h, int source, Status* error,
                                     double seconds) {
  const Deadline deadline(seconds);
  for (int look = 0; look < LooksForNotice() || !deadline.Expired(); ++look)
    if (PeerGaveUp(h, source, error)) return true;
  return false;
}

Status MpiTransport::SendersStayed(const Header& h, size_t largest_received, int source) {
  Status error;
  const int looks = largest_received >= kRendezvousBytes ? LooksForNotice() : kLooksForNotice;
  for (int look = 0; look < looks; ++look)
    if (PeerGaveUp(h, source, &error)) return error;
  return Status();
}

Status MpiTransport::Fail(Status status) {
  if (broken_.empty()) {
    broken_ = status.message();
    // Every peer learns why, so that one still waiting, or one that comes later, fails at once
    // (PeerGaveUp) instead of after a timeout of its own. A rank that gives up because of a
    // peer's notice passes it on too: a peer waiting for this rank alone (a point-to-point
    // receive from it) looks only for this rank's notices. The notice is small enough to go
    // eagerly, and its text is left allocated: a communicator fails once, and MPI may still be
    // sending it when this transport is gone.
    const std::string* notice = new std::string(Notice(broken_));
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      MPI_Request request;
      if (MPI_Isend(notice->data(), static_cast<int>(notice->size()), MPI_CHAR, peer, kGaveUpTag,
                    comm_, &request) == MPI_SUCCESS)
        MPI_Request_free(&request);
    }
  }
  std::vector<Requests*> pending = {&sends_, &recvs_};
  for (InPlace& slot : in_place_) {
    pending.push_back(&slot.ready_wait);
    pending.push_back(&slot.payload);
    slot.pending = false;
  }
  in_place_pending_ = 0;
  // Many requests are on the caller's buffers, which XLA frees once the call returns, so each
  // receive is cancelled, and every request is then given a moment to complete: a receive that
  // had not matched is then done with at once, and one under way finishes. What is still active
  // after that is freed, which leaves it running. Sends are not cancelled: MPI 4 deprecates it,
  // MPICH cannot cancel one whose peer never came (MPI_Wait on it hung in
  // tests/mpi/test_mpi_p2p.py), and with the UCX device of MPICH 5 from PyPI, MPI_Cancel on a
  // large send under way crashed the process (a rank that came after its peers had given up,
  // tests/mpi/test_mpi_collectives.py). Such a send may still read its buffer if that peer
  // comes, and its peer is in this call too: a collective's, whose peers exchanged headers with
  // this rank before any data moved, or a point-to-point payload, posted only once its receiver
  // was ready. That peer then finds this rank's notice (SendersStayed) rather than return what it
  // read.
  for (Requests* r : pending) {
    receives_left_running_ = DropRequests(&r->requests, r->sending) || receives_left_running_;
    r->Clear();
  }
  return status;
}

void MpiTransport::Abandon(const std::string& why) {
  if (broken_.empty()) Fail(Status::Error(why));
}

Status MpiTransport::Broken(const Header& h) const {
  return Status::Error(Where(h) + ": this communicator failed earlier and can no longer be used "
                       "(its ranks' messages are out of step); the first error was: " + broken_);
}

// ---- collectives -----------------------------------------------------------------------------

Status MpiTransport::RunCollective(const Header& h, const CollectiveBuffers& b,
                                   const Config& config) {
  if (!broken_.empty()) return Broken(h);
  config_ = config;
  UseCpuKernels(config.cpu_kernels);  // this module's own copy of the kernels follows the config
  const Deadline deadline(config.timeout_seconds);
  sends_.Clear();
  recvs_.Clear();
  const Method method = MethodOf(h, size_, config);
  Header mine = h;
  mine.plan = Plan(method, config);
  Status status = ExchangeHeaders(mine, deadline);
  if (status.ok()) data_stall.TakeIfArmed();
  if (status.ok() && h.kind != Collective::kBarrier) {
    const size_t width = ByteWidth(h.dtype);
    if (size_ == 1) {
      if (h.kind == Collective::kAllGather || h.kind == Collective::kBroadcast) {
        if (h.count > 0) std::memmove(b.output, b.input, h.count * width);
      } else {
        Operand in{b.input};
        Target out{b.output};
        Reduce(h.dtype, h.op, &in, 1, &out, 1, h.count, h.op == ReduceOp::kMean ? 1 : 0);
      }
    } else if (h.kind == Collective::kBroadcast) {
      status = Broadcast(h, b, method == Method::kBroadcastTree);
    } else if (method == Method::kRecursiveDoubling) {
      status = RecursiveDoubling(h, b);
    } else {
      status = Ring(h, b);
    }
  }
  return status.ok() ? status : Fail(status);
}

Status MpiTransport::Agree(const Header& h, const Config& config) {
  if (!broken_.empty()) return Broken(h);
  config_ = config;
  sends_.Clear();
  recvs_.Clear();
  Status status = ExchangeHeaders(h, Deadline(config.timeout_seconds));
  return status.ok() ? status : Fail(status);
}

// Every rank learns every rank's header before data moves, so every rank finds the same
// mismatch, and nobody can leave before everybody arrived (which makes this the barrier too).
// Direct (up to mpi_direct_header_ranks ranks when the communicator was made): each rank sends
// its header to all others in one round, and a timeout names exactly the ranks that never
// arrived. Otherwise Bruck's all-gather (round k passes everything known to rank - 2^k) keeps it
// to log2 n rounds, but a timeout can then only name the rank a waiter heard nothing from, which
// may itself be waiting for another.
Status MpiTransport::ExchangeHeaders(const Header& h, const Deadline& deadline) {
  std::vector<Header>& known = headers_;  // known[i]: rank (rank_ + i) % size_
  known.assign(size_, Header{});
  known[0] = h;
  const char* what = kArriveAtCollective;
  if (direct_headers_) {
    recvs_.Clear();
    Status status;
    for (int i = 1; i < size_ && status.ok(); ++i)
      status = Irecv(h, &known[i], sizeof(Header), (rank_ + i) % size_, kHeaderTag, &recvs_);
    for (int i = 1; i < size_ && status.ok(); ++i)
      status = Isend(h, &known[0], sizeof(Header), (rank_ + i) % size_, kHeaderTag, &sends_);
    if (status.ok()) status = Wait(h, &recvs_, -1, deadline, what);
    if (status.ok()) status = Wait(h, &sends_, -1, deadline, what);
    if (!status.ok()) return status;
  } else {
    int have = 1;
    for (int distance = 1; distance < size_; distance *= 2) {
      const int count = std::min(distance, size_ - distance);
      recvs_.Clear();
      Status status = Irecv(h, &known[have], count * sizeof(Header), (rank_ + distance) % size_,
                            kHeaderTag, &recvs_);
      if (status.ok())
        status = Isend(h, known.data(), count * sizeof(Header),
                       (rank_ - distance + size_) % size_, kHeaderTag, &recvs_);
      if (status.ok()) status = Wait(h, &recvs_, -1, deadline, what);
      if (!status.ok()) return status;
      have += count;
    }
  }
  sends_.Clear();
  recvs_.Clear();
  // A rank that comes after its peers gave up still completes the exchange, on the headers they
  // sent before they did. Its later waits, and the look once its data is in (SendersStayed),
  // find their gave-up notices; a call that receives nothing (a barrier, an Agree, a broadcast
  // from its root) returns, and the next one fails. One look for a notice here did not help: MPI
  // had yet to take it in.
  return CheckHeadersAgree([&] { return Where(h); }, size_, [&](int rank) -> const Header& {
    return known[(rank - rank_ + size_) % size_];
  });
}

// All-reduce by recursive doubling: log2(p) exchanges of the whole (accumulator-typed) vector
// for p the largest power of two <= n; the other n - p ranks first fold into a partner and
// receive the result at the end. Partners always combine the lower rank's value first, so both
// hold the same bits after every round.
Status MpiTransport::RecursiveDoubling(const Header& h, const CollectiveBuffers& b) {
  const size_t bytes = h.count * AccumulatorWidth(h.dtype);
  char* mine = Scratch(0, bytes);
  char* theirs = Scratch(1, bytes);
  Operand in{b.input};
  Target acc{mine, true};
  Reduce(h.dtype, h.op, &in, 1, &acc, 1, h.count, 0);
  auto combine = [&](bool theirs_first) {
    Operand srcs[2] = {{theirs, true}, {mine, true}};
    if (!theirs_first) std::swap(srcs[0], srcs[1]);
    Reduce(h.dtype, h.op, srcs, 2, &acc, 1, h.count, 0);
  };
  auto exchange = [&](int peer, bool send, bool receive, void* into) {
    recvs_.Clear();
    Status status = receive ? Irecv(h, into, bytes, peer, kDataTag, &recvs_) : Status();
    if (status.ok() && send) status = Isend(h, mine, bytes, peer, kDataTag, &recvs_);
    return status.ok() ? Wait(h, &recvs_, -1, EachWait(), "exchange data") : status;
  };
  int p = 1;
  while (p * 2 <= size_) p *= 2;
  const int extra = size_ - p;
  int vrank = rank_ - extra;  // rank among the p that exchange
  Status status;
  if (rank_ < 2 * extra) {
    const bool folds = rank_ % 2 == 0;  // the even one hands its value to the odd one
    status = exchange(folds ? rank_ + 1 : rank_ - 1, folds, !folds, theirs);
    if (!status.ok()) return status;
    if (!folds) combine(true);
    vrank = folds ? -1 : rank_ / 2;
  }
  for (int mask = 1; vrank >= 0 && mask < p; mask <<= 1) {
    const int vpeer = vrank ^ mask;
    const int peer = vpeer < extra ? 2 * vpeer + 1 : vpeer + extra;
    status = exchange(peer, true, true, theirs);
    if (!status.ok()) return status;
    combine(vpeer < vrank);
  }
  if (rank_ < 2 * extra) {
    const bool folded = rank_ % 2 == 0;
    status = exchange(folded ? rank_ + 1 : rank_ - 1, !folded, folded, mine);
    if (!status.ok()) return status;
  }
  status = SendersStayed(h, 0);  // its messages come from scratch, kept after a failure
  if (!status.ok()) return status;
  Operand result{mine, true};
  Target out{b.output};
  Reduce(h.dtype, h.op, &result, 1, &out, 1, h.count, h.op == ReduceOp::kMean ? size_ : 0);
  return Status();
}

// The ring of ring/schedule.h, in messages: rank r's step g reads what its left neighbour
// produced in step g-1, so left sends each slice of that step's result the moment it is made.
// Receives are posted a step ahead, so payloads land straight in their buffers.
Status MpiTransport::Ring(const Header& h, const CollectiveBuffers& b) {
  const int n = size_;
  const int right = (rank_ + 1) % n;
  const int left = (rank_ + n - 1) % n;
  const size_t width = ByteWidth(h.dtype);
  const size_t acc_width = AccumulatorWidth(h.dtype);
  auto schedule = [&](int rank) {
    switch (h.kind) {
      case Collective::kAllReduce:
        return RingAllReduceSchedule(rank, n, h.count, std::max<int64_t>(1, 64 / width));
      case Collective::kReduceScatter:
        return RingReduceScatterSchedule(rank, n, h.count / n);
      default:
        return RingAllGatherSchedule(rank, n, h.count);
    }
  };
  const std::vector<RingStep> mine = schedule(rank_);
  const std::vector<RingStep> theirs = schedule(right);
  const int steps = static_cast<int>(mine.size());
  // Slices within one MPI message (MaxPiece()), so that each slice is one request in Wait.
  const int64_t slice = std::max<int64_t>(
      1, SliceBytes(h.count * static_cast<int64_t>(acc_width), config_.pipeline_slice_bytes) /
             static_cast<int64_t>(acc_width));
  int64_t largest = 0;
  for (const RingStep& s : mine) largest = std::max(largest, s.reduce ? s.count : 0);
  char* scratch = h.kind == Collective::kAllGather ? nullptr : Scratch(0, h.count * acc_width);
  char* incoming[2] = {Scratch(1, largest * acc_width), Scratch(2, largest * acc_width)};
  auto base = [&](Buffer buffer) -> char* {
    switch (buffer) {
      case Buffer::kInput: return const_cast<char*>(static_cast<const char*>(b.input));
      case Buffer::kOutput: return static_cast<char*>(b.output);
      default: return scratch;
    }
  };
  auto element = [&](Buffer buffer) { return buffer == Buffer::kScratch ? acc_width : width; };
  auto slices = [&](int64_t count) { return (count + slice - 1) / slice; };

  // Slice k of the region that `step` (right's) reads from this rank.
  // At most kRingSendsInFlight slices are on their way to right at any time: a large message
  // would otherwise post all of a step's slices at once and hold MPI's buffers for all of them.
  size_t oldest = 0;  // sends_ before this index have completed
  auto send = [&](const RingStep& step, int64_t k) {
    while (sends_.requests.size() - oldest >= kRingSendsInFlight) {
      Status status = Wait(h, &sends_, static_cast<int>(oldest), EachWait(),
                           "receive this rank's data");
      if (!status.ok()) return status;
      ++oldest;
    }
    const int64_t first = k * slice;
    const int64_t len = std::min(slice, step.count - first);
    const size_t w = element(step.source);
    return Isend(h, At(base(step.source), step.source_offset + first, w), len * w, right, kDataTag,
                 &sends_);
  };
  // In place (all_reduce with output == input, jaxring.all_reduce's in_place): right reads this
  // rank's input chunk r-1 in its first step, and the all-gather's first step receives chunk r-1
  // into the same memory. So the first receive into the output waits until every send so far has
  // completed, and is posted after the first step's sends are.
  const bool in_place = b.input == b.output;
  bool input_sent = !in_place;
  std::vector<int> posted(steps + 1, 0);  // index into recvs_ of each step's first slice
  auto post = [&](int g) {
    const RingStep& step = mine[g];
    if (!input_sent && step.from_left && !step.reduce && step.dst == Buffer::kOutput) {
      Status status = Wait(h, &sends_, -1, EachWait(), "receive this rank's data");
      if (!status.ok()) return status;
      input_sent = true;
    }
    posted[g] = static_cast<int>(recvs_.requests.size());
    if (!step.from_left) return Status();
    const size_t w = element(step.source);
    for (int64_t k = 0; k < slices(step.count); ++k) {
      const int64_t first = k * slice;
      const int64_t len = std::min(slice, step.count - first);
      char* into = step.reduce ? incoming[g % 2] + first * w
                               : At(base(step.dst), step.dst_offset + first, element(step.dst));
      Status status = Irecv(h, into, len * w, left, kDataTag, &recvs_);
      if (!status.ok()) return status;
    }
    return Status();
  };

  Status status = steps > 0 ? post(0) : Status();
  for (int g = 0; g < steps && status.ok(); ++g) {
    const RingStep& step = mine[g];
    if (g + 1 < steps && !in_place) status = post(g + 1);
    // What right reads in step g without waiting for this rank (its own input): send at once.
    if (status.ok() && theirs[g].from_left && !theirs[g].waits_for_left) {
      for (int64_t k = 0; k < slices(theirs[g].count) && status.ok(); ++k) status = send(theirs[g], k);
    }
    if (g + 1 < steps && in_place && status.ok()) status = post(g + 1);
    // What right reads in step g+1 is what this step produces: forward it slice by slice.
    const bool forward = g + 1 < steps && theirs[g + 1].from_left && theirs[g + 1].waits_for_left;
    if (forward && (theirs[g + 1].source != step.dst ||
                    theirs[g + 1].source_offset != step.dst_offset ||
                    theirs[g + 1].count != step.count))
      return Status::Error(Where(h) + ": internal error: ring schedules of neighbours disagree");
    if (!status.ok()) break;
    if (!step.from_left) {  // this rank's own block (all_gather's first step)
      std::memcpy(At(base(step.dst), step.dst_offset, element(step.dst)),
                  At(base(step.source), step.source_offset, element(step.source)),
                  step.count * element(step.source));
    }
    for (int64_t k = 0; k < slices(step.count) && status.ok(); ++k) {
      const int64_t first = k * slice;
      const int64_t len = std::min(slice, step.count - first);
      if (step.from_left) {
        status = Wait(h, &recvs_, posted[g] + static_cast<int>(k), EachWait(), "send its data");
        if (!status.ok()) break;
      }
      if (step.reduce) {
        Operand srcs[2] = {{incoming[g % 2] + first * element(step.source),
                            step.source == Buffer::kScratch},
                           {At(b.input, step.own_input_offset + first, width)}};
        Target dst{At(base(step.dst), step.dst_offset + first, element(step.dst)),
                   step.dst == Buffer::kScratch};
        const bool final = step.dst == Buffer::kOutput && h.op == ReduceOp::kMean;
        Reduce(h.dtype, h.op, srcs, 2, &dst, 1, len, final ? n : 0);
      }
      if (forward) status = send(theirs[g + 1], k);
      ring_slice_stalls.TakeIfArmed();
    }
  }
  if (status.ok()) status = Wait(h, &sends_, -1, EachWait(), "receive this rank's data");
  // Left sends from its output (the all-gather's slices), which XLA frees once left gives up.
  size_t received = 0;  // bytes of the largest slice received
  for (const RingStep& s : mine)
    if (s.from_left)
      received = std::max<size_t>(received, std::min(slice, s.count) * element(s.source));
  if (status.ok()) status = SendersStayed(h, received);
  if (status.ok()) {
    sends_.Clear();
    recvs_.Clear();
  }
  return status;
}

// Broadcast: a binomial tree (log2 n hops) for small messages; above the ring threshold a chain
// from the root, in slices, so every link carries the whole message once, pipelined.
Status MpiTransport::Broadcast(const Header& h, const CollectiveBuffers& b, bool tree) {
  const int n = size_;
  const size_t bytes = h.count * ByteWidth(h.dtype);
  const int root = static_cast<int>(h.root);
  const int v = (rank_ - root + n) % n;  // rank counted from the root
  char* out = static_cast<char*>(b.output);
  if (v == 0 && bytes > 0 && b.input != b.output) std::memcpy(out, b.input, bytes);
  Status status;
  size_t received = bytes;  // the largest message a rank other than the root receives
  if (tree) {
    int mask = 1;
    for (; mask < n; mask <<= 1) {
      if (v & mask) {
        status = Irecv(h, out, bytes, (rank_ - mask + n) % n, kDataTag, &recvs_);
        if (status.ok()) status = Wait(h, &recvs_, -1, EachWait(), "send the broadcast");
        if (!status.ok()) return status;
        break;
      }
    }
    for (mask >>= 1; mask > 0 && status.ok(); mask >>= 1) {
      if (v + mask < n) status = Isend(h, out, bytes, (rank_ + mask) % n, kDataTag, &sends_);
    }
  } else {
    const size_t slice =
        static_cast<size_t>(SliceBytes(static_cast<int64_t>(bytes), config_.pipeline_slice_bytes));
    const size_t pieces = (bytes + slice - 1) / slice;
    received = std::min(slice, bytes);
    for (size_t k = 0; v > 0 && k < pieces && status.ok(); ++k)
      status = Irecv(h, out + k * slice, std::min(slice, bytes - k * slice), (rank_ + n - 1) % n,
                     kDataTag, &recvs_);
    for (size_t k = 0; k < pieces && status.ok(); ++k) {
      if (v > 0) status = Wait(h, &recvs_, static_cast<int>(k), EachWait(), "send the broadcast");
      if (status.ok() && v + 1 < n)
        status = Isend(h, out + k * slice, std::min(slice, bytes - k * slice), (rank_ + 1) % n,
                       kDataTag, &sends_);
    }
  }
  if (status.ok()) status = Wait(h, &sends_, -1, EachWait(), "receive the broadcast");
  // Every rank sends from its output, which XLA frees once that rank gives up.
  if (status.ok() && v > 0) status = SendersStayed(h, received);
  if (status.ok()) {
    sends_.Clear();
    recvs_.Clear();
  }
  return status;
}

// ---- point-to-point --------------------------------------------------------------------------

Status MpiTransport::ReapEager(const Header& h, bool block) {
  while (!eager_.empty()) {
    Requests& front = eager_.front().requests;
    int done = 0;
    MPI_Testall(static_cast<int>(front.requests.size()), front.requests.data(), &done,
                MPI_STATUSES_IGNORE);
    if (!done && block) {
      Status status = Wait(h, &front, -1, Deadline(config_.timeout_seconds),
                           "receive this rank's earlier messages", front.peers.front());
      if (!status.ok()) return status;
      done = 1;
    }
    if (!done) break;
    eager_.pop_front();
    block = false;
  }
  return Status();
}

// One message: the header, then the payload in the same message (eager, copied) or after it,
// sent straight from the caller's buffer (`in_place`; the caller waits in WaitSent).
Status MpiTransport::Post(int dest, const Header& header, const void* data, size_t bytes,
                          bool in_place) {
  if (!broken_.empty()) return Broken(header);
  Status status = ReapEager(header, eager_.size() >= kMaxEagerInFlight);
  if (!status.ok()) return Fail(status);
  const Payload payload = in_place ? kPayloadInPlace
                          : sizeof(WireHeader) + bytes > std::min(MaxPiece(), kMaxInlineBytes)
                              ? kPayloadSeparate
                              : kPayloadInline;
  Eager message;
  message.bytes.resize(sizeof(WireHeader) + (in_place ? 0 : bytes));
  const WireHeader wire{header, payload, 0};
  std::memcpy(message.bytes.data(), &wire, sizeof(wire));
  if (!in_place && bytes > 0) std::memcpy(message.bytes.data() + sizeof(wire), data, bytes);
  const size_t first = payload == kPayloadInline ? message.bytes.size() : sizeof(wire);
  const int tag = PointToPointTag(header);
  status = Isend(header, message.bytes.data(), first, dest, tag, &message.requests);
  if (status.ok() && payload == kPayloadSeparate)
    status = Isend(header, message.bytes.data() + sizeof(wire), bytes, dest, tag,
                   &message.requests);
  if (status.ok() && in_place) {
    InPlace& slot = in_place_[dest];
    slot.header = header;
    slot.data = data;
    slot.bytes = bytes;
    slot.ready_wait.Clear();
    slot.payload.Clear();
    slot.pending = true;
    ++in_place_pending_;
    status = Irecv(header, &slot.ready, 1, dest, kReadyTag, &slot.ready_wait);
  }
  eager_.push_back(std::move(message));
  return status.ok() ? status : Fail(status);
}

Status MpiTransport::SendCopy(int dest, const Header& header, const void* data, size_t bytes) {
  return Post(dest, header, data, bytes, false);
}

Status MpiTransport::SendInPlace(int dest, const Header& header, const void* data, size_t bytes) {
  return Post(dest, header, data, bytes, true);
}

Status MpiTransport::SendReadyPayloads() {
  for (int dest = 0; dest < size_; ++dest) {
    InPlace& slot = in_place_[dest];
    if (!slot.pending || !slot.payload.requests.empty()) continue;
    int ready = 0;
    Status status = Call(slot.header, MPI_Test(slot.ready_wait.requests.data(), &ready,
                                               MPI_STATUS_IGNORE), "receive a ready message");
    if (!status.ok()) return status;
    if (!ready) continue;
    slot.ready_wait.Clear();
    status = Isend(slot.header, slot.data, slot.bytes, dest, kPayloadTag, &slot.payload);
    if (!status.ok()) return status;
  }
  return Status();
}

Status MpiTransport::WaitSent(int dest) {
  InPlace& slot = in_place_[dest];
  // Two waits: for the receiver to say it is ready, then for the payload to go out, each with
  // the whole timeout.
  Deadline deadline(config_.timeout_seconds);
  bool going_out = !slot.payload.requests.empty();
  Status status;
  int64_t polls = 0;
  auto sent = [&] {
    if (!(status = SendReadyPayloads()).ok()) return true;
    if (!slot.payload.requests.empty()) {  // else its receiver is not ready yet
      if (!going_out) {
        going_out = true;
        deadline = EachWait();
      }
      int flag = 0;
      status = Call(slot.header,
                    MPI_Testall(static_cast<int>(slot.payload.requests.size()),
                                slot.payload.requests.data(), &flag, MPI_STATUSES_IGNORE),
                    "send");
      if (!status.ok() || flag != 0) return true;
    }
    return PeerGaveUpEvery(&polls, slot.header, dest, &status);
  };
  if (!Poll(sent, deadline, config_.spin_iterations))
    status = TimedOut(slot.header, deadline, {dest}, "receive this rank's message");
  if (!status.ok()) return Fail(status);
  slot.pending = false;
  --in_place_pending_;
  slot.payload.Clear();
  return status;
}

void MpiTransport::WithdrawSent(int dest, const std::string&) {
  // Every failed call has already failed this transport (Fail, whose first error stands), which
  // drops its pending in-place sends; a send still pending here is dropped the same way.
  InPlace& slot = in_place_[dest];
  if (slot.pending)
    Fail(Status::Error(Where(slot.header) + ": took back the message lent to rank " +
                       std::to_string(dest) + " after this call failed"));
}

Status MpiTransport::Receive(int source, const Header& expected, void* out, size_t bytes) {
  if (!broken_.empty()) return Broken(expected);
  ReapEager(expected, false);  // frees this rank's sent copies already received, never waits
  receive_stall.TakeIfArmed();
  const Deadline deadline(config_.timeout_seconds);
  MPI_Message message = MPI_MESSAGE_NULL;
  MPI_Status probe;
  int code = MPI_SUCCESS;
  Status sending;
  int64_t polls = 0;
  auto arrived = [&] {
    if (in_place_pending_ > 0 && !(sending = SendReadyPayloads()).ok()) return true;
    int flag = 0;
    code = MPI_Improbe(source, PointToPointTag(expected), comm_, &flag, &message, &probe);
    return code != MPI_SUCCESS || flag != 0 ||
           PeerGaveUpEvery(&polls, expected, source, &sending);
  };
  if (!Poll(arrived, deadline, config_.spin_iterations)) {
    std::ostringstream s;
    s << Where(expected) << ": timed out after " << deadline.seconds()
      << " s waiting for rank(s) [" << source << "] to send (a rank that never makes the matching send, or has died)";
    const bool send_recv = expected.kind == Collective::kSendRecv;
    int other = 0;
    if (MPI_Iprobe(source, send_recv ? kP2PTag : kSendRecvTag, comm_, &other,
                   MPI_STATUS_IGNORE) == MPI_SUCCESS && other)
      s << "." << OtherChannelHint(source, send_recv);
    return Fail(Status::Error(s.str()));
  }
  if (!sending.ok()) return Fail(sending);
  Status status = Call(expected, code, "probe for a message");
  int length = 0;
  if (status.ok()) status = Call(expected, MPI_Get_count(&probe, MPI_BYTE, &length), "receive");
  if (status.ok()) {
    if (message_.size() < static_cast<size_t>(length)) message_.resize(length);
    status = Call(expected,
                  MPI_Mrecv(message_.data(), length, MPI_BYTE, &message, MPI_STATUS_IGNORE),
                  "receive");
  }
  if (!status.ok()) return Fail(status);
  WireHeader wire;
  if (static_cast<size_t>(length) < sizeof(wire))
    return Fail(Status::Error(Where(expected) + ": a malformed message arrived from rank " +
                              std::to_string(source)));
  std::memcpy(&wire, message_.data(), sizeof(wire));
  if (!SameMessage(wire.header, expected)) {
    std::ostringstream s;
    s << Where(expected) << ": mismatched point-to-point calls: rank " << source << " sent "
      << Describe(wire.header) << " but this rank expected " << Describe(expected) << "."
      << PermsDiffer(wire.header, expected);
    return Fail(Status::Error(s.str()));
  }
  if (wire.payload == kPayloadInPlace || wire.payload == kPayloadSeparate) {
    // An in-place payload comes once this rank says it is ready, straight into `out`. The pieces
    // of a separate copy follow its header, so MPI has usually matched them before their receive
    // is posted, and a matched receive cannot be cancelled: they go into this transport's own
    // buffer, which a receive left running after a failure may then write into (the destructor
    // keeps it), and are copied out.
    const bool in_place = wire.payload == kPayloadInPlace;
    if (!in_place && message_.size() < bytes) message_.resize(bytes);
    void* into = in_place ? out : message_.data();
    recvs_.Clear();
    const int tag = in_place ? kPayloadTag : PointToPointTag(expected);
    status = Irecv(expected, into, bytes, source, tag, &recvs_);
    if (status.ok() && in_place) status = Isend(expected, &ready_, 1, source, kReadyTag, &recvs_);
    if (status.ok()) data_stall.TakeIfArmed();
    // The header's arrival was one wait; the payload is another, with the whole timeout.
    if (status.ok()) status = Wait(expected, &recvs_, -1, EachWait(), "send its data", source);
    // An in-place payload came straight from the caller's buffer, which XLA frees once the
    // sender gives up.
    if (status.ok() && in_place) status = SendersStayed(expected, bytes, source);
    if (!status.ok()) return Fail(status);  // which cancels the receive
    recvs_.Clear();
    if (!in_place && bytes > 0) std::memcpy(out, message_.data(), bytes);
    if (message_.size() > kKeptReceiveBytes) std::vector<char>().swap(message_);
    return status;
  }
  if (wire.payload != kPayloadInline)
    return Fail(Status::Error(Where(expected) + ": a malformed message arrived from rank " +
                              std::to_string(source)));
  if (static_cast<size_t>(length) != sizeof(wire) + bytes)
    return Fail(Status::Error(Where(expected) + ": a message of the wrong size arrived"));
  if (bytes > 0) std::memcpy(out, message_.data() + sizeof(wire), bytes);
  return Status();
}

bool DropRequests(std::vector<MPI_Request>* requests, const std::vector<bool>& sending) {
  for (size_t i = 0; i < requests->size(); ++i)
    if ((*requests)[i] != MPI_REQUEST_NULL && !sending[i]) MPI_Cancel(&(*requests)[i]);
  // Done when every request (with `sends`) or every receive has completed or is cancelled.
  auto completed = [&](bool sends) {
    bool done = true;
    for (size_t i = 0; i < requests->size(); ++i) {
      int flag = 1;
      if ((*requests)[i] != MPI_REQUEST_NULL && (sends || !sending[i]))
        MPI_Test(&(*requests)[i], &flag, MPI_STATUS_IGNORE);
      done = done && flag;
    }
    return done;
  };
  Poll([&] { return completed(true); }, Deadline(kDropGraceSeconds), 0);
  // A cancelled receive completes at once, so one still running was matched and is being
  // written: a large one (up to MaxPiece()) can take longer than the grace, and would write on
  // into a buffer XLA is about to reuse, so it gets longer.
  Poll([&] { return completed(false); }, Deadline(kReceiveUnderWaySeconds), 0);
  bool receiving = false;
  for (size_t i = 0; i < requests->size(); ++i) {
    if ((*requests)[i] == MPI_REQUEST_NULL) continue;
    receiving = receiving || !sending[i];
    MPI_Request_free(&(*requests)[i]);
  }
  return receiving;
}

void SetMaxPieceForTest(size_t bytes) {
  // Every message is at least its header; at 0, back to MPI's limit.
  max_piece.store(bytes > 0 ? std::max(bytes, sizeof(WireHeader)) : kMaxPiece);
}

void StallNextReceiveForTest(double seconds) {
  receive_stall.Arm(seconds, seconds > 0 ? 1 : 0);
}

void StallNextDataForTest(double seconds) {
  data_stall.Arm(seconds, seconds > 0 ? 1 : 0);
}

void StallNextRingSlicesForTest(double seconds, int64_t slices) {
  ring_slice_stalls.Arm(seconds, slices);
}

}  // namespace jaxring
