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
// by its receiver straight out of `input`, and Permute waits until it has been (WaitSent) unless
// `left_in_place` is given: then it says whether the message went in place, and the caller must
// WaitSent(dest) before `input` may change.
Status Permute(PointToPoint& transport, const Header& header, int dest, int source,
               const void* input, void* output, size_t bytes, const Config& config,
               bool* left_in_place = nullptr);

// The two halves of a permutation as separate calls. A send never waits for its receiver, so a
// stage can send, compute, then receive without deadlocking a cycle of stages.
Status Send(PointToPoint& transport, const Header& header, int dest, const void* input,
            size_t bytes);
Status Receive(PointToPoint& transport, const Header& header, int source, void* output,
               size_t bytes);

}  // namespace jaxring
