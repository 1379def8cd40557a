// Point-to-point protocols: how ppermute, send and recv move one message over any PointToPoint
// transport. Small messages go eagerly (copied into the receiver's mailbox; the sender moves on);
// large ppermute messages are read once, straight out of the sender's buffer (rendezvous).
#pragma once

#include <cstddef>

#include "common/config.h"
#include "common/status.h"
#include "common/types.h"
#include "transports/point_to_point.h"

namespace jaxring {

// One rank's part of a permutation: send `input` to `dest` and receive `output` from `source`
// (-1: none; a rank that receives nothing gets zeros, as lax.ppermute). A large message is read
// by its receiver straight out of `input`, and Permute returns once it has been.
Status Permute(PointToPoint& transport, const Header& header, int dest, int source,
               const void* input, void* output, size_t bytes, const Config& config);

// Permute in its three steps, for a caller that may go on with them on another thread: post the
// message (`in_place` says whether it lends `input`), receive, and, for a message lent in place,
// wait until `dest` has read it (transport.WaitSent(dest)). Every rank posts before it receives,
// so cycles of in-place sends cannot deadlock. A rank that sends to and receives from itself
// only copies, in PostPermute.
Status PostPermute(PointToPoint& transport, const Header& header, int dest, int source,
                   const void* input, void* output, size_t bytes, const Config& config,
                   bool* in_place);
Status ReceivePermute(PointToPoint& transport, const Header& header, int dest, int source,
                      void* output, size_t bytes);
// The last step after ReceivePermute's `received`: for a message lent in place, wait until `dest`
// has read it or, where the receive failed, take the buffer back (WithdrawSent), since the call
// returns its error at once and XLA may then free the buffer.
Status SettleLent(PointToPoint& transport, int dest, bool in_place, Status received);

// The two halves of a permutation as separate calls. A send never waits for its receiver, so a
// stage can send, compute, then receive without deadlocking a cycle of stages.
Status Send(PointToPoint& transport, const Header& header, int dest, const void* input,
            size_t bytes);
Status Receive(PointToPoint& transport, const Header& header, int source, void* output,
               size_t bytes);

}  // namespace jaxring
