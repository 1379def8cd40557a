"""ppermute, send and recv across processes (over jaxring's MPI transport), checked against numpy
on every rank's gathered inputs. Runs under mpiexec (tests/test_mpi.py) and as one rank."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxring
import jaxring.mpi
from helpers import DTYPES, called_at, random_array

COMM = jaxring.mpi.world()
MPI_COMM = COMM.mpi_comm
N = COMM.size
pytestmark = pytest.mark.skipif(COMM.point_to_point_unavailable is not None,
                                reason=str(COMM.point_to_point_unavailable))


def gathered(x):
    return np.stack(MPI_COMM.allgather(np.asarray(x)))


def expected_permute(inputs, perm, rank):
    """What `rank` receives: its source's input, or zeros."""
    for source, dest in perm:
        if dest == rank:
            return inputs[source]
    return np.zeros_like(inputs[0])


def permutations():
    rng = np.random.default_rng(7)  # the same on every rank
    shuffled = rng.permutation(N)
    return {
        "shift": [(i, (i + 1) % N) for i in range(N)],
        "reverse": [(i, (i - 1) % N) for i in range(N)],
        "random": [(i, int(shuffled[i])) for i in range(N)],
        "partial": [(0, N - 1)],
        "identity": [(i, i) for i in range(N)],
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ppermute_against_numpy_on_every_permutation(dtype):
    rng = np.random.default_rng([COMM.rank, dtype.num])
    # Sizes on both protocols: eager up to p2p_eager_bytes (64 KiB), in place above.
    for size in (0, 1, 1001, 40_000):
        x = random_array(rng, (size,), dtype)
        inputs = gathered(x)
        for name, perm in permutations().items():
            y = jax.jit(lambda v, perm=perm: jaxring.ppermute(v, COMM, perm))(x)
            np.testing.assert_array_equal(np.asarray(y), expected_permute(inputs, perm, COMM.rank),
                                          err_msg=f"{name} perm, {size} elements")


def test_sends_on_both_sides_of_64_kib_arrive_whole():
    """A send is always copied; up to 64 KiB with its header the copy travels in the header's
    message, above it as a message of its own, received into the transport's buffer and copied
    out. Sizes on both sides of that line, and one of several MiB, on every permutation."""
    rng = np.random.default_rng([COMM.rank, 23])
    for size in (16_000, 16_380, 16_400, 1_500_000):
        x = rng.standard_normal(size).astype(np.float32)
        inputs = gathered(x)
        for name, perm in permutations().items():
            def step(v, perm=perm):
                jaxring.send(v, COMM, perm)
                return jaxring.recv(v, COMM, perm)
            np.testing.assert_array_equal(np.asarray(jax.jit(step)(x)),
                                          expected_permute(inputs, perm, COMM.rank),
                                          err_msg=f"{name} perm, {size} elements")


def test_a_ppermute_between_a_send_and_its_recv_takes_its_own_message():
    """send/recv and ppermute once shared one MPI tag, so a ppermute over the send's pairs, made
    before the recv, received the send's message and refused it as a mismatch, though every rank
    made the same calls. Each now has a tag of its own (the pieces of a long copy follow its
    header under it), at sizes sent in the header's message, as pieces after it, and (ppermute
    above 64 KiB) in place."""
    rng = np.random.default_rng([COMM.rank, 29])
    for name, perm in permutations().items():
        for size in (5, 16_400, 40_000):
            x = rng.standard_normal(size).astype(np.float32)
            inputs = gathered(x)

            def calls(v, perm=perm):
                jaxring.send(v, COMM, perm)
                between = jaxring.ppermute(v * 10, COMM, perm)
                jaxring.send(v + 1, COMM, perm)
                return jnp.stack([between, jaxring.recv(v, COMM, perm),
                                  jaxring.recv(v, COMM, perm), jaxring.ppermute(v - 1, COMM, perm)])

            want = np.stack([expected_permute(f(inputs), perm, COMM.rank)
                             for f in (lambda u: u * 10, lambda u: u, lambda u: u + 1,
                                       lambda u: u - 1)])
            np.testing.assert_array_equal(np.asarray(jax.jit(calls)(x)), want,
                                          err_msg=f"{name} perm, {size} elements")


@pytest.mark.skipif(N < 2, reason="needs two ranks")
def test_a_ppermute_that_meets_a_send_times_out_naming_the_send():
    """As in process: rank 0 sends where rank 1 calls ppermute, on a channel of its own, so
    rank 1 times out, and says that a send/recv message from rank 0 waits."""
    sub = COMM.split(0, key=COMM.rank)  # a fresh communicator: an error leaves it unusable
    x = np.ones(3, np.float32)
    with jaxring.config.override(timeout_seconds=2.0):
        if COMM.rank == 0:
            jax.jit(lambda v: jaxring.send(v, sub, [(0, 1)]))(x)
        elif COMM.rank == 1:
            with pytest.raises(Exception, match=r"Rank 0 has sent this rank a send/recv message "
                                                r"that nothing took: did it call send where "
                                                r"this rank calls ppermute\?"):
                np.asarray(jax.jit(lambda v: jaxring.ppermute(v, sub, [(0, 1)]))(x))
    MPI_COMM.Barrier()
    jaxring.reset_after_error()


def test_send_compute_recv_scan_vmap_and_pytrees():
    shift = permutations()["shift"]
    x = np.arange(12.0, dtype=np.float32).reshape(3, 4) + 100 * COMM.rank
    inputs = gathered(x)

    def step(v):
        jaxring.send(v, COMM, shift)
        return jaxring.recv(v, COMM, shift) * 2.0

    np.testing.assert_array_equal(np.asarray(jax.jit(step)(x)),
                                  2.0 * expected_permute(inputs, shift, COMM.rank))
    # N ring passes inside one scan bring every block home.
    around = jax.jit(lambda v: jax.lax.fori_loop(
        0, N, lambda _, c: jaxring.ppermute(c, COMM, shift), v))(x)
    np.testing.assert_array_equal(np.asarray(around), x)
    vmapped = jax.jit(jax.vmap(lambda v: jaxring.ppermute(v, COMM, shift), in_axes=1))(x)
    np.testing.assert_array_equal(np.asarray(vmapped),
                                  expected_permute(inputs, shift, COMM.rank).T)
    tree = {"a": x, "b": np.int64(COMM.rank)}
    got = jax.jit(lambda t: jaxring.ppermute(t, COMM, shift))(tree)
    np.testing.assert_array_equal(np.asarray(got["a"]), expected_permute(inputs, shift, COMM.rank))
    np.testing.assert_array_equal(np.asarray(got["b"]), (COMM.rank - 1) % N)


def test_grad_through_ppermute_is_the_inverse_permutation():
    """Every process differentiates its own loss: d/dx of sum_r loss_r(ppermute(x)) on rank r is
    the cotangent of the rank that x went to."""
    perm = permutations()["random"]
    rng = np.random.default_rng(COMM.rank + 30)
    x = rng.standard_normal(5)
    w = rng.standard_normal(5)
    grad = jax.jit(jax.grad(lambda v: jnp.sum(jaxring.ppermute(v, COMM, perm) * w)))(x)
    dest = dict(perm)[COMM.rank]
    np.testing.assert_allclose(np.asarray(grad), gathered(w)[dest], rtol=1e-6)


@pytest.fixture
def full_float32_products():
    """Full float32 matrix products (not TF32, a GPU's default) in the layers and the reference
    alike, so that the tolerance checks the data movement, not the rounding of the products."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.skipif(N < 2, reason="needs two ranks")
@pytest.mark.usefixtures("full_float32_products")
def test_pipeline_over_processes_equals_the_unsharded_layers():
    """jaxring.parallel.pipeline with a process communicator for the axis: each rank holds one
    stage (two tanh layers) and the activations travel over MPI; GPipe's schedule and the ring of
    interleaved streams both equal running every layer in order on one process."""
    from jaxring.parallel import pipeline

    n, width, rows = COMM.size, 16, 3
    rng = np.random.default_rng(11)  # the same layers and inputs on every rank
    layers = [{"w": (rng.standard_normal((width, width)) / 4).astype(np.float32),
               "b": rng.standard_normal(width).astype(np.float32)} for _ in range(2 * n)]
    microbatches = rng.standard_normal((5, rows, width)).astype(np.float32)

    def dense(params, h):
        return jnp.tanh(h @ params["w"] + params["b"])

    def unsharded(x):
        for layer in layers:
            x = dense(layer, x)
        return x

    stage_fn = pipeline.scan_layers(dense)
    mine = jax.tree.map(lambda leaf: leaf[COMM.rank:COMM.rank + 1],
                        pipeline.stack_stages(layers, n))
    got = jax.jit(lambda p, m: pipeline.pipeline_apply(stage_fn, p, m, COMM))(mine, microbatches)
    expected = jax.vmap(unsharded)(microbatches)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-5, atol=2e-6)

    # The ring of n interleaved streams (ring=True: the last stage hands on to the first), as an
    # autoregressive loop runs it: the stream that starts on rank r goes through stages r, r+1,
    # ..., n-1, 0, ..., r-1 and is back on rank r after n ticks.
    passes = 3
    start = microbatches[COMM.rank]

    def ring(p, x):
        def tick(carry, _):
            return pipeline.pipeline_step(stage_fn, p, carry, COMM, ring=True)[1], None
        return jax.lax.scan(tick, x, None, length=n * passes)[0]

    want = start
    for tick in range(n * passes):
        stage = (COMM.rank + tick) % n
        for layer in layers[2 * stage:2 * stage + 2]:
            want = dense(layer, want)
    np.testing.assert_allclose(np.asarray(jax.jit(ring)(mine, start)), np.asarray(want),
                               rtol=2e-5, atol=2e-6)

    # Gradients follow every collective's across processes: each rank differentiates its own
    # copy, so the objective is the sum of the ranks' losses. Each rank computing the whole loss
    # from the broadcast output divides it by n; its stage then gets the unsharded gradient of
    # its layers, and the ranks' copies of the microbatches share theirs (a review measured n
    # times the unsharded gradient with the undivided loss, which the docs did not say).
    targets = rng.standard_normal(microbatches.shape).astype(np.float32)

    def loss(p, m):
        return jnp.sum((pipeline.pipeline_apply(stage_fn, p, m, COMM) - targets) ** 2) / n

    def unsharded_loss(all_layers, m):
        x = m
        for layer in all_layers:
            x = dense(layer, x)
        return jnp.sum((x - targets) ** 2)

    got_params, got_inputs = jax.jit(jax.grad(loss, argnums=(0, 1)))(mine, microbatches)
    want_layers, want_inputs = jax.grad(unsharded_loss, argnums=(0, 1))(layers, microbatches)
    want_mine = jax.tree.map(lambda leaf: leaf[COMM.rank:COMM.rank + 1],
                             pipeline.stack_stages(want_layers, n))
    inputs = sum(MPI_COMM.allgather(np.asarray(got_inputs)))  # before any rank's assertion
    for got_leaf, want_leaf in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_mine)):
        np.testing.assert_allclose(np.asarray(got_leaf), np.asarray(want_leaf), rtol=2e-4,
                                   atol=2e-5)
    np.testing.assert_allclose(inputs, np.asarray(want_inputs), rtol=2e-4, atol=2e-5)


def test_mismatched_point_to_point_calls_name_both_sides():
    sub = COMM.split(0, key=COMM.rank)  # a fresh communicator: an error leaves it unusable
    x = np.ones(3 if COMM.rank == 0 else 4, np.float32)
    shift = permutations()["shift"]
    call = lambda v: jaxring.ppermute(v, sub, shift)  # noqa: E731
    with jaxring.config.override(timeout_seconds=20.0):
        if COMM.rank == 1:
            with pytest.raises(Exception, match=r"mismatched point-to-point calls: rank 0 sent "
                                                r"ppermute\(perm #[0-9a-f]+\) op \d+ float32\[3\] "
                                                + called_at(call) + r" but this rank expected "
                                                r"ppermute\(perm #[0-9a-f]+\) op \d+ float32\[4\] "
                                                + called_at(call) + r"\.(?! Their perms)"):
                np.asarray(jax.jit(call)(x))
        else:
            try:  # other ranks may fail too (rank 1 never forwards), or succeed
                np.asarray(jax.jit(call)(x))
            except Exception:
                pass
    jaxring.reset_after_error()
    MPI_COMM.Barrier()


@pytest.mark.skipif(N < 2, reason="needs two ranks")
def test_an_in_place_send_nobody_receives_times_out_and_is_cancelled():
    """Rank 0's ppermute sends 1 MiB straight from its buffer to rank 1, which never makes the
    call. Rank 0's wait for the message to be read times out, and the failure path cancels its
    MPI request and gives it a moment to complete. MPICH cannot cancel such a send (waiting for
    it hung), so the call must still return at once, freeing the request."""
    sub = COMM.split(0, key=COMM.rank)
    if COMM.rank == 0:
        x = np.arange(1 << 18, dtype=np.float32)  # far above p2p_eager_bytes: in place
        with jaxring.config.override(timeout_seconds=2.0):
            start = time.monotonic()
            with pytest.raises(Exception, match=r"timed out after 2 s waiting for rank\(s\) \[1\] "
                                                r"to receive this rank's message"):
                np.asarray(jax.jit(lambda v: jaxring.ppermute(v, sub, [(0, 1)]))(x))
            assert time.monotonic() - start < 10, "the cancelled send was waited for"
        jaxring.reset_after_error()
    MPI_COMM.Barrier()


@pytest.mark.skipif(N < 2, reason="needs two ranks")
@pytest.mark.parametrize("late", ["before its call", "after its ready message"])
def test_a_late_receiver_of_an_in_place_message_gets_an_error_not_its_senders_buffer(late):
    """Rank 0 sends 1 MiB in place to rank 1 and gives up after 1 s; rank 1 is 2.5 s late, before
    its call, or stalled in it once it has said it is ready for the payload. Before its call:
    rank 0's payload once went out at once, and MPICH cannot cancel a send nobody has received,
    so rank 1 received it from a buffer XLA had freed when rank 0's call failed (here still the
    right bytes, by luck); now the payload goes out only once its receiver says it is ready,
    which rank 0 never heard, and rank 1 fails at once on rank 0's notice that it gave up (before
    the notice, it timed out waiting for the payload). After its ready message: the payload was
    under way, so rank 1 still received it when it woke, after XLA had freed that buffer, and
    returned it; now it looks for rank 0's notice once the payload is in. Either way rank 1
    raises, quoting rank 0's error."""
    sub = COMM.split(0 if COMM.rank < 2 else 1, key=COMM.rank)
    if COMM.rank < 2:
        x = np.arange(1 << 18, dtype=np.float32) + COMM.rank  # far above p2p_eager_bytes
        send = jax.jit(lambda v: jaxring.ppermute(v, sub, [(0, 1)]))
        send.lower(x).compile()
        ext, _ = jaxring.mpi._mpi_extension()
        sub.mpi_comm.Barrier()
        if COMM.rank == 1 and late == "before its call":
            time.sleep(2.5)
        elif COMM.rank == 1:
            ext.stall_next_data(2.5)
        timed_out = (r"timed out after 1 s waiting for rank\(s\) \[1\] to receive this rank's "
                     r"message")
        expected = (timed_out if COMM.rank == 0 else
                    rf"rank 0 gave up .* The error on rank 0: .*{timed_out}")
        start = time.monotonic()
        try:
            with jaxring.config.override(timeout_seconds=1.0 if COMM.rank == 0 else 20.0):
                with pytest.raises(Exception, match=expected):
                    np.asarray(send(x))
        finally:
            ext.stall_next_data(0)
        assert time.monotonic() - start < 10, "the late receiver waited for its own timeout"
        jaxring.reset_after_error()
    MPI_COMM.Barrier()


