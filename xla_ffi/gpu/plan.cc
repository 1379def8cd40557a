#include "gpu/plan.h"

#include <algorithm>

namespace jaxring {
namespace gpu {

int64_t StepElements(Transport transport, Collective kind, int size, int64_t bytes,
                     size_t width) {
  // Where a step needs n pieces in one slot: reduce_scatter stages one piece per destination;
  // the staged all_gather receives n pieces into one chunk.
  const bool n_pieces = kind == Collective::kReduceScatter ||
                        (transport == Transport::kStaged && kind == Collective::kAllGather);
  const int64_t pieces = n_pieces ? size : 1;
  const int64_t elements = bytes / static_cast<int64_t>(width) / pieces;
  const int64_t vector = kVectorBytes / static_cast<int64_t>(width);
  return elements >= vector ? elements / vector * vector : elements;
}

std::vector<Step> PlanSteps(int64_t block_count, int64_t step_elements) {
  std::vector<Step> steps;
  if (block_count <= 0 || step_elements <= 0) {
    steps.push_back(Step{0, 0});
    return steps;
  }
  for (int64_t first = 0; first < block_count; first += step_elements)
    steps.push_back(Step{first, std::min(step_elements, block_count - first)});
  return steps;
}

IpcAlgorithm ChooseIpcAlgorithm(int64_t step_bytes, int size) {
  return size <= 2 || step_bytes <= kIpcOneShotBytes ? IpcAlgorithm::kOneShot
                                                     : IpcAlgorithm::kTwoShot;
}

Partition ShareOf(int64_t count, int size, size_t width) {
  return Partition{count, size, std::max<int64_t>(1, kVectorBytes / static_cast<int64_t>(width))};
}

int64_t BlockCount(Collective kind, int64_t input_count, int size) {
  return kind == Collective::kReduceScatter ? input_count / std::max(size, 1) : input_count;
}

Header HeaderOf(const JaxringHostCall& call) {
  Header header;
  header.kind = static_cast<Collective>(call.kind);
  header.op = static_cast<ReduceOp>(call.op);
  header.dtype = static_cast<DType>(call.dtype);
  header.op_id = call.op_id;
  header.count = call.input_count;
  header.root = call.root;
  header.whole = call.whole_count;
  return header;
}

void LeaveAfterFailure(JaxringHostCallFn host_call, const JaxringHostCall& call, int rank,
                       const std::string& why) {
  if (host_call == nullptr) return;
  JaxringHostCall leave = call;
  leave.rank = rank;
  leave.group = 0;
  leave.role = kJaxringHostLeave;
  leave.input = why.data();
  leave.input_count = static_cast<int64_t>(why.size());
  leave.output = nullptr;
  leave.output_count = 0;
  char error[256];
  (void)host_call(&leave, error, sizeof(error));
}

std::string CheckSlotBytes(Transport transport, int64_t bytes, int size) {
  const char* what = transport == Transport::kIpc ? "gpu_workspace_bytes" : "gpu_staging_bytes";
  if (bytes < kMinSlotBytes)
    return std::string(what) + " must be at least " + std::to_string(kMinSlotBytes) +
           " bytes, got " + std::to_string(bytes);
  if (bytes % kVectorBytes != 0)
    return std::string(what) + " must be a multiple of " + std::to_string(kVectorBytes) +
           " bytes, got " + std::to_string(bytes);
  if (bytes / size < kVectorBytes)
    return std::string(what) + " of " + std::to_string(bytes) + " bytes is too small for " +
           std::to_string(size) + " ranks (at least 16 bytes per rank)";
  return "";
}

}  // namespace gpu
}  // namespace jaxring
