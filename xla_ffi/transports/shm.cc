#include "transports/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <sstream>

#include "kernels/reduce_cpu.h"

namespace jaxring {

namespace {
constexpr uint32_t kMagic = 0x4a58524e;  // "JXRN"
constexpr size_t kPageBytes = 4096;
constexpr uint32_t kSerialMask = ~Flag::kAbandoned;

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }
}  // namespace

// What of a rank's error its peers can quote once it left (ShmCommunicator::Abandon).
constexpr size_t kWhyBytes = 1024;

struct alignas(64) RankControl {
  Flag progress;  // 3 * step + phase, in serial-number order
  alignas(64) Header headers[2];  // by step parity
  char why[kWhyBytes];  // written once, before `progress` is marked abandoned

  std::string Why() const { return std::string(why, strnlen(why, kWhyBytes)); }
};

struct ShmSegment {
  uint32_t magic;
  int32_t size;
  int64_t slot_bytes;
  alignas(64) RankControl ranks[1];  // `size` of them; the data area follows at DataOffset()

  static size_t DataOffset(int size) {
    return RoundUp(offsetof(ShmSegment, ranks) + size * sizeof(RankControl), kPageBytes);
  }
  static size_t Bytes(int size, int64_t slot_bytes) {
    return DataOffset(size) + 2 * (size + 1) * static_cast<size_t>(slot_bytes);
  }
  char* Data(int parity) {
    return reinterpret_cast<char*>(this) + DataOffset(size) +
           static_cast<size_t>(parity) * (size + 1) * slot_bytes;
  }
};

namespace {
std::mutex registry_mutex;
std::map<uint64_t, std::shared_ptr<ShmCommunicator>>& Registry() {
  static auto* registry = new std::map<uint64_t, std::shared_ptr<ShmCommunicator>>();
  return *registry;
}
}  // namespace

ShmCommunicator::ShmCommunicator(ShmSegment* segment, size_t mapped_bytes, int rank, int size,
                                 int64_t slot_bytes, std::string name)
    : segment_(segment),
      mapped_bytes_(mapped_bytes),
      rank_(rank),
      size_(size),
      slot_bytes_(slot_bytes),
      name_(std::move(name)) {}

Status ShmCommunicator::Attach(uint64_t key, const std::string& path, bool create, int rank,
                               int size, int64_t slot_bytes, const std::string& name) {
  const size_t bytes = ShmSegment::Bytes(size, slot_bytes);
  int fd = shm_open(path.c_str(), O_RDWR | (create ? O_CREAT | O_EXCL : 0), 0600);
  if (fd < 0)
    return Status::Error("jaxring: cannot open shared memory segment " + path + ": " +
                         std::strerror(errno));
  if (create) {
    // ftruncate alone reserves nothing on tmpfs: a segment larger than what /dev/shm has left
    // would map fine and then kill every rank with SIGBUS at the first large collective. So the
    // creator reserves the pages now, and a shortage is an error here instead.
    int error = ftruncate(fd, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
    if (error == 0) error = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (error != 0) {
      close(fd);
      return Status::Error("jaxring: cannot reserve " + std::to_string(bytes) +
                           " bytes of shared memory for segment " + path + ": " +
                           std::strerror(error) +
                           " (is /dev/shm large enough? a smaller slot_bytes needs less)");
    }
  }
  void* mapped = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (mapped == MAP_FAILED)
    return Status::Error("jaxring: cannot map shared memory segment " + path + ": " +
                         std::strerror(errno));
  auto* segment = static_cast<ShmSegment*>(mapped);
  if (create) {
    // A fresh segment is zero-filled: every flag and counter starts at 0.
    segment->size = size;
    segment->slot_bytes = slot_bytes;
    std::atomic_thread_fence(std::memory_order_release);
    segment->magic = kMagic;
  } else if (segment->magic != kMagic || segment->size != size ||
             segment->slot_bytes != slot_bytes) {
    munmap(mapped, bytes);
    return Status::Error("jaxring: shared memory segment " + path +
                         " does not match this communicator (size or slot bytes differ)");
  }
  std::lock_guard<std::mutex> lock(registry_mutex);
  Registry()[key].reset(new ShmCommunicator(segment, bytes, rank, size, slot_bytes, name));
  return Status();
}

ShmCommunicator::~ShmCommunicator() {
  if (closed_alone_)
    Abandon("rank " + std::to_string(rank_) + " closed " + name_ + " while its peers went on "
            "calling: its jaxring.mpi.Communicator was garbage-collected, or its process exited, "
            "with no free() on every rank. Keep a communicator alive on every rank while "
            "programs that use it run, and free() it on every rank together");
  munmap(segment_, mapped_bytes_);
}

void ShmCommunicator::Detach(uint64_t key, bool alone) {
  std::shared_ptr<ShmCommunicator> gone;  // unmapped once a call still running lets go of it
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = Registry().find(key);
    if (it == Registry().end()) return;
    gone = std::move(it->second);
    Registry().erase(it);
  }
  // Read by the destructor, in whichever thread lets go last (the release of a shared_ptr's
  // count orders this write before it).
  gone->closed_alone_ = alone;
}

