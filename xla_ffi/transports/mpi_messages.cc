#include "transports/mpi_messages.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "common/wait.h"
#include "transports/mpi.h"

namespace jaxring {
namespace {

constexpr int kTag = 0x6a75;         // apart from the MPI transport's tags
constexpr int kGaveUpTag = 0x6a76;   // a rank's notice that it gave up on these messages
constexpr size_t kMaxPiece = size_t{1} << 30;  // MPI counts are ints

struct MpiMessages {
  MPI_Comm comm;
  int rank = 0;
  int size = 0;
  std::string name;
  std::string broken;  // why this rank gave up (then every later exchange fails at once)
  std::vector<MPI_Request> requests;
  std::vector<int> peers;
  std::vector<bool> sending;

  void Clear() {
    requests.clear();
    peers.clear();
    sending.clear();
  }
};

int Fail(char* error, size_t error_bytes, const std::string& message) {
  if (error_bytes > 0) {
    const size_t n = std::min(message.size(), error_bytes - 1);
    std::memcpy(error, message.data(), n);
    error[n] = '\0';
  }
  return 1;
}

// A rank that gives up (a timeout, an MPI error) returns its buffers to XLA while MPI may still
// read a send of its, since a send under way is only freed, never cancelled (WaitAll). So it
// tells every peer, and a peer that then finds the notice fails: before it posts a receive that
// could match such a send, while it waits, and after its receives completed (data that may have
// come from freed memory), as the MPI transport's notices and SendersStayed do. The notice's
// text is left allocated: MPI may still be sending it after this call returns.
std::string GiveUp(MpiMessages* m, std::string why) {
  if (!m->broken.empty()) return why;
  m->broken = why;
  const std::string* notice = new std::string(Notice(why));
  for (int peer = 0; peer < m->size; ++peer) {
    if (peer == m->rank) continue;
    MPI_Request request;
    if (MPI_Isend(notice->data(), static_cast<int>(notice->size()), MPI_CHAR, peer, kGaveUpTag,
                  m->comm, &request) == MPI_SUCCESS)
      MPI_Request_free(&request);
  }
  return why;
}

// Takes in `peer`'s notice that it gave up, if one has come, and says why. MPICH may need more
// than one probe to take in a message that has arrived, so it looks `looks` times (it runs before
// and after every message, so it does not look once per rank as the MPI transport's
// PeerGaveUpLooking does once per call).
bool PeerGaveUp(MpiMessages* m, int peer, std::string* why, int looks = 3) {
  int flag = 0;
  MPI_Message message = MPI_MESSAGE_NULL;
  MPI_Status status;
  for (int look = 0; look < looks && !flag; ++look)
    if (MPI_Improbe(peer, kGaveUpTag, m->comm, &flag, &message, &status) != MPI_SUCCESS)
      return false;
  if (!flag) return false;
  int length = 0;
  if (MPI_Get_count(&status, MPI_CHAR, &length) != MPI_SUCCESS || length < 0) length = 0;
  std::string text(static_cast<size_t>(length), '\0');
  if (MPI_Mrecv(text.data(), length, MPI_CHAR, &message, MPI_STATUS_IGNORE) != MPI_SUCCESS)
    text = "its notice could not be received";
  *why = "rank " + std::to_string(peer) + " gave up on " + m->name + " (" + text +
         "), so what it sent cannot be trusted";
  return true;
}

// An MPI error: this rank gives up on the messages, and the error says what failed.
// "MPI failed to <what>: <MPI's text for code>".
std::string MpiFailure(int code, const char* what) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string("MPI failed to ") + what + ": " + std::string(text, length);
}

int FailMpi(MpiMessages* m, int code, const char* what, char* error, size_t error_bytes) {
  return Fail(error, error_bytes, GiveUp(m, MpiFailure(code, what)));
}

template <typename Start>
int Post(MpiMessages* m, size_t bytes, int peer, bool sending, const char* what, char* error,
         size_t error_bytes, Start start) {
  if (!m->broken.empty())
    return Fail(error, error_bytes, "an earlier exchange on " + m->name + " failed: " + m->broken);
  std::string why;
  if (PeerGaveUp(m, peer, &why)) return Fail(error, error_bytes, GiveUp(m, why));
  size_t done = 0;
  do {  // a zero-byte message is still one message
    const size_t piece = std::min(bytes - done, kMaxPiece);
    m->requests.push_back(MPI_REQUEST_NULL);
    m->peers.push_back(peer);
    m->sending.push_back(sending);
    const int code = start(done, static_cast<int>(piece), &m->requests.back());
    if (code != MPI_SUCCESS) {
      m->requests.back() = MPI_REQUEST_NULL;  // not started; WaitAll drops the others
      return FailMpi(m, code, what, error, error_bytes);
    }
    done += piece;
  } while (done < bytes);
  return 0;
}

int PostSend(void* context, const void* data, size_t bytes, int peer, char* error,
             size_t error_bytes) {
  auto* m = static_cast<MpiMessages*>(context);
  return Post(m, bytes, peer, true, "send", error, error_bytes,
              [&](size_t offset, int count, MPI_Request* request) {
                return MPI_Isend(static_cast<const char*>(data) + offset, count, MPI_BYTE, peer,
                                 kTag, m->comm, request);
              });
}

int PostReceive(void* context, void* data, size_t bytes, int peer, char* error,
                size_t error_bytes) {
  auto* m = static_cast<MpiMessages*>(context);
  return Post(m, bytes, peer, false, "receive", error, error_bytes,
              [&](size_t offset, int count, MPI_Request* request) {
                return MPI_Irecv(static_cast<char*>(data) + offset, count, MPI_BYTE, peer, kTag,
                                 m->comm, request);
              });
}

// Receives are cancelled and given a moment to finish, sends only freed (DropRequests): a
// receive under way could write into an output XLA reclaims once the call returns.
void Drop(MpiMessages* m) {
  DropRequests(&m->requests, m->sending);
  m->Clear();
}

// Gives up (its peers learn why at once), then drops this wait's requests, which may take a
// while (a receive under way is given time to finish), and fails with `why`.
int GiveUpThenDrop(MpiMessages* m, const std::string& why, char* error, size_t error_bytes) {
  const std::string message = GiveUp(m, why);
  Drop(m);
  return Fail(error, error_bytes, message);
}

// The peers this rank exchanges with in the current wait (those it receives from with `only_from`).
std::set<int> Peers(const MpiMessages& m, bool only_from) {
  std::set<int> peers;
  for (size_t i = 0; i < m.peers.size(); ++i)
    if (!only_from || !m.sending[i]) peers.insert(m.peers[i]);
  return peers;
}

// Polls with a back-off (yield, then naps up to 50 us): MPI offers nothing to sleep on.
int WaitAll(void* context, double timeout_seconds, char* error, size_t error_bytes) {
  auto* m = static_cast<MpiMessages*>(context);
  if (!m->broken.empty()) {  // a post failed (it found a peer's notice): drop what was posted
    Drop(m);
    return Fail(error, error_bytes, "an earlier exchange on " + m->name + " failed: " + m->broken);
  }
  const Deadline deadline(timeout_seconds);
  auto nap = std::chrono::microseconds(1);
  int code = MPI_SUCCESS;
  std::string why;
  std::set<int> peers;  // whose notices a long wait looks for, once it is long
  for (;;) {
    int done = 0;
    code = MPI_Testall(static_cast<int>(m->requests.size()), m->requests.data(), &done,
                       MPI_STATUSES_IGNORE);
    if (code != MPI_SUCCESS || done) break;
    if (nap.count() >= 50) {  // waiting a while: a peer that gave up will not come
      if (peers.empty()) peers = Peers(*m, false);
      for (int peer : peers) {
        if (!PeerGaveUp(m, peer, &why, 1)) continue;  // one look per pass
        return GiveUpThenDrop(m, why, error, error_bytes);
      }
    }
    if (deadline.Expired()) {
      std::set<int> missing;
      for (size_t i = 0; i < m->requests.size(); ++i) {
        int flag = 0;
        MPI_Test(&m->requests[i], &flag, MPI_STATUS_IGNORE);
        if (!flag) missing.insert(m->peers[i]);
      }
      std::ostringstream s;
      s << "timed out after " << timeout_seconds << " s waiting for rank(s) [";
      bool first = true;
      for (int peer : missing) {
        s << (first ? "" : ", ") << peer;
        first = false;
      }
      s << "] to exchange data on " << m->name;
      return GiveUpThenDrop(m, s.str(), error, error_bytes);
    }
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::microseconds(50));
  }
  if (code != MPI_SUCCESS)
    return GiveUpThenDrop(m, MpiFailure(code, "exchange data"), error, error_bytes);
  // What came from a peer that gave up may have been read from a buffer it has since freed.
  for (int peer : Peers(*m, true)) {
    if (!PeerGaveUp(m, peer, &why)) continue;
    m->Clear();
    return Fail(error, error_bytes, GiveUp(m, why));
  }
  m->Clear();
  return 0;
}

void GiveUpOn(void* context, const char* why) { GiveUp(static_cast<MpiMessages*>(context), why); }

}  // namespace

Status CreateMpiMessages(MPI_Comm parent, const std::string& name, JaxringMessageOps** out) {
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  if (provided < MPI_THREAD_MULTIPLE)
    return Status::Error("jaxring.mpi: MPI was initialised without MPI_THREAD_MULTIPLE; jaxring "
                         "calls MPI from XLA's threads");
  auto* messages = new MpiMessages();
  if (MPI_Comm_dup(parent, &messages->comm) != MPI_SUCCESS) {
    delete messages;
    return Status::Error("jaxring.mpi: MPI_Comm_dup failed for " + name);
  }
  MPI_Comm_set_errhandler(messages->comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(messages->comm, &messages->rank);
  MPI_Comm_size(messages->comm, &messages->size);
  messages->name = name;
  *out = new JaxringMessageOps{messages, &PostSend, &PostReceive, &WaitAll, &GiveUpOn};
  return Status();
}

}  // namespace jaxring
