#include "transports/process.h"

#include <map>

namespace jaxring {
namespace {
std::mutex registry_mutex;
std::map<uint64_t, std::shared_ptr<ProcessTransport>>& Registry() {
  static auto* registry = new std::map<uint64_t, std::shared_ptr<ProcessTransport>>();
  return *registry;
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

}  // namespace jaxring
