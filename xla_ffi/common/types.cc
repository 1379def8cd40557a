#include "common/types.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <sstream>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace jaxring {

bool IsSupported(DType dtype) {
  switch (dtype) {
    case DType::kS32: case DType::kS64: case DType::kF16:
    case DType::kF32: case DType::kF64: case DType::kBF16:
      return true;
  }
  return false;
}

size_t ByteWidth(DType dtype) {
  switch (dtype) {
    case DType::kF16: case DType::kBF16: return 2;
    case DType::kS32: case DType::kF32: return 4;
    case DType::kS64: case DType::kF64: return 8;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kS32: return "int32";
    case DType::kS64: return "int64";
    case DType::kF16: return "float16";
    case DType::kF32: return "float32";
    case DType::kF64: return "float64";
    case DType::kBF16: return "bfloat16";
  }
  return "unsupported";
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMean: return "mean";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "unknown";
}

const char* CollectiveName(Collective kind) {
  switch (kind) {
    case Collective::kAllReduce: return "all_reduce";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kAllGather: return "all_gather";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kBarrier: return "barrier";
    case Collective::kPermute: return "ppermute";
    case Collective::kSendRecv: return "send/recv";
  }
  return "unknown";
}

bool operator==(const Header& a, const Header& b) {
  return a.kind == b.kind && a.op == b.op && a.dtype == b.dtype && a.plan == b.plan &&
         a.op_id == b.op_id && a.count == b.count && a.root == b.root && a.whole == b.whole;
}

uint64_t Fnv1a(const int64_t* values, size_t count) {
  uint64_t digest = 14695981039346656037ull;
  for (size_t i = 0; i < count; ++i)
    for (int byte = 0; byte < 8; ++byte)
      digest = (digest ^ static_cast<uint8_t>(values[i] >> (8 * byte))) * 1099511628211ull;
  return digest;
}

int64_t PermDigest(const int64_t* perm, int64_t size) {
  std::vector<std::pair<int64_t, int64_t>> pairs;
  for (int64_t i = 0; i + 1 < size; i += 2) pairs.emplace_back(perm[i], perm[i + 1]);
  std::sort(pairs.begin(), pairs.end());
  std::vector<int64_t> flat;
  for (const auto& [source, destination] : pairs) flat.insert(flat.end(), {source, destination});
  return static_cast<int64_t>(Fnv1a(flat.data(), flat.size()) &
                              (static_cast<uint64_t>(kGpuStepTag) - 1));
}

bool SameMessage(const Header& a, const Header& b) {
  // A send and its recv are different call sites, so only ppermute compares op ids.
  return a.kind == b.kind && a.dtype == b.dtype && a.count == b.count && a.root == b.root &&
         (a.kind != Collective::kPermute || a.op_id == b.op_id);
}

std::string PermsDiffer(const Header& sent, const Header& expected) {
  if (sent.root == expected.root) return "";
  return " Their perms differ: a receive takes a message only if it passes the perm (the same "
         "pairs) that its send passed, and messages between two ranks are taken in the order "
         "they were sent.";
}

namespace {
struct CallSites {
  std::mutex mutex;
  std::unordered_set<std::string> sites;  // one copy of each: many op ids share a line
  std::unordered_map<int64_t, const std::string*> names;  // into `sites`, whose nodes stay put
};
CallSites& Sites() {
  static CallSites* sites = new CallSites;  // never destroyed: device threads may outlive exit
  return *sites;
}
std::atomic<size_t (*)(int64_t, char*, size_t)> call_site_source{nullptr};
}  // namespace

void SetCallSiteSource(size_t (*source)(int64_t, char*, size_t)) { call_site_source = source; }

void NameCallSite(int64_t op_id, std::string site) {
  CallSites& sites = Sites();
  std::lock_guard<std::mutex> lock(sites.mutex);
  sites.names[op_id] = &*sites.sites.insert(std::move(site)).first;
}

std::string NamedCallSite(int64_t op_id) {
  CallSites& sites = Sites();
  std::lock_guard<std::mutex> lock(sites.mutex);
  const auto found = sites.names.find(op_id);
  return found == sites.names.end() ? std::string() : *found->second;
}

