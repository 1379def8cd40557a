#include "transports/mpi_messages.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "common/wait.h"

namespace jaxring {
namespace {

constexpr int kTag = 0x6a75;                     // apart from the MPI transport's tags
constexpr size_t kMaxPiece = size_t{1} << 30;  // MPI counts are ints

struct MpiMessages {
  MPI_Comm comm;
  std::string name;
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

int MpiFailure(int code, const char* what, char* error, size_t error_bytes) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return Fail(error, error_bytes,
              std::string("MPI failed to ") + what + ": " + std::string(text, length));
}

template <typename Start>
int Post(MpiMessages* m, size_t bytes, int peer, bool sending, const char* what, char* error,
         size_t error_bytes, Start start) {
  size_t done = 0;
  do {  // a zero-byte message is still one message
    const size_t piece = std::min(bytes - done, kMaxPiece);
    m->requests.push_back(MPI_REQUEST_NULL);
    m->peers.push_back(peer);
    m->sending.push_back(sending);
    const int code = start(done, static_cast<int>(piece), &m->requests.back());
    if (code != MPI_SUCCESS) return MpiFailure(code, what, error, error_bytes);
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

// Polls with a back-off (yield, then naps up to 50 us): MPI offers nothing to sleep on.
int WaitAll(void* context, double timeout_seconds, char* error, size_t error_bytes) {
  auto* m = static_cast<MpiMessages*>(context);
  const Deadline deadline(timeout_seconds);
  auto nap = std::chrono::microseconds(1);
  int code = MPI_SUCCESS;
  for (;;) {
    int done = 0;
    code = MPI_Testall(static_cast<int>(m->requests.size()), m->requests.data(), &done,
                       MPI_STATUSES_IGNORE);
    if (code != MPI_SUCCESS || done) break;
    if (deadline.Expired()) {
      std::set<int> missing;
      for (size_t i = 0; i < m->requests.size(); ++i) {
        int flag = 0;
        MPI_Test(&m->requests[i], &flag, MPI_STATUS_IGNORE);
        if (!flag) missing.insert(m->peers[i]);
      }
      // Receives are cancelled, sends only freed: cancelling a large send under way crashed
      // MPICH's UCX device (MpiTransport::Fail).
      for (size_t i = 0; i < m->requests.size(); ++i) {
        MPI_Request& request = m->requests[i];
        if (request == MPI_REQUEST_NULL) continue;
        if (!m->sending[i]) MPI_Cancel(&request);
        MPI_Request_free(&request);
      }
      m->Clear();
      std::ostringstream s;
      s << "timed out after " << timeout_seconds << " s waiting for rank(s) [";
      bool first = true;
      for (int peer : missing) {
        s << (first ? "" : ", ") << peer;
        first = false;
      }
      s << "] to exchange data on " << m->name;
      return Fail(error, error_bytes, s.str());
    }
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::microseconds(50));
  }
  m->Clear();
  return code == MPI_SUCCESS ? 0 : MpiFailure(code, "exchange data", error, error_bytes);
}

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
  messages->name = name;
  *out = new JaxringMessageOps{messages, &PostSend, &PostReceive, &WaitAll};
  return Status();
}

}  // namespace jaxring
