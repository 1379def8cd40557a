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

Status PostPermute(PointToPoint& transport, const Header& header, int dest, int source,
                   const void* input, void* output, size_t bytes, const Config& config,
                   bool* in_place) {
  *in_place = false;
  const int self = transport.rank();
  if (dest == self && source == self) {
    std::memcpy(output, input, bytes);
    return Status();
  }
  *in_place = dest >= 0 && static_cast<int64_t>(bytes) > config.p2p_eager_bytes;
  return *in_place ? transport.SendInPlace(dest, header, input, bytes)
                   : Send(transport, header, dest, input, bytes);
}

Status ReceivePermute(PointToPoint& transport, const Header& header, int dest, int source,
                      void* output, size_t bytes) {
  if (dest == transport.rank() && source == transport.rank()) return Status();  // copied
  return Receive(transport, header, source, output, bytes);
}

Status Permute(PointToPoint& transport, const Header& header, int dest, int source,
               const void* input, void* output, size_t bytes, const Config& config) {
  bool in_place = false;
  Status status = PostPermute(transport, header, dest, source, input, output, bytes, config,
                              &in_place);
  if (!status.ok()) return status;  // nothing was lent
  return SettleLent(transport, dest, in_place,
                    ReceivePermute(transport, header, dest, source, output, bytes));
}

Status SettleLent(PointToPoint& transport, int dest, bool in_place, Status received) {
  if (!in_place) return received;
  if (received.ok()) return transport.WaitSent(dest);
  transport.WithdrawSent(dest, received.message());
  return received;
}

}  // namespace jaxring
