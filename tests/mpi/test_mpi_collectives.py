"""Collectives across processes (run under mpiexec; tests/test_mpi.py launches this file with 2,
3 and 4 ranks; under plain pytest it runs as one rank). Results are compared against float64
numpy on the gathered inputs of every rank, and against each other across ranks."""

import dataclasses
import gc
import os
import re
import time
import weakref

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import jaxring
import jaxring.mpi
from jaxring._src import native
from helpers import DTYPES, RTOL, assert_close, called_at, random_array

COMM = jaxring.mpi.world()
MPI_COMM = COMM.mpi_comm
# The same transport with 64 KiB staging slots, so that the larger sizes below move in many
# chunks, each large enough for the shared-memory all-reduce to share its reduction out. The MPI
# transport has no slots, so there it would only repeat the default communicator's tests.
SHARED_MEMORY = COMM.transport != "mpi"
SMALL_SLOTS = jaxring.mpi.Communicator(MPI_COMM.Dup(), label="64 KiB slots", slot_bytes=64 << 10)
COMMS = pytest.mark.parametrize("comm", [
    COMM, pytest.param(SMALL_SLOTS, marks=pytest.mark.skipif(
        not SHARED_MEMORY, reason="slot_bytes sizes shared memory, which the MPI transport has "
                                  "none of"))], ids=["default", "small slots"])
# Per-rank sizes: empty, one, prime, and larger than a staging slot (several chunks).
SIZES = [0, 1, 7, 1001, 300_001]


def gathered(x):
    return np.stack(MPI_COMM.allgather(np.asarray(x)))


def same_on_every_rank(y):
    mine = np.ascontiguousarray(np.asarray(y)).tobytes()
    assert all(other == mine for other in MPI_COMM.allgather(mine)), "ranks disagree"


REFERENCE = {
    "sum": lambda a: a.sum(0), "mean": lambda a: a.mean(0),
    "max": lambda a: a.max(0), "min": lambda a: a.min(0),
}


@COMMS
@pytest.mark.parametrize("op", list(jaxring.REDUCE_OPS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_reduce_against_float64_on_gathered_inputs(dtype, op, comm):
    rng = np.random.default_rng([COMM.rank, dtype.num])
    f = jax.jit(lambda v: jaxring.all_reduce(v, comm, op))
    for size in SIZES:
        x = random_array(rng, (size,), dtype)
        y = f(x)
        expected = REFERENCE[op](gathered(x).astype(np.float64))
        if op == "mean" and np.issubdtype(dtype, np.integer):  # true division, as lax.pmean
            assert_close(y, expected, np.asarray(y).dtype)
        else:
            assert np.asarray(y).dtype == dtype
            assert_close(y, expected, dtype, count=COMM.size)
        same_on_every_rank(y)


@COMMS
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce_scatter_all_gather_broadcast(dtype, comm):
    n = COMM.size
    rng = np.random.default_rng([COMM.rank, dtype.num, 1])
    for block in (0, 1, 7, 200_003):
        x = random_array(rng, (n * block,), dtype)
        inputs = gathered(x).astype(np.float64)
        scattered = jax.jit(lambda v: jaxring.reduce_scatter(v, comm))(x)
        assert_close(scattered, inputs.sum(0)[COMM.rank * block:(COMM.rank + 1) * block], dtype,
                     count=n)
        piece = x[:block]
        together = jax.jit(lambda v: jaxring.all_gather(v, comm))(piece)
        np.testing.assert_array_equal(np.asarray(together), gathered(piece).reshape(-1))
        for root in {0, n - 1}:
            got = jax.jit(lambda v, root=root: jaxring.broadcast(v, comm, root=root))(piece)
            np.testing.assert_array_equal(np.asarray(got), gathered(piece)[root])


def test_a_long_gave_up_notice_keeps_its_start_and_its_end_the_first_ranks_error():
    """A rank that gives up on a peer's notice passes on its own error, which quotes the peer's at
    its end; each rank on a chain of point-to-point calls adds about 270 characters in front. The
    notice (at most 1024 bytes, to go eagerly) was the error's first 1024, which after a few
    ranks no longer held the first rank's error, the cause. Now its middle is dropped."""
    ext = jaxring.mpi._mpi_extension()[0]
    relayed = "".join(f"rank {k} (where) : rank {k - 1} gave up. The error on rank {k - 1}: "
                      for k in range(30, 0, -1))
    why = relayed + "rank 0: timed out after 2 s waiting for rank(s) [5] to send"
    for bytes_ in (1024, 300, 100):
        notice = ext.notice(why, bytes_)
        assert len(notice) == bytes_ and " [...] " in notice, notice
        head, tail = notice.split(" [...] ")
        assert why.startswith(head) and why.endswith(tail) and len(tail) >= 3 * len(head), notice
    assert ext.notice(why, 1024).endswith("rank 0: timed out after 2 s waiting for rank(s) [5] "
                                          "to send")
    assert ext.notice(why, len(why)) == why and ext.notice("short", 1024) == "short"
    # Cuts fall between UTF-8 characters (a non-ASCII axis name): a cut inside one made the
    # notice undecodable as a Python string.
    named = "mesh axis 'données' " * 100
    for bytes_ in list(range(1, 40)) + [100, 1024]:
        notice = ext.notice(named, bytes_)  # a str: it decoded
        assert len(notice.encode()) <= bytes_, bytes_


def test_tiny_pipeline_slices_grow_to_at_most_1024_a_step_and_change_no_result():
    """Each slice of the MPI ring's steps and broadcast chain is an MPI request, and a step
    posts all its receives ahead: 4-byte slices of a 4 MiB all-reduce held 1 GiB of MPICH's
    request state. Slices grow until a step has at most 1024 (SliceBytes, the same on every rank
    from the header and plan), and give the results of the default slices."""
    ext = jaxring.mpi._mpi_extension()[0]
    assert ext.slice_bytes(4 << 20, 4) == 4096
    assert ext.slice_bytes(4 << 20, 256 << 10) == 256 << 10
    assert ext.slice_bytes(1 << 40, 256 << 10) == 1 << 30  # then MPI's 1 GiB piece bounds it
    assert ext.slice_bytes(0, 4) == 4 and ext.slice_bytes(5, 0) == 1
    n = COMM.size
    rng = np.random.default_rng([COMM.rank, 57])
    x = rng.standard_normal(n * 65_537).astype(np.float32)
    calls = {
        "all_reduce": lambda v: jaxring.all_reduce(v, COMM),
        "reduce_scatter": lambda v: jaxring.reduce_scatter(v, COMM),
        "all_gather": lambda v: jaxring.all_gather(v[:65_537], COMM),
        "broadcast": lambda v: jaxring.broadcast(v, COMM, root=n - 1),
    }
    expected = {name: np.asarray(jax.jit(call)(x)) for name, call in calls.items()}
    with jaxring.config.override(pipeline_slice_bytes=4, mpi_ring_threshold_bytes=0):
        for name, call in calls.items():
            np.testing.assert_array_equal(np.asarray(jax.jit(call)(x)), expected[name],
                                          err_msg=name)


@pytest.mark.skipif(not SHARED_MEMORY, reason="the MPI transport has no shared memory")
@COMMS
@pytest.mark.parametrize("stores", ["plain", "streaming", "auto"])
def test_every_kind_of_shared_memory_store(stores, comm):
    """Ranks write into their shared memory with plain or non-temporal stores (chosen by timing
    under "auto"); every collective's result must not depend on which. Odd element counts put
    the copies at offsets that are not 16-byte aligned (the streamed copy's unaligned head)."""
    n = COMM.size
    rng = np.random.default_rng([COMM.rank, 7])
    with jaxring.config.override(shm_stores=stores):
        for dtype in (np.float32, jnp.bfloat16, np.int64):
            dtype = np.dtype(dtype)
            for size in (4_099, 300_001):
                x = random_array(rng, (size,), dtype)
                inputs = gathered(x).astype(np.float64)
                for op in ("sum", "mean"):
                    y = jax.jit(lambda v, op=op: jaxring.all_reduce(v, comm, op))(x)
                    if op == "mean" and np.issubdtype(dtype, np.integer):
                        assert_close(y, REFERENCE[op](inputs), np.asarray(y).dtype)
                    else:
                        assert_close(y, REFERENCE[op](inputs), dtype, count=n)
                    same_on_every_rank(y)
                block = size // n
                scattered = jax.jit(lambda v: jaxring.reduce_scatter(v, comm))(x[:n * block])
                assert_close(scattered,
                             inputs[:, :n * block].sum(0)[COMM.rank * block:(COMM.rank + 1) * block],
                             dtype, count=n)
                together = jax.jit(lambda v: jaxring.all_gather(v, comm))(x)
                np.testing.assert_array_equal(np.asarray(together), gathered(x).reshape(-1))
                got = jax.jit(lambda v: jaxring.broadcast(v, comm, root=n - 1))(x)
                np.testing.assert_array_equal(np.asarray(got), gathered(x)[n - 1])


@COMMS
@pytest.mark.parametrize("algorithm", ["auto", "direct", "ring"])
def test_all_reduce_in_place_gives_the_bits_of_a_fresh_output(algorithm, comm):
    """A loop carry is reduced in place (written over its input). Every pass scales the sum by a
    factor that differs per rank, so every call sees different inputs on every rank. Over MPI
    "direct" is recursive doubling and "ring" the ring at every size; the ring is the one that
    sends part of its input while receiving into the same memory."""
    n = COMM.size
    rng = np.random.default_rng([COMM.rank, 11])
    scale = np.float32((1 + COMM.rank / 8) / n)

    def program(in_place):
        step = lambda _, a: jaxring.all_reduce(a, comm, in_place=in_place) * scale
        return jax.jit(lambda v: jax.lax.fori_loop(0, 3, step, v))

    with jaxring.config.override(algorithm=algorithm):
        for size in (1, 7, 4_099, 300_001):
            x = random_array(rng, (size,), np.float32)
            if n > 1 and jax.devices()[0].platform == "cpu":  # one rank: no call at all
                # (GPU processes keep a fresh output: common.bind_collective aliases on CPU only)
                assert "output_operand_aliases" in program(None).lower(x).as_text()
            fresh = np.asarray(program(False)(x))
            in_place = np.asarray(program(None)(x))
            np.testing.assert_array_equal(in_place, fresh)
            expected = x.astype(np.float64)
            for _ in range(3):
                expected = gathered(expected).sum(0) * scale
            assert_close(in_place, expected, np.float32, count=3 * n)


def test_scalars_pytrees_vmap_and_barrier():
    rng = np.random.default_rng(COMM.rank)
    tree = {"a": np.float32(rng.standard_normal()), "b": rng.standard_normal((3, 4))}
    out = jax.jit(lambda t: jaxring.all_reduce(t, COMM))(tree)
    for key in tree:
        np.testing.assert_allclose(np.asarray(out[key]), gathered(tree[key]).sum(0), rtol=1e-6)
    batched = rng.standard_normal((5, 6))
    vmapped = jax.jit(jax.vmap(lambda v: jaxring.all_reduce(v, COMM, "max"), in_axes=1))(batched)
    np.testing.assert_array_equal(np.asarray(vmapped), gathered(batched).max(0).T)
    jax.jit(lambda: jaxring.barrier(COMM))()


@pytest.mark.parametrize("size", [9, 20_000])  # also above mpi_ring_threshold_bytes
def test_grad_sums_cotangents_over_processes(size):
    """Each process differentiates its own copy of the result (mpi4jax's convention): the
    gradient of sum over ranks of loss(all_reduce(x)) w.r.t. x is the all-reduced cotangent."""
    rng = np.random.default_rng(COMM.rank + 10)
    x = rng.standard_normal(size)
    w = rng.standard_normal(size)
    grad = jax.jit(jax.grad(lambda v: jnp.sum(jnp.sin(jaxring.all_reduce(v, COMM)) * w)))(x)
    total = gathered(x).sum(0)
    expected = (np.cos(total) * gathered(w)).sum(0)
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-9)


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("size", [9, 20_000])  # 20_000: through the node levels, where there are
def test_grad_of_max_and_min_goes_to_the_winning_rank(op, size):
    rng = np.random.default_rng(COMM.rank + 30)
    x = rng.standard_normal(size)
    w = rng.standard_normal(size)
    grad = jax.jit(jax.grad(lambda v: jnp.sum(jaxring.all_reduce(v, COMM, op) * w)))(x)
    xs = gathered(x)
    winner = xs.argmax(0) if op == "max" else xs.argmin(0)
    expected = np.where(winner == COMM.rank, gathered(w).sum(0), 0.0)
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-12, atol=1e-12)


