"""The host side of the GPU transports, on CPU processes (runs in every tests/mpi job):

* the header-only exchange (kJaxringHostAgree) that cuda-ipc synchronises its steps with passes
  when ranks agree, names both sides when they do not, names a missing rank, and refuses to pair
  with a rank that runs the same collective on the host transport;
* cuda-ipc's steps (gpu/ipc_steps.h: staging, one-shot and two-shot reductions, slot layouts,
  parities, chunking) run on host memory shared by the processes, against float64;
* the staged transport's pipeline (gpu/staged_steps.h: chunking, buffer rotation, strided
  copies) runs on host memory, each chunk on the real host transport;
* the CUDA-aware path's algorithm (gpu/direct.h) runs on host memory over plain MPI.

Only the CUDA operations underneath (copies, kernels, interprocess events) need a GPU."""

import os
import re
import time

import jax
import numpy as np
import pytest

import jaxring
import jaxring.mpi
from jaxring._src import common, native
from helpers import ANY_SITE

COMM = jaxring.mpi.world()
MPI_COMM = COMM.mpi_comm
ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, BROADCAST = (
    common.COLLECTIVE_CODES[kind] for kind in ("all_reduce", "reduce_scatter", "all_gather",
                                               "broadcast"))
SUM, MAX = common.REDUCE_OPS["sum"], common.REDUCE_OPS["max"]
F32, F16 = common.DTYPE_CODES[np.dtype(np.float32)], common.DTYPE_CODES[np.dtype(np.float16)]


def agree(comm, kind=ALL_REDUCE, op=SUM, dtype=F32, count=8, op_id=1, root=0):
    native.extension.host_agree(comm.key, comm.name, comm.rank, comm.size, kind, op, dtype, count,
                                op_id, root)


def test_ranks_that_agree_pass_and_the_communicator_goes_on():
    sub = COMM.split(0, key=COMM.rank)
    n = COMM.size
    for step in range(5):  # more steps than the shared-memory transport's two parities
        agree(sub, ALL_REDUCE, MAX, F16, count=1001, op_id=step)
        agree(sub, REDUCE_SCATTER, SUM, F32, count=7 * n, op_id=step)
        agree(sub, ALL_GATHER, SUM, F32, count=0, op_id=step)
        agree(sub, BROADCAST, SUM, F32, count=3, op_id=step, root=n - 1)
    x = np.arange(5.0) + COMM.rank
    y = jax.jit(lambda v: jaxring.all_reduce(v, sub))(x)
    np.testing.assert_array_equal(np.asarray(y), n * np.arange(5.0) + n * (n - 1) / 2)


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_a_mismatch_is_named_on_every_rank():
    sub = COMM.split(0, key=COMM.rank)
    with jaxring.config.override(timeout_seconds=30.0):
        with pytest.raises(RuntimeError, match=r"mismatched collectives: rank 0 called "
                                               r"all_reduce\(sum\) op 4 float32\[8\]" + ANY_SITE
                                               + r" but rank 1 called all_reduce\(sum\) op 4 "
                                               r"float32\[9\]"):
            agree(sub, count=8 if COMM.rank == 0 else 9, op_id=4)


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_a_broadcast_root_mismatch_shows_the_roots_without_the_gpu_tag():
    sub = COMM.split(0, key=COMM.rank)
    with pytest.raises(RuntimeError, match=r"rank 0 called broadcast\(root=0\) op 2 float32\[3\]"
                                           + ANY_SITE + r" but rank 1 called broadcast\(root=1\)"):
        agree(sub, BROADCAST, count=3, op_id=2, root=min(COMM.rank, 1))


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_a_missing_rank_is_named():
    sub = COMM.split(0, key=COMM.rank)
    last = COMM.size - 1
    if COMM.rank != last:
        with jaxring.config.override(timeout_seconds=2.0):
            with pytest.raises(RuntimeError, match=rf"timed out after 2 s waiting for rank\(s\) "
                                                   rf"\[{last}\]"):
                agree(sub, op_id=9)
    MPI_COMM.Barrier()


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
@pytest.mark.skipif(COMM.gpu_transport == "ipc" or (COMM.gpu_transport == "staged" and
                                                    COMM.cuda_aware_mpi),
                    reason="the other ranks' all_reduce is a GPU step too (cuda-ipc, or staged "
                    "over a CUDA-aware MPI); the CPU runs cover the pairing")