@pytest.mark.skipif(N < 2, reason="needs two ranks")
@pytest.mark.parametrize("late", ["receiver", "sender"])
def test_an_in_place_message_whose_peer_came_late_and_then_paused_is_still_delivered(late):
    """Under a 2 s timeout, rank 0 sends 1 MiB in place to rank 1 (and, when the sender is late,
    rank 1 sends 1 MiB back). The late rank comes 1.2 s after the other, then pauses 1.2 s where
    the payload cannot move: the receiver once it has said it is ready for it, the sender before
    it sends it (in its own receive, which goes first). Each wait (the peer's arrival, then the
    payload) is under the timeout and their sum over it, so the call completes. The payload's
    wait once counted from the call's start, and the rank waiting for the late one timed out."""
    sub = COMM.split(0 if COMM.rank < 2 else 1, key=COMM.rank)
    if COMM.rank < 2:
        x = np.arange(1 << 18, dtype=np.float32) + 7 * COMM.rank  # far above p2p_eager_bytes
        perm = [(0, 1)] if late == "receiver" else [(0, 1), (1, 0)]
        send = jax.jit(lambda v: jaxring.ppermute(v, sub, perm))
        send.lower(x).compile()
        ext, _ = jaxring.mpi._mpi_extension()
        sub.mpi_comm.Barrier()
        if COMM.rank == (1 if late == "receiver" else 0):
            time.sleep(1.2)
            (ext.stall_next_data if late == "receiver" else ext.stall_next_receive)(1.2)
        try:
            with jaxring.config.override(timeout_seconds=2.0):
                y = np.asarray(send(x))
        finally:
            ext.stall_next_data(0)
            ext.stall_next_receive(0)
        inputs = [np.arange(1 << 18, dtype=np.float32) + 7 * rank for rank in (0, 1)]
        np.testing.assert_array_equal(y, expected_permute(inputs, perm, COMM.rank))
    MPI_COMM.Barrier()