std::string CallSite(int64_t op_id) {
  std::string site = NamedCallSite(op_id);
  const auto source = call_site_source.load();
  if (!site.empty() || source == nullptr) return site;
  // Asked once per op id and kept: calls are named when traced, before any of them runs, and a
  // GPU collective describes its call on every run.
  size_t bytes = source(op_id, nullptr, 0);
  while (bytes > site.size()) {  // a name may grow between two calls
    site.resize(bytes);
    bytes = source(op_id, site.data(), site.size());
  }
  site.resize(bytes);
  if (!site.empty()) NameCallSite(op_id, site);
  return site;
}

std::string Describe(const Header& h) {
  std::ostringstream s;
  s << CollectiveName(h.kind);
  if (h.kind == Collective::kAllReduce || h.kind == Collective::kReduceScatter)
    s << "(" << ReduceOpName(h.op) << ")";
  if (h.kind == Collective::kBroadcast) s << "(root=" << (h.root & ~kGpuStepTag) << ")";
  if ((h.kind == Collective::kPermute || h.kind == Collective::kSendRecv) && h.root != 0)
    s << "(perm #" << std::hex << h.root << std::dec << ")";
  s << " op " << h.op_id;
  if (h.kind != Collective::kBarrier) s << " " << DTypeName(h.dtype) << "[" << h.count << "]";
  if (h.whole != 0) s << " (a chunk of " << h.whole << ")";
  const std::string site = CallSite(h.op_id);
  if (!site.empty()) s << " (called at " << site << ")";
  return s.str();
}

Status CheckHeadersAgree(const std::function<std::string()>& where, int size,
                         const std::function<const Header&(int)>& header_of) {
  const Header& reference = header_of(0);
  for (int peer = 1; peer < size; ++peer) {
    const Header& other = header_of(peer);
    if (other == reference) continue;
    std::ostringstream s;
    Header same_plan = other;
    same_plan.plan = reference.plan;
    if (same_plan == reference) {
      s << where() << ": rank 0 and rank " << peer << " both called " << Describe(reference)
        << ", but their jaxring.config settings for collectives between processes (algorithm, "
           "mpi_ring_threshold_bytes, pipeline_slice_bytes) make them move its data differently, "
           "so their messages would not match: set the same on every rank.";
      return Status::Error(s.str());
    }
    s << where() << ": mismatched collectives: rank 0 called " << Describe(reference) << " but rank "
      << peer << " called " << Describe(other)
      << ". Every rank must make the same collective calls in the same order.";
    if ((reference.root ^ other.root) & kGpuStepTag)
      s << " One of them ran it on a GPU transport and the other on the host: on a communicator "
           "with a GPU transport every rank must run its collectives on its GPU.";
    return Status::Error(s.str());
  }
  return Status();
}

std::string NameInGroup(std::string_view name, int64_t group) {
  std::string named(name);
  constexpr std::string_view kGroup = "{group}";
  const size_t at = named.find(kGroup);
  if (at != std::string::npos) named.replace(at, kGroup.size(), std::to_string(group));
  return named;
}

std::string PeerError(int peer, const std::string& what, const std::string& why) {
  const std::string name = "rank " + std::to_string(peer);
  return name + " " + what + ". The error on " + name + ": " + why;
}

std::string Notice(const std::string& why, size_t bytes) {
  constexpr std::string_view kCut = " [...] ";
  if (why.size() <= bytes) return why;
  // Cuts fall between UTF-8 characters (a non-ASCII name, say), never inside one: the notice
  // becomes a Python string on the other rank. `at` moves back (the head) or on (the tail) past
  // continuation bytes.
  auto between = [&](size_t at, int step) {
    while (at > 0 && at < why.size() && (why[at] & 0xC0) == 0x80) at += step;
    return at;
  };
  if (bytes <= kCut.size()) return why.substr(0, between(bytes, -1));
  const size_t head = (bytes - kCut.size()) / 4;
  const size_t tail = why.size() - (bytes - kCut.size() - head);
  return why.substr(0, between(head, -1)) + std::string(kCut) + why.substr(between(tail, 1));
}

std::string Where(const Header& h, const std::string& comm_name, int rank, int size) {
  std::ostringstream s;
  s << "jaxring " << Describe(h) << " on " << comm_name << " (rank " << rank << " of " << size
    << ")";
  return s.str();
}

}  // namespace jaxring