def test_a_gpu_step_never_pairs_with_a_host_collective():
    """Rank 0 takes a cuda-ipc step, the others run the same all_reduce on the host transport:
    an error on every rank that says so, never a step paired with data that was not moved."""
    sub = COMM.split(0, key=COMM.rank)
    x = np.ones(8, np.float32)
    with jaxring.config.override(timeout_seconds=30.0):
        with pytest.raises(Exception, match="One of them ran it on a GPU transport and the other "
                                            "on the host"):
            if COMM.rank == 0:
                agree(sub, count=8, op_id=0)
            else:
                np.asarray(jax.jit(lambda v: jaxring.all_reduce(v, sub))(x))
    jaxring.reset_after_error()


def test_a_header_exchange_needs_a_process_communicator():
    with pytest.raises(RuntimeError, match="needs a process communicator"):
        native.extension.host_agree(12345, "nothing", 0, 1, ALL_REDUCE, SUM, F32, 4, 0, 0)


# ---- the CUDA-aware path's algorithm (gpu/direct.h), on host memory over plain MPI --------------

DIRECT_DTYPES = common.DTYPE_CODES
OPS = common.REDUCE_OPS
REFERENCE = {"sum": lambda a: a.sum(0), "mean": lambda a: a.mean(0),
             "max": lambda a: a.max(0), "min": lambda a: a.min(0)}


def direct(ops, kind, op, x, output_count, root=0, scratch=4096, timeout=60.0, fail_reduce=-1,
           deferred=False):
    code = DIRECT_DTYPES[x.dtype]
    out = jaxring.mpi._mpi_extension()[0].direct_collective(
        ops, COMM.rank, COMM.size, kind, OPS[op], code, x.tobytes(), output_count, root, scratch,
        timeout, fail_reduce, deferred)
    return np.frombuffer(out, x.dtype)


def message_ops():
    extension, why_not = jaxring.mpi._mpi_extension()
    if extension is None:
        pytest.skip(why_not)
    from mpi4py import MPI
    return extension.message_ops(MPI._addressof(MPI_COMM), "direct test")


def outcome_of(call):
    """(seconds taken, None or the error's text): every rank reports, none asserts alone."""
    start = time.monotonic()
    try:
        call()
        return time.monotonic() - start, None
    except Exception as error:  # noqa: BLE001 - checked after gathering
        return time.monotonic() - start, str(error)


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_a_rank_already_waiting_learns_at_once_that_its_peer_gave_up():
    """Rank 0 waits for a broadcast from rank 1 (1 s timeout) while every other rank waits for
    one from rank 0 (20 s): all are inside their wait when rank 0 times out and gives up. The
    others fail within seconds, quoting rank 0's timeout, as a wait that has gone on a while
    looks for its peers' notices (mpi_messages.cc WaitAll); a mutation that never looked
    passed every other test (their notices came before the next post) and waited out 20 s."""
    ops = message_ops()
    x = np.arange(16, dtype=np.float32)
    MPI_COMM.Barrier()
    root, timeout = (1, 1.0) if COMM.rank == 0 else (0, 20.0)
    took, error = outcome_of(lambda: direct(ops, BROADCAST, "sum", x, x.size, root=root,
                                            timeout=timeout))
    outcomes = MPI_COMM.allgather((took, error))
    assert outcomes[0][1] is not None and "timed out after 1 s waiting for rank(s) [1]" in \
        outcomes[0][1], outcomes
    for rank, (took, error) in enumerate(outcomes[1:], 1):
        assert error is not None and re.search(r"rank 0 gave up on direct test \(.*timed out "
                                               r"after 1 s", error), (rank, error)
        assert took < 10, (rank, took, error)


