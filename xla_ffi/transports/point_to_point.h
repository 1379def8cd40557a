// What a point-to-point protocol needs from a transport: the ability to hand one message to one
// peer, either by copying it out (eager) or by exposing the sender's buffer until the receiver
// has read it (rendezvous). The in-process mailbox implements it today; the MPI/shm and CUDA
// transports implement the same four calls.
//
// Messages between one (source, destination) pair are matched in the order they were sent, apart
// for ppermute's and for send/recv's (a channel each), and the receiver checks each message's
// header against the one it expects.
#pragma once

#include <cstddef>
#include <string>

#include "common/status.h"
#include "common/types.h"

namespace jaxring {

// For a receive that timed out while the other channel from `source` had a message waiting:
// why the calls may not have met. `send_recv`: the channel of the receive.
inline std::string OtherChannelHint(int source, bool send_recv) {
  return std::string(" Rank ") + std::to_string(source) + " has sent this rank a " +
         (send_recv ? "ppermute" : "send/recv") + " message that nothing took: did it call " +
         (send_recv ? "ppermute" : "send") + " where this rank calls " +
         (send_recv ? "recv" : "ppermute") + "? Every rank must make the same calls.";
}

class PointToPoint {
 public:
  virtual ~PointToPoint() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Copies `bytes` out of `data` for `dest` and returns without waiting for the receiver (unless
  // it has fallen a whole mailbox of messages behind).
  virtual Status SendCopy(int dest, const Header& header, const void* data, size_t bytes) = 0;
  // Lets `dest` copy straight out of `data`; `data` must not change until WaitSent(dest), or
  // WithdrawSent(dest) where the call fails in between.
  virtual Status SendInPlace(int dest, const Header& header, const void* data, size_t bytes) = 0;
  virtual Status WaitSent(int dest) = 0;
  // Takes back what SendInPlace lent, without waiting for `dest`: once this returns, `dest` never
  // starts reading `data` (it fails instead), and a copy it had begun has ended. For a call that
  // failed after lending its buffer, which XLA may free once the call returns; `why` is its error.
  virtual void WithdrawSent(int dest, const std::string& why) = 0;
  // Receives the next message from `source` into `out`, after checking its header.
  virtual Status Receive(int source, const Header& expected, void* out, size_t bytes) = 0;

  // Error text prefix naming the call, the communicator and this rank.
  virtual std::string Where(const Header& header) const = 0;
};

}  // namespace jaxring
