#include "transports/process.h"

#include <map>

#include "transports/shm.h"

namespace jaxring {
namespace {
std::mutex registry_mutex;
std::map<uint64_t, std::shared_ptr<ProcessTransport>>& Registry() {
  static auto* registry = new std::map<uint64_t, std::shared_ptr<ProcessTransport>>();
  return *registry;
}
std::mutex links_mutex;
std::map<uint64_t, std::vector<uint64_t>>& Links() {  // each key's linked keys, itself included
  static auto* links = new std::map<uint64_t, std::vector<uint64_t>>();
  return *links;
}

// This rank leaves the communicators under `key` (shared memory's, a process transport's) with
// `why`. A process transport whose mutex is held runs a call, and is skipped (process.h); so is
// `held`, whose failed call this thread runs, holding its mutex (it has left already).
void AbandonKey(uint64_t key, const std::string& why, const ProcessTransport* held = nullptr) {
  if (auto shm = ShmCommunicator::Find(key)) shm->Abandon(why);  // its first error stands
  auto transport = ProcessTransport::Find(key);
  if (transport && transport.get() != held) {
    std::unique_lock<std::mutex> lock(transport->mutex(), std::try_to_lock);
    if (lock.owns_lock()) transport->Abandon(why);
  }
}
}  // namespace

void ProcessTransport::Register(uint64_t key, std::unique_ptr<ProcessTransport> transport) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  Registry()[key] = std::move(transport);
}

void ProcessTransport::Unregister(uint64_t key) {
  std::shared_ptr<ProcessTransport> gone;  // a call still running holds its own reference
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = Registry().find(key);
    if (it == Registry().end()) return;
    gone = std::move(it->second);
    Registry().erase(it);
  }
}

std::shared_ptr<ProcessTransport> ProcessTransport::Find(uint64_t key) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = Registry().find(key);
  return it == Registry().end() ? nullptr : it->second;
}

void ProcessTransport::LinkFailures(const std::vector<uint64_t>& keys) {
  std::lock_guard<std::mutex> lock(links_mutex);
  for (uint64_t key : keys) Links()[key] = keys;
}

void ProcessTransport::UnlinkFailures(uint64_t key) {
  std::lock_guard<std::mutex> lock(links_mutex);
  Links().erase(key);
}

void ProcessTransport::FailLinked(uint64_t key, const std::string& why) {
  std::vector<uint64_t> linked;
  {
    std::lock_guard<std::mutex> lock(links_mutex);
    auto it = Links().find(key);
    if (it == Links().end()) return;
    linked = it->second;
  }
  for (uint64_t other : linked)
    if (other != key) AbandonKey(other, why);
}

void ProcessTransport::Leave(uint64_t key, const std::string& why) {
  CallFailed(key, nullptr, why);
}

void ProcessTransport::CallFailed(uint64_t key, const ProcessTransport* held,
                                  const std::string& why) {
  AbandonKey(key, why, held);
  FailLinked(key, why);
}

}  // namespace jaxring
