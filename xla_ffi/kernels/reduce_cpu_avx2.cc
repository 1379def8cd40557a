// The reduction kernels built for AVX2 (CMakeLists.txt sets the flags); see reduce_cpu_impl.inc.
#define JAXRING_CPU_KERNELS_NS avx2
#include "kernels/reduce_cpu_impl.inc"