def op_ids(jaxpr):
    """The op ids of every jaxring call in `jaxpr`, nested jaxprs included, in program order."""
    ids = []
    for eqn in jaxpr.eqns:
        if "op_id" in eqn.params:
            ids.append(eqn.params["op_id"])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            ids.extend(op_ids(sub))
    return ids


@pytest.mark.skipif(COMM.size < 2, reason="one rank makes no collective call")
@pytest.mark.parametrize("op", ["max", "min"])
def test_the_two_tangent_sums_of_max_and_min_take_different_op_ids(op):
    """max/min's tangent sums the winners' tangents and then the winners (_winners_tangent); the
    two calls derive their ids from the primal's with different roles, so that a mismatch error
    can tell them apart."""
    x = np.arange(9.0) + COMM.rank
    ids = op_ids(jax.make_jaxpr(
        lambda v, t: jax.jvp(lambda u: jaxring.all_reduce(u, COMM, op), (v,), (t,)))(x, x).jaxpr)
    assert len(ids) == 3 and len(set(ids)) == 3, ids


def on_rank_dependent_lines(f, *args):
    """f(*args), called from one line on even ranks and another on odd ones."""
    if COMM.rank % 2 == 0:
        return f(*args)
    return f(*args)


@pytest.mark.parametrize("per_rank", [3, 20_000])  # 20_000: through a hierarchical one's levels
def test_rules_take_their_op_ids_from_the_call_they_derive_from(per_rank):
    """Transposes, and JVPs and batching of a function already traced (an inner jit), bind their
    collectives while the program is differentiated or batched, on the line that started it,
    which ranks running the same loss may reach from different lines. Their op ids derive from
    the call they come from (common.next_op_id): taken from that line, they differed between
    such ranks, which refused each other's calls as mismatched. So do the calls of a
    hierarchical all-reduce's levels, whose custom JVP runs there too."""
    rng = np.random.default_rng(COMM.rank + 45)
    x = rng.standard_normal(per_rank * COMM.size)
    w = rng.standard_normal(per_rank * COMM.size)

    def loss(v):
        total = jaxring.all_reduce(jnp.sin(v), COMM)
        part = jaxring.reduce_scatter(total * w, COMM, "mean")
        whole = jaxring.all_gather(part ** 2, COMM)
        top = jaxring.all_reduce(v, COMM, "max")
        return jnp.sum(jaxring.broadcast(whole, COMM, root=COMM.size - 1) * w + top)

    inner = jax.jit(loss)
    makers = {
        "grad": lambda: jax.jit(jax.grad(loss)),
        "jvp of a jitted function": lambda: lambda v: jax.jvp(inner, (v,), (w,)),
        "vmap of a jitted function": lambda: jax.vmap(jax.jit(jax.grad(loss)), in_axes=1),
    }
    arguments = {"vmap of a jitted function": np.stack([x, w], axis=1)}
    for name, make in makers.items():
        argument = arguments.get(name, x)
        apart = jax.tree.map(np.asarray, on_rank_dependent_lines(make(), argument))
        together = jax.tree.map(np.asarray, make()(argument))
        for a, b in zip(jax.tree.leaves(apart), jax.tree.leaves(together)):
            np.testing.assert_array_equal(a, b, err_msg=name)


def test_calls_outside_jit():
    """Process communicators' operands are concrete, so calls need no jit (as with mpi4jax):
    each compiles on its own."""
    rng = np.random.default_rng(COMM.rank + 40)
    x = rng.standard_normal(7 * COMM.size)
    np.testing.assert_allclose(np.asarray(jaxring.all_reduce(x, COMM)), gathered(x).sum(0),
                               rtol=1e-12)
    np.testing.assert_array_equal(np.asarray(jaxring.all_gather(x, COMM)),
                                  gathered(x).reshape(-1))
    np.testing.assert_allclose(np.asarray(jaxring.reduce_scatter(x, COMM)),
                               gathered(x).sum(0).reshape(COMM.size, 7)[COMM.rank], rtol=1e-12)
    np.testing.assert_array_equal(np.asarray(jaxring.broadcast(x, COMM, root=COMM.size - 1)),
                                  gathered(x)[-1])
    jaxring.barrier(COMM)
    w = rng.standard_normal(x.shape)
    grad = jax.grad(lambda v: jnp.sum(jaxring.all_reduce(v, COMM) * w))(x)
    np.testing.assert_allclose(np.asarray(grad), gathered(w).sum(0), rtol=1e-12)


def test_a_rank_splitting_with_an_undefined_color_joins_none():
    """MPI.UNDEFINED, MPI's way to leave a rank out of a split, gives that rank None (it was a
    raw MPI error on a null communicator); the others' communicator works without it."""
    sub = COMM.split(MPI.UNDEFINED if COMM.rank == 0 else 1, key=COMM.rank)
    if COMM.rank == 0:
        assert sub is None
    else:
        assert sub.size == COMM.size - 1 and sub.rank == COMM.rank - 1
        x = np.full(3, float(COMM.rank), np.float32)
        expected = sum(range(1, COMM.size))
        np.testing.assert_array_equal(np.asarray(jax.jit(
            lambda v: jaxring.all_reduce(v, sub))(x)), np.full(3, expected, np.float32))
        sub.free()
    MPI_COMM.Barrier()


