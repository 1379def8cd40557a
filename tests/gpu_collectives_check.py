"""A few calls of every collective on the GPU transport of JAXRING_GPU_TRANSPORT, compared with
numpy; small enough to run under compute-sanitizer (tests/test_gpu.py):

    JAXRING_GPU_TRANSPORT=ipc JAXRING_GPU_WORKSPACE_BYTES=65536 \
        mpiexec -n 2 compute-sanitizer --tool memcheck python tests/gpu_collectives_check.py
"""

import sys

import jax
import numpy as np

import jaxring
import jaxring.mpi

jax.config.update("jax_enable_x64", True)  # int64 and float64 buffers stay 64-bit


def main() -> int:
    comm = jaxring.mpi.world()
    if comm.gpu_transport in ("none", "host"):
        print(f"no GPU transport here ({comm.gpu_transport})", file=sys.stderr)
        return 2
    mpi = comm.mpi_comm
    n, rank = comm.size, comm.rank
    rng = np.random.default_rng(rank)
    for dtype in (np.float32, np.float16, np.int64):
        for block in (1, 7, 40_001):  # 40_001 float32 is several 64 KiB steps
            x = (rng.standard_normal(n * block) * 100).astype(dtype)
            everyone = np.stack(mpi.allgather(x)).astype(np.float64)
            y = np.asarray(jax.jit(lambda v: jaxring.all_reduce(v, comm, "max"))(x))
            np.testing.assert_array_equal(y, everyone.max(0).astype(dtype))
            y = np.asarray(jax.jit(lambda v: jaxring.all_reduce(v, comm))(x)).astype(np.float64)
            if dtype == np.int64:
                np.testing.assert_array_equal(y, everyone.sum(0))
            else:  # one rounding of the float32 sum (float16 too: it accumulates in float32)
                np.testing.assert_allclose(y, everyone.sum(0), rtol=np.finfo(dtype).eps, atol=0)
            y = np.asarray(jax.jit(lambda v: jaxring.reduce_scatter(v, comm, "min"))(x))
            np.testing.assert_array_equal(
                y, everyone.min(0)[rank * block:(rank + 1) * block].astype(dtype))
            y = np.asarray(jax.jit(lambda v: jaxring.all_gather(v, comm))(x[:block]))
            np.testing.assert_array_equal(y, np.concatenate(mpi.allgather(x[:block])))
            y = np.asarray(jax.jit(lambda v: jaxring.broadcast(v, comm, root=n - 1))(x))
            np.testing.assert_array_equal(y, mpi.bcast(x, root=n - 1))
    print(f"rank {rank}: collectives agree with numpy ({comm.gpu_transport})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
