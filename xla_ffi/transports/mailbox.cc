#include "transports/mailbox.h"

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>

namespace jaxring {

namespace {

constexpr uint64_t kSlots = kMailboxSlots;
// Payload stored inside the slot; larger eager messages go to a pooled buffer.
constexpr size_t kInlineBytes = 4096;
constexpr uint32_t kRoundMask = ~Flag::kAbandoned;

// The flag value announcing round `round` of a slot. Rounds wrap around, so waiters compare for
// equality; round -1 (nothing sent yet) is 0, the initial value.
uint32_t RoundFlag(uint64_t round) { return static_cast<uint32_t>((round + 1) & kRoundMask); }

}  // namespace

struct alignas(64) Slot {
  // Written by the sender: header and payload first, then `ready`, all in this slot.
  Flag ready;
  Header header;
  int64_t run_id = 0;  // the XLA run that sent it
  bool in_place = false;
  const void* pointer = nullptr;  // in-place: the sender's buffer; eager: inline or spill
  ScratchLease spill;
  alignas(64) unsigned char inline_data[kInlineBytes];
  // Written by the receiver once it has copied the message out (its own cache line).
  alignas(64) Flag read;
  // An in-place message's round flag while the receiver copies it out of the sender's buffer,
  // else 0. A sender that gives up waits for a copy under way before XLA reclaims its buffer,
  // and a receiver that finds the sender gone does not start one.
  std::atomic<uint32_t> copying{0};
  // Why the side that marked `read` abandoned gave up, for the other side's error to quote: JAX
  // reports one device's error of a failed program, and it may be the other side's.
  std::mutex giving_up;
  std::string why;
};

namespace {

// Marks `slot.read` abandoned, keeping the first reason given.
void GiveUp(Slot& slot, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(slot.giving_up);
    if (slot.why.empty()) slot.why = why;
  }
  slot.read.Abandon();
}

// The error of a rank that found `slot.read` abandoned by `peer` (PeerError).
std::string PeerGaveUp(Slot& slot, const std::string& where, int peer, const char* what) {
  std::lock_guard<std::mutex> lock(slot.giving_up);
  return where + ": " + PeerError(peer, what, slot.why);
}

}  // namespace

class Mailbox {
 public:
  Slot slots[kSlots];
  alignas(64) uint64_t sent = 0;      // touched only by the source device
  alignas(64) uint64_t received = 0;  // touched only by the destination device

  void Reset() {
    for (Slot& slot : slots) {
      slot.ready.Store(0);
      slot.read.Store(0);
      slot.copying.store(0);
      slot.spill = ScratchLease();
      slot.in_place = false;
      slot.pointer = nullptr;
      std::lock_guard<std::mutex> lock(slot.giving_up);
      slot.why.clear();
    }
    sent = received = 0;
  }
};

namespace {

// comm, group, source, destination, send/recv's channel (or ppermute's)
using MailboxKey = std::tuple<uint64_t, int64_t, int, int, bool>;

class MailboxRegistry {
 public:
  static MailboxRegistry& Get() {
    static MailboxRegistry* registry = new MailboxRegistry();  // outlives device threads
    return *registry;
  }
  Mailbox* Find(const CommunicatorId& comm, int source, int dest, bool send_recv) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& slot = mailboxes_[MailboxKey{comm.comm, comm.group, source, dest, send_recv}];
    if (!slot) slot = std::make_unique<Mailbox>();
    return slot.get();
  }
  void ResetAll() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [key, mailbox] : mailboxes_) mailbox->Reset();
  }

 private:
  std::mutex mutex_;
  std::map<MailboxKey, std::unique_ptr<Mailbox>> mailboxes_;
};

}  // namespace

LocalPointToPoint::LocalPointToPoint(CommunicatorId comm, int rank, int64_t run_id,
                                     Collective kind, double timeout_seconds,
                                     int64_t spin_iterations)
    : comm_(std::move(comm)),
      rank_(rank),
      run_id_(run_id),
      send_recv_(kind == Collective::kSendRecv),
      timeout_seconds_(timeout_seconds),
      spin_iterations_(spin_iterations) {}

void LocalPointToPoint::ResetAll() { MailboxRegistry::Get().ResetAll(); }

std::string LocalPointToPoint::Where(const Header& header) const {
  return jaxring::Where(header, comm_.name, rank_, comm_.size);
}

