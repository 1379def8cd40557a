// The C ABI between jaxring's host library (_jaxring, which owns every communicator) and its CUDA
// library: a GPU handler stages its buffers in pinned host memory and hands them to the host
// library, which runs the collective or point-to-point call there exactly as a CPU handler would.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

// What a call does beyond its Collective kind: a collective, or one side of point-to-point.
enum JaxringHostRole : uint8_t {
  kJaxringHostCollective = 0,
  kJaxringHostPermute = 1,
  kJaxringHostSend = 2,
  kJaxringHostRecv = 3,
  // Only the header exchange of a collective: peers agree on the header (a mismatch or a missing
  // rank is an error, as for any call) and all arrive; no data moves. The GPU transports
  // (cuda/ipc.cc) synchronise their steps with it and move the data in device memory themselves.
  kJaxringHostAgree = 4,
  // This rank leaves process communicator `comm` because one of its GPU collectives failed
  // outside the host library (a CUDA error between the host calls of its steps or chunks): its
  // peers, waiting in a host call of the same collective for this rank, fail at once quoting
  // `input` (input_count bytes of text) instead of waiting out their timeout, and this rank's
  // later calls fail. The first error stands; a rank that left already stays as it was.
  kJaxringHostLeave = 5,
};

struct JaxringHostCall {
  uint64_t comm;          // communicator key (the custom call's "comm" attribute)
  const char* comm_name;  // for error messages: comm_name_size bytes, not NUL-terminated
  size_t comm_name_size;
  int32_t rank;
  int32_t size;
  int64_t group;          // index along the mesh axes not reduced over (0 for processes)
  int64_t run_id;
  int64_t op_id;
  uint8_t role;           // JaxringHostRole
  uint8_t kind;           // jaxring::Collective
  uint8_t op;             // jaxring::ReduceOp
  uint8_t dtype;          // jaxring::DType
  int64_t root;
  const void* input;
  int64_t input_count;
  void* output;
  int64_t output_count;
  const int64_t* perm;    // point-to-point: flattened (source, destination) pairs
  int64_t perm_size;
  // A collective run in chunks, each its own call (the staged GPU transport): the input_count of
  // the whole call, which peers compare too; 0 for a whole call.
  int64_t whole_count;
};

// Runs `call`. Returns 0 on success; otherwise nonzero, with a NUL-terminated message (cut to
// `error_bytes`) in `error`.
typedef int (*JaxringHostCallFn)(const JaxringHostCall* call, char* error, size_t error_bytes);
int JaxringRunHostCall(const JaxringHostCall* call, char* error, size_t error_bytes);

// jaxring.config's timeout_seconds (for waits the CUDA library makes itself).
double JaxringHostTimeoutSeconds(void);

// The source line _jaxring named for op_id's calls (jaxring::NamedCallSite): copies at most `bytes`
// of it into `site` (no NUL) and returns its whole length, 0 where none was named.
size_t JaxringHostCallSite(int64_t op_id, char* site, size_t bytes);

}  // extern "C"
