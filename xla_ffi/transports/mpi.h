// The MPI transport: processes on different nodes (or, when asked, on one node) exchange
// non-blocking MPI point-to-point messages on a private duplicate of the user's communicator.
//
//   * all_reduce up to `mpi_ring_threshold_bytes` per rank: recursive doubling (log2 n rounds,
//     the latency-optimal exchange), with the usual fold for counts that are not powers of two.
//   * larger all_reduce, reduce_scatter, all_gather: the ring of ring/schedule.h, each chunk sent
//     in slices of `pipeline_slice_bytes` (SliceBytes), so that a rank forwards slice k while
//     slice k+1 is still arriving and reduction overlaps communication. 16-bit partial sums
//     travel as float32 and are rounded once.
//   * broadcast: a binomial tree for small messages, a sliced chain from the root for large ones.
//   * every collective first all-gathers the ranks' headers (directly up to 64 ranks, so that a
//     timeout names exactly the absent ranks; by Bruck's log2 n rounds above), so a mismatch is
//     reported identically on every rank before any data moves; that exchange is the barrier.
//   * point-to-point: a message is a header followed by its payload (eager, up to
//     `p2p_eager_bytes`) or by a second message, sent straight from the caller's buffer once the
//     receiver has posted the receive that lands it in place and said so (a ready message).
//
// Waits poll MPI_Test with the same spin/yield/sleep back-off as jaxring's flags and give up at
// the configured timeout, naming the ranks that never answered. After an error the communicator
// refuses further calls, since its message streams are no longer in step.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <deque>
#include <set>
#include <string>
#include <vector>

#include "common/wait.h"
#include "transports/process.h"

namespace jaxring {

class MpiTransport final : public ProcessTransport {
 public:
  // Duplicates `parent` (collective over its ranks, like MPI_Comm_dup). `direct_headers`: the
  // header exchange's method (ExchangeHeaders), which every rank must share; jaxring.mpi agrees
  // it from mpi_direct_header_ranks when it creates the communicator.
  static Status Create(MPI_Comm parent, std::string name, bool direct_headers,
                       std::unique_ptr<MpiTransport>* out);
  ~MpiTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string Where(const Header& header) const override;

  Status RunCollective(const Header& header, const CollectiveBuffers& buffers,
                       const Config& config) override;
  Status Agree(const Header& header, const Config& config) override;
  void Configure(const Config& config) override { config_ = config; }
  void Abandon(const std::string& why) override;

  Status SendCopy(int dest, const Header& header, const void* data, size_t bytes) override;
  Status SendInPlace(int dest, const Header& header, const void* data, size_t bytes) override;
  Status WaitSent(int dest) override;
  void WithdrawSent(int dest, const std::string& why) override;
  Status Receive(int source, const Header& expected, void* out, size_t bytes) override;

 private:
  // Requests of one phase, the peer each talks to (for timeout messages) and whether it sends
  // (Fail cancels only receives).
  struct Requests {
    std::vector<MPI_Request> requests;
    std::vector<int> peers;
    std::vector<bool> sending;
    void Clear() { requests.clear(); peers.clear(); sending.clear(); }
  };
  struct Eager {  // a point-to-point message this rank owns until it has been received
    Requests requests;
    std::vector<char> bytes;
  };

  MpiTransport(MPI_Comm comm, std::string name, bool direct_headers);

  Status Call(const Header& header, int code, const char* what);  // MPI return code -> Status
  template <typename Start>
  Status Pieces(const Header& h, size_t bytes, int peer, bool sending, Requests* r,
                const char* what, Start start);
  Status Isend(const Header& h, const void* data, size_t bytes, int peer, int tag, Requests* r);
  Status Irecv(const Header& h, void* data, size_t bytes, int peer, int tag, Requests* r);
  // Waits for request `index` of `r` (or all of them when index < 0). Gives up at once on a
  // gave-up notice from `notices_from`: any rank for a collective's waits, the partner for a
  // point-to-point call's.
  Status Wait(const Header& h, Requests* r, int index, const Deadline& deadline, const char* what,
              int notices_from = MPI_ANY_SOURCE);
  // Marks the communicator broken, cancels what is pending, and tells every peer why (a notice
  // that PeerGaveUp finds), unless the failure is itself such a notice.
  Status Fail(Status status);
  // Whether a notice from `source` (or MPI_ANY_SOURCE) that it gave up on this communicator has
  // come; if so, receives it into *error (the error on this rank that names the peer and quotes
  // its error). Waits poll it, so a rank that comes after its peers gave up fails at once
  // instead of after a timeout.
  bool PeerGaveUp(const Header& h, int source, Status* error);
  // PeerGaveUp on every kPollsPerNoticeProbe-th call, counted in *polls: a wait's poll.
  bool PeerGaveUpEvery(int64_t* polls, const Header& h, int source, Status* error);
  // PeerGaveUp, looking LooksForNotice() times (enough for a notice that came while this rank
  // was out of MPI) and until `seconds` have passed.
  bool PeerGaveUpLooking(const Header& h, int source, Status* error, double seconds = 0);
  int LooksForNotice() const;
  // After every receive of a call has completed: the error of PeerGaveUp if `source` (any rank
  // by default) gave up. Its data, sent before it did, completed this rank's receives, but the
  // call failed on that rank, so it must fail here too (as a late rank's does in shared
  // memory): a rank stalled past its peers' timeout once its headers were exchanged found their
  // small messages waiting and returned a result they had reported failed. For that, a few
  // looks (kLooksForNotice, whatever the communicator's size). Where the largest message
  // received was large enough for MPI to read it out of its sender's buffer only as this rank
  // took it (kRendezvousBytes), LooksForNotice() looks: a sender gives up, frees its sends
  // (they cannot be cancelled) and sends its notice before its call returns and XLA frees the
  // buffers those sends read, so a receiver that took such a message late may have read freed
  // memory, and finds the notice here instead of returning those bytes. A peer that gives up
  // just as this rank finishes can still go unseen.
  Status SendersStayed(const Header& h, size_t largest_received, int source = MPI_ANY_SOURCE);
  Status Broken(const Header& h) const;
  // Frees eager sends that have been received; with `block`, first waits for the oldest.
  Status ReapEager(const Header& h, bool block);
  Status Post(int dest, const Header& header, const void* data, size_t bytes, bool in_place);
  // Sends the in-place payloads whose receivers have said they are ready; every wait polls it
  // while a payload is pending, since the receiver may be waiting for one of this rank's.
  Status SendReadyPayloads();
  Status TimedOut(const Header& h, const Deadline& deadline, const std::set<int>& missing,
                  const char* what) const;