void ShmCommunicator::Unlink(const std::string& path) { shm_unlink(path.c_str()); }

std::shared_ptr<ShmCommunicator> ShmCommunicator::Find(uint64_t key) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = Registry().find(key);
  return it == Registry().end() ? nullptr : it->second;
}

std::string ShmCommunicator::Where(const Header& header) const {
  return jaxring::Where(header, name_, rank_, size_);
}

uint32_t ShmCommunicator::Target(uint64_t step, Phase phase) const {
  return static_cast<uint32_t>(3 * step + static_cast<uint32_t>(phase)) & kSerialMask;
}

void* ShmCommunicator::Slot(int peer) const {
  return segment_->Data(static_cast<int>((step_ - 1) & 1)) + peer * slot_bytes_;
}

void* ShmCommunicator::Result() const { return Slot(size_); }

namespace {
// Copies smaller than this are too short to time and just follow the current mode.
constexpr size_t kTimedCopyBytes = 64 * 1024;
// Plain copies into shared memory ran at 11-36 GB/s with both cores on one die and 2.2 GB/s
// across dies (1 MiB, the peer having read the lines last). On one die about one in 30 still
// ran slow (a preempted copy, a page touched for the first time), so it takes kSlowInARow slow
// ones in a row to switch to streaming; one fast probe switches back.
constexpr double kSlowPlainBytesPerSecond = 5e9;
constexpr int64_t kSlowInARow = 3;
constexpr int64_t kProbeEvery = 64;
}  // namespace