Status LocalPointToPoint::Post(int dest, const Header& header, const void* data, size_t bytes,
                               bool in_place) {
  Mailbox* mailbox = MailboxRegistry::Get().Find(comm_, rank_, dest, send_recv_);
  const uint64_t sequence = mailbox->sent++;
  const uint64_t round = sequence / kSlots;
  Slot& slot = mailbox->slots[sequence % kSlots];
  // The slot is free once the receiver has read what was sent into it one round earlier.
  if (!slot.read.WaitUntilEqual(RoundFlag(round - 1), Deadline(timeout_seconds_),
                                spin_iterations_)) {
    std::ostringstream s;
    s << Where(header) << ": timed out after " << timeout_seconds_ << " s waiting for rank "
      << dest << " to receive message " << sequence + 1 - kSlots << " (this rank is " << kSlots
      << " messages ahead of it, as many as its mailbox holds from one sender: does rank " << dest
      << " make the matching calls, and does it make them before this rank's next send to it "
         "must wait for room?)";
    return Status::Error(s.str());
  }
  if (slot.read.Load() & Flag::kAbandoned)
    return Status::Error(PeerGaveUp(slot, Where(header), dest, "gave up on this mailbox"));
  slot.header = header;
  slot.run_id = run_id_;
  slot.in_place = in_place;
  if (in_place) {
    slot.pointer = data;
  } else if (bytes <= kInlineBytes) {
    std::memcpy(slot.inline_data, data, bytes);
    slot.pointer = slot.inline_data;
  } else {
    slot.spill = ScratchLease::Acquire(bytes);
    if (slot.spill.data() == nullptr)  // the receiver times out, naming this rank
      return Status::Error(Where(header) + ": out of memory for a copy of this " +
                           std::to_string(bytes) + "-byte message");
    std::memcpy(slot.spill.data(), data, bytes);
    slot.pointer = slot.spill.data();
  }
  slot.ready.Store(RoundFlag(round));  // publishes everything above (release)
  if (in_place) {
    in_place_mailbox_ = mailbox;
    in_place_sequence_ = sequence;
  }
  return Status();
}

Status LocalPointToPoint::SendCopy(int dest, const Header& header, const void* data,
                                   size_t bytes) {
  return Post(dest, header, data, bytes, /*in_place=*/false);
}

Status LocalPointToPoint::SendInPlace(int dest, const Header& header, const void* data,
                                      size_t bytes) {
  return Post(dest, header, data, bytes, /*in_place=*/true);
}

bool LocalPointToPoint::TakeBack(const std::string& why) {
  Slot& slot = in_place_mailbox_->slots[in_place_sequence_ % kSlots];
  const uint32_t done = RoundFlag(in_place_sequence_ / kSlots);
  // A late receiver must not read a buffer XLA is about to reclaim: mark the slot abandoned,
  // then let a copy that began before the mark finish (a memcpy, not a wait for anyone).
  GiveUp(slot, why);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  while (slot.copying.load(std::memory_order_seq_cst) == done) YieldCore();
  if ((slot.read.Load() & ~Flag::kAbandoned) != done) return false;
  {
    std::lock_guard<std::mutex> lock(slot.giving_up);
    slot.why.clear();
  }
  slot.read.Store(done);  // the receiver took the message after all
  return true;
}

void LocalPointToPoint::WithdrawSent(int, const std::string& why) { TakeBack(why); }

Status LocalPointToPoint::WaitSent(int dest) {
  Slot& slot = in_place_mailbox_->slots[in_place_sequence_ % kSlots];
  const uint32_t done = RoundFlag(in_place_sequence_ / kSlots);
  if (!slot.read.WaitUntilEqual(done, Deadline(timeout_seconds_), spin_iterations_)) {
    std::ostringstream s;
    s << Where(slot.header) << ": timed out after " << timeout_seconds_
      << " s waiting for rank [" << dest << "] to receive this rank's message";
    if (TakeBack(s.str())) return Status();
    return Status::Error(s.str());
  }
  if (slot.read.Load() & Flag::kAbandoned)
    return Status::Error(PeerGaveUp(slot, Where(slot.header), dest,
                                    "failed while receiving this rank's message"));
  return Status();
}