@pytest.mark.parametrize("deferred", [False, True], ids=["kernels at once", "kernels deferred"])
@pytest.mark.parametrize("dtype", list(DIRECT_DTYPES), ids=str)
def test_the_cuda_aware_algorithm_against_float64(dtype, deferred):
    """Kernels deferred run as late as a stream may run them (HostMemory): MPI reading a piece
    before the kernel that writes it has run, or writing scratch that a queued kernel still
    reads, gives wrong results there."""
    from helpers import assert_close, random_array

    ops = message_ops()
    n, me = COMM.size, COMM.rank
    rng = np.random.default_rng([me, dtype.num, 3])
    for size in (0, 1, 7, 1001, 5000):  # 4 KiB scratch: 5000 elements take several steps
        x = random_array(rng, (size,), dtype)
        everyone = np.stack(MPI_COMM.allgather(x)).astype(np.float64)
        for op in OPS:
            if op == "mean" and dtype.kind == "i":
                continue  # jaxring divides integers in float (as lax.pmean) before the kernel
            y = direct(ops, ALL_REDUCE, op, x, size, deferred=deferred)
            assert_close(y, REFERENCE[op](everyone), dtype, count=n)
            mine = y.tobytes()
            assert all(other == mine for other in MPI_COMM.allgather(mine)), "ranks disagree"
        block = x[: size // n * n] if size >= n else x[:0]
        b = len(block) // n
        everyone = np.stack(MPI_COMM.allgather(block)).astype(np.float64)
        y = direct(ops, REDUCE_SCATTER, "max", block, b, deferred=deferred)
        np.testing.assert_array_equal(y, everyone.max(0)[me * b:(me + 1) * b].astype(dtype))
        y = direct(ops, REDUCE_SCATTER, "sum", block, b, deferred=deferred)
        assert_close(y, everyone.sum(0)[me * b:(me + 1) * b], dtype, count=n)
        y = direct(ops, ALL_GATHER, "sum", x, size * n, deferred=deferred)
        np.testing.assert_array_equal(y, np.concatenate(MPI_COMM.allgather(x)))
        for root in sorted({0, n - 1}):
            y = direct(ops, BROADCAST, "sum", x, size, root=root, deferred=deferred)
            np.testing.assert_array_equal(y, MPI_COMM.bcast(x, root=root))


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
@pytest.mark.parametrize("count", [4, 300_000])
def test_the_cuda_aware_algorithm_names_a_missing_rank(count):
    """300000 elements go as MPI's rendezvous sends, still under way when the wait times out:
    cancelling them crashed MPICH's UCX device, so the failure only frees them."""
    ops = message_ops()
    last = COMM.size - 1
    try:
        if COMM.rank != last:
            with pytest.raises(RuntimeError, match=rf"timed out after 1 s waiting for rank\(s\) "
                                                   rf"\[.*{last}\]"):
                direct(ops, ALL_GATHER, "sum", np.ones(count, np.float32), count * COMM.size,
                       timeout=1.0)
    finally:
        MPI_COMM.Barrier()  # in any case: a rank that failed an assertion must not hang the others


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_a_late_receiver_of_a_root_that_gave_up_fails_and_the_messages_stay_failed():
    """The root's broadcast (300000 elements: MPI's rendezvous sends, which read the root's
    buffer only once a receiver comes) times out after 1 s; the other ranks come 2 s late. They
    once posted their receives, matched the root's send (freed, not cancelled) and returned its
    buffer's bytes, by then freed memory, as a success. They must fail, naming the root's error,
    and so must every later exchange on these messages, on every rank."""
    ops = message_ops()
    x = np.arange(300_000, dtype=np.float32)
    try:
        if COMM.rank == 0:
            with pytest.raises(RuntimeError, match=r"timed out after 1 s waiting for rank\(s\) \["):
                direct(ops, BROADCAST, "sum", x, x.size, timeout=1.0)
        else:
            time.sleep(2.0)
            with pytest.raises(RuntimeError, match=r"rank 0 gave up on direct test \(timed out"):
                direct(ops, BROADCAST, "sum", x, x.size, timeout=10.0)
        with pytest.raises(RuntimeError, match="an earlier exchange on direct test failed"):
            direct(ops, ALL_GATHER, "sum", x[:4], 4 * COMM.size, timeout=10.0)
    finally:
        MPI_COMM.Barrier()  # in any case: a rank that failed an assertion must not hang the others


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_a_rank_whose_reduction_fails_fails_its_peers_at_once_quoting_it():
    """Rank 0's first reduction fails (as a kernel launch may) after every rank has exchanged its
    shares: rank 0 gives up on the messages, so its peers, waiting for its reduced share, fail at
    once with its error instead of waiting out their timeout, and so does every later exchange."""
    ops = message_ops()
    x = np.ones(1000, np.float32)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"reduction 0 failed \(injected\)"):
        direct(ops, ALL_REDUCE, "sum", x, x.size, timeout=20.0,
               fail_reduce=0 if COMM.rank == 0 else -1)
    assert time.monotonic() - start < 10.0
    with pytest.raises(RuntimeError, match="an earlier exchange on direct test failed"):
        direct(ops, ALL_GATHER, "sum", x[:4], 4 * COMM.size, timeout=10.0)
    MPI_COMM.Barrier()


# ---- cuda-ipc's steps (gpu/ipc_steps.h), on host memory shared between the processes ----------