def test_transport_follows_the_node_layout():
    asked = os.environ.get("JAXRING_MPI_TRANSPORT", "auto")
    per_node = int(os.environ.get("JAXRING_MPI_RANKS_PER_NODE", "0")) or COMM.size
    nodes = -(-COMM.size // per_node)
    if asked != "auto":
        expected = asked
    elif nodes == 1:
        expected = "shm"
    else:
        expected = "hierarchical" if COMM.size % per_node == 0 else "mpi"
    assert COMM.transport == expected
    if expected == "hierarchical":
        node, across = COMM.levels
        assert (node.size, across.size) == (per_node, nodes)
        assert (node.transport, across.transport) == ("shm", "mpi")


def test_a_color_or_key_refused_on_one_rank_fails_the_split_on_every_rank():
    """mpi4py refuses a color or key that is no C int on that rank alone, once its peers are in
    MPI_Comm_split for ever; a float color was cut to an int. The split's meeting now shares the
    refusal, and the communicator goes on working."""
    last = COMM.size - 1
    for color, key in ((2**31, 0), (0.5, 0), (-5, 0), (0, 2**31)):
        start = time.monotonic()
        mine = (color, key) if COMM.rank == last else (0, 0)
        with pytest.raises(ValueError, match=r"split takes an int color >= 0" if COMM.rank == last
                           else rf"rank {last}'s arguments to split .* were refused"):
            COMM.split(*mine)
        assert time.monotonic() - start < 10
    with COMM.split(np.int64(COMM.rank % 2), key=np.int32(-COMM.rank)) as sub:
        members = [r for r in range(COMM.size) if r % 2 == COMM.rank % 2][::-1]
        assert (sub.size, sub.rank) == (len(members), members.index(COMM.rank))


def test_ranks_making_different_communicators_at_once_all_fail():
    """The set-up's meeting passed ranks that came to make different communicators of the same
    MPI communicator (a split on one, a Communicator on another), which then waited for ever in
    different MPI collectives; now every rank raises, and the next set-up works."""
    if COMM.size == 1:
        pytest.skip("needs two ranks")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="came to different set-ups at once"):
        if COMM.rank == 0:
            COMM.split(0)
        else:
            jaxring.mpi.Communicator(COMM.mpi_comm)
    assert time.monotonic() - start < 10
    with COMM.split(0, key=COMM.rank) as sub:
        x = np.full(3, COMM.rank + 1.0)
        np.testing.assert_array_equal(np.asarray(jaxring.all_reduce(x, sub)),
                                      np.full(3, COMM.size * (COMM.size + 1) / 2))


def test_a_split_keeps_its_parents_pretend_nodes_and_names_agree():
    """A split of a communicator with pretend nodes (ranks_per_node=2) keeps each rank on its
    node: the ranks of one parity, on different nodes, make a hierarchical communicator (or a
    flat MPI one over nodes of unequal sizes), where the split once renumbered its own ranks into
    new nodes and made them one shared-memory node. An unlabelled communicator's name is the
    same on every rank (it was each rank's own object address)."""
    if COMM.size < 3:
        pytest.skip("needs ranks on two pretend nodes of two")
    with jaxring.mpi.Communicator(MPI_COMM, transport="auto", ranks_per_node=2) as base:
        names = MPI_COMM.allgather(base.name)
        assert len(set(names)) == 1, names
        with base.split(COMM.rank % 2, key=COMM.rank) as sub:
            members = [r for r in range(COMM.size) if r % 2 == COMM.rank % 2]
            sizes = [sum(r // 2 == node for r in members) for node in {r // 2 for r in members}]
            expected = ("shm" if len(sizes) == 1 else
                        "hierarchical" if len(set(sizes)) == 1 else "mpi")
            assert sub.transport == expected, (members, sizes)
            x = random_array(np.random.default_rng(COMM.rank), (70_001,), np.float64)
            y = np.asarray(jax.jit(lambda v: jaxring.all_reduce(v, sub))(x))
            np.testing.assert_allclose(y, np.stack(sub.mpi_comm.allgather(x)).sum(0),
                                       rtol=1e-12)


def test_split_communicators_never_mix():
    color = COMM.rank % 2
    sub = COMM.split(color, key=COMM.rank)
    x = np.full(4, COMM.rank + 1.0)
    got = jax.jit(lambda v: jaxring.all_reduce(v, sub))(x)
    members = [r for r in range(COMM.size) if r % 2 == color]
    np.testing.assert_array_equal(np.asarray(got), np.full(4, sum(r + 1.0 for r in members)))


def test_a_split_asks_for_its_parents_slot_bytes():
    """A split took the default slots (1 MiB per rank) whatever its parent's, which a /dev/shm
    too small for them refuses. With 64 KiB slots, 300_001 elements move in many chunks."""
    with SMALL_SLOTS.split(0, key=COMM.rank) as sub:
        assert sub.slot_bytes == SMALL_SLOTS.slot_bytes == 64 << 10
        x = random_array(np.random.default_rng(COMM.rank), (300_001,), np.float32)
        y = np.asarray(jax.jit(lambda v: jaxring.all_reduce(v, sub))(x))
        assert_close(y, gathered(x).astype(np.float64).sum(0), np.float32, COMM.size)


def test_deterministic_across_runs():
    rng = np.random.default_rng(COMM.rank + 20)
    x = rng.standard_normal(100_000).astype(np.float32)
    f = jax.jit(lambda v: jaxring.all_reduce(v, COMM))
    first = np.asarray(f(x))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(x)), first)
    same_on_every_rank(first)


# ---- errors ------------------------------------------------------------------------------------


def test_bad_arguments_are_refused_at_trace_time():
    with pytest.raises(TypeError, match="unsupported dtype uint8"):
        jax.jit(lambda v: jaxring.all_reduce(v, COMM))(np.ones(3, np.uint8))
    with pytest.raises(ValueError, match="unsupported op 'prod'"):
        jax.jit(lambda v: jaxring.all_reduce(v, COMM, "prod"))(np.ones(3))
    # too small for one element per rank, not an int, slots off a cache line (misaligned)
    for slot_bytes in (0, 8 * COMM.size - 1, 4096.0, 4096 + 8):
        with pytest.raises(ValueError, match=r"slot_bytes must be an int of at least 8 x \d+ "
                                             r"ranks = \d+ bytes and a multiple of 64"):
            jaxring.mpi.Communicator(MPI_COMM, slot_bytes=slot_bytes)
    # So large that the segment's size would wrap (it mapped a few bytes, then crashed).
    with pytest.raises(ValueError, match=r"slot_bytes must be at most 2\*\*62"):
        jaxring.mpi.Communicator(MPI_COMM, slot_bytes=1 << 61)


def test_ranks_meet_at_exit_on_a_communicator_holding_each_gpu_peer_once():
    """GPU communicators' ranks wait for each other at exit (their peers may still read their
    memory): one communicator is added per GPU communicator whose ranks no earlier one holds.
    Before, only the first GPU communicator's ranks met."""
    saved = list(jaxring.mpi._exit_barrier_comms)
    jaxring.mpi._exit_barrier_comms.clear()
    pairs = MPI_COMM.Split(COMM.rank // 2, key=COMM.rank)
    try:
        for comm in (pairs, pairs, MPI_COMM, pairs, MPI_COMM):
            jaxring.mpi._meet_at_exit(comm)
        sizes = [comm.Get_size() for comm in jaxring.mpi._exit_barrier_comms]
        assert sizes == [pairs.Get_size()] + ([COMM.size] if COMM.size > 2 else []), sizes
    finally:
        for comm in jaxring.mpi._exit_barrier_comms:
            comm.Free()
        jaxring.mpi._exit_barrier_comms[:] = saved
        pairs.Free()


def test_free_releases_a_communicator_and_later_calls_say_so():
    """free() is collective; afterwards the MPI communicator split made is freed, tracing on the
    communicator refuses, and a program compiled before fails at once, naming it."""
    sub = COMM.split(0, key=COMM.rank)
    made = [sub.mpi_comm] + [level.mpi_comm for level in sub.levels or ()]  # and its levels'
    x = np.arange(4.0) + COMM.rank
    total = gathered(x).sum(0)
    f = jax.jit(lambda v: jaxring.all_reduce(v, sub))
    np.testing.assert_array_equal(np.asarray(f(x)), total)
    sub.free()
    assert all(comm == MPI.COMM_NULL for comm in made), made
    with pytest.raises(ValueError, match=r"MPI communicator split\(color=0\) .* was freed"):
        jax.jit(lambda v: jaxring.all_reduce(v, sub))(x + 1)
    if COMM.size > 1:  # (one rank's all-reduce makes no call)
        with pytest.raises(Exception, match=r"this process communicator is closed \(its "
                                            r"jaxring.mpi.Communicator was freed"):
            np.asarray(f(x))
        jaxring.reset_after_error()
    sub.free()  # a second time: nothing
    with COMM.split(0, key=COMM.rank) as other:  # a with block frees it at its end
        made = other.mpi_comm
        np.testing.assert_array_equal(
            np.asarray(jax.jit(lambda v: jaxring.all_reduce(v, other, "max"))(x)),
            gathered(x).max(0))
    assert made == MPI.COMM_NULL
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: jaxring.all_reduce(v, COMM))(x)),
                                  total)  # the communicator split from is untouched


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_a_rank_that_never_frees_is_named():
    """free() waits for every rank, with the timeout, and names the ranks that never came."""
    sub = COMM.split(0, key=COMM.rank)
    last = COMM.size - 1
    try:
        if COMM.rank != last:
            with jaxring.config.override(timeout_seconds=1.0):
                with pytest.raises(Exception, match=rf"timed out after 1 s waiting for "
                                                    rf"rank\(s\) \[{last}\]"):
                    sub.free()
        MPI_COMM.Barrier()
        if COMM.rank == last and sub.transport == "shm":  # told that its peers gave up
            with pytest.raises(Exception, match="gave up on this communicator|left the "
                                                "communicator"):
                sub.free()
        elif COMM.rank == last:  # over MPI a late barrier may return (README, failure
            try:                 # behaviour): it fails only where a peer's notice came first
                sub.free()
            except Exception as error:  # noqa: BLE001 - checked below
                assert re.search("gave up on this communicator|left the communicator",
                                 str(error)), str(error)
    finally:
        jaxring.reset_after_error()
        MPI_COMM.Barrier()


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
@pytest.mark.parametrize("how", ["create", "split"])
def test_a_rank_that_never_sets_up_a_communicator_is_given_up_on(how):
    """Making or splitting a communicator is collective, and mpi4py's collectives wait for ever:
    the ranks that came give up after the timeout, saying what they waited for. The late rank's
    set-up then raises at once, saying that they gave up, instead of waiting for ever in the
    next collective of the set-up; its collectives and theirs stay in step."""
    mpi_comm = MPI_COMM.Dup()
    parent = jaxring.mpi.Communicator(mpi_comm, label="parent") if how == "split" else None
    late = COMM.size - 1
    waited_for = ("create a jaxring.mpi.Communicator on it" if how == "create"
                  else r"split MPI communicator parent \(\d processes\)")

    def set_up():
        return jaxring.mpi.Communicator(mpi_comm) if parent is None else parent.split(0)

    if COMM.rank != late:
        start = time.monotonic()
        with jaxring.config.override(timeout_seconds=1.0):
            with pytest.raises(TimeoutError, match=rf"rank {COMM.rank} timed out after 1 s "
                               rf"waiting for the other ranks of an MPI communicator of "
                               rf"{COMM.size} processes to {waited_for}: every rank must"):
                set_up()
        assert time.monotonic() - start < 10
    MPI_COMM.Barrier()  # the others have given up
    if COMM.rank == late:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"rank {late} came to {waited_for} on an MPI "
                                               r"communicator of \d processes after another rank "
                                               r"had given up waiting for it"):
            set_up()
        assert time.monotonic() - start < 10
    else:  # the late rank's meeting completed this rank's abandoned one
        requests, _ = jaxring.mpi._abandoned_requests.pop()
        assert jaxring.mpi._done_within(requests, 30)
    np.testing.assert_array_equal(mpi_comm.allreduce(COMM.rank), sum(range(COMM.size)))
    if parent is not None:
        parent.free()
    mpi_comm.Free()
    MPI_COMM.Barrier()


