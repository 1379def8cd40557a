// FFI handlers that belong to the models (for example a fused WaveNet sampling step), as opposed to
// the collectives. Each model's source file adds its handlers to the list in targets.cc.
#pragma once

#include <vector>

namespace jaxring::models {

struct FfiTarget {
  const char* name;  // the custom-call target name used by the Python lowering
  void* handler;     // an XLA_FFI_Handler*
};

std::vector<FfiTarget> CpuTargets();

}  // namespace jaxring::models
