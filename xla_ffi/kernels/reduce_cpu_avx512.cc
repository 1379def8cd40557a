// The reduction kernels built for AVX-512 F, BW and VL (CMakeLists.txt sets the flags); see
// reduce_cpu_impl.inc.
#define JAXRING_CPU_KERNELS_NS avx512
#include "kernels/reduce_cpu_impl.inc"