class SharedSlots:
    """2 * size slots of `slot_bytes` that every rank maps (a file in /dev/shm, as the
    workspaces cudaIpc maps on the GPU), with the step counter cuda-ipc keeps per communicator."""

    def __init__(self, comm, slot_bytes):
        import ctypes
        import mmap

        self.comm, self.slot_bytes, self.step, self.trace = comm, slot_bytes, 0, []
        path = MPI_COMM.bcast(f"/dev/shm/jaxring-ipc-test-{comm.key:016x}", root=0)
        nbytes = 2 * comm.size * slot_bytes
        if comm.rank == 0:
            with open(path, "wb") as f:
                f.truncate(nbytes)
        MPI_COMM.Barrier()
        with open(path, "r+b") as f:
            self.map = mmap.mmap(f.fileno(), nbytes)
        MPI_COMM.Barrier()
        if comm.rank == 0:
            os.unlink(path)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))

    def run(self, kind, op, x, output_count, root=0, op_id=0, fail_operation=-1):
        out, self.step, trace = native.extension.ipc_steps_on_host(
            self.comm.key, self.comm.name, self.comm.rank, self.comm.size, self.address,
            self.slot_bytes, self.step, kind, OPS[op], DIRECT_DTYPES[x.dtype], x.tobytes(),
            output_count, root, op_id, fail_operation)
        self.trace += trace
        return np.frombuffer(out, x.dtype)


STAGED, REDUCED, DONE = 0, 1, 2  # gpu::IpcEvent


def check_ipc_ordering(trace, me):
    """The order that cuda-ipc's steps need on a GPU, where copies and kernels run on a stream
    and only events order them against other processes (cuda/ipc.h), checked on the trace of
    this rank's operations (HostIpcOps), since on the host every copy is done when it returns:
    - a step of parity p touches only slots of parity p and ends by recording `done` p;
    - from the third step on, this rank writes its slot only after waiting for every rank's
      `done` p, its own included (every reader of that slot two steps ago has finished);
    - before each exchange (`agree`) it records `staged` p, or in a two-shot all-reduce's
      second one `reduced` p, after its last write to its slot;
    - it reads a peer's slot only after the latest exchange, and after waiting, since then,
      for that peer's event recorded before it."""
    steps, current = [], []
    for entry in trace:
        current.append(entry.split())
        if current[-1][:2] == ["record", str(DONE)]:
            steps.append(current)
            current = []
    assert not current, f"a step that never recorded `done`: {current}"
    for number, ops in enumerate(steps):
        p = number % 2
        where = f"step {number}: {[' '.join(op) for op in ops]}"
        assert all(int(op[2]) == p for op in ops if op[0] in ("read", "write", "record")), where
        assert all(int(op[2]) == p for op in ops if op[0] == "wait"), where
        done_waited = number < 2
        agreed = 0  # exchanges so far in this step
        recorded = waited = None  # the events recorded and waited for since the last exchange
        for op in ops:
            if op[0] == "wait" and int(op[1]) == DONE:
                assert op[3:] == ["-1", "1"], where  # every rank's, this one's too
                done_waited = True
            elif op[0] == "write" and int(op[1]) == me:
                assert done_waited, f"wrote its slot before every reader was done; {where}"
                recorded = None  # a record before this write would publish too early
            elif op[0] == "record" and int(op[1]) != DONE:
                recorded = int(op[1])
            elif op[0] == "agree":
                assert recorded == (STAGED if agreed == 0 else REDUCED), (
                    f"exchange {agreed} without its event recorded after the last write; {where}")
                agreed, recorded, waited = agreed + 1, None, None
            elif op[0] == "wait":
                waited = (int(op[1]), int(op[3]))
            elif op[0] == "read" and int(op[1]) != me:
                expected = STAGED if agreed == 1 else REDUCED
                assert agreed and waited is not None and waited[0] == expected and (
                    waited[1] in (-1, int(op[1]))), (
                    f"read rank {op[1]}'s slot without waiting for its event; {where}")
        assert ops[-1][:2] == ["record", str(DONE)], where