bool LocalPointToPoint::SlotFree(int dest, const Deadline& by) const {
  const Mailbox* mailbox = MailboxRegistry::Get().Find(comm_, rank_, dest, send_recv_);
  const Slot& slot = mailbox->slots[mailbox->sent % kSlots];
  return slot.read.WaitUntilEqual(RoundFlag(mailbox->sent / kSlots - 1), by, spin_iterations_);
}

bool LocalPointToPoint::MessageReady(int source, const Deadline& by) const {
  const Mailbox* mailbox = MailboxRegistry::Get().Find(comm_, source, rank_, send_recv_);
  const Slot& slot = mailbox->slots[mailbox->received % kSlots];
  return slot.ready.WaitUntilEqual(RoundFlag(mailbox->received / kSlots), by, spin_iterations_);
}

bool LocalPointToPoint::SentRead(const Deadline& by) const {
  const Slot& slot = in_place_mailbox_->slots[in_place_sequence_ % kSlots];
  return slot.read.WaitUntilEqual(RoundFlag(in_place_sequence_ / kSlots), by, spin_iterations_);
}

Status LocalPointToPoint::Receive(int source, const Header& expected, void* out, size_t bytes) {
  Mailbox* mailbox = MailboxRegistry::Get().Find(comm_, source, rank_, send_recv_);
  const uint64_t sequence = mailbox->received++;
  const uint64_t round = sequence / kSlots;
  Slot& slot = mailbox->slots[sequence % kSlots];
  if (!slot.ready.WaitUntilEqual(RoundFlag(round), Deadline(timeout_seconds_),
                                 spin_iterations_)) {
    std::ostringstream s;
    s << Where(expected) << ": timed out after " << timeout_seconds_
      << " s waiting for rank [" << source << "] to send (message " << sequence + 1
      << " from it, counting from 1). A peer that never makes the matching call (a "
         "rank-dependent branch, or a crashed device) cannot be waited for; raise jaxring.config "
         "timeout_seconds if it is just slow.";
    const Mailbox* other = MailboxRegistry::Get().Find(comm_, source, rank_, !send_recv_);
    if (other->slots[other->received % kSlots].ready.Load() ==
        RoundFlag(other->received / kSlots))  // this rank's reads of `other` are its own
      s << OtherChannelHint(source, send_recv_);
    GiveUp(slot, s.str());  // a late sender fails instead of waiting for this rank
    return Status::Error(s.str());
  }
  if (slot.run_id != run_id_) {
    // Mailboxes outlive programs, so a send whose receive never ran (the perms of a send and its
    // recv differ) leaves its message for whichever later program receives from that rank next.
    std::ostringstream s;
    s << Where(expected) << ": the next message from rank " << source << " ("
      << Describe(slot.header) << ") was sent by an earlier program run, in which no receive "
      << "took it: every send needs a matching recv in the same program.";
    GiveUp(slot, s.str());
    return Status::Error(s.str());
  }
  if (!SameMessage(slot.header, expected)) {
    std::ostringstream s;
    s << Where(expected) << ": mismatched point-to-point calls: rank " << rank_ << " expected "
      << Describe(expected) << " from rank " << source << ", but rank " << source << " sent "
      << Describe(slot.header) << "." << PermsDiffer(slot.header, expected)
      << " Every rank must make the same calls in the same order.";
    GiveUp(slot, s.str());
    return Status::Error(s.str());
  }
  const bool in_place = slot.in_place;
  if (in_place) {
    // Announce the copy, then look for the sender's give-up mark (WaitSent does the converse):
    // with both orders sequentially consistent, at least one of the two sees the other.
    slot.copying.store(RoundFlag(round), std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (slot.read.Load() & Flag::kAbandoned) {
      slot.copying.store(0, std::memory_order_seq_cst);
      return Status::Error(PeerGaveUp(slot, Where(expected), source,
                                      "took back the message it lent this rank (it timed out "
                                      "waiting for this rank, or failed, first, and its buffer "
                                      "is gone)"));
    }
  }
  std::memcpy(out, slot.pointer, bytes);
  slot.spill = ScratchLease();
  slot.read.Store(RoundFlag(round));  // frees the slot, and releases an in-place sender
  if (in_place) slot.copying.store(0, std::memory_order_seq_cst);
  return Status();
}

}  // namespace jaxring