@pytest.mark.skipif(N < 2, reason="needs two ranks")
def test_a_receive_that_times_out_leaves_nothing_to_write_into_its_freed_output():
    """Ranks 0 and 1 swap 1 MiB in place. Rank 1 posts its half, then stalls 2.5 s before its
    receive, so it neither sends its payload nor says it is ready for rank 0's; rank 0, which gives
    up after 1 s, had posted its receive of rank 1's payload into its output. When rank 1 wakes it
    finds rank 0's ready message and sends. Rank 0's receive was once dropped from the failure
    path's list before the path cancelled what the list held, so it stayed active: MPI wrote the
    1 MiB into memory XLA had freed, which rank 0 had since handed to new arrays (or that was no
    longer mapped). Now it is cancelled, and those arrays keep their -1s."""
    sub = COMM.split(0 if COMM.rank < 2 else 1, key=COMM.rank)
    if COMM.rank < 2:
        x = np.arange(1 << 18, dtype=np.float32) + COMM.rank  # far above p2p_eager_bytes
        swap = jax.jit(lambda v: jaxring.ppermute(v, sub, [(0, 1), (1, 0)]))
        swap.lower(x).compile()
        ext, _ = jaxring.mpi._mpi_extension()
        sub.mpi_comm.Barrier()
        if COMM.rank == 1:
            ext.stall_next_receive(2.5)
        try:
            with jaxring.config.override(timeout_seconds=1.0 if COMM.rank == 0 else 20.0):
                with pytest.raises(Exception, match="timed out" if COMM.rank == 0 else "gave up"):
                    np.asarray(swap(x))
        finally:
            ext.stall_next_receive(0)
        jaxring.reset_after_error()
        if COMM.rank == 0:
            fresh = [np.full(1 << 18, -1.0, np.float32) for _ in range(64)]
        sub.mpi_comm.Barrier()  # rank 1 has failed: its payload may have gone out
        for _ in range(20):  # MPI's progress, in which an active receive would match it
            sub.mpi_comm.Iprobe()
            time.sleep(0.05)
        sub.mpi_comm.Barrier()
        if COMM.rank == 0:
            for i, a in enumerate(fresh):
                assert (a == -1.0).all(), f"array {i} was written into"
    MPI_COMM.Barrier()