  Status ExchangeHeaders(const Header& h, const Deadline& deadline);
  // The collectives give each of their waits the whole timeout (EachWait), not what is left of
  // the call's: a large call that keeps moving may take longer than the timeout.
  Status RecursiveDoubling(const Header& h, const CollectiveBuffers& b);
  Status Ring(const Header& h, const CollectiveBuffers& b);
  // `tree`: a binomial tree of whole messages (small ones), else a pipelined chain of slices.
  Status Broadcast(const Header& h, const CollectiveBuffers& b, bool tree);
  Deadline EachWait() const { return Deadline(config_.timeout_seconds); }

  char* Scratch(int which, size_t bytes);

  MPI_Comm comm_;
  int rank_;
  int size_;
  bool direct_headers_;
  std::string name_;
  Config config_;
  std::string broken_;  // why the communicator failed; empty while healthy
  std::vector<char> scratch_[3];
  bool receives_left_running_ = false;  // by DropRequests: scratch_ may still be written
  std::vector<char> message_;     // the point-to-point message being received
  std::vector<Header> headers_;   // the header all-gather's
  Requests sends_, recvs_;        // the current collective's
  std::vector<MPI_Status> statuses_;  // Wait's, for the errors of failed requests
  std::deque<Eager> eager_;       // point-to-point sends still in flight
  // A payload sent straight from the caller's buffer (SendInPlace), per destination. It is posted
  // only once its receiver has posted the receive for it: MPICH cannot cancel a send whose
  // receiver has not come, so one posted earlier and given up on (a timeout) could be matched
  // later by a receiver that comes late, and read the caller's buffer after XLA has freed it.
  struct InPlace {
    Header header;
    const void* data = nullptr;
    size_t bytes = 0;
    bool pending = false;  // from SendInPlace to WaitSent (or a failure)
    char ready = 0;        // where the receiver's ready message lands (its content is unused)
    Requests ready_wait;   // the receive of that message
    Requests payload;      // the payload's sends, once it came
  };
  std::vector<InPlace> in_place_;
  int in_place_pending_ = 0;
  char ready_ = 0;  // the ready message this rank sends
};

// For tests: the next collective of this process's MPI transports sleeps `seconds` once its
// header exchange has completed, and the next in-place point-to-point receive once it has told
// its sender to send, as a rank does that the scheduler (or a debugger) stops there; 0 disarms it.
void StallNextDataForTest(double seconds);
// For tests: the next `slices` slices of this process's MPI rings each sleep `seconds` once
// handled (received, reduced, forwarded where forwarded), as a rank does that the scheduler
// leaves without a core.
void StallNextRingSlicesForTest(double seconds, int64_t slices);
// For tests: the next point-to-point receive of this process's MPI transports sleeps `seconds`
// before it looks for its message (after its own call's sends were posted); 0 disarms it.
void StallNextReceiveForTest(double seconds);
// Gives up on `requests` (sending[i]: whether request i is a send): cancels the receives, gives
// every request 0.1 s to complete (a cancelled receive that had not matched does at once), and a
// receive under way up to 1 s more to finish, then frees what is still active, which leaves it
// running. Sends are never cancelled (MpiTransport::Fail says why). A receive under way past that
// (its sender stalled mid-message) may still write into its buffer. Returns whether it left a
// receive running.
bool DropRequests(std::vector<MPI_Request>* requests, const std::vector<bool>& sending);

// The slices, in bytes, that the ring's steps and the broadcast chain cut `bytes` into:
// `pipeline_slice_bytes`, within one MPI piece (at most 1 GiB, MPI's counts being ints), but
// large enough that there are at most 1024 of them. Each slice is an MPI request, and a step posts
// all its receives ahead, so 4-byte slices of a 4 MiB all-reduce held 1 GiB of MPICH's request
// state. Every rank computes the same from the header and the plan, which carries the
// configured size.
int64_t SliceBytes(int64_t bytes, int64_t pipeline_slice_bytes);

// For tests: this process's MPI transports split messages into pieces of at most `bytes` (0:
// back to 1 GiB, as MPI's int counts need), so that small messages take the paths of large ones.
// Every rank must set the same, between calls.
void SetMaxPieceForTest(size_t bytes);

}  // namespace jaxring
