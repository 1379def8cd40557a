"""GPU processes (skipped without a GPU; tests/test_gpu.py launches this directory on 1, 2 and 4
processes sharing one GPU, once per GPU transport). The rest of tests/mpi runs on the transport
under test as well: every op x dtype against float64 numpy, awkward sizes, mismatches, timeouts.
Here: the transports against float64 and against each other on one job, bits that repeat and
agree across ranks, many calls in one program (the workspace parities and events are reused with
no host synchronisation between calls), and steps cut small enough to cover the 2D copies."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxring
import jaxring.mpi
from jaxring._src import native
from helpers import DTYPES, assert_close, random_array

pytestmark = pytest.mark.skipif(not native.has_cuda_backend(), reason="no CUDA GPU visible")

COMM = jaxring.mpi.world()
MPI_COMM = COMM.mpi_comm
OPS = list(jaxring.REDUCE_OPS)
# cuda-ipc needs one node; under pretend nodes (JAXRING_MPI_RANKS_PER_NODE) only staged and host.
NODE = jaxring.mpi._node_communicator(MPI_COMM, jaxring.mpi._ranks_per_node(None))
ONE_NODE = NODE.Get_size() == COMM.size
TRANSPORTS = ["ipc", "staged", "host"] if ONE_NODE else ["staged", "host"]
GPU_TRANSPORTS = [t for t in TRANSPORTS if t != "host"]
REFERENCE = {"sum": lambda a: a.sum(0), "mean": lambda a: a.mean(0),
             "max": lambda a: a.max(0), "min": lambda a: a.min(0)}


@functools.cache
def communicator(transport: str, small: bool = False) -> jaxring.mpi.Communicator:
    """A communicator per GPU transport; `small`: 4 KiB steps (many steps per call)."""
    sizes = dict(gpu_workspace_bytes=4096, gpu_staging_bytes=4096) if small else {}
    return jaxring.mpi.Communicator(MPI_COMM.Dup(), label=f"{transport}{' small' * small}",
                                    gpu_transport=transport, **sizes)


def gathered(x):
    return np.stack(MPI_COMM.allgather(np.asarray(x)))


def same_on_every_rank(y):
    mine = np.ascontiguousarray(np.asarray(y)).tobytes()
    assert all(other == mine for other in MPI_COMM.allgather(mine)), "ranks disagree"


def exact(dtype, op):
    return np.issubdtype(dtype, np.integer) and op != "mean" or op in ("max", "min")


def test_the_requested_transport_is_in_use_on_the_gpu():
    assert jax.devices()[0].platform == "gpu"
    expected = os.environ.get("JAXRING_EXPECT_GPU_TRANSPORT")
    if expected:
        assert COMM.gpu_transport == expected, COMM
    for transport in TRANSPORTS:
        assert communicator(transport).gpu_transport == transport


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_transport_against_float64_and_each_other(dtype, op):
    n = COMM.size
    rng = np.random.default_rng([COMM.rank, dtype.num, OPS.index(op)])
    for size in (0, 5, 4097, (1 << 18) + 3):
        x = random_array(rng, (size,), dtype)
        expected = REFERENCE[op](gathered(x).astype(np.float64))
        results = {}
        for transport in TRANSPORTS:
            comm = communicator(transport)
            y = np.asarray(jax.jit(lambda v, c=comm: jaxring.all_reduce(v, c, op))(x))
            integer_mean = op == "mean" and np.issubdtype(dtype, np.integer)
            assert_close(y, expected, y.dtype if integer_mean else dtype, count=n)
            same_on_every_rank(y)
            results[transport] = y
        if exact(dtype, op):
            for transport in GPU_TRANSPORTS:
                np.testing.assert_array_equal(results[transport], results["host"])


@pytest.mark.parametrize("transport", GPU_TRANSPORTS)
def test_bits_repeat_run_to_run_and_agree_across_ranks(transport):
    rng = np.random.default_rng(COMM.rank)
    f = jax.jit(lambda v: jaxring.all_reduce(v, communicator(transport)))
    for dtype in (np.float32, jnp.bfloat16):
        x = random_array(rng, ((3 << 20) + 7,), np.dtype(dtype))  # several steps, two-shot
        first = np.asarray(f(x))
        for _ in range(3):
            np.testing.assert_array_equal(np.asarray(f(x)).view(np.uint8), first.view(np.uint8))
        same_on_every_rank(first)


@pytest.mark.parametrize("transport", GPU_TRANSPORTS)
def test_many_calls_in_one_program_and_in_flight(transport):
    """Calls back to back with no host synchronisation: a loop of 12 in one program, and 6
    dispatched programs before the first result is read."""
    comm = communicator(transport, small=True)
    n = COMM.size
    rng = np.random.default_rng(COMM.rank + 100)
    x = rng.standard_normal(3001)
    scale = 1.0 + COMM.rank  # so that every step reduces different values on every rank
    loop = jax.jit(lambda v: jax.lax.fori_loop(
        0, 12, lambda i, c: jaxring.all_reduce(c * scale, comm) / n + i, v))
    scales = 1.0 + np.arange(n)[:, None]
    c = gathered(x)
    for i in range(12):
        c = np.broadcast_to((c * scales).sum(0) / n + i, c.shape)
    np.testing.assert_allclose(np.asarray(loop(x)), c[0], rtol=1e-12)
    f = jax.jit(lambda v: jaxring.all_reduce(v, comm, "max"))
    inputs = [rng.standard_normal(1000 + 37 * k).astype(np.float32) for k in range(6)]
    outputs = [f(v) for v in inputs]  # dispatched, not yet read
    for v, y in zip(inputs, outputs):
        np.testing.assert_array_equal(np.asarray(y), gathered(v).max(0))


@pytest.mark.parametrize("small", [False, True], ids=["one step", "4 KiB steps"])
@pytest.mark.parametrize("transport", GPU_TRANSPORTS)
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), np.dtype(np.float64),
                                   np.dtype(np.int32)], ids=str)
def test_reduce_scatter_all_gather_broadcast(dtype, transport, small):
    n = COMM.size
    comm = communicator(transport, small)
    rng = np.random.default_rng([COMM.rank, dtype.num, 7])
    for block in (0, 1, 7, 3001):
        x = random_array(rng, (n * block,), dtype)
        inputs = gathered(x).astype(np.float64)
        for op in ("sum", "max"):
            y = jax.jit(lambda v, op=op: jaxring.reduce_scatter(v, comm, op))(x)
            expected = REFERENCE[op](inputs)[COMM.rank * block:(COMM.rank + 1) * block]
            assert_close(y, expected, dtype, count=n)
        piece = x[:block]
        together = jax.jit(lambda v: jaxring.all_gather(v, comm))(piece)
        np.testing.assert_array_equal(np.asarray(together), gathered(piece).reshape(-1))
        for root in sorted({0, n - 1}):
            got = jax.jit(lambda v, root=root: jaxring.broadcast(v, comm, root=root))(piece)
            np.testing.assert_array_equal(np.asarray(got), gathered(piece)[root])


def test_two_dimensional_arrays_and_misaligned_sizes():
    comm = communicator(GPU_TRANSPORTS[0], small=True)
    rng = np.random.default_rng(COMM.rank + 5)
    for shape in [(3, 5), (17, 33), (1, 1031)]:
        x = rng.standard_normal(shape).astype(np.float32)
        y = jax.jit(lambda v: jaxring.all_reduce(v, comm, "min"))(x)
        np.testing.assert_array_equal(np.asarray(y), gathered(x).min(0))