@pytest.mark.skipif(N < 3, reason="needs three ranks")
def test_a_rank_that_gave_up_on_a_peers_notice_passes_it_on():
    """Rank 0 gives up receiving from rank 2, which is late; rank 1 then gives up on rank 0's
    notice while receiving from it; rank 2, later still, receives from rank 1, and looks for
    notices from rank 1 alone. Rank 1 once sent none of its own (it had only been told), so
    rank 2 waited out its 20 s; now it fails at once, quoting rank 0's error."""
    sub = COMM.split(0 if COMM.rank < 3 else 1, key=COMM.rank)
    if COMM.rank < 3:
        like = np.zeros(4, np.float32)
        source = {0: 2, 1: 0, 2: 1}[COMM.rank]
        recv = jax.jit(lambda v: jaxring.recv(v, sub, [(source, COMM.rank)]))
        recv.lower(like).compile()
        sub.mpi_comm.Barrier()
        time.sleep(1.5 * COMM.rank)
        expected = {0: r"timed out after 1 s waiting for rank\(s\) \[2\]",
                    1: r"rank 0 gave up .* timed out after 1 s",
                    2: r"rank 1 gave up .* rank 0 gave up .* timed out after 1 s"}[COMM.rank]
        start = time.monotonic()
        with jaxring.config.override(timeout_seconds=1.0 if COMM.rank == 0 else 20.0):
            with pytest.raises(Exception, match=expected):
                np.asarray(recv(like))
        assert time.monotonic() - start < 10, "waited out its own timeout"
        jaxring.reset_after_error()
    MPI_COMM.Barrier()


