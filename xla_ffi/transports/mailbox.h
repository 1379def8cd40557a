// The in-process point-to-point transport: one mailbox per (communicator, group, source,
// destination, channel), a ring of slots written by the source device and read by the destination
// device. ppermute (and the WaveNet stages' messages) and send/recv have a channel each, as XLA
// gives its ppermute and its send/recv channels of their own: a ppermute between a send and its
// recv over the same pairs takes its own message, not the send's.
//
// Low latency follows NCCL's LL protocol: the flag that says "round r is here" sits in the slot
// beside the header and the payload and is written after them, so the receiver polls the slot
// itself and the sender never waits for the receiver to arrive (no handshake, no barrier). Only a
// sender that is a whole ring of slots ahead waits, for its oldest unread message.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "common/wait.h"
#include "transports/local.h"
#include "transports/point_to_point.h"

namespace jaxring {

class Mailbox;

// Slots per mailbox: how many messages a sender may run ahead of its receiver.
constexpr int kMailboxSlots = 8;

class LocalPointToPoint final : public PointToPoint {
 public:
  // `run_id`: XLA's id of the program run making the call; a message is received only by the
  // run that sent it. `kind`: the calls served, Collective::kSendRecv or (any other) ppermute's,
  // which choose the channel.
  LocalPointToPoint(CommunicatorId comm, int rank, int64_t run_id, Collective kind,
                    double timeout_seconds, int64_t spin_iterations);

  int rank() const override { return rank_; }
  int size() const override { return comm_.size; }
  Status SendCopy(int dest, const Header& header, const void* data, size_t bytes) override;
  Status SendInPlace(int dest, const Header& header, const void* data, size_t bytes) override;
  Status WaitSent(int dest) override;
  void WithdrawSent(int dest, const std::string& why) override;
  Status Receive(int source, const Header& expected, void* out, size_t bytes) override;
  std::string Where(const Header& header) const override;

  // The waits the next calls would make, given up (false) when `by` passes first: until the next
  // send to `dest` finds its slot free, the next message from `source` is there, and the last
  // in-place send has been read (true also where the wait would end at once with an error).
  bool SlotFree(int dest, const Deadline& by) const;
  bool MessageReady(int source, const Deadline& by) const;
  bool SentRead(const Deadline& by) const;

  // Empties every mailbox (after an error, when no device is inside a jaxring call).
  static void ResetAll();

 private:
  Status Post(int dest, const Header& header, const void* data, size_t bytes, bool in_place);
  // Marks the last in-place send's slot given up on (`why`: this rank's error), then lets a copy
  // that began before the mark finish; true if the receiver had read the message all the same
  // (the mark is then undone).
  bool TakeBack(const std::string& why);

  CommunicatorId comm_;
  int rank_;
  int64_t run_id_;
  bool send_recv_;  // the channel: send/recv's, or ppermute's
  // Each wait gives up after this long without what it waits for, so that a call that keeps
  // exchanging messages (the WaveNet stage kernel's, a whole chunk of steps long) may take longer.
  double timeout_seconds_;
  int64_t spin_iterations_;
  // The slot of the last in-place send, per call (a ppermute sends at most one message).
  Mailbox* in_place_mailbox_ = nullptr;
  uint64_t in_place_sequence_ = 0;
};

}  // namespace jaxring