void ShmCommunicator::CopyIn(void* dst, const void* src, size_t bytes, ShmStores mode) {
  if (mode != ShmStores::kAuto || bytes < kTimedCopyBytes) {
    if (StreamStores(mode)) {
      CopyStreamed(dst, src, bytes);
    } else {
      std::memcpy(dst, src, bytes);
    }
    return;
  }
  if (streaming_ && ++streamed_since_probe_ < kProbeEvery) {
    CopyStreamed(dst, src, bytes);
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  std::memcpy(dst, src, bytes);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const bool slow = static_cast<double>(bytes) < kSlowPlainBytesPerSecond * seconds;
  slow_in_a_row_ = slow ? slow_in_a_row_ + 1 : 0;
  streaming_ = slow && (streaming_ || slow_in_a_row_ >= kSlowInARow);
  streamed_since_probe_ = 0;
}

Status ShmCommunicator::BeginStep(const Header& header, const Deadline& deadline, int64_t spin) {
  if (broken_)
    return Status::Error(Where(header) + ": this communicator failed earlier and can no longer "
                         "be used (create a new one to continue); the first error was: " +
                         segment_->ranks[rank_].Why());
  ++step_;
  if (step_ <= 2) return Status();
  // This parity's buffers were last used two steps ago; every peer must be done with them.
  const uint64_t previous = step_ - 3;
  for (int peer = 0; peer < size_; ++peer) {
    Status status = WaitFor(peer, Phase::kCopied, header, deadline, spin, previous);
    if (!status.ok()) return status;
  }
  return Status();
}

void ShmCommunicator::PostHeader(const Header& header) {
  segment_->ranks[rank_].headers[(step_ - 1) & 1] = header;
}

Status ShmCommunicator::CheckHeaders(const Header& mine) const {
  const int parity = static_cast<int>((step_ - 1) & 1);
  return CheckHeadersAgree([&] { return Where(mine); }, size_, [&](int rank) -> const Header& {
    return segment_->ranks[rank].headers[parity];
  });
}

void ShmCommunicator::Publish(Phase phase) {
  segment_->ranks[rank_].progress.Store(Target(step_ - 1, phase));
}

void ShmCommunicator::Abandon(const std::string& why) {
  if (broken_) return;  // left already; its first error stands
  broken_ = true;
  RankControl& me = segment_->ranks[rank_];
  const size_t n = std::min(why.size(), kWhyBytes - 1);
  std::memcpy(me.why, why.data(), n);
  me.why[n] = '\0';
  me.progress.Abandon();  // sequentially consistent: a peer that sees the mark finds `why`
}

Status ShmCommunicator::WaitFor(int peer, Phase phase, const Header& header,
                                const Deadline& deadline, int64_t spin, uint64_t step) {
  const uint32_t target = Target(step, phase);
  const Flag& flag = segment_->ranks[peer].progress;
  flag.WaitReached(target, deadline, spin);
  const uint32_t seen = flag.Load();
  // A peer that got this far and then failed (say, on the header check) still counts as
  // arrived, so that every rank reaches the check and reports the mismatch itself.
  if (Flag::Reached(seen, target)) return Status();
  if (seen & Flag::kAbandoned) return PeerLeft(header, peer);
  std::ostringstream s;
  s << Where(header) << ": timed out after " << deadline.seconds() << " s waiting for rank(s) [";
  bool first = true;
  for (int other = 0; other < size_; ++other) {
    // `peer` as it was seen, so that it is named even if it arrives as the list is made.
    const uint32_t progress = other == peer ? seen : segment_->ranks[other].progress.Load();
    if (Flag::Reached(progress, target)) continue;
    s << (first ? "" : ", ") << other;
    first = false;
  }
  s << "]. A rank that never makes this call (a rank-dependent branch, or a crashed or killed "
       "process) cannot be waited for; raise jaxring.config timeout_seconds if it is just slow.";
  Abandon(s.str());
  return Status::Error(s.str());
}

Status ShmCommunicator::PeerLeft(const Header& header, int peer) {
  // This rank leaves too, passing on the first error (not its own, which would quote it, and
  // push it out of kWhyBytes as ranks leave one after another).
  const std::string first = segment_->ranks[peer].Why();
  Abandon(first);
  return Status::Error(Where(header) + ": rank " + std::to_string(peer) + " left the "
                       "communicator (it failed in this collective or an earlier one, or closed "
                       "the communicator), so this call cannot complete. The first error: " +
                       first);
}

Status ShmCommunicator::CheckNoPeerLeft(const Header& header) {
  const uint32_t finished = Target(step_ - 1, Phase::kCopied);
  for (int peer = 0; peer < size_; ++peer) {
    // A peer that finished this step left after it (it closed the communicator, or failed in a
    // later call): its part of the step is done, and its buffers stay as they are until every
    // rank has finished the step.
    const uint32_t seen = segment_->ranks[peer].progress.Load();
    if (peer != rank_ && (seen & Flag::kAbandoned) && !Flag::Reached(seen, finished))
      return PeerLeft(header, peer);
  }
  return Status();
}

Status ShmCommunicator::WaitFor(int peer, Phase phase, const Header& header,
                                const Deadline& deadline, int64_t spin) {
  return WaitFor(peer, phase, header, deadline, spin, step_ - 1);
}

Status ShmCommunicator::WaitAll(Phase phase, const Header& header, const Deadline& deadline,
                                int64_t spin) {
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    Status status = WaitFor(peer, phase, header, deadline, spin);
    if (!status.ok()) return status;
  }
  return Status();
}

}  // namespace jaxring