@pytest.mark.skipif(N < 2, reason="needs two ranks")
def test_messages_of_several_pieces_arrive_whole():
    """MPI messages travel as pieces of at most 1 GiB (MPI's counts are ints); the test makes them
    pieces of 4 KiB. A copied message that no longer fits one piece with its header (an eager
    ppermute, any send) then follows its header as pieces: it was once announced as in place,
    so its receiver told the sender it was ready and waited for a payload that never came, until
    its timeout. In-place messages and the collectives' slices then also come in many pieces."""
    from helpers import assert_close

    ext, _ = jaxring.mpi._mpi_extension()
    sub = COMM.split(0, key=COMM.rank)
    shift = permutations()["shift"]
    rng = np.random.default_rng([COMM.rank, 11])

    def send_recv(v):
        jaxring.send(v, sub, shift)
        return jaxring.recv(v, sub, shift)

    MPI_COMM.Barrier()
    ext.set_max_piece(4096)
    try:
        with jaxring.config.override(timeout_seconds=20.0):
            # in one piece with its header, just over one, and in place (40 pieces)
            for size in (900, 1100, 40_000):
                x = rng.standard_normal(size).astype(np.float32)
                inputs = gathered(x)
                expected = expected_permute(inputs, shift, COMM.rank)
                for name, f in (("ppermute", lambda v: jaxring.ppermute(v, sub, shift)),
                                ("send/recv", send_recv)):
                    np.testing.assert_array_equal(np.asarray(jax.jit(f)(x)), expected,
                                                  err_msg=f"{name}, {size} elements")
                y = jax.jit(lambda v: jaxring.all_reduce(v, sub))(x)
                assert_close(np.asarray(y), inputs.astype(np.float64).sum(0), np.float32, count=N)
    finally:
        MPI_COMM.Barrier()
        ext.set_max_piece(0)