@pytest.mark.parametrize("slot_bytes", [4096, 512 << 10], ids=["4 KiB slots", "512 KiB slots"])
@pytest.mark.parametrize("dtype", list(DIRECT_DTYPES), ids=str)
def test_the_ipc_steps_against_float64(dtype, slot_bytes):
    """Every collective through cuda-ipc's steps: one-shot and (3+ ranks, steps over 256 KiB)
    two-shot all-reduces, many steps per call in small slots, several calls (parities)."""
    from helpers import assert_close, random_array

    sub = COMM.split(0, key=COMM.rank)
    slots = SharedSlots(sub, slot_bytes)
    n, me = COMM.size, COMM.rank
    rng = np.random.default_rng([me, dtype.num, 4])
    for size in (0, 1, 7, 1001, 150_001):  # 150_001 float32: 600 KB, two-shot with 4 ranks
        x = random_array(rng, (size,), dtype)
        everyone = np.stack(MPI_COMM.allgather(x)).astype(np.float64)
        for op in OPS:
            if op == "mean" and dtype.kind == "i":
                continue
            y = slots.run(ALL_REDUCE, op, x, size)
            assert_close(y, REFERENCE[op](everyone), dtype, count=n)
            mine = y.tobytes()
            assert all(other == mine for other in MPI_COMM.allgather(mine)), "ranks disagree"
        b = size // n
        block = x[:b * n]
        everyone = np.stack(MPI_COMM.allgather(block)).astype(np.float64)
        y = slots.run(REDUCE_SCATTER, "min", block, b)
        np.testing.assert_array_equal(y, everyone.min(0)[me * b:(me + 1) * b].astype(dtype))
        y = slots.run(REDUCE_SCATTER, "sum", block, b)
        assert_close(y, everyone.sum(0)[me * b:(me + 1) * b], dtype, count=n)
        y = slots.run(ALL_GATHER, "sum", x, size * n)
        np.testing.assert_array_equal(y, np.concatenate(MPI_COMM.allgather(x)))
        for root in sorted({0, n - 1}):
            y = slots.run(BROADCAST, "sum", x, size, root=root)
            np.testing.assert_array_equal(y, MPI_COMM.bcast(x, root=root))
    expected_steps = slots.step
    assert MPI_COMM.allgather(expected_steps) == [expected_steps] * n
    check_ipc_ordering(slots.trace, me)


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_the_ipc_steps_report_a_mismatch_on_every_rank():
    sub = COMM.split(0, key=COMM.rank)
    slots = SharedSlots(sub, 4096)
    x = np.ones(3 if COMM.rank == 0 else 5, np.float32)
    with pytest.raises(RuntimeError, match=r"mismatched collectives: rank 0 called "
                                           r"all_reduce\(sum\) op 7 float32\[3\]" + ANY_SITE
                                           + r" but rank 1 called all_reduce\(sum\) op 7 "
                                           r"float32\[5\]"):
        slots.run(ALL_REDUCE, "sum", x, len(x), op_id=7)


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_an_ipc_step_failing_fails_the_peers_at_once_quoting_it():
    """Rank 0's reduction of step 1 (its second device operation) fails after every rank agreed
    on step 1, as a kernel launch may: rank 0 leaves the host communicator, so its peers, waiting
    for it in step 2's agreement, fail at once with its error instead of timing out; so does
    every later call."""
    sub = COMM.split(0, key=COMM.rank)  # the failure breaks it; COMM must stay usable
    slots = SharedSlots(sub, 4096)
    x = np.ones(3000, np.float32)  # three steps of 1024 elements
    with jaxring.config.override(timeout_seconds=20.0):
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"device operation 1 failed \(injected\)"):
            slots.run(ALL_REDUCE, "sum", x, len(x), fail_operation=1 if COMM.rank == 0 else -1)
        assert time.monotonic() - start < 10.0
        with pytest.raises(RuntimeError, match=r"injected"):
            slots.run(ALL_REDUCE, "sum", x, len(x))


# ---- the staged transport's pipeline (gpu/staged_steps.h), on host memory ---------------------

def staged(comm, kind, op, x, output_count, chunk_bytes, root=0, fail_copy_out=-1,
           deferred=False):
    out = native.extension.staged_steps_on_host(
        comm.key, comm.name, comm.rank, comm.size, chunk_bytes, kind, OPS[op],
        DIRECT_DTYPES[x.dtype], x.tobytes(), output_count, root, 3, fail_copy_out, deferred)
    return np.frombuffer(out, x.dtype)


