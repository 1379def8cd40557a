#include "models/targets.h"

namespace jaxring::models {

std::vector<FfiTarget> CpuTargets() { return {}; }

}  // namespace jaxring::models