@pytest.mark.skipif(N < 2, reason="needs two ranks")
@pytest.mark.parametrize("first", ["collective", "point-to-point"])
def test_a_failure_of_either_kind_of_call_refuses_the_other_kind(first):
    """A shared-memory communicator's point-to-point calls go over MPI: a failed collective left
    them working, and a failed ppermute left the collectives working."""
    sub = COMM.split(0, key=COMM.rank)
    bad = np.ones(3 if COMM.rank == 0 else 4, np.float32)
    collective = jax.jit(lambda v: jaxring.all_reduce(v, sub))
    point_to_point = jax.jit(lambda v: jaxring.ppermute(v, sub, permutations()["shift"]))
    failing, other = ((collective, point_to_point) if first == "collective"
                      else (point_to_point, collective))
    with jaxring.config.override(timeout_seconds=30.0):
        try:  # a rank fails, or finds out later that a peer did (a ppermute on 3 or more ranks)
            np.asarray(failing(bad))
        except Exception:  # noqa: BLE001 - what each rank raises is tested elsewhere
            pass
        jaxring.reset_after_error()
        with pytest.raises(Exception, match="failed earlier|gave up on this|left the communicator"):
            np.asarray(other(np.ones(4, np.float32)))
    jaxring.reset_after_error()
    MPI_COMM.Barrier()


@pytest.mark.skipif(N < 2, reason="needs two ranks")
def test_a_failed_collective_reaches_a_peer_waiting_in_a_receive_at_once():
    """Rank 0's all-reduce times out (rank 1 is in a receive from it, not there): over shared
    memory rank 1 waited out its own 60 s timeout instead of failing on rank 0's notice."""
    sub = COMM.split(0, key=COMM.rank)
    start = time.monotonic()
    if COMM.rank == 0:
        with jaxring.config.override(timeout_seconds=3.0):
            with pytest.raises(Exception, match="timed out after 3 s"):
                np.asarray(jax.jit(lambda v: jaxring.all_reduce(v, sub))(np.ones(4, np.float32)))
    elif COMM.rank == 1:
        with jaxring.config.override(timeout_seconds=60.0):
            with pytest.raises(Exception, match="rank 0 gave up"):
                np.asarray(jax.jit(lambda v: jaxring.recv(v, sub, [(0, 1)]))(np.ones(4)))
        assert time.monotonic() - start < 30
    jaxring.reset_after_error()
    MPI_COMM.Barrier()


