// Shared vocabulary of jaxring's native code: element types, reduction ops, collective kinds and
// the header peers exchange before any data moves. One table each; every other file uses these.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "common/status.h"

namespace jaxring {

// The values of DType, ReduceOp and Collective reach Python by name through _jaxring.codes()
// (python/module.cc), the only table of them there.

// Values match xla::ffi::DataType (XLA_FFI_DataType) so a buffer's element type converts directly.
enum class DType : uint8_t {
  kS32 = 4,
  kS64 = 5,
  kF16 = 10,
  kF32 = 11,
  kF64 = 12,
  kBF16 = 16,
};

bool IsSupported(DType dtype);
size_t ByteWidth(DType dtype);
const char* DTypeName(DType dtype);

enum class ReduceOp : uint8_t { kSum = 0, kMean = 1, kMax = 2, kMin = 3 };
const char* ReduceOpName(ReduceOp op);

enum class Collective : uint8_t {
  kAllReduce = 0,
  kReduceScatter = 1,
  kAllGather = 2,
  kBroadcast = 3,
  kBarrier = 4,
  kPermute = 5,   // ppermute: send and receive in one call
  kSendRecv = 6,  // a send matched with a recv (a separate call site on each side)
};
const char* CollectiveName(Collective kind);

// What every participant announces before data moves. Peers must agree on all fields; a mismatch
// is reported on every rank, naming both sides (Horovod's standard for mismatch errors).
struct Header {
  Collective kind = Collective::kBarrier;
  ReduceOp op = ReduceOp::kSum;
  DType dtype = DType::kF32;
  // A digest of how this rank moves the collective's data between processes, as its
  // configuration decides (MpiTransport: the method and, where it slices, the slice size), since
  // ranks that differ there would pair messages of different sizes; 0 where none is exchanged.
  uint32_t plan = 0;
  int64_t op_id = 0;   // static id of the call site, assigned at trace time
  int64_t count = 0;   // elements in this rank's input
  // Broadcast: the root. Point-to-point calls: a digest of the perm (PermDigest), which the
  // sender's and receiver's calls must share, so that a message is not taken by a call that does
  // not expect it (a rank's perm that names only its own pair, a message left by an earlier call
  // of another perm, a recv of one perm before that of another). 0 otherwise.
  int64_t root = 0;
  // Where this call is one chunk of a collective (the staged GPU transport runs each on the
  // host), the whole collective's input count, so that ranks whose calls differ in size fail in
  // the first chunk, even where the shorter call's chunks all match the longer one's; else 0.
  int64_t whole = 0;
};

// Set in `root` of the headers a GPU transport exchanges for its steps (kJaxringHostAgree), so
// that a rank running the same collective on the host transport is reported as a mismatch
// instead of being paired with a step that moves no data.
constexpr int64_t kGpuStepTag = int64_t{1} << 40;

bool operator==(const Header& a, const Header& b);
// FNV-1a over the bytes of `count` values (little-endian, 8 bytes each).
uint64_t Fnv1a(const int64_t* values, size_t count);
// A digest of a perm, `size` values of flattened (source, destination) pairs, whatever their
// order; below kGpuStepTag.
int64_t PermDigest(const int64_t* perm, int64_t size);
// Whether a point-to-point message with header `a` matches a receive expecting `b`.
bool SameMessage(const Header& a, const Header& b);
// For the error of a mismatched message: a sentence saying that the perms differ, if they do.
std::string PermsDiffer(const Header& sent, const Header& expected);
// Names the source line that traced the calls with this op id ("train.py:42 in loss"), as
// jaxring's Python side does for every call site (common.next_op_id), so that errors can say where
// each call they name comes from: where this process traced it, so a peer process's call that
// this one never traced goes unnamed. The names live in _jaxring; the other libraries that print
// headers (the MPI transport, the CUDA library) ask it through JaxringHostCallSite, their source.
void NameCallSite(int64_t op_id, std::string site);
std::string NamedCallSite(int64_t op_id);  // this library's name of op_id, "" where none
std::string CallSite(int64_t op_id);       // that, or else the source's
void SetCallSiteSource(size_t (*source)(int64_t op_id, char* site, size_t bytes));
// e.g. "all_reduce(sum) op 3 float32[1024] (called at train.py:42 in loss)"
std::string Describe(const Header& h);
// Every rank's header (`header_of(rank)`) must equal rank 0's. Otherwise an error after `where()`
// that names the first rank that differs and both calls: the same text on every rank, but for
// the calls' source lines, which each process names as far as it traced them. `where` is
// only called on a mismatch: formatting it costs about a microsecond, a whole small step's worth.
Status CheckHeadersAgree(const std::function<std::string()>& where, int size,
                         const std::function<const Header&(int)>& header_of);
// A communicator's name for errors, with its "{group}" (a mesh axis whose devices the other mesh
// axes split into groups: jaxring/_src/common.py) replaced by `group`, the call's.
std::string NameInGroup(std::string_view name, int64_t group);
// What a rank reports when `peer` gave up first: "rank <peer> <what>. The error on rank <peer>:
// <why>" (JAX raises one device's error of a failed program, so each quotes the first).
std::string PeerError(int peer, const std::string& what, const std::string& why);
// A gave-up notice's text: `why` cut to at most `bytes` (kept small, so that MPI sends it eagerly)
// by dropping its middle. A rank that gives up on a peer's notice passes on its own error, which
// quotes the peer's at its end, so the first rank's error (the cause) is the end of the text.
std::string Notice(const std::string& why, size_t bytes = 1024);
// Error text prefix naming the call, the communicator and the rank, e.g.
// "jaxring all_reduce(sum) op 3 float32[1024] on mesh axis 'i' (rank 2 of 4)".
std::string Where(const Header& h, const std::string& comm_name, int rank, int size);

}  // namespace jaxring
