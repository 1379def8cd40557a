// A tiny error type for the native layers; handlers turn it into an XLA FFI error.
#pragma once

#include <string>
#include <utility>

namespace jaxring {

class Status {
 public:
  Status() = default;
  // An error is an error whatever its text: one built from an empty message (an MPI error
  // string that came back empty, say) still fails, with a text that says so.
  static Status Error(std::string message) {
    return Status(message.empty() ? "jaxring: an error without a message" : std::move(message));
  }
  bool ok() const { return message_.empty(); }
  const std::string& message() const { return message_; }

 private:
  explicit Status(std::string message) : message_(std::move(message)) {}
  std::string message_;
};

}  // namespace jaxring