@pytest.mark.skipif(N < 2, reason="needs two ranks")
def test_missing_sender_times_out_naming_it():
    sub = COMM.split(0, key=COMM.rank)
    if COMM.rank == 0:  # rank 1 never sends
        with jaxring.config.override(timeout_seconds=2.0):
            with pytest.raises(Exception, match=r"timed out after 2 s waiting for rank\(s\) \[1\] "
                                                r"to send"):
                np.asarray(jax.jit(lambda v: jaxring.recv(v, sub, [(1, 0)]))(np.ones(4)))
        jaxring.reset_after_error()
        with pytest.raises(Exception, match="failed earlier"):
            np.asarray(jax.jit(lambda v: jaxring.recv(v, sub, [(1, 0)]))(np.ones(4)))
        jaxring.reset_after_error()
    MPI_COMM.Barrier()


@pytest.mark.skipif(N < 2, reason="needs two ranks")
def test_eager_messages_outlive_their_senders_communicator():
    """Rank 0 sends eager messages (copied into buffers its transport owns) that rank 1 receives
    only after rank 0 has dropped the communicator: its transport then waits 1 s for them and
    frees their requests, which leaves MPI sending them when rank 1 comes. Their bytes once went
    with the transport, so rank 1 received whatever rank 0 allocated there next (here arrays
    filled with -1), or rank 0 crashed; now rank 1 receives every message exactly as sent."""
    sub = jaxring.mpi.Communicator(MPI_COMM.Split(0 if COMM.rank < 2 else 1, key=COMM.rank),
                                   label="outlived", transport="mpi")
    if COMM.rank < 2:
        count, size = 48, 15_000  # 60 KB each, under p2p_eager_bytes (64 KiB): eager
        messages = [np.arange(size, dtype=np.float32) + 1000 * i for i in range(count)]
        permute = jax.jit(lambda v: jaxring.ppermute(v, sub, [(0, 1)]))
        with jaxring.config.override(timeout_seconds=1.0 if COMM.rank == 0 else 30.0):
            if COMM.rank == 0:  # rank 0 receives nothing, so each call returns once it is sent
                for m in messages:
                    permute(m).block_until_ready()
                jaxring.mpi._detach(sub.key)  # the transport goes, its sends still in flight
                churn = [np.full(size + 64, -1.0, np.float32) for _ in range(4 * count)]
                sub.mpi_comm.Barrier()
                sub.mpi_comm.Barrier()  # keeps MPI's progress going while rank 1 receives
                del churn
            else:
                sub.mpi_comm.Barrier()
                got = [np.asarray(permute(np.zeros(size, np.float32))) for _ in messages]
                sub.mpi_comm.Barrier()
                for i, (g, m) in enumerate(zip(got, messages)):
                    np.testing.assert_array_equal(g, m, err_msg=f"message {i}")
    MPI_COMM.Barrier()


@pytest.mark.skipif(N < 2, reason="needs two ranks")
def test_a_message_sent_under_another_perm_is_refused_not_received():
    """Across processes each rank passes its own perm. Here each first sends with a perm naming
    only its own pair, so nobody receives; then a ring exchange of the same dtype and size
    (send, then recv, with the ring's perm) found the first call's message waiting and returned
    it as its own data. The perm's digest now travels in the header, and the ring's receive
    refuses the message, naming both calls, on every rank."""
    sub = COMM.split(0, key=COMM.rank)
    ring = [(i, (i + 1) % N) for i in range(N)]
    own = [(COMM.rank, (COMM.rank + 1) % N)]
    x = np.full(4, 10.0 + COMM.rank, np.float32)
    jax.jit(lambda v: jaxring.send(v, sub, own))(x)  # an eager send nobody receives

    def exchange(v):
        jaxring.send(v, sub, ring)
        return jaxring.recv(v, sub, ring)

    with jaxring.config.override(timeout_seconds=20.0):
        with pytest.raises(Exception, match=r"mismatched point-to-point calls: rank \d+ sent "
                                            r"send/recv\(perm #[0-9a-f]+\) .* Their perms differ"):
            np.asarray(jax.jit(exchange)(x + 100.0))
    jaxring.reset_after_error()
    MPI_COMM.Barrier()