def test_a_rank_with_bad_or_different_options_makes_every_rank_raise():
    """Set-up runs MPI collectives without a timeout: a rank that raised alone, or took another
    path, would leave the others waiting there for ever."""
    last = COMM.size - 1
    with pytest.raises(ValueError, match=rf"rank {last}: jaxring.mpi: slot_bytes must be"):
        jaxring.mpi.Communicator(MPI_COMM, slot_bytes=1 if COMM.rank == last else 1 << 20)
    if COMM.size > 1:
        with pytest.raises(ValueError, match=r"every rank must ask for the same communicator, "
                                             rf"but rank 0 asked for .* and rank 1 for"):
            jaxring.mpi.Communicator(MPI_COMM, transport="shm" if COMM.rank == 0 else "mpi")


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_ranks_running_different_builds_refuse_to_make_a_communicator(monkeypatch):
    """Builds from other sources may lay out headers and shared memory differently, so their
    ranks would misread each other: every rank refuses, naming each build and its ranks."""
    mine = native.extension.build_id()
    if COMM.rank == 1:
        monkeypatch.setattr(native.extension, "build_id", lambda: "0123456789abcdef")
    others = "".join(f", {rank}" for rank in range(2, COMM.size))
    with pytest.raises(RuntimeError, match=(
            rf"every rank must run the same build of jaxring, but ranks? 0{others}: build "
            rf"{mine}; rank 1: build 0123456789abcdef$")):
        jaxring.mpi.Communicator(MPI_COMM)


def test_a_stale_mpi_transport_is_refused(monkeypatch):
    """The MPI transport shares C structs with the host library (gpu/direct.h): a module left
    from another build is not used, and a communicator that needs it says why."""
    ext, reason = jaxring.mpi._mpi_extension()
    if ext is None:
        pytest.skip(reason)
    stale = (r"jaxring: jaxring's MPI transport was built from other sources \(build stale\) "
             r"than jaxring's host library \(build [0-9a-f]{16}\), a stale build: reinstall "
             r"jaxring")
    monkeypatch.setattr(ext, "build_id", lambda: "stale")
    jaxring.mpi._mpi_extension.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"needs the MPI transport.*, but " + stale):
            jaxring.mpi.Communicator(MPI_COMM, transport="mpi")
        if COMM.size > 1:  # on one rank only: every rank refuses, saying which cannot
            if COMM.rank != 1:
                monkeypatch.undo()
            jaxring.mpi._mpi_extension.cache_clear()
            others = "".join(f", {rank}" for rank in range(2, COMM.size))
            with pytest.raises(RuntimeError, match=(
                    r"every rank must be able to use jaxring's MPI transport, or none, but "
                    rf"ranks? 0{others}: usable; rank 1: " + stale)):
                jaxring.mpi.Communicator(MPI_COMM)
    finally:
        jaxring.mpi._mpi_extension.cache_clear()


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_the_header_exchange_is_fixed_when_the_communicator_is_made():
    """The MPI transport's header exchange (mpi_direct_header_ranks: direct or Bruck's) must be
    the same on every rank, or ranks mistake each other's messages (from 4 ranks, a truncated
    message or a timeout). Ranks that would take different ones refuse to make a communicator,
    and a later change on one rank leaves the communicators already made as they were."""
    x = np.arange(4, dtype=np.float32) + COMM.rank
    expected = sum(np.arange(4, dtype=np.float32) + rank for rank in range(COMM.size))
    with jaxring.config.override(mpi_direct_header_ranks=1 if COMM.rank == 1 else 64):
        y = jax.jit(lambda v: jaxring.all_reduce(v, COMM))(x)
        np.testing.assert_array_equal(np.asarray(y), expected)
        with pytest.raises(ValueError, match=r"every rank must ask for the same communicator, "
                                             r"but rank 0 asked for .*direct header exchange\) "
                                             r"\(.*, True\) and rank 1 for \(.*, False\)"):
            jaxring.mpi.Communicator(MPI_COMM)


@pytest.mark.skipif(COMM.transport != "shm", reason="a shared-memory communicator")
def test_a_segment_larger_than_dev_shm_is_an_error_not_a_crash(monkeypatch):
    """The segment's pages are reserved when it is made; mapping more than /dev/shm holds would
    otherwise only fail at the first large collective, with SIGBUS on every rank. The failed
    set-up frees the node communicator it made (it was left allocated)."""
    made = []

    def recorded(comm, pretend, make=jaxring.mpi._node_communicator):
        made.append(make(comm, pretend))
        return made[-1]
    monkeypatch.setattr(jaxring.mpi, "_node_communicator", recorded)
    dup = MPI_COMM.Dup()
    try:
        with pytest.raises(RuntimeError, match=r"cannot reserve \d+ bytes of shared memory"):
            jaxring.mpi.Communicator(dup, slot_bytes=1 << 40)
    finally:
        dup.Free()
    assert made and all(comm == MPI.COMM_NULL for comm in made), made


@pytest.mark.parametrize("transport", ["auto", "hierarchical"])
def test_a_set_up_that_fails_at_its_last_step_releases_what_it_made(monkeypatch, transport):
    """The GPU transport is attached last, after the levels of a hierarchical communicator are
    made. A failure there left this rank's MPI transport and shared memory registered, and the
    levels with their MPI communicators allocated, for the rest of the process."""
    made, nodes = [], []

    def recording(comm, make, owning=jaxring.mpi._owning):
        made.append(owning(comm, make))
        return made[-1]

    def node(comm, pretend, split=jaxring.mpi._node_communicator):
        nodes.append(split(comm, pretend))
        return nodes[-1]

    def attach(mpi_comm, key, rank, size, name, *rest, real=jaxring.mpi.gpu.attach):
        if "communicator late (" in name:  # not its levels
            raise RuntimeError("imagined: no GPU transport")
        return real(mpi_comm, key, rank, size, name, *rest)
    monkeypatch.setattr(jaxring.mpi, "_owning", recording)
    monkeypatch.setattr(jaxring.mpi, "_node_communicator", node)
    monkeypatch.setattr(jaxring.mpi.gpu, "attach", attach)
    hierarchical = transport == "hierarchical" and COMM.size > 1
    monkeypatch.setenv("JAXRING_MPI_RANKS_PER_NODE", "1" if hierarchical else "0")
    dup = MPI_COMM.Dup()
    try:
        with pytest.raises(RuntimeError, match="imagined"):
            jaxring.mpi.Communicator(dup, label="late", transport=transport)
    finally:
        dup.Free()
    assert len(made) == (2 if hierarchical else 0)
    assert nodes and all(comm == MPI.COMM_NULL for comm in nodes), nodes
    for level in made:
        assert level._freed and level.mpi_comm == MPI.COMM_NULL, level
        with pytest.raises(ValueError, match="was freed"):
            jax.jit(lambda v, level=level: jaxring.all_reduce(v, level))(np.ones(3, np.float32))
    MPI_COMM.Barrier()


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_a_communicator_that_failed_is_released_by_free():
    """A failed call leaves a communicator refusing every later call, free()'s barrier too, so
    free() raised before releasing anything: its shared memory, MPI transport and the MPI
    communicators split made stayed for the rest of the process, and every later free() raised
    again. Now free() releases this rank's part and then raises the barrier's error."""
    sub = COMM.split(0, key=COMM.rank)
    made = [sub.mpi_comm] + [level.mpi_comm for level in sub.levels or ()]
    x = np.ones(3 if COMM.rank == 0 else 5, np.float32)
    with jaxring.config.override(timeout_seconds=30.0):
        with pytest.raises(Exception, match="mismatched collectives"):
            np.asarray(jax.jit(lambda v: jaxring.all_reduce(v, sub))(x))
    jaxring.reset_after_error()
    try:
        with pytest.raises(Exception, match="failed earlier"):
            sub.free()
    finally:
        jaxring.reset_after_error()
    assert all(comm == MPI.COMM_NULL for comm in made), made
    sub.free()  # released: nothing more to do, and nothing raised
    with pytest.raises(ValueError, match="was freed"):
        jax.jit(lambda v: jaxring.all_reduce(v, sub))(x)
    MPI_COMM.Barrier()


