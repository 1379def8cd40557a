#include "p2p/protocol.h"

#include <cstring>

namespace jaxring {

Status Send(PointToPoint& transport, const Header& header, int dest, const void* input,
            size_t bytes) {
  if (dest < 0) return Status();
  return transport.SendCopy(dest, header, input, bytes);
}

Status Receive(PointToPoint& transport, const Header& header, int source, void* output,
               size_t bytes) {
  if (source < 0) {
    std::memset(output, 0, bytes);
    return Status();
  }
  return transport.Receive(source, header, output, bytes);
}

Status Permute(PointToPoint& transport, const Header& header, int dest, int source,
               const void* input, void* output, size_t bytes, const Config& config,
               bool* left_in_place) {
  if (left_in_place != nullptr) *left_in_place = false;
  const int self = transport.rank();
  if (dest == self && source == self) {
    std::memcpy(output, input, bytes);
    return Status();
  }
  // Everyone posts before anyone receives, so cycles of in-place sends cannot deadlock.
  const bool in_place = dest >= 0 && static_cast<int64_t>(bytes) > config.p2p_eager_bytes;
  Status status = in_place ? transport.SendInPlace(dest, header, input, bytes)
                           : Send(transport, header, dest, input, bytes);
  if (!status.ok()) return status;
  status = Receive(transport, header, source, output, bytes);
  if (!status.ok() || !in_place) return status;
  if (left_in_place != nullptr) {
    *left_in_place = true;
    return status;
  }
  return transport.WaitSent(dest);
}

}  // namespace jaxring
