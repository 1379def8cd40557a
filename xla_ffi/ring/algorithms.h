// The collective algorithms on the local transport: which rank reduces or copies what, and when.
// Handlers pick one and call it; the algorithms call the transport for pointers and hand-offs and
// the kernels for arithmetic.
#pragma once

#include <cstdint>

#include "common/config.h"
#include "common/status.h"
#include "common/types.h"
#include "transports/local.h"

namespace jaxring {

struct CollectiveBuffers {
  const void* input;
  void* output;
  int64_t output_count;
};

// The direct algorithms cut each rank's work into pieces of about this many bytes, which other
// ranks take over once their own are done (LocalTransport::Share); the all-gather, where it
// streams, reads each piece of an input once and writes it into every output.
constexpr int64_t kDirectPieceBytes = 256 * 1024;

// The algorithm `config` selects for this call on `size` ranks (kDirect or kRing).
Algorithm ChooseAlgorithm(const Header& header, int size, const Config& config);

// Bytes of accumulator scratch a rank must publish for `algorithm` (0 if none).
size_t ScratchBytes(const Header& header, int size, Algorithm algorithm);

// Runs the collective after WaitForPeers succeeded. Returns once this rank's output is complete
// and no peer will read this rank's buffers again.
Status RunCollective(LocalTransport& transport, Algorithm algorithm, const Config& config,
                     const CollectiveBuffers& buffers);

}  // namespace jaxring