@pytest.mark.skipif(COMM.size < 4 or COMM.size % 2, reason="needs two nodes of two ranks")
def test_the_levels_place_ranks_on_nodes_as_their_communicator_was_told(monkeypatch):
    """A hierarchical communicator made with ranks_per_node=2 while JAXRING_MPI_RANKS_PER_NODE
    says 1: its node level read the variable, found its two ranks on two nodes, and every rank
    refused the shared-memory transport it had asked for. An all-reduce large enough to go
    through the levels, against float64."""
    monkeypatch.setenv("JAXRING_MPI_RANKS_PER_NODE", "1")
    with jaxring.mpi.Communicator(MPI_COMM, transport="hierarchical", ranks_per_node=2) as comm:
        assert comm.transport == "hierarchical"
        assert [level.size for level in comm.levels] == [2, COMM.size // 2]
        x = random_array(np.random.default_rng(COMM.rank),
                         (comm.levels_threshold_bytes // 4 + 5,), np.float32)
        y = np.asarray(jax.jit(lambda v: jaxring.all_reduce(v, comm))(x))
        assert_close(y, gathered(x).astype(np.float64).sum(0), np.float32, COMM.size)


@pytest.mark.skipif(COMM.size < 2 or len(jax.local_devices()) < 2,
                    reason="needs two ranks (one alone communicates nothing) and two devices")
def test_a_process_communicator_refuses_several_devices_of_one_process():
    """Every device of the program would act as this process's rank: refused when lowered."""
    mesh = jax.make_mesh((2,), ("i",), devices=jax.local_devices()[:2])
    f = jax.jit(jax.shard_map(lambda v: jaxring.all_reduce(v, COMM), mesh=mesh,
                              in_specs=jax.P("i"), out_specs=jax.P("i")))
    with pytest.raises(ValueError, match="one device per process, but this program runs on 2"):
        f(jax.device_put(np.ones(2, np.float32), jax.NamedSharding(mesh, jax.P("i"))))


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_mismatched_shapes_raise_on_every_rank_naming_both_sides():
    sub = COMM.split(0, key=COMM.rank)  # a fresh communicator: an error leaves it unusable
    x = np.ones(3 if COMM.rank == 0 else 5, np.float32)
    call = lambda v: jaxring.all_reduce(v, sub)  # noqa: E731
    site = called_at(call)  # both ranks' calls, named after the line that traced them
    with jaxring.config.override(timeout_seconds=30.0):
        with pytest.raises(Exception, match=r"mismatched collectives: rank 0 called "
                                            r"all_reduce\(sum\) op \d+ float32\[3\] " + site
                                            + r" but rank 1 called all_reduce\(sum\) op \d+ "
                                            r"float32\[5\] " + site):
            np.asarray(jax.jit(call)(x))
    jaxring.reset_after_error()
    with pytest.raises(Exception, match="failed earlier"):
        np.asarray(jax.jit(lambda v: jaxring.all_reduce(v, sub))(np.ones(3, np.float32)))
    jaxring.reset_after_error()


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_ranks_whose_config_shapes_messages_differently_raise_instead_of_pairing_them():
    """Rank 1 alone sets mpi_ring_threshold_bytes to 0, so over MPI it runs the ring where the
    others run their small-message algorithm: rank 0 once received one of rank 1's ring slices as
    a whole message and returned a sum of stale scratch, silently. The headers now carry a digest
    of the choice those settings make (method and slice size), and every rank raises before any
    data moves; where the settings make no difference, as for all_gather, the call goes on."""
    sub = jaxring.mpi.Communicator(MPI_COMM.Dup(), label="config digest", transport="mpi")
    ok = jaxring.mpi.Communicator(MPI_COMM.Dup(), label="config digest, settings that differ",
                                  transport="mpi")
    x = np.arange(1000, dtype=np.float32) + COMM.rank
    with jaxring.config.override(timeout_seconds=30.0,
                                 mpi_ring_threshold_bytes=0 if COMM.rank == 1 else 1 << 20):
        call = lambda v: jaxring.all_reduce(v, sub)  # noqa: E731
        with pytest.raises(Exception, match=r"rank 0 and rank 1 both called all_reduce\(sum\) "
                                            r"op \d+ float32\[1000\] " + called_at(call)
                                            + r", but their jaxring.config settings .* make "
                                            r"them move its data differently"):
            np.asarray(jax.jit(call)(x))
        # all_gather always takes the ring, whatever the threshold: the settings do not matter
        y = jax.jit(lambda v: jaxring.all_gather(v, ok))(x)
        np.testing.assert_array_equal(np.asarray(y), np.concatenate(MPI_COMM.allgather(x)))
    jaxring.reset_after_error()
    # The slice size shapes the ring's messages, so ranks whose sizes differ are refused there;
    # recursive doubling sends whole messages, and goes on.
    sliced = jaxring.mpi.Communicator(MPI_COMM.Dup(), label="config digest, slices",
                                      transport="mpi")
    slices = 4096 if COMM.rank == 1 else 256 << 10
    big = np.arange(300_000, dtype=np.float32) + COMM.rank
    with jaxring.config.override(timeout_seconds=30.0, mpi_ring_threshold_bytes=0,
                                 pipeline_slice_bytes=slices):
        call = lambda v: jaxring.all_reduce(v, sliced)  # noqa: E731
        with pytest.raises(Exception, match=r"rank 0 and rank 1 both called all_reduce\(sum\) "
                                            r"op \d+ float32\[300000\] .*, but their "
                                            r"jaxring.config settings .* make them move its data "
                                            r"differently"):
            np.asarray(jax.jit(call)(big))
    jaxring.reset_after_error()
    with jaxring.config.override(timeout_seconds=30.0, mpi_ring_threshold_bytes=1 << 30,
                                 pipeline_slice_bytes=slices):
        total = jax.jit(lambda v: jaxring.all_reduce(v, ok))(x)
        np.testing.assert_array_equal(np.asarray(total), gathered(x).astype(np.float64).sum(0))


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_a_communicator_made_while_tracing_lives_as_long_as_the_program():
    """The split communicator has no reference left once tracing returns: the traced program
    keeps it alive (before, it was collected and the call waited out the timeout)."""
    f = jax.jit(lambda v: jaxring.all_reduce(v, COMM.split(0, key=COMM.rank)))
    rng = np.random.default_rng(COMM.rank)
    for _ in range(2):
        gc.collect()
        x = random_array(rng, (33,), np.float32)
        with jaxring.config.override(timeout_seconds=30.0):
            out = np.asarray(f(x))
        assert_close(out, gathered(x).astype(np.float64).sum(0), np.float32, count=COMM.size)


class _Detached:
    """A process communicator's handle that does not keep the communicator alive."""

    def __init__(self, comm):
        self._axis = dataclasses.replace(comm.axis_communicator(), owner=None)

    def axis_communicator(self):
        return self._axis


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_a_call_on_a_collected_communicator_fails_at_once():
    sub = COMM.split(0, key=COMM.rank)
    handle = _Detached(sub)
    del sub
    gc.collect()
    start = time.monotonic()
    with jaxring.config.override(timeout_seconds=60.0):
        with pytest.raises(Exception, match="this process communicator is closed"):
            np.asarray(jax.jit(lambda v: jaxring.all_reduce(v, handle))(np.ones(4, np.float32)))
    assert time.monotonic() - start < 30, "it waited for peers instead of failing"
    jaxring.reset_after_error()
    MPI_COMM.Barrier()


def _all_reduce_on_a_shared_memory_split():
    """A fresh split in shared memory (the test is skipped where the split is not), a jitted
    all-reduce on it that does not keep it alive (_Detached), and its input, once every rank has
    called it."""
    sub = COMM.split(0, key=COMM.rank)
    if sub.transport != "shm":
        pytest.skip("over MPI a dropped communicator's peers wait out their timeout (README)")
    handle = _Detached(sub)
    f = jax.jit(lambda v: jaxring.all_reduce(v, handle))
    x = np.arange(4.0, dtype=np.float32) + COMM.rank
    np.testing.assert_array_equal(np.asarray(f(x)), gathered(x).sum(0))
    return sub, f, x


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_a_rank_that_drops_a_communicator_fails_its_peers_calls_at_once():
    """Rank 0 lets a communicator in shared memory be collected, with no free(), while its peers
    go on calling it. They waited out their timeout for rank 0, then named it missing; now they
    fail at once, quoting why it left. Every rank's outcome is gathered before any asserts, so
    that a failure cannot leave the others at a barrier."""
    sub, f, x = _all_reduce_on_a_shared_memory_split()
    outcome = None
    if COMM.rank == 0:
        collected = weakref.ref(sub)
        del sub
        gc.collect()
        outcome = None if collected() is None else "the communicator was not collected"
        MPI_COMM.Barrier()
    else:
        MPI_COMM.Barrier()
        start = time.monotonic()
        try:
            with jaxring.config.override(timeout_seconds=20.0):
                np.asarray(f(x))
            outcome = "the call returned"
        except Exception as error:  # noqa: BLE001 - its text is what is checked
            took = time.monotonic() - start
            if not re.search(r"\(rank \d+ of \d+\): rank 0 left the communicator .*so this call "
                             r"cannot complete\. "
                             r"The first error: rank 0 closed .* while its peers went on "
                             r"calling", str(error)):
                outcome = f"another error: {error}"
            elif took > 10:
                outcome = f"it failed after {took:.1f} s, waiting for rank 0"
        jaxring.reset_after_error()
    outcomes = MPI_COMM.allgather(outcome)
    assert outcomes == [None] * COMM.size, outcomes


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_a_rank_that_leaves_after_a_call_does_not_fail_its_slower_peers():
    """Rank 0 completes a call and drops the communicator while the last rank, having staged its
    data, has not yet checked that no peer has left (it stalls there); with 3 ranks, rank 1 also
    makes one more call, which fails on rank 0's departure, so that it leaves too. The last rank
    must complete the call with the right sum: its peers left after a call they completed, not
    during it (rank 1's failure in the next call failed it once, the review's repro). Outcomes
    gathered before asserting."""
    sub, f, x = _all_reduce_on_a_shared_memory_split()
    last = COMM.size - 1
    expected = gathered(x + 1).sum(0)  # (an MPI collective: not between the call and the close)
    if COMM.rank == last:
        native.extension.stall_next_shm_steps(3.0, 1, after_staging=True)
    MPI_COMM.Barrier()
    outcome = None
    try:
        got = np.asarray(f(x + 1))
        if not np.array_equal(got, expected):
            outcome = f"a wrong sum: {got}"
    except Exception as error:  # noqa: BLE001 - reported below
        outcome = f"it failed: {error}"
        jaxring.reset_after_error()
    if COMM.rank == 0:
        collected = weakref.ref(sub)
        del sub
        gc.collect()  # within the last rank's stall
        if collected() is not None:
            outcome = "the communicator was not collected"
    elif COMM.rank != last and outcome is None:
        try:
            np.asarray(f(x))
            outcome = "the call after rank 0 left returned"
        except Exception as error:  # noqa: BLE001 - its text is checked
            if "rank 0 closed" not in str(error):
                outcome = f"another error: {error}"
        jaxring.reset_after_error()
    native.extension.stall_next_shm_steps(0.0, 0, after_staging=True)
    outcomes = MPI_COMM.allgather(outcome)
    assert outcomes == [None] * COMM.size, outcomes


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_missing_rank_times_out_naming_it():
    sub = COMM.split(0, key=COMM.rank)
    last = COMM.size - 1
    try:
        if COMM.rank != last:  # the last rank never calls
            with jaxring.config.override(timeout_seconds=2.0):
                with pytest.raises(Exception, match=rf"timed out after 2 s waiting for rank\(s\) "
                                                    rf"\[{last}\]"):
                    np.asarray(jax.jit(lambda v: jaxring.all_reduce(v, sub))(np.ones(4)))
            jaxring.reset_after_error()
    finally:
        MPI_COMM.Barrier()  # in any case: a rank that failed an assertion must not hang the others


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_an_all_reduce_slower_than_the_timeout_that_keeps_moving_completes():
    """The timeout bounds each wait, not the call: the last rank sleeps 0.9 s three times (before
    each of its first three staging steps of 64 KiB slots in shared memory; over MPI once each
    of its first three ring slices is handled), so the all-reduce takes over 2.7 s, and no
    rank, with a 2 s timeout, waits 2 s for one thing. It once failed at 2 s, a deadline
    counted from the start of the call."""
    if COMM.transport == "hierarchical":
        pytest.skip("the other node's ranks would wait at the level across nodes for as long as "
                    "the stalls at this node's level take, which is one wait")
    comm = SMALL_SLOTS if SHARED_MEMORY else COMM
    late = COMM.size - 1
    x = random_array(np.random.default_rng([COMM.rank, 23]), (300_001,), np.float32)
    f = jax.jit(lambda v: jaxring.all_reduce(v, comm))
    f.lower(x).compile()
    ext = jaxring.mpi._mpi_extension()[0]
    MPI_COMM.Barrier()
    if COMM.rank == late and SHARED_MEMORY:
        native.extension.stall_next_shm_steps(0.9, 3)
    elif COMM.rank == late:
        ext.stall_next_ring_slices(0.9, 3)
    try:
        with jaxring.config.override(timeout_seconds=2.0):
            start = time.monotonic()
            y = np.asarray(f(x))
            took = time.monotonic() - start
    finally:
        native.extension.stall_next_shm_steps(0.0, 0)
        if ext is not None:
            ext.stall_next_ring_slices(0.0, 0)
    assert_close(y, gathered(x).astype(np.float64).sum(0), np.float32, COMM.size)
    if COMM.rank == late:
        assert took > 2.7, took
    MPI_COMM.Barrier()


LATE_CALLS = {  # the latency path, the pipelined ring, a late root's sends, and no data at all
    "all_reduce 9": (lambda v, comm: jaxring.all_reduce(v, comm), 9),
    "all_reduce 300001": (lambda v, comm: jaxring.all_reduce(v, comm), 300_001),
    "broadcast from the late rank": (lambda v, comm: jaxring.broadcast(v, comm, comm.size - 1), 9),
    "barrier": (lambda v, comm: (jaxring.barrier(comm), v + 1)[1], 9),
}


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
@pytest.mark.parametrize("call", list(LATE_CALLS))
def test_a_rank_that_comes_after_its_peers_gave_up_raises_too(call):
    """The last rank calls only after its peers' 1 s timeout. Every rank must raise, none may
    return a result, and none may crash; the late rank, whose own timeout is 30 s, must fail at
    once, naming a peer that gave up and quoting its timeout. In shared memory it once found its
    peers' data staged and returned a sum that its peers had reported failed; over MPI it once
    waited out its own timeout, and cancelling its large send then crashed it inside MPICH's UCX
    device."""
    body, size = LATE_CALLS[call]
    sub = COMM.split(0, key=COMM.rank)  # a fresh communicator: an error leaves it unusable
    if sub.transport != "shm" and call in ("broadcast from the late rank", "barrier"):
        pytest.skip("over MPI, a late rank whose call waits for nothing after the header "
                    "exchange returns; its next call fails (README, failure behaviour)")
    late = COMM.size - 1
    f = jax.jit(lambda v: body(v, sub))
    x = np.full(size, COMM.rank + 1.0, np.float32)
    f.lower(x).compile()
    MPI_COMM.Barrier()
    if COMM.rank == late:
        time.sleep(2.5)
    left = (r"(gave up on this communicator|left the communicator).*, so this call cannot "
            r"complete\. (The error on rank \d+|The first error): .*timed out after 1 s")
    expected = left if COMM.rank == late else rf"timed out after 1 s|{left}"
    start = time.monotonic()
    with jaxring.config.override(timeout_seconds=30.0 if COMM.rank == late else 1.0):
        with pytest.raises(Exception, match=expected) as error:
            np.asarray(f(x))
    took = time.monotonic() - start
    jaxring.reset_after_error()
    errors = MPI_COMM.allgather(str(error.value))
    assert took < 10, f"rank {COMM.rank} took {took:.1f} s to fail"
    if sub.transport != "hierarchical":
        # Every peer of the late rank waited for it directly and names it.
        for rank, text in enumerate(errors[:-1]):
            assert re.search(rf"timed out after 1 s waiting for rank\(s\) \[{late}\]", text), \
                (rank, text)
    MPI_COMM.Barrier()


def with_the_last_rank_stalled(f, x):
    """(f(x), None), or (None, its error) on this rank, where the last rank stalls 2.5 s (the MPI
    transport's test hook) once its header exchange is done, past its peers' 1 s timeout."""
    f.lower(x).compile()
    ext, _ = jaxring.mpi._mpi_extension()
    MPI_COMM.Barrier()
    if COMM.rank == COMM.size - 1:
        ext.stall_next_data(2.5)
    try:
        with jaxring.config.override(timeout_seconds=30.0 if COMM.rank == COMM.size - 1 else 1.0):
            return np.asarray(f(x)), None
    except Exception as raised:  # noqa: BLE001 - the caller checks it, on every rank
        jaxring.reset_after_error()
        return None, str(raised)
    finally:
        ext.stall_next_data(0)


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
@pytest.mark.parametrize("size", [4096, 300_001], ids=["tree", "chain"])
def test_a_rank_that_takes_a_broadcast_after_its_sender_gave_up_raises(size):
    """The last rank stalls once its header exchange is done, past its sender's 1 s timeout. MPI
    sends these messages (16 KiB whole, or 256 KiB slices) by rendezvous: the sender's gave-up
    sends stay matchable (MPI cannot cancel them), so the stalled rank still received them when it
    woke, read out of the sender's output after XLA had freed it, and returned those bytes while
    its sender reported the broadcast failed. Now it looks for its senders' notices once its
    data is in, and raises, quoting its sender's timeout. Every other rank raises or returns the
    root's data."""
    sub = COMM.split(0, key=COMM.rank)  # a fresh communicator: an error leaves it unusable
    if sub.transport != "mpi":
        pytest.skip("shared memory stages every message in its own segment, which outlives a "
                    "rank's call")
    late = COMM.size - 1
    y, error = with_the_last_rank_stalled(jax.jit(lambda v: jaxring.broadcast(v, sub, 0)),
                                          np.arange(size, dtype=np.float32) + COMM.rank)
    returned = y is not None and np.array_equal(y, np.arange(size, dtype=np.float32))
    outcomes = MPI_COMM.allgather((error, returned))  # every rank gets here, whatever it saw
    for rank, (text, root_data) in enumerate(outcomes):
        if rank == late:
            assert text is not None, "the stalled rank returned a broadcast its sender gave up on"
            assert re.search(r"rank \d+ gave up on this communicator .* The error on rank \d+: "
                             r".*timed out after 1 s waiting for rank\(s\) \[" + str(late) +
                             r"\] to receive the broadcast", text), text
        elif text is None:
            assert root_data, f"rank {rank} returned other data than the root's"
        else:
            assert re.search(r"timed out after 1 s|gave up on this communicator", text), text


STALLED_CALLS = {
    "all_reduce": (lambda v, c: jaxring.all_reduce(v, c), 9),  # recursive doubling over MPI
    "all_gather": (lambda v, c: jaxring.all_gather(v, c), 12),
    "reduce_scatter": (lambda v, c: jaxring.reduce_scatter(v, c), 12 * COMM.size),
}


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
@pytest.mark.parametrize("call", list(STALLED_CALLS))
def test_a_rank_that_takes_small_messages_after_its_peers_gave_up_raises(call):
    """The last rank stalls once its header exchange is done, past its peers' 1 s timeout. Its
    peers had sent their small messages eagerly before they gave up, so over MPI it found them
    waiting when it woke and returned a result its peers had reported failed (its next call
    failed). Now every call that received data looks for its peers' notices before it returns."""
    body, size = STALLED_CALLS[call]
    sub = COMM.split(0, key=COMM.rank)  # a fresh communicator: an error leaves it unusable
    if sub.transport == "shm":
        pytest.skip("the stall is the MPI transport's; in shared memory a late rank finds its "
                    "peers' flags marked (test_a_rank_that_comes_after_its_peers_gave_up_...)")
    late = COMM.size - 1
    _, error = with_the_last_rank_stalled(jax.jit(lambda v: body(v, sub)),
                                          np.arange(size, dtype=np.float32) + COMM.rank)
    errors = MPI_COMM.allgather(error)  # every rank gets here, whatever it saw
    for rank, text in enumerate(errors):
        assert text is not None, f"rank {rank} returned a call its peers reported failed"
        assert re.search(r"timed out after 1 s", text), (rank, text)
        # A timeout past the header exchange knows that every rank made the call.
        if rank != late and text.startswith(("INTERNAL: jaxring", "jaxring")) and \
                "gave up" not in text:
            assert "every rank made this call, so it is stalled" in text, (rank, text)


@pytest.mark.skipif(COMM.transport != "hierarchical", reason="a hierarchical communicator")
def test_a_failure_on_one_node_reaches_the_other_nodes_at_once():
    """The ranks of node 0 disagree on a large all-reduce, which fails at once in its node-level
    reduce-scatter. Their peers on the other nodes, whose own node levels agree, go on to the
    level between nodes, where they waited for the ranks of node 0 until their timeout (30 s)
    before their levels were linked; now they fail at once, quoting the mismatch."""
    sub = COMM.split(0, key=COMM.rank)  # a fresh communicator: an error leaves it unusable
    node, across = sub.levels
    size = 300_001 if COMM.rank != 1 else 400_001  # rank 1 is on node 0, beside rank 0
    assert size * 4 > jaxring.config.get().mpi_ring_threshold_bytes  # through the levels
    f = jax.jit(lambda v: jaxring.all_reduce(v, sub))
    x = np.ones(size, np.float32)
    f.lower(x).compile()
    MPI_COMM.Barrier()
    try:
        start = time.monotonic()
        with jaxring.config.override(timeout_seconds=30.0):
            with pytest.raises(Exception, match=r"mismatched collectives") as error:
                np.asarray(f(x))
        took = time.monotonic() - start
        jaxring.reset_after_error()
        assert took < 10, f"rank {COMM.rank} took {took:.1f} s to fail: {error.value}"
        if across.rank != 0:  # not on node 0: told by its peer between the nodes
            assert re.search(r"rank 0 gave up on this communicator .* The error on rank 0: .*"
                             r"mismatched collectives", str(error.value)), str(error.value)
    finally:
        MPI_COMM.Barrier()  # in any case: a rank that failed an assertion must not hang the others


@pytest.mark.skipif(COMM.transport != "hierarchical", reason="a hierarchical communicator")
def test_a_hierarchical_communicator_fixes_which_all_reduces_go_through_its_levels():
    """Whether an all-reduce goes through the levels is decided at trace time, from
    mpi_ring_threshold_bytes. Ranks that decided differently once waited for each other on
    different communicators (the node's against the whole one) until the timeout. Now the
    communicator fixes the threshold when it is made, and ranks that differ then refuse to make
    it, naming each other. A rank whose threshold changes afterwards (where the level between
    nodes moves the shard alike, by recursive doubling up to either threshold, so that the
    headers' digest of the MPI method agrees) still goes through the levels with the others;
    the results are checked against float64."""
    agreed, rank_1 = 256 << 10, 1 << 30
    with jaxring.config.override(mpi_ring_threshold_bytes=rank_1 if COMM.rank == 1 else agreed):
        with pytest.raises(ValueError, match=r"every rank of the hierarchical .* must have the "
                                             r"same jaxring.config mpi_ring_threshold_bytes, "
                                             rf".*rank 1 {rank_1}"):
            COMM.split(0, key=COMM.rank)
    with jaxring.config.override(mpi_ring_threshold_bytes=agreed):
        sub = COMM.split(0, key=COMM.rank)
    assert sub.levels_threshold_bytes == agreed
    node, _ = sub.levels
    size = 40_000  # 320 KB: through the levels at the agreed threshold, not at rank 1's
    assert size * 8 > agreed >= size * 8 // node.size  # and each shard by recursive doubling
    rng = np.random.default_rng(COMM.rank + 70)
    x = rng.standard_normal(size)
    with jaxring.config.override(mpi_ring_threshold_bytes=rank_1 if COMM.rank == 1 else agreed,
                                 timeout_seconds=30.0):
        y = np.asarray(jax.jit(lambda v: jaxring.all_reduce(v, sub))(x))
    np.testing.assert_allclose(y, gathered(x).sum(0), rtol=1e-12, atol=1e-12)
    same_on_every_rank(y)
    sub.free()


def test_build_time_and_run_time_mpi_must_agree(monkeypatch):
    """A transport linked with another MPI library than mpi4py's is refused, with the fix."""
    ext, reason = jaxring.mpi._mpi_extension()
    if ext is None:
        pytest.skip(reason)
    monkeypatch.setattr(ext, "library_version", lambda: "Open MPI v5.0.0, imagined")
    jaxring.mpi._mpi_extension.cache_clear()
    try:
        runtime = MPI.Get_library_version().strip(" \n\x00").splitlines()[0]
        with pytest.raises(RuntimeError, match="build-time and run-time MPI differ: .* runs Open "
                           f"MPI v5.0.0, imagined, but mpi4py runs {re.escape(runtime)};"):
            jaxring.mpi.Communicator(MPI_COMM, transport="mpi")
        alone = MPI_COMM.Split(COMM.rank)  # one rank, so shared memory serves it on any layout
        sub = jaxring.mpi.Communicator(alone, transport="shm")  # collectives still work
        assert "differ" in sub.point_to_point_unavailable
        x = np.arange(3.0)
        np.testing.assert_array_equal(jax.jit(lambda v: jaxring.all_reduce(v, sub))(x), x)
        with pytest.raises(NotImplementedError, match="ppermute over .* needs jaxring's MPI "
                                                      "transport, but build-time and run-time"):
            jax.jit(lambda v: jaxring.ppermute(v, sub, [(0, 0)]))(np.ones(3))
    finally:
        jaxring.mpi._mpi_extension.cache_clear()


@pytest.mark.skipif(COMM.transport != "shm", reason="the exchange runs on shared memory")
@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
def test_the_benchmarks_exchange_floor_moves_what_it_claims(streamed):
    """benchmarks/allreduce_mpi.py's exchange floor must do the data movement it claims: each
    rank ends with its left neighbour's input plus, over the last (n - 2)/n of each step's
    elements, its second left neighbour's, in steps of one element, smaller than the message and
    of the whole slot."""
    from jaxring._jaxring import shm_exchange

    rng = np.random.default_rng([COMM.rank, 7])
    n = COMM.size
    for size, chunk in ((1, 4), (100_003, 64 << 10), (300_001, jaxring.mpi.DEFAULT_SLOT_BYTES)):
        x = rng.standard_normal(size).astype(np.float32)
        out = np.full_like(x, np.nan)
        shm_exchange(COMM.key, out, x, chunk, streamed, 3)
        inputs = gathered(x)
        want = inputs[(COMM.rank - 1) % n].copy()
        second = inputs[(COMM.rank - 2) % n]
        per_step = chunk // 4
        for at in range(0, size, per_step):
            end = min(at + per_step, size)
            tail = slice(end - (end - at) * max(n - 2, 0) // n, end)
            want[tail] += second[tail]
        np.testing.assert_array_equal(out, want)


# ---- set-up checks at their edges (a mutation review of jaxring/mpi.py) ----------------------


# Kills mpi01 (`value < 8 * size` -> `value < 8`) and mpi02 (`> 1 << 62` -> `> 1 << 63`):
# the bounds of slot_bytes at their edges, for rank counts the mpiexec runs never reach.
def test_slot_bytes_bounds_at_their_edges():
    check = jaxring.mpi._check_slot_bytes
    check(128, 16)                                  # 8 x 16 ranks = 128: just enough
    with pytest.raises(ValueError, match=r"at least 8 x 9 ranks = 72 bytes"):
        check(64, 9)                                # a multiple of 64, but < 8 x 9
    check(1 << 60, 1)                               # 2 x 2 x 2**60 = 2**62: the largest
    with pytest.raises(ValueError, match=r"at most 2\*\*62 / \(2 x 2\) = 1152921504606846976"):
        check((1 << 60) + 64, 1)


# Kills mpi08 (the check of `transport` dropped).
def test_an_unknown_transport_is_refused_on_every_rank():
    with pytest.raises(ValueError, match=r"transport must be one of \('auto', 'shm', 'mpi', "
                                         r"'hierarchical'\), got 'tcp'"):
        jaxring.mpi.Communicator(MPI_COMM, transport="tcp")


# Kills mpi09 (`size <= mpi_direct_header_ranks` -> `<`): at exactly size ranks the exchange
# is direct, at size - 1 Bruck's, so ranks set so disagree (they would agree under `<`).
@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_direct_headers_up_to_and_including_mpi_direct_header_ranks():
    limit = COMM.size if COMM.rank == 0 else COMM.size - 1
    with jaxring.config.override(mpi_direct_header_ranks=limit):
        with pytest.raises(ValueError, match=r"direct header exchange\) \(.*, True\) and rank 1 "
                                             r"for \(.*, False\)"):
            jaxring.mpi.Communicator(MPI_COMM)


# Kills mpi12 (nodes of unequal sizes made hierarchical): 3 ranks on pretend nodes of 2 and 1
# are a flat MPI ring, and a large all-reduce (which would go through the levels) is right.
def test_uneven_pretend_nodes_make_a_flat_mpi_communicator():
    expected = ("shm" if COMM.size <= 2 else
                "hierarchical" if COMM.size % 2 == 0 else "mpi")
    with jaxring.mpi.Communicator(MPI_COMM, transport="hierarchical", ranks_per_node=2) as comm:
        assert comm.transport == expected
        x = random_array(np.random.default_rng(COMM.rank), (300_001,), np.float64)
        y = np.asarray(jax.jit(lambda v: jaxring.all_reduce(v, comm))(x))
        np.testing.assert_allclose(y, gathered(x).sum(0), rtol=1e-12, atol=1e-12)


# Kills mpi14 (shared memory across nodes let through).
@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_shared_memory_across_pretend_nodes_is_refused():
    with pytest.raises(ValueError, match=r"are on several nodes; the shared-memory transport "
                                         r"needs them on one"):
        jaxring.mpi.Communicator(MPI_COMM, transport="shm", ranks_per_node=1)


# Kills mpi15 (hierarchical without the MPI transport not refused by name): the communicator
# asked for says it needs the MPI transport, not one of its levels after the node level was made.
@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_a_hierarchical_communicator_without_the_mpi_transport_is_refused_by_name(monkeypatch):
    ext, reason = jaxring.mpi._mpi_extension()
    if ext is None:
        pytest.skip(reason)
    monkeypatch.setattr(ext, "build_id", lambda: "stale")
    jaxring.mpi._mpi_extension.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"MPI communicator stale \(\d+ processes\) needs "
                                               r"the MPI transport \(its ranks are on several "
                                               r"nodes\)"):
            jaxring.mpi.Communicator(MPI_COMM, label="stale", transport="hierarchical",
                                     ranks_per_node=1)
    finally:
        jaxring.mpi._mpi_extension.cache_clear()


# Kills mpi19 (key -2**31, INT_MIN, refused).
def test_split_takes_every_c_int_key():
    for key in (-2**31, 2**31 - 1):
        with COMM.split(0, key=key) as sub:   # equal keys: ordered by rank
            assert (sub.size, sub.rank) == (COMM.size, COMM.rank)


# Kills mpi21 (negative ranks_per_node let through) and mpi22 (JAXRING_MPI_RANKS_PER_NODE
# read through float()).
def test_bad_ranks_per_node_is_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"ranks_per_node must be a whole number of ranks "
                                         r"\(0: the real nodes\), got -1"):
        jaxring.mpi.Communicator(MPI_COMM, ranks_per_node=-1)
    for text in ("2.5", "two"):
        monkeypatch.setenv("JAXRING_MPI_RANKS_PER_NODE", text)
        with pytest.raises(ValueError, match=rf"JAXRING_MPI_RANKS_PER_NODE must be a whole "
                                             rf"number of ranks \(0: the real nodes\), got "
                                             rf"'{text}'"):
            jaxring.mpi.Communicator(MPI_COMM)


# Kills mpi23 (_owning leaves the MPI communicator of a failed make allocated): a split whose
# set-up fails at its last step frees the communicator MPI_Comm_split made.
def test_a_split_that_fails_frees_its_mpi_communicator(monkeypatch):
    seen = []

    def attach(mpi_comm, key, rank, size, name, *rest, real=jaxring.mpi.gpu.attach):
        if "split(color=0)" in name:
            seen.append(mpi_comm)
            raise RuntimeError("imagined: no GPU transport")
        return real(mpi_comm, key, rank, size, name, *rest)
    monkeypatch.setattr(jaxring.mpi.gpu, "attach", attach)
    with pytest.raises(RuntimeError, match="imagined"):
        COMM.split(0, key=COMM.rank)
    assert seen and all(comm == MPI.COMM_NULL for comm in seen), seen
    MPI_COMM.Barrier()


# Kills mpi24 (free() of world() leaves it cached): world() after its free() is a new one.
def test_world_after_its_free_is_a_new_communicator():
    jaxring.mpi.world.cache_clear()  # this module's COMM (and others') stays alive
    try:
        first = jaxring.mpi.world()
        assert first is not COMM and jaxring.mpi.world() is first
        first.free()
        again = jaxring.mpi.world()
        assert again is not first
        x = np.full(3, COMM.rank + 1.0)
        np.testing.assert_array_equal(
            np.asarray(jax.jit(lambda v: jaxring.all_reduce(v, again))(x)),
            np.full(3, COMM.size * (COMM.size + 1) / 2))
        again.free()
    finally:
        jaxring.mpi.world.cache_clear()


# Kills mpi25 (split of a freed communicator not refused by name).
def test_a_freed_communicator_refuses_to_split():
    sub = COMM.split(0, key=COMM.rank)
    sub.free()
    with pytest.raises(ValueError, match=r"split\(color=0\) .* was freed"):
        sub.split(0)


# Kills mpi27 (a TypeError of one rank's options raised on that rank alone, its peers left to
# time out): every rank raises at once, naming the rank and its problem.
@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_a_rank_whose_option_has_the_wrong_type_makes_every_rank_raise():
    last = COMM.size - 1
    start = time.monotonic()
    with jaxring.config.override(timeout_seconds=5.0):
        with pytest.raises(ValueError, match=rf"rank {last}: jaxring.mpi: gpu_workspace_bytes "
                                             rf"must be an int, got 65536.5"):
            jaxring.mpi.Communicator(
                MPI_COMM, gpu_workspace_bytes=65536.5 if COMM.rank == last else 65536)
    assert time.monotonic() - start < 4
