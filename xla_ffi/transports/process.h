// Transports between processes that run whole collectives and point-to-point messages
// themselves (MPI between nodes). They are built into a separate extension module, which links
// the MPI library, and registered here under their communicator's key; the CPU handlers look
// them up like the shared-memory communicators.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/status.h"
#include "common/types.h"
#include "ring/algorithms.h"
#include "transports/point_to_point.h"

namespace jaxring {

class ProcessTransport : public PointToPoint {
 public:
  // Runs one collective on this rank's buffers. Every rank of the communicator makes the same
  // calls in the same order (jaxring's ordered effect sees to that within a process).
  virtual Status RunCollective(const Header& header, const CollectiveBuffers& buffers,
                               const Config& config) = 0;
  // Exchanges and checks `header` with every rank, moving no data (a barrier with the checks of
  // a collective): the GPU transports synchronise their steps with it.
  virtual Status Agree(const Header& header, const Config& config) = 0;
  // The timeout and spin count that point-to-point calls (which take no config) use next.
  virtual void Configure(const Config& config) = 0;
  // Leaves the communicator because a linked one failed with `why` (FailLinked): later calls
  // fail, and peers are told `why` as if this transport had failed so itself.
  virtual void Abandon(const std::string& why) = 0;
  // Held by a handler for the whole of one call.
  std::mutex& mutex() { return mutex_; }

  // Takes ownership of `transport` under `key`, replacing any earlier one.
  static void Register(uint64_t key, std::unique_ptr<ProcessTransport> transport);
  static void Unregister(uint64_t key);
  // The transport registered under `key`, or null. The caller's reference keeps it alive for
  // the call even if its communicator is collected meanwhile.
  static std::shared_ptr<ProcessTransport> Find(uint64_t key);

  // Process communicators whose failures are one (a hierarchical communicator and its two
  // levels): when a call on one fails, FailLinked makes this rank leave the others too, shared
  // memory's (ShmCommunicator::Abandon) and process transports' alike, so that their peers, on
  // other nodes too, fail at once quoting the error instead of waiting out a timeout. A linked
  // communicator is left only while no call runs on it; jaxring's ordered effect runs a
  // process's calls one at a time, and a process transport whose mutex is held is skipped.
  static void LinkFailures(const std::vector<uint64_t>& keys);
  static void UnlinkFailures(uint64_t key);
  static void FailLinked(uint64_t key, const std::string& why);
  // This rank leaves communicator `key` and those linked to it with `why`, between calls (a GPU
  // collective failed outside the host library: kJaxringHostLeave).
  static void Leave(uint64_t key, const std::string& why);
  // A call on communicator `key` failed with `why`: this rank leaves all of it, its shared memory
  // and its process transport (a shared-memory communicator's point-to-point calls go over MPI;
  // a failure of either must refuse later calls on both and reach peers waiting in the other at
  // once), and the communicators linked to it. `held`: the process transport whose call failed,
  // whose mutex the caller holds (it has left already), or null.
  static void CallFailed(uint64_t key, const ProcessTransport* held, const std::string& why);

 private:
  std::mutex mutex_;
};

}  // namespace jaxring