@pytest.mark.parametrize("deferred", [False, True], ids=["copies at once", "copies deferred"])
@pytest.mark.parametrize("chunk_bytes", [4096, 64 << 10], ids=["4 KiB chunks", "64 KiB chunks"])
@pytest.mark.parametrize("dtype", list(DIRECT_DTYPES), ids=str)
def test_the_staged_pipeline_against_float64(dtype, chunk_bytes, deferred):
    """Copies deferred run as late as a GPU stream may run them (HostStagingOps): a chunk read
    before the pipeline waited for its copy in, or a result buffer written before its last copy
    out, gives wrong results there."""
    from helpers import assert_close, random_array

    n, me = COMM.size, COMM.rank
    rng = np.random.default_rng([me, dtype.num, 5])
    for size in (0, 1, 7, 1001, 40_001):
        x = random_array(rng, (size,), dtype)
        everyone = np.stack(MPI_COMM.allgather(x)).astype(np.float64)
        for op in OPS:
            if op == "mean" and dtype.kind == "i":
                continue
            y = staged(COMM, ALL_REDUCE, op, x, size, chunk_bytes, deferred=deferred)
            assert_close(y, REFERENCE[op](everyone), dtype, count=n)
        b = size // n
        block = x[:b * n]
        everyone = np.stack(MPI_COMM.allgather(block)).astype(np.float64)
        y = staged(COMM, REDUCE_SCATTER, "max", block, b, chunk_bytes, deferred=deferred)
        np.testing.assert_array_equal(y, everyone.max(0)[me * b:(me + 1) * b].astype(dtype))
        y = staged(COMM, ALL_GATHER, "sum", x, size * n, chunk_bytes, deferred=deferred)
        np.testing.assert_array_equal(y, np.concatenate(MPI_COMM.allgather(x)))
        for root in sorted({0, n - 1}):
            y = staged(COMM, BROADCAST, "sum", x, size, chunk_bytes, root=root, deferred=deferred)
            np.testing.assert_array_equal(y, MPI_COMM.bcast(x, root=root))


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
@pytest.mark.parametrize("sizes", [(3000, 2500), (2048, 3072)],
                         ids=["a last chunk apart", "whole chunks"])
def test_the_staged_pipeline_reports_calls_of_different_sizes_in_the_first_chunk(sizes):
    """Each chunk is its own host call, and chunks compare the whole call's size too: every rank
    reports the mismatch in chunk 0, and the pipeline still ends the call (on a GPU, End() makes
    XLA's stream wait for the result copies already queued into y; staged_steps_on_host raises
    "returned without End()" if it was skipped). Chunks once compared only their own sizes: in
    `whole chunks` rank 0's two chunks matched rank 1's first two, rank 0 returned a result mixed
    from different calls, and rank 1 waited out its timeout in its third."""
    sub = COMM.split(0, key=COMM.rank)  # the mismatch breaks it; COMM must stay usable
    mine, theirs = sizes if COMM.rank == 0 else sizes[::-1]
    x = np.ones(mine, np.float32)  # chunks of 1024 elements
    with jaxring.config.override(timeout_seconds=20.0):
        with pytest.raises(RuntimeError, match=rf"^(?!the staged pipeline returned without End)"
                                               rf".*mismatched collectives: rank 0 called "
                                               rf"all_reduce\(sum\) op 3 float32\[1024\] \(a "
                                               rf"chunk of {sizes[0]}\){ANY_SITE} but rank 1 called "
                                               rf"all_reduce\(sum\) op 3 float32\[1024\] \(a "
                                               rf"chunk of {sizes[1]}\)"):
            staged(sub, ALL_REDUCE, "sum", x, len(x), 4096)


@pytest.mark.skipif(COMM.size < 2, reason="needs two ranks")
def test_a_copy_failing_between_chunks_fails_the_peers_at_once_quoting_it():
    """Rank 0's copy of chunk 1's result fails after every rank ran chunk 1's host call, as a CUDA
    copy may: rank 0 leaves the host communicator (kJaxringHostLeave), so its peers, waiting for
    it in chunk 2's, fail at once with its error instead of timing out."""
    sub = COMM.split(0, key=COMM.rank)  # the failure breaks it; COMM must stay usable
    x = np.ones(3000, np.float32)  # three chunks of 1024 elements
    with jaxring.config.override(timeout_seconds=20.0):
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"copying result chunk 1 to the device failed "
                                               r"\(injected\)"):
            staged(sub, ALL_REDUCE, "sum", x, len(x), 4096,
                   fail_copy_out=1 if COMM.rank == 0 else -1)
        assert time.monotonic() - start < 10.0
        with pytest.raises(RuntimeError, match=r"injected"):  # and so does every later call
            staged(sub, ALL_REDUCE, "sum", x, len(x), 4096)
