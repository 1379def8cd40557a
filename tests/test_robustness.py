"""Determinism, concurrency, stress, the failure behaviour DESIGN.md promises, configuration and
the kernels' 16-bit rounding."""

import dataclasses
import math
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring._src import common, native, runtime_tokens
from helpers import (HeldDevices, assert_close, called_at, every_device, late_devices, mesh,
                     on_threads, random_array, shard, shmap)

# ---- determinism -------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["direct", "ring"])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_bit_identical_across_runs_and_devices(algorithm, dtype):
    n = 8
    m = mesh(n)
    x = shard(random_array(np.random.default_rng(0), (n * 5003,), dtype), m)
    f = shmap(lambda v: jaxring.all_reduce(v, "i"), m, out_specs=P("i"))  # keep every copy
    with jaxring.config.override(algorithm=algorithm, pipeline_slice_bytes=4096):
        runs = [np.asarray(f(x)).reshape(n, -1) for _ in range(3)]
    for run in runs:
        for device in range(1, n):
            np.testing.assert_array_equal(run[device].view(np.uint16 if run.itemsize == 2 else
                                                           np.uint32),
                                          run[0].view(np.uint16 if run.itemsize == 2 else
                                                      np.uint32))
        np.testing.assert_array_equal(run, runs[0])


# ---- concurrency -------------------------------------------------------------------------------


def test_many_collectives_in_one_program_and_back_to_back():
    n = 8
    m = mesh(n)
    rng = np.random.default_rng(1)
    xs = [random_array(rng, (n * s, 3), np.float32) for s in (1, 17, 300, 2)]

    def ours(a, b, c, d):
        return (jaxring.all_reduce(a, "i"), jaxring.reduce_scatter(jnp.tile(b, (n, 1)), "i"),
                jaxring.all_gather(c, "i"), jaxring.broadcast(d, "i", root=5),
                jaxring.all_reduce(c * 2, "i", "max"))

    def theirs(a, b, c, d):
        return (lax.psum(a, "i"), lax.psum_scatter(jnp.tile(b, (n, 1)), "i", tiled=True),
                lax.all_gather(c, "i", tiled=True), lax.all_gather(d, "i", tiled=False)[5],
                lax.pmax(c * 2, "i"))

    specs = (P("i"),) * 4
    f = shmap(ours, m, specs, (P(), P("i"), P("i"), P("i"), P()))
    g = shmap(theirs, m, specs, (P(), P("i"), P("i"), P("i"), P()))
    args = [shard(x, m) for x in xs]
    expected = [np.asarray(e) for e in g(*args)]
    outs = [f(*args) for _ in range(20)]  # dispatched back to back, without waiting
    for out in outs:
        for a, e in zip(out, expected):
            assert_close(np.asarray(a), e.astype(np.float64), np.float32, count=2 * n,
                         exact_reference=False)


def test_empty_arrays_on_a_mesh_axis_make_no_collective_call():
    """Zero-size data on a mesh axis compiles to no collective call (nothing to move; it also
    leaves an empty shard_map argument unused, which jaxlib 0.11.2 crashes compiling any use of),
    gives empty results of the lax twins' shapes, and leaves the calls around it matched: the
    all-reduce after them still meets its peers. A send and a recv, whose shapes are given apart,
    keep their calls, on empty constants instead of the argument."""
    n = 4
    m = mesh(n)
    perm = [(i, (i + 1) % n) for i in range(n)]
    empty = shard(np.zeros((0, 3), np.float32), m)
    x = shard(random_array(np.random.default_rng(3), (n * 5,), np.float32), m)

    def body(e, v):
        jaxring.send(e, "i", perm)
        outs = (jaxring.all_reduce(e, "i"), jaxring.reduce_scatter(e, "i"),
                jaxring.all_gather(e, "i"), jaxring.broadcast(e, "i", root=1),
                jaxring.ppermute(e, "i", perm), jaxring.recv(e, "i", perm))
        return outs, jaxring.all_reduce(v, "i")

    f = shmap(body, m, in_specs=(P("i"), P("i")), out_specs=P("i"))
    text = f.lower(empty, x).as_text()
    calls = {target: text.count(f"stablehlo.custom_call @jaxring_{target}(")
             for target in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "ppermute",
                            "send", "recv")}
    assert calls == dict(all_reduce=1, reduce_scatter=0, all_gather=0, broadcast=0, ppermute=0,
                         send=1, recv=1), calls
    outs, total = f(empty, x)
    assert [o.shape for o in outs] == [(0, 3)] * 6
    expected = np.asarray(x).reshape(n, 5).astype(np.float64).sum(0)
    np.testing.assert_allclose(np.asarray(total).reshape(n, 5), np.tile(expected, (n, 1)),
                               rtol=1e-6)


@pytest.mark.skipif(not runtime_tokens.install(common.CollectiveEffect),
                    reason="JAX's token hand-over differs from what runtime_tokens expects")
def test_token_hand_over_orders_programs_over_changing_device_lists():
    """Programs over 8 devices, the first 4, and the 8 in reverse order, dispatched back to back
    without waiting: the token must follow each program onto its devices (resharded by JAX where
    the list changes, reused where it does not), or the programs' collectives interleave on the
    devices' threads and time out. Also mixes in a program with a second ordered effect, which
    JAX's own code handles."""
    from jax.experimental import io_callback

    rng = np.random.default_rng(3)
    meshes = [mesh(8), mesh(4), jax.make_mesh((8,), ("i",), devices=jax.devices()[:8][::-1])]
    seen = []

    def record(v):
        seen.append(np.asarray(v))
        return np.zeros((), np.float32)

    def with_callback(v):
        total = jaxring.all_reduce(v, "i")
        return total + io_callback(record, jax.ShapeDtypeStruct((), np.float32), total[0],
                                   ordered=True)

    programs, expected = [], []
    for k in range(48):
        m = meshes[k % 3]
        x = random_array(rng, (m.size * 5,), np.float32)
        body = with_callback if k == 20 else (lambda v: jaxring.all_reduce(v, "i"))
        programs.append(shmap(body, m, out_specs=P())(shard(x, m)))
        expected.append(x.astype(np.float64).reshape(m.size, 5).sum(0))
    for got, want in zip(programs, expected):  # every device's copy
        copies = every_device(got)
        assert_close(copies, np.broadcast_to(want, copies.shape), np.float32, count=8)
    assert len(seen) == 8  # the callback runs on each device of the program
    np.testing.assert_allclose(seen, expected[20][0], rtol=1e-5)
    token = jax._src.dispatch.runtime_tokens.current_tokens[common.collective_effect]
    devices = tuple(meshes[47 % 3].devices.flat)
    assert token._buf.sharding is runtime_tokens._token_layout(devices)[0]


@pytest.mark.skipif(not runtime_tokens.install(common.CollectiveEffect),
                    reason="JAX's token hand-over differs from what runtime_tokens expects")
def test_programs_with_only_jaxrings_effect_take_jaxrings_dispatch_and_others_jaxs():
    """A program whose only effect is jaxring's runs through runtime_tokens' dispatch, which hands
    out no per-device runtime tokens, and jax.effects_barrier still waits for it; one that also
    calls back to Python (an unordered effect) goes through JAX's dispatch, token and all."""
    tokens = jax._src.dispatch.runtime_tokens
    m = mesh(8)
    rng = np.random.default_rng(5)
    x = random_array(rng, (8 * 6,), np.float32)
    f = shmap(lambda v: jaxring.all_reduce(v, "i"), m, out_specs=P())
    jax.effects_barrier()
    outs = [f(shard(x, m)) for _ in range(5)]
    assert not tokens.output_runtime_tokens
    token = tokens.current_tokens[common.collective_effect]
    assert token._buf.sharding is runtime_tokens._token_layout(tuple(m.devices.flat))[0]
    jax.effects_barrier()
    assert not tokens.current_tokens
    expected = x.astype(np.float64).reshape(8, 6).sum(0)
    for out in outs:
        assert_close(np.asarray(out), expected, np.float32, count=8)

    seen = []

    def with_callback(v):
        total = jaxring.all_reduce(v, "i")
        jax.debug.callback(lambda t: seen.append(np.asarray(t)), total)
        return total

    outs = [shmap(with_callback, m, out_specs=P())(shard(x, m)) for _ in range(2)]
    assert tokens.output_runtime_tokens  # JAX's dispatch ran these
    outs.append(f(shard(x, m)))
    jax.effects_barrier()
    assert len(seen) == 16
    np.testing.assert_allclose(seen, np.broadcast_to(expected, (16, 6)), rtol=1e-5)
    for out in outs:
        assert_close(np.asarray(out), expected, np.float32, count=8)


@pytest.mark.skipif(not runtime_tokens.install(common.CollectiveEffect),
                    reason="JAX's token hand-over differs from what runtime_tokens expects")
def test_repeated_calls_run_the_remembered_executable_and_new_placements_take_jaxs_path(
        monkeypatch):
    """A jitted program whose only effect is jaxring's runs JAX's dispatch path once per
    placement of its arguments, then the executable that path found (runtime_tokens'
    _remembered_runs). Fresh values each call, checked against float64, prove that nothing but
    the executable is reused; an argument on other devices and a program with a Python callback
    take JAX's path; a deleted argument still raises JAX's error."""
    import jax._src.pjit as jax_pjit

    if not hasattr(jax_pjit._run_python_pjit, "remembered"):
        pytest.skip("JAX's dispatch path differs from what runtime_tokens._remembered_runs expects")
    calls = []
    jax_impl = jax_pjit._pjit_call_impl_python

    def counted(*args, **kwargs):
        calls.append(kwargs["name"])
        return jax_impl(*args, **kwargs)

    monkeypatch.setattr(jax_pjit, "_pjit_call_impl_python", counted)
    n = 4
    m = mesh(n)
    rng = np.random.default_rng(11)
    f = shmap(lambda v: jaxring.all_reduce(v, "i"), m, out_specs=P())

    def check(out, x):
        assert_close(np.asarray(out), x.astype(np.float64).reshape(n, 7).sum(0), np.float32,
                     count=n)

    xs = [random_array(rng, (n * 7,), np.float32) for _ in range(4)]
    for x in xs:
        check(f(shard(x, m)), x)
    assert len(calls) == 1, calls  # the first call only
    # An argument the program does not use: XLA drops it, so only the kept ones go in.
    unused = shmap(lambda v, w: jaxring.all_reduce(v, "i"), m, in_specs=(P("i"), P("i")),
                   out_specs=P())
    for x in xs[:3]:
        check(unused(shard(x, m), shard(xs[3], m)), x)
    assert len(calls) == 2, calls
    # The same type on other devices: not the remembered executable's, which would run it on
    # the first four devices, but JAX's path, which refuses it.
    elsewhere = jax.make_mesh((n,), ("i",), devices=jax.devices()[n:2 * n])
    with pytest.raises(ValueError, match="incompatible devices"):
        f(shard(xs[0], elsewhere))
    assert len(calls) == 3, calls

    seen = []

    def with_callback(v):
        total = jaxring.all_reduce(v, "i")
        jax.debug.callback(lambda t: seen.append(np.asarray(t)), total)
        return total

    g = shmap(with_callback, m, out_specs=P())
    for x in xs[:3]:
        check(g(shard(x, m)), x)
    assert len(calls) == 6, calls  # another effect: JAX's path every time
    jax.effects_barrier()
    assert len(seen) == 3 * n

    gone = shard(xs[0], m)
    gone.delete()
    with pytest.raises(RuntimeError, match="deleted"):
        f(gone)
    check(f(shard(xs[3], m)), xs[3])
    assert jax_pjit._run_python_pjit.remembered.entries
    jax.clear_caches()  # forgets them with JAX's caches
    assert not jax_pjit._run_python_pjit.remembered.entries


def test_remembered_runs_go_with_their_function():
    """A remembered run held its traced program, and through it the arrays the jitted function
    closed over, after the function was gone (up to 256 of them: a review's loop of jitted
    closures kept 1.25 GiB alive), where JAX's own caches let them go with the function."""
    import gc
    import weakref

    import jax._src.pjit as jax_pjit

    if not hasattr(jax_pjit._run_python_pjit, "remembered"):
        pytest.skip("JAX's dispatch path differs from what runtime_tokens._remembered_runs expects")
    remembered = jax_pjit._run_python_pjit.remembered.entries
    gc.collect()  # earlier tests' functions that only the collector frees
    m = mesh(4)
    x = shard(np.ones(8, np.float32), m)
    inner = jax.shard_map(lambda v: jaxring.all_reduce(v, "i"), mesh=m, in_specs=P("i"),
                          out_specs=P())
    closed = jnp.full((1000,), 3.0)
    alive = weakref.ref(closed)
    f = jax.jit(lambda v: inner(v) + closed[0])
    before = set(remembered)
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(x)), np.full(2, 7.0))
    mine = set(remembered) - before
    assert len(mine) == 1  # remembered, and run from there
    del f, closed
    gc.collect()
    assert alive() is None
    assert not mine & set(remembered)


def test_a_jitted_functions_clear_cache_forgets_the_remembered_runs():
    """f.clear_cache() empties JAX's cache of traced programs (every function's), so that no
    later call found the remembered runs, which kept their executables alive: one more with
    every clear_cache(), where JAX's path freed them (a review's loop)."""
    import gc
    import weakref

    import jax._src.pjit as jax_pjit
    from jax._src.interpreters import pxla

    if not hasattr(jax_pjit._run_python_pjit, "remembered"):
        pytest.skip("JAX's dispatch path differs from what runtime_tokens._remembered_runs expects")
    remembered = jax_pjit._run_python_pjit.remembered.entries
    m = mesh(4)
    f = jax.jit(jax.shard_map(lambda v: jaxring.all_reduce(v, "i"), mesh=m, in_specs=P("i"),
                              out_specs=P()))
    xs = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    executables = []
    for x in xs:
        before = set(remembered)
        np.testing.assert_array_equal(np.asarray(f(shard(x, m))), x.reshape(4, 2).sum(0))
        np.testing.assert_array_equal(np.asarray(f(shard(x, m))), x.reshape(4, 2).sum(0))
        (key,) = set(remembered) - before
        executables.append(weakref.ref(remembered[key][1]))
        assert isinstance(remembered[key][1], pxla.MeshExecutable)
        f.clear_cache()
        assert key not in remembered
    gc.collect()
    assert [e() for e in executables] == [None] * len(xs)


_CONSTANT_ARGUMENTS = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_USE_SIMPLIFIED_JAXPR_CONSTANTS"] = "1"  # read as jax is imported
    import jax, numpy as np, jaxring
    import jax._src.pjit as jax_pjit
    from jax.sharding import NamedSharding, PartitionSpec as P
    remembered = getattr(jax_pjit._run_python_pjit, "remembered", None)
    if remembered is None:
        print("SKIP")
        raise SystemExit
    m = jax.make_mesh((4,), ("i",), devices=jax.devices()[:4])
    inner = jax.shard_map(lambda v: jaxring.all_reduce(v, "i"), mesh=m, in_specs=P("i"),
                          out_specs=P())
    # Large enough not to be inlined into the program as a literal.
    x = np.random.default_rng(4).standard_normal(4096).astype(np.float32)
    scale = jax.device_put(np.full(4096, 3.0, np.float32), NamedSharding(m, P()))
    f = jax.jit(lambda v: inner(v * scale))
    for _ in range(3):
        got = np.asarray(f(jax.device_put(x, NamedSharding(m, P("i")))))
        np.testing.assert_allclose(got, (3 * x).reshape(4, 1024).sum(0), rtol=1e-5, atol=1e-5)
    assert not remembered.entries, remembered.entries
    scale.delete()
    try:
        f(jax.device_put(x, NamedSharding(m, P("i"))))
    except RuntimeError as error:
        assert "deleted" in str(error), error
        print("ALL OK")
""")


def test_a_program_with_constant_arguments_is_not_remembered():
    """With jax_use_simplified_jaxpr_constants, JAX passes the arrays a function closes over as
    arguments, sent to the devices on every call. A remembered run reused the first call's, so
    a closed-over array deleted since ran as a program with a missing shard ("Expected args to
    execute_sharded_on_local_devices to have 4 shards"), where JAX's path names the deletion."""
    result = subprocess.run([sys.executable, "-c", _CONSTANT_ARGUMENTS], capture_output=True,
                            text=True, timeout=600)
    if "SKIP" in result.stdout:
        pytest.skip("JAX's dispatch path differs from what runtime_tokens._remembered_runs expects")
    assert result.returncode == 0 and "ALL OK" in result.stdout, result.stderr[-3000:]


def test_clearing_the_remembered_runs_while_another_thread_adds_one():
    """cache_clear iterated over the functions' key sets while another thread's first call of a
    function added one, or a function's death dropped one: "dictionary changed size during
    iteration", from jax.clear_caches() or when the 256 entries filled up."""
    remembered = runtime_tokens._Remembered()

    class Function:  # the jitted functions' stand-ins: weakly referable
        pass

    kept = [Function() for _ in range(2000)]
    for i, fun in enumerate(kept):
        assert remembered.own(fun, i)
        remembered.entries[i] = i
    errors, clears, done = [], [], threading.Event()

    def clear():
        while not done.is_set():
            try:
                remembered.cache_clear()
            except RuntimeError as error:
                errors.append(error)
                return
            clears.append(None)

    clearer = threading.Thread(target=clear)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        clearer.start()
        for j in range(20000):
            remembered.own(Function(), ("short-lived", j))  # dropped at once: forget() runs
            if errors:
                break
    finally:
        done.set()
        clearer.join()
        sys.setswitchinterval(switch)
    assert errors == [] and clears
    assert not remembered.entries and all(not keys for keys in remembered.owners.values())


def test_a_deleted_token_is_named():
    """The token among jax.live_arrays(), deleted with them, was reported as an earlier
    program's failure (a review's repro); reset_after_error starts a fresh one."""
    from jax._src import dispatch

    if not runtime_tokens.install(common.CollectiveEffect):
        pytest.skip("JAXRING_FAST_TOKENS=0: JAX's own token path")
    m = mesh(4)
    x = shard(np.arange(8, dtype=np.float32), m)
    f = shmap(lambda v: jaxring.all_reduce(v, "i"), m, out_specs=P())
    f(x).block_until_ready()
    dispatch.runtime_tokens.current_tokens[common.collective_effect]._buf.delete()
    with pytest.raises(RuntimeError, match="the token JAX passes from one jaxring program to the "
                                           "next was deleted"):
        f(x)
    jaxring.reset_after_error()
    np.testing.assert_array_equal(np.asarray(f(x)), [12, 16])


def test_ahead_of_time_compiled_programs_take_the_token_on_every_call():
    """`jax.jit(f).lower(x).compile()` and pmap's equivalent: JAX moved a compiled program's
    second call to its C++ fast path, which passes no token, and the process crashed on it (the
    executable expected the token as well). Fresh values on every call, interleaved with jitted
    calls of the same function, each checked on every device against float64."""
    import jax._src.interpreters.pxla as pxla

    n = 4
    m = mesh(n)
    rng = np.random.default_rng(17)
    f = shmap(lambda v: jaxring.all_reduce(v, "i"), m, out_specs=P())
    xs = [random_array(rng, (n * 5,), np.float32) for _ in range(4)]
    compiled = f.lower(shard(xs[0], m)).compile()
    assert compiled._executable.create_cpp_call(compiled._params) is None  # JAX's Python path
    for x in xs:
        for out in (compiled(shard(x, m)), f(shard(x, m))):
            assert_close(every_device(out), np.broadcast_to(
                x.astype(np.float64).reshape(n, 5).sum(0), (n, 5)), np.float32, count=n)
    p = jax.pmap(lambda v: jaxring.all_gather(v, "d"), axis_name="d", devices=jax.devices()[:n])
    blocks = [random_array(rng, (n, 3), np.float64) for _ in range(3)]
    compiled_p = p.lower(blocks[0]).compile()
    for b in blocks:
        np.testing.assert_array_equal(np.asarray(compiled_p(b)),
                                      np.broadcast_to(b.reshape(-1), (n, 3 * n)))
    # Programs without an ordered effect keep JAX's fast path.
    plain = jax.jit(lambda v: v * 2).lower(np.ones(3, np.float32)).compile()
    assert isinstance(plain._executable, pxla.MeshExecutable)
    assert plain._executable.create_cpp_call(plain._params) is not None


_PIPELINED = textwrap.dedent("""
    import faulthandler, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np, jaxring
    from jax.sharding import NamedSharding, PartitionSpec as P
    faulthandler.dump_traceback_later(float(sys.argv[1]), exit=True)  # a hang fails the test
    mesh = jax.make_mesh((8,), ("i",))

    def step(v):  # compute on both sides of the collective, so programs overlap on the devices
        m = jnp.tanh(v @ v.T)
        return jnp.tanh(jaxring.all_reduce(m, "i") @ m)

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8 * 32, 32)) / 8).astype(np.float32)
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    outs = [f(jax.device_put(x, NamedSharding(mesh, P("i")))) for _ in range(300)]
    blocks = x.astype(np.float64).reshape(8, 32, 32)
    ms = np.tanh(blocks @ blocks.transpose(0, 2, 1))
    expected = np.tanh(ms.sum(0) @ ms).reshape(8 * 32, 32)
    for out in outs:
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-5)
    print("ALL OK")
""")


def test_calls_of_many_runs_at_once_meet_the_calls_of_their_own_run():
    """A rank's calls on an in-process communicator are matched with its peers' by XLA run and
    by their place in the run. Here 32 runs are under way at once on one communicator (a thread
    per rank and run, each making three calls, each rank starting its runs in another order):
    every call must come out as the sum of its own run's inputs for that call, on both ranks."""
    n, runs, calls, count = 2, 32, 3, 64
    rng = np.random.default_rng(29)
    inputs = rng.standard_normal((runs, calls, n, count), dtype=np.float32)
    outputs = np.full((runs, calls, n, count), np.nan, np.float32)
    errors = []
    key = int(rng.integers(1 << 40, 1 << 50))  # a fresh in-process communicator
    sum_f32 = (common.COLLECTIVE_CODES["all_reduce"], common.REDUCE_OPS["sum"],
               common.DTYPE_CODES[np.dtype(np.float32)])

    def calls_of(rank, run):
        for call in range(calls):
            error = native.extension.collective_on_host(
                key, "many runs test", rank, n, *sum_f32, inputs[run, call, rank],
                outputs[run, call, rank], run_id=1000 + run, op_id=call)
            if error:
                errors.append(error)

    orders = [range(runs), reversed(range(runs))]
    with jaxring.config.override(timeout_seconds=30):  # 120 s: the native waits' 30 s and more
        on_threads(calls_of, [(rank, run) for rank in range(n) for run in orders[rank]], 120)
    assert not errors, errors[:3]
    expected = inputs[:, :, 0] + inputs[:, :, 1]  # two float32 terms: the same sum either way
    for rank in range(n):
        np.testing.assert_array_equal(outputs[:, :, rank], expected)


def test_a_call_runs_under_the_configuration_its_first_device_found():
    """Each device once read jaxring.config when its own call ran, so a change landing between
    two devices' calls of one collective split it: rank 0 ran the ring while rank 1 ran the
    direct path, and each waited for the other until the timeout. A call's devices now share the
    configuration in force when its first device arrived. Rank 0 arrives under the ring with
    small slices and waits; the configuration changes to the direct path; rank 1 arrives. Both
    must finish with the sum, checked against float64, and so must a call after the change."""
    n, count = 2, 100_003
    rng = np.random.default_rng(31)
    key = int(rng.integers(1 << 40, 1 << 50))  # a fresh in-process communicator
    sum_f32 = (common.COLLECTIVE_CODES["all_reduce"], common.REDUCE_OPS["sum"],
               common.DTYPE_CODES[np.dtype(np.float32)])
    inputs = rng.standard_normal((2, n, count), dtype=np.float32)
    outputs = np.full((2, n, count), np.nan, np.float32)
    errors = []

    def call(run, rank):
        error = native.extension.collective_on_host(
            key, "configuration test", rank, n, *sum_f32, inputs[run, rank], outputs[run, rank],
            run_id=7000 + run, op_id=1)
        if error:
            errors.append(error)

    with jaxring.config.override(algorithm="ring", pipeline_slice_bytes=4096,
                                 timeout_seconds=20.0):
        first = threading.Thread(target=call, args=(0, 0), daemon=True)
        first.start()
        time.sleep(0.2)  # rank 0 waits in the call, having found the ring
        jaxring.config.update(algorithm="direct")
        call(0, 1)
        first.join(timeout=60)  # the native wait times out after 20 s
        assert not first.is_alive(), "a native wait outlived its timeout"
        assert not errors, errors
        on_threads(call, [(1, rank) for rank in range(n)])
    assert not errors, errors
    for run in range(2):
        expected = inputs[run].astype(np.float64).sum(0)
        for rank in range(n):
            assert_close(outputs[run, rank], expected, np.float32, count=n)


def test_programs_dispatched_back_to_back_do_not_starve_the_device_threads():
    """300 programs with compute around an all-reduce, dispatched without waiting: PJRT CPU holds
    a pool thread per device for a whole program, so programs that overlap on the devices can
    starve each other (runtime_tokens: one jaxring program at a time). Every result is checked
    against a float64 reference."""
    env = dict(os.environ, JAXRING_TIMEOUT_SECONDS="120")
    result = subprocess.run([sys.executable, "-c", _PIPELINED, "240"], capture_output=True,
                            text=True, timeout=600, env=env)
    assert result.returncode == 0 and "ALL OK" in result.stdout, result.stderr[-3000:]


_MIXED = textwrap.dedent("""
    import faulthandler, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np, jaxring
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxring.parallel import data as data_parallel
    faulthandler.dump_traceback_later(float(sys.argv[1]), exit=True)  # a hang fails the test
    mesh = jax.make_mesh((8,), ("i",))
    rng = np.random.default_rng(0)
    shapes = {"w": ((5, 3), np.float32), "b": ((7,), np.float32), "scalar": ((), np.float32),
              "empty": ((0, 4), np.float32), "big": ((1001,), np.float32),
              "f64": ((3, 3), np.float64), "f64b": ((2,), np.float64), "count": ((4,), np.int32),
              "f16_empty": ((2, 0), np.float16)}
    tree = {k: rng.integers(-100, 100, (8,) + s).astype(d) for k, (s, d) in shapes.items()}
    ring = [(k, (k + 1) % 8) for k in range(8)]
    ours, reference = {
        "all_reduce": (lambda v: jaxring.all_reduce(v, "i"),
                       lambda x: np.broadcast_to(x.sum(0, dtype=x.dtype), x.shape)),
        "ppermute": (lambda v: jaxring.ppermute(v, "i", ring), lambda x: np.roll(x, 1, 0)),
    }[sys.argv[3]]

    def step(grads):  # jaxring's calls on fused buckets beside lax's sums, independent
        grads = jax.tree.map(lambda g: g[0], grads)
        mine = data_parallel._apply_fused("test", ours, grads, 400, None, "i")
        theirs = jax.tree.map(lambda g: lax.psum(g, "i") if g.size else jnp.zeros_like(g), grads)
        return jax.tree.map(lambda x: x[None], (mine, theirs))

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    args = jax.device_put(tree, NamedSharding(mesh, P("i")))
    for _ in range(int(sys.argv[2])):  # every run checked: a race may spoil any one
        mine, theirs = f(args)
        for got, x in zip(jax.tree.leaves(mine), jax.tree.leaves(tree)):
            np.testing.assert_array_equal(np.asarray(got), reference(x))
        for got, x in zip(jax.tree.leaves(theirs), jax.tree.leaves(tree)):
            np.testing.assert_array_equal(
                np.asarray(got), np.broadcast_to(x.sum(0, dtype=x.dtype), x.shape))
    print("ALL OK")
""")


@pytest.mark.parametrize("call", ["all_reduce", "ppermute"])
def test_jaxring_and_lax_collectives_mixed_in_one_program(call):
    """jaxring's calls on fused gradient buckets (all_reduce, or a ring pass) and per-leaf
    lax.psums, independent of each other, in one program on 8 devices, 100 times. XLA's thunk
    executor hands independent thunks to its intra-op pool (2 threads here); when jaxring's calls
    slept there waiting for peers whose calls were queued behind them, and lax's all-reduce
    (which blocks too) waited for devices stuck that way, the program hung until XLA aborted it
    (every run of this test did, before cpu/handoff.h). Every element is checked against numpy's
    exact integer-valued results."""
    env = dict(os.environ, JAXRING_TIMEOUT_SECONDS="120")
    result = subprocess.run([sys.executable, "-c", _MIXED, "240", "100", call],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0 and "ALL OK" in result.stdout, result.stderr[-3000:]


_FAILED_AT_EXIT = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax, numpy as np, jaxring
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P
    m = jax.make_mesh((2,), ("i",))
    skip_on_0 = lambda v: lax.cond(lax.axis_index("i") == 0, lambda v: v,
                                   lambda v: jaxring.all_reduce(v, "i"), v)
    f = jax.jit(jax.shard_map(skip_on_0, mesh=m, in_specs=P("i"), out_specs=P("i"),
                              check_vma=False))
    x = jax.device_put(np.arange(4.0), NamedSharding(m, P("i")))
    with jaxring.config.override(timeout_seconds=0.3):
        try:
            np.asarray(f(x))
        except Exception as error:
            print("CAUGHT", error)
        if sys.argv[1] == "reset":
            jaxring.reset_after_error()
""")


@pytest.mark.parametrize("reset", [False, True], ids=["not reset", "reset"])
def test_a_failed_program_is_told_once_at_exit_unless_reset(reset):
    """JAX's exit handlers printed a failed jaxring program's error as two ignored exceptions
    with their tracebacks, however long before the caller had caught it."""
    result = subprocess.run([sys.executable, "-c", _FAILED_AT_EXIT, "reset" if reset else "-"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "CAUGHT" in result.stdout, result.stderr[-3000:]
    # The program failed as meant to (not, say, while tracing, which leaves nothing to tell).
    assert "timed out after 0.3 s waiting for rank(s) [0]" in result.stdout, result.stdout[-3000:]
    assert "Exception ignored" not in result.stderr, result.stderr[-3000:]
    told = [line for line in result.stderr.splitlines() if line.startswith("jaxring: ")]
    assert told == ([] if reset else [
        "jaxring: a jaxring program failed, and jaxring.reset_after_error() was not called after "
        "it: INTERNAL: jaxring all_reduce(sum) op 1 float32[2] (called at <string>:9 in "
        "<lambda>) on mesh axis 'i' (rank 1 of 2): "
        "timed out after 0.3 s waiting for rank(s) [0] to arrive. A peer that never calls this "
        "collective (a rank-dependent branch, or a crashed device) cannot be waited for; raise "
        "jaxring.config timeout_seconds if it is just slow."]), result.stderr[-3000:]


_MANY_DEVICES = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=32"
    import jax, jax.numpy as jnp, numpy as np, jaxring
    from jax.sharding import NamedSharding, PartitionSpec as P
    for n in (5, 7, 16, 32):
        m = jax.make_mesh((n,), ("i",), devices=jax.devices()[:n])
        sharded = lambda a: jax.device_put(a, NamedSharding(m, P("i")))
        program = lambda body: jax.jit(jax.shard_map(body, mesh=m, in_specs=P("i"),
                                                     out_specs=P("i")))
        x = np.random.default_rng(n).standard_normal((n * 1001,)).astype(np.float32)
        y = np.random.default_rng(n + 1).standard_normal(n * n * 7).astype(np.float32)
        xs, ys = sharded(x), sharded(y)
        # Every device's copy (a row each), which must hold the same bits.
        f = program(lambda v: jaxring.all_reduce(v, "i")[None])
        # Over 8 sources the fold runs in groups; the mean scales only the last one's.
        mean = program(lambda v: jaxring.all_reduce(v, "i", "mean")[None])
        # The grouped fold for the other ops and dtypes, and for reduce_scatter. The programs
        # are compiled once: the algorithm is chosen as they run.
        folds = {(op, dtype): program(lambda v, op=op, dtype=dtype: jaxring.all_reduce(
                     (v * 1000).astype(dtype), "i", op)[None])
                 for op, dtype in (("max", np.float32), ("min", np.float32), ("sum", np.int32),
                                   ("sum", jnp.bfloat16))}
        scatter = program(lambda v: jaxring.reduce_scatter(v, "i"))
        per_device = x.reshape(n, -1)
        for algorithm in ("direct", "ring"):
            with jaxring.config.override(algorithm=algorithm):
                got = np.asarray(f(xs))
                means = np.asarray(mean(xs))
                folded = {case: np.asarray(g(xs)) for case, g in folds.items()}
                scattered = np.asarray(scatter(ys))
            assert (got == got[0]).all(), (n, algorithm, "devices disagree")
            expected = x.astype(np.float64).reshape(n, -1).sum(0)
            err = np.max(np.abs(got - expected) / np.maximum(np.abs(expected), 1))
            assert err < 1e-5 * n, (n, algorithm, err)
            assert np.array_equal(means, got / np.float32(n)), (n, algorithm)
            for (op, dtype), out in folded.items():
                case = (n, algorithm, op, str(dtype))
                assert (out == out[0]).all(), case + ("devices disagree",)
                inputs = (per_device * 1000).astype(dtype).astype(np.float64)
                expected = getattr(inputs, op)(0)
                if dtype == jnp.bfloat16:  # summed in float32 and rounded once
                    np.testing.assert_allclose(out.astype(np.float64), np.broadcast_to(
                        expected, out.shape), rtol=2.0 ** -8, atol=1e-2 * n, err_msg=str(case))
                else:
                    assert np.array_equal(out, np.broadcast_to(expected, out.shape)), case
            expected = y.astype(np.float64).reshape(n, -1).sum(0)
            np.testing.assert_allclose(scattered, expected, rtol=1e-5, atol=1e-5 * n,
                                       err_msg=f"reduce_scatter {n} {algorithm}")
    print("ALL OK")
""")


def test_up_to_32_devices_including_odd_counts():
    env = dict(os.environ, JAXRING_TIMEOUT_SECONDS="120")
    result = subprocess.run([sys.executable, "-c", _MANY_DEVICES], capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0 and "ALL OK" in result.stdout, result.stderr[-3000:]


_DISTRIBUTED = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{sys.argv[2]}", num_processes=2,
                               process_id=int(sys.argv[1]))
    import numpy as np, jaxring
    from jax import lax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices).reshape(2, 2), ("p", "d"))  # "d": the devices of one process
    values = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    x = jax.make_array_from_callback(values.shape, NamedSharding(mesh, P(("p", "d"))),
                                     lambda index: values[index])

    def run(f, axis):
        g = jax.jit(jax.shard_map(lambda v: f(v, axis), mesh=mesh, in_specs=P(("p", "d")),
                                  out_specs=P(("p", "d"))))
        return {s.device.id: np.asarray(s.data) for s in g(x).addressable_shards}

    try:
        run(jaxring.all_reduce, ("p", "d"))
        raise SystemExit("a collective over devices of two processes was not refused")
    except ValueError as e:
        assert "spans 2 processes (jax.distributed)" in str(e) and "jaxring.mpi" in str(e), e
    ours, theirs = run(jaxring.all_reduce, "d"), run(lax.psum, "d")
    assert ours.keys() == theirs.keys() and len(ours) == 2
    for device in ours:
        np.testing.assert_allclose(ours[device], theirs[device], rtol=1e-6)
    print("ALL OK")
""")


def test_a_mesh_axis_across_jax_distributed_processes_is_refused():
    """Under jax.distributed a mesh may span processes, and a collective over devices of several
    of them is refused as it lowers (it once waited for peers that never come to this process,
    for the whole timeout), while an axis within each process works, as lax.psum."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, JAXRING_TIMEOUT_SECONDS="10")
    procs = [subprocess.Popen([sys.executable, "-c", _DISTRIBUTED, str(i), port], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        outputs = [proc.communicate(timeout=180) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0 and "ALL OK" in out, err[-3000:]


_ONE_CORE = textwrap.dedent("""
    import os
    os.sched_setaffinity(0, [min(os.sched_getaffinity(0))])  # before XLA starts its threads
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, numpy as np, jaxring
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P
    assert len(os.sched_getaffinity(0)) == 1
    for n in (2, 8):
        m = jax.make_mesh((n,), ("i",), devices=jax.devices()[:n])
        ring = [(i, (i + 1) % n) for i in range(n)]

        def loop(permute, reduce):
            def step(c, _):
                c = permute(c, "i", ring)
                c = c * 0.9 + reduce(c, "i") * (0.1 / n)
                return c, c
            return lambda v: lax.scan(step, v, length=300)[1]

        x = np.random.default_rng(n).standard_normal((n * 257,)).astype(np.float32)
        xs = jax.device_put(x, NamedSharding(m, P("i")))
        run = lambda *fns: np.asarray(jax.jit(jax.shard_map(loop(*fns), mesh=m, in_specs=P("i"),
                                                              out_specs=P(None, "i")))(xs))
        ours, theirs = run(jaxring.ppermute, jaxring.all_reduce), run(lax.ppermute, lax.psum)
        assert np.allclose(ours, theirs, rtol=1e-5, atol=1e-5), (n, np.abs(ours - theirs).max())
    # Large enough that every device's share is cut into several pieces, which whichever device
    # thread runs takes over from the ones waiting for the core (LocalTransport::Share). int32
    # sums are exact, so every element must equal lax's.
    pairs = [(jaxring.all_reduce, lax.psum),
             (jaxring.reduce_scatter, lambda v, a: lax.psum_scatter(v, a, tiled=True)),
             (jaxring.all_gather, lambda v, a: lax.all_gather(v, a, tiled=True))]
    for n in (3, 8):
        m = jax.make_mesh((n,), ("i",), devices=jax.devices()[:n])
        count = n * ((3 << 20) // (4 * n) + 37)
        x = np.random.default_rng(n).integers(-1000, 1000, n * count, dtype=np.int32)
        xs = jax.device_put(x, NamedSharding(m, P("i")))
        for ours, theirs in pairs:
            run = lambda fn: np.asarray(jax.jit(jax.shard_map(lambda v: fn(v, "i"), mesh=m,
                                                              in_specs=P("i"),
                                                              out_specs=P("i")))(xs))
            np.testing.assert_array_equal(run(ours), run(theirs), err_msg=f"{ours} {n}")
        root = x.reshape(n, -1)[n - 1]
        np.testing.assert_array_equal(run(lambda v, a: jaxring.broadcast(v, a, root=n - 1)),
                                      np.tile(root, n), err_msg=f"broadcast {n}")
    print("ALL OK")
""")


def test_devices_sharing_one_core():
    """Every device thread on one core: each wait's spin finds its peer not running, so the spin
    shrinks to almost nothing and the waits run on yields (common/wait.h). 300 steps of a ring
    pass and an all-reduce at 2 and 8 devices still equal lax's at every step, and large
    collectives, whose pieces the running device threads take over, equal lax's exactly."""
    env = dict(os.environ, JAXRING_TIMEOUT_SECONDS="120")
    result = subprocess.run([sys.executable, "-c", _ONE_CORE], capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0 and "ALL OK" in result.stdout, result.stderr[-3000:]


def test_stress_thousands_of_calls_of_random_sizes():
    """2048 collectives in one program: 64 calls of random kind, op, dtype and size, in a scan of
    32 steps. Every input differs per device, per call and per step, so a call that read a stale
    buffer (an earlier step's, another call's) or the wrong peer's would show; every output of
    every step on every device must equal lax's twin exactly (the inputs are small integers, so
    float sums are exact and means divide them as lax.pmean does)."""
    n = 4
    m = mesh(n)
    rng = np.random.default_rng(2)
    calls = []
    for _ in range(64):
        kind = str(rng.choice(["all_reduce", "reduce_scatter", "all_gather"]))
        op = str(rng.choice(["sum", "mean", "max", "min"]))
        dtype = np.dtype(rng.choice([np.float32, np.float64, np.int32]))
        size = int(rng.integers(0, 3000)) // n * n
        if np.issubdtype(dtype, np.integer) and op == "mean":
            op = "sum"
        calls.append((kind, op, dtype, size, rng.integers(1, 1000, size=3)))
    lax_reduce = {"sum": lax.psum, "mean": lax.pmean, "max": lax.pmax, "min": lax.pmin}

    def program(ours):
        def step(_, i):
            outputs = []
            for kind, op, dtype, size, (a, b, c) in calls:
                iota = jnp.arange(size, dtype=jnp.int32)
                v = ((iota * a + lax.axis_index("i") * b + i * c) % 2001 - 1000).astype(dtype)
                if kind == "all_gather":
                    y = jaxring.all_gather(v, "i") if ours else lax.all_gather(v, "i", tiled=True)
                elif kind == "reduce_scatter" and ours:
                    y = jaxring.reduce_scatter(v, "i", op)
                elif kind == "reduce_scatter":  # lax's reduction, this device's block of it
                    y = lax.dynamic_slice_in_dim(lax_reduce[op](v, "i"),
                                                 lax.axis_index("i") * (size // n), size // n)
                else:
                    y = jaxring.all_reduce(v, "i", op) if ours else lax_reduce[op](v, "i")
                outputs.append(y[None])
            return None, outputs
        return shmap(lambda: lax.scan(step, None, jnp.arange(32))[1], m, in_specs=(),
                     out_specs=P(None, "i"))

    expected = [np.asarray(y) for y in program(False)()]
    with jaxring.config.override(pipeline_slice_bytes=1024):
        for algorithm in ("direct", "ring"):
            with jaxring.config.override(algorithm=algorithm):
                got = program(True)()
            for y, e, call in zip(got, expected, calls):
                assert y.dtype == e.dtype
                np.testing.assert_array_equal(np.asarray(y), e, err_msg=f"{algorithm} {call}")


# ---- errors at trace time ----------------------------------------------------------------------


_EVERY_CALL = {
    "all_reduce": lambda v: jaxring.all_reduce(v, "i"),
    "reduce_scatter": lambda v: jaxring.reduce_scatter(v, "i"),
    "all_gather": lambda v: jaxring.all_gather(v, "i"),
    "broadcast": lambda v: jaxring.broadcast(v, "i", root=1),
    "ppermute": lambda v: jaxring.ppermute(v, "i", [(0, 1), (1, 0)]),
    "send": lambda v: jaxring.send(v, "i", [(0, 1)]),
}


@pytest.mark.parametrize("call", list(_EVERY_CALL))
@pytest.mark.parametrize("dtype", [np.complex64, np.int8, np.uint32, np.bool_])
def test_unsupported_dtype_is_refused_at_trace_time_with_allowed_values(dtype, call):
    m = mesh(2)
    f = shmap(lambda v: _EVERY_CALL[call](v) if call != "send" else (_EVERY_CALL[call](v), v)[1],
              m)
    with pytest.raises(TypeError, match=rf"jaxring.{call}: unsupported dtype "
                                        rf"{np.dtype(dtype)}; allowed: float32, float64"):
        f.trace(shard(np.zeros(4, dtype), m))


def test_an_extended_dtype_is_refused_with_allowed_values():
    m = mesh(2)
    x = shard(np.zeros(4, np.float32), m)
    for call in (lambda key: jaxring.all_reduce(key, "i"),
                 lambda key: jaxring.recv(key, "i", [(0, 1)])):
        with pytest.raises(TypeError, match=r"unsupported dtype key<fry>; allowed: float32"):
            # a PRNG key's dtype has no NumPy twin
            shmap(lambda v, call=call: (call(jax.random.key(0)), v)[1], m)(x)


def test_a_sum_over_axes_the_input_varies_over_only_partly_is_refused_as_lax_refuses_it():
    """Over ("a", "b") of an input that varies over "b" only, jaxring summed every copy along
    "a", while lax.psum refuses it: it is unclear whether they count once or once each. An input
    invariant over every axis counts every copy in both, and max takes either."""
    m = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices()[:4])
    x = np.random.default_rng(5).standard_normal((4, 6))
    calls = {"all_reduce": (lambda v: jaxring.all_reduce(v, ("a", "b")),
                            lambda v: lax.psum(v, ("a", "b"))),
             "reduce_scatter": (lambda v: jaxring.reduce_scatter(v, ("a", "b"), "mean"),
                                lambda v: lax.psum_scatter(v, ("a", "b"), tiled=True))}
    with jax.set_mesh(m):
        for spec in (P("b"), P()):
            xs = jax.device_put(x, jax.NamedSharding(m, spec))
            for name, (ours, theirs) in calls.items():
                f = lambda call: jax.jit(jax.shard_map(call, mesh=m, in_specs=spec,  # noqa
                                                       out_specs=P(("a", "b"))))(xs)
                if spec == P():
                    expected = np.asarray(f(theirs)) / (4 if name == "reduce_scatter" else 1)
                    np.testing.assert_allclose(np.asarray(f(ours)), expected, rtol=1e-12)
                    continue
                with pytest.raises(ValueError, match="can only accept axis_name"):
                    f(theirs)
                with pytest.raises(ValueError, match=rf"jaxring.{name}: the input varies over "
                                                     r"\('b',\) but not over \('a',\)"):
                    f(ours)
        got = jax.jit(jax.shard_map(lambda v: jaxring.all_reduce(v, ("a", "b"), "max"), mesh=m,
                                    in_specs=P("b"), out_specs=P()))(
            jax.device_put(x, jax.NamedSharding(m, P("b"))))
    np.testing.assert_array_equal(every_device(got), np.broadcast_to(np.maximum(x[:2], x[2:]),
                                                                      (4, 2, 6)))


def test_mesh_axes_left_to_the_compiler_are_refused_and_the_ways_around_agree_with_lax():
    """jaxring needs every mesh axis manual (it must know which device runs it). A shard_map that
    leaves an axis out, and jax.vmap of a shard_map whose batch is sharded over an Explicit mesh
    axis (which leaves that axis to the compiler), are refused, naming the ways around; each way
    around gives lax.psum's result."""
    from jax.sharding import AxisType

    x = np.random.default_rng(41).standard_normal((2, 8, 5)).astype(np.float32)
    expected = x.astype(np.float64).reshape(2, 4, 2, 5).sum(1)
    refused = r"\['d'\] are not: .* Give shard_map every mesh axis, or vmap inside"
    for types in ((AxisType.Explicit,) * 2, (AxisType.Auto,) * 2):
        m = jax.make_mesh((2, 4), ("d", "i"), axis_types=types)
        y = jax.device_put(x, jax.NamedSharding(m, P("d", "i")))
        outputs = {}
        for name, reduce in (("lax", lambda v: lax.psum(v, "i")),
                             ("jaxring", lambda v: jaxring.all_reduce(v, "i"))):
            batched = jax.jit(jax.vmap(jax.shard_map(reduce, mesh=m, in_specs=P("i"),
                                                     out_specs=P())))
            inside = jax.jit(jax.shard_map(jax.vmap(reduce), mesh=m, in_specs=P("d", "i"),
                                           out_specs=P("d")))
            partly = jax.jit(jax.shard_map(reduce, mesh=m, in_specs=P(None, "i"),
                                           out_specs=P(), axis_names={"i"}))
            if name == "jaxring" and types[0] == AxisType.Explicit:
                with pytest.raises(ValueError, match=refused):
                    batched(y)
            else:
                outputs[name, "vmap of shard_map"] = batched(y)
            if name == "jaxring":
                with pytest.raises(ValueError, match=refused):
                    partly(y)
            else:
                outputs[name, "shard_map over i alone"] = partly(y)
            outputs[name, "vmap inside shard_map"] = inside(y)
        for (name, way), out in outputs.items():
            np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, err_msg=(name, way))


def test_unsupported_op_and_bad_arguments():
    m = mesh(4)
    x = shard(np.zeros((8, 3), np.float32), m)
    with pytest.raises(ValueError, match=r"unsupported op 'prod'; allowed: 'sum', 'mean'"):
        shmap(lambda v: jaxring.all_reduce(v, "i", "prod"), m)(x)
    with pytest.raises(ValueError, match=r"unsupported op \['sum'\]; allowed: 'sum'"):
        shmap(lambda v: jaxring.all_reduce(v, "i", ["sum"]), m)(x)
    with pytest.raises(ValueError, match=r"jaxring.reduce_scatter: unsupported op 'prod'; "
                                         r"allowed: 'sum', 'mean'"):
        shmap(lambda v: jaxring.reduce_scatter(v, "i", "prod"), m).trace(x)
    with pytest.raises(NameError, match="unbound axis name 'j'"):
        shmap(lambda v: jaxring.all_reduce(v, "j"), m)(x)
    with pytest.raises(ValueError, match="must be divisible by the 4 devices"):
        shmap(lambda v: jaxring.reduce_scatter(v, "i", scatter_dimension=1), m)(x)
    with pytest.raises(ValueError, match=r"reduce_scatter: needs an array of rank >= 1, got a "
                                         r"scalar"):  # (lax.psum_scatter: an IndexError)
        shmap(lambda v: jaxring.reduce_scatter(v[0, 0], "i")[None], m).trace(x)
    with pytest.raises(ValueError, match=r"root must be an int in \[0, 4\)"):
        shmap(lambda v: jaxring.broadcast(v, "i", root=4), m)(x)
    with pytest.raises(TypeError, match=r"root must be a static Python int in \[0, 4\), known "
                                        r"when the program is traced, not a traced value"):
        shmap(lambda v: jaxring.broadcast(v, "i", root=lax.axis_index("i")), m)(x)
    for root in (True, 1.0, -1):  # not ranks, though Python compares the first two equal to 1
        with pytest.raises(ValueError, match=r"root must be an int in \[0, 4\)"):
            shmap(lambda v, root=root: jaxring.broadcast(v, "i", root=root), m)(x)
    for axis in (2, 0.0, "0"):
        with pytest.raises(ValueError, match=r"axis must be an int in \[-2, 2\) .* got"):
            shmap(lambda v, axis=axis: jaxring.all_gather(v, "i", axis=axis), m)(x)
    with pytest.raises(ValueError, match=r"scatter_dimension must be an int in \[-2, 2\)"):
        shmap(lambda v: jaxring.reduce_scatter(v, "i", scatter_dimension=1.0), m)(x)
    with pytest.raises(TypeError, match="perm must be a sequence of .* int pairs"):
        shmap(lambda v: jaxring.ppermute(v, "i", [(0.7, 1)]), m)(x)
    with pytest.raises(ValueError, match="not a device mesh axis"):
        shmap(jax.vmap(lambda v: jaxring.all_reduce(v, "v"), axis_name="v"), m)(x)
    for hidden in (lambda v: jaxring.all_reduce(v, "i"),
                   lambda v: (jaxring.barrier("i"), v)[1],  # before, it waited out the timeout
                   lambda v: jaxring.recv(v, "i", [(0, 1)])):
        with pytest.raises(ValueError, match="a vmap axis named like mesh axis 'i' hides it"):
            shmap(jax.vmap(hidden, axis_name="i"), m)(x)
    # The vmap hides the other mesh axis, which numbers the groups, and is named (it once named
    # the collective's own axis).
    grid = jax.make_mesh((2, 2), ("d", "i"), devices=jax.devices()[:4])
    with pytest.raises(ValueError, match="a vmap axis named like mesh axis 'd' hides it"):
        shmap(jax.vmap(lambda v: jaxring.all_reduce(v, "i"), axis_name="d"), grid,
              in_specs=P("d", "i"), out_specs=P("d", "i"))(
                  shard(np.zeros((2, 2, 6), np.float32), grid, P("d", "i")))
    with pytest.raises(ValueError, match=r"axis must be an int in \[-1, 1\) for an input of "
                                         r"rank 0, tiled \(a vector of one\), got 1"):
        shmap(lambda v: jaxring.all_gather(v[0, 0], "i", axis=1), m)(x)
    with pytest.raises(ValueError, match=r"axis names repeat in \('i', 'i'\)"):
        shmap(lambda v: jaxring.all_reduce(v, ("i", "i")), m)(x)
    with pytest.raises(ValueError, match="algorithm must be"):
        jaxring.config.update(algorithm="tree")


# ---- errors at run time: never a hang, never wrong data ----------------------------------------


def _rank_dependent(m, on_rank0, on_others):
    """A program whose devices disagree: device 0 runs `on_rank0`, the others `on_others`."""
    def f(v):
        return lax.cond(lax.axis_index("i") == 0, on_rank0, on_others, v)
    return jax.jit(jax.shard_map(f, mesh=m, in_specs=P("i"), out_specs=P("i"), check_vma=False))


def _axis_key(m, axis):
    """The key of the in-process communicator of mesh axis `axis` of `m`, as its calls find it."""
    keys = []

    def body(v):
        keys.append(common.communicator("test", axis).key)
        return v
    jax.eval_shape(jax.shard_map(body, mesh=m, in_specs=P(axis), out_specs=P(axis)),
                   shard(np.zeros(m.shape[axis], np.float32), m))
    return keys[0]


@pytest.mark.parametrize("call", ["all_reduce", "barrier"])
def test_missing_peer_times_out_naming_the_missing_devices(call):
    """Device 0 calls, the others never do: device 0 must wait for them (a barrier that did not
    wait would return) and then name them."""
    m = mesh(4)
    x = shard(np.ones((8, 3), np.float32), m)
    body = {"all_reduce": lambda v: jaxring.all_reduce(v, "i"),
            "barrier": lambda v: (jaxring.barrier("i"), v + 1)[1]}[call]
    f = _rank_dependent(m, body, lambda v: v + 1)
    key = _axis_key(m, "i")
    with jaxring.config.override(timeout_seconds=1.0):
        with pytest.raises(Exception, match=called_at(body) + r" on .*timed out "
                                            r"after 1 s waiting for rank\(s\) \[1, 2, 3\] to "
                                            r"arrive"):
            np.asarray(f(x))
    # The given-up call stays for late devices to find, until reset_after_error, which knows
    # that none is still to come.
    assert native.extension.open_meetings(key) == 1
    _check_recovery(m, x, "timed out")
    assert native.extension.open_meetings(key) == 0


def test_a_failed_runs_calls_are_counted_afresh_should_its_run_id_come_again():
    """Calls meet by (run id, the rank's count of calls in that run). In a failed run device 0
    made a call that device 1 never made; XLA's run ids are launch ids, counted per executable,
    so that id may come again. After reset_after_error both devices' calls of that run must meet
    again (device 0's count once went on from 1 while device 1's began at 0, and both timed
    out)."""
    key = int(np.random.default_rng().integers(1 << 40, 1 << 50))  # a fresh communicator
    code = (common.COLLECTIVE_CODES["all_reduce"], common.REDUCE_OPS["sum"],
            common.DTYPE_CODES[np.dtype(np.float32)])
    inputs = [np.full(3, rank + 1.0, np.float32) for rank in range(2)]
    outputs = [np.zeros(3, np.float32) for _ in range(2)]

    def call(rank, errors):
        errors[rank] = native.extension.collective_on_host(
            key, "run id test", rank, 2, *code, inputs[rank], outputs[rank], run_id=7, op_id=0)

    errors = {}
    with jaxring.config.override(timeout_seconds=0.5):
        call(0, errors)
    assert "timed out after 0.5 s waiting for rank(s) [1]" in errors[0], errors
    jaxring.reset_after_error()
    errors = {}
    with jaxring.config.override(timeout_seconds=10.0):
        on_threads(call, [(rank, errors) for rank in range(2)])
    assert errors == {0: "", 1: ""}, errors
    for out in outputs:
        np.testing.assert_array_equal(out, np.full(3, 3.0, np.float32))


def test_an_infinite_timeout_waits_for_a_late_peer():
    """float("inf") waits for ever; it once overflowed into a deadline in the past, and every
    wait longer than its first spin gave up."""
    m = mesh(4)
    x = shard(np.arange(8.0, dtype=np.float32), m)
    f = late_devices(m, {3: 0.05}, lambda v: jaxring.all_reduce(v, "i"))
    with jaxring.config.override(timeout_seconds=float("inf")):
        out = np.asarray(f(x))
    np.testing.assert_array_equal(out, np.tile(np.asarray(x).reshape(4, 2).sum(0), 4))


def test_ranks_later_than_a_timeout_fail_at_once_in_the_abandoned_meeting():
    """Device 0 gives up after 1 s; devices 1 and 2 come 1.5 and 3 s late. Both must find the
    meeting device 0 abandoned and fail at once: device 2 once found a fresh meeting, waited a
    timeout of its own there and blamed devices 0 and 1, which had come."""
    m = mesh(3)
    x = shard(np.arange(3.0, dtype=np.float32), m)
    delays = {}  # none while the program compiles and runs once
    g = late_devices(m, delays, lambda v: jaxring.all_reduce(v, "i"))
    np.testing.assert_array_equal(np.asarray(g(x)), [3.0, 3.0, 3.0])
    delays.update({1: 1.5, 2: 3.0})
    with jaxring.config.override(timeout_seconds=1.0):
        start = time.perf_counter()
        with pytest.raises(Exception, match="timed out") as error:
            np.asarray(g(x))
        elapsed = time.perf_counter() - start
    assert "[0, 1]" not in str(error.value), str(error.value)
    assert elapsed < 3.9, elapsed  # device 2 fails on arrival (3 s), not after 4 s
    jaxring.reset_after_error()
    delays.update({1: 0.0, 2: 0.0})
    np.testing.assert_array_equal(np.asarray(g(x)), [3.0, 3.0, 3.0])


def test_a_call_slower_than_the_timeout_that_keeps_making_progress_completes():
    """The timeout bounds each wait, not the call: device 1 stalls 0.9 s in each of its first
    three ring slices, so the call takes over 2.7 s, and device 0, whose timeout is 2 s, never
    waits 2 s for one thing. It once failed at 2 s, a deadline counted from the start of the
    call. (The direct algorithm's pieces go to whichever device is free, so one stall there
    delays nobody for long.)"""
    n, count = 2, 1 << 14
    rng = np.random.default_rng(19)
    inputs = [random_array(rng, (count,), np.float32) for _ in range(n)]
    outputs = [np.zeros(count, np.float32) for _ in range(n)]
    errors = {}
    sum_f32 = (common.COLLECTIVE_CODES["all_reduce"], common.REDUCE_OPS["sum"],
               common.DTYPE_CODES[np.dtype(np.float32)])
    key = int(rng.integers(1 << 40, 1 << 50))  # a fresh in-process communicator

    def run(rank):
        errors[rank] = native.extension.collective_on_host(
            key, "slow test", rank, n, *sum_f32, inputs[rank], outputs[rank], run_id=1, op_id=0)

    stalls = native.extension.stalls_taken()
    native.extension.stall_next_piece(key, 1, 0.9, pieces=3)
    try:
        with jaxring.config.override(timeout_seconds=2.0, algorithm="ring",
                                     pipeline_slice_bytes=1024):  # 32 slices a step
            start = time.perf_counter()
            on_threads(run, [(rank,) for rank in range(n)])
            took = time.perf_counter() - start
    finally:
        native.extension.stall_next_piece(key, -1, 0.0)
    assert errors == {0: "", 1: ""}, errors
    assert native.extension.stalls_taken() - stalls == 3 and took > 2.7, took
    expected = inputs[0].astype(np.float64) + inputs[1]
    for out in outputs:
        assert_close(out, expected, np.float32, count=n)


@pytest.mark.parametrize("algorithm", ["direct", "ring"])
def test_a_rank_that_gives_up_returns_only_once_no_peer_touches_its_buffers(algorithm):
    """Device 1 stalls for 2.5 s inside its first piece (direct: a share of the sum that it also
    writes into device 0's output) or ring slice (reading device 0's buffers); device 0 gives up
    after 1 s. Device 0 once returned then, and device 1 went on to write into (direct) or read
    from (ring) buffers that XLA had freed. Now device 0 returns only once device 1 has left
    them, so nothing changes its output afterwards; device 1 then fails at once instead of
    waiting a timeout of its own for a rank that has left."""
    n, count, stall, timeout = 2, 1 << 22, 2.5, 1.0
    rng = np.random.default_rng(17 if algorithm == "direct" else 18)
    inputs = [rng.standard_normal(count, dtype=np.float32) for _ in range(n)]
    outputs = [np.zeros(count, np.float32) for _ in range(n)]
    errors, ends, snapshots = {}, {}, {}
    sum_f32 = (common.COLLECTIVE_CODES["all_reduce"], common.REDUCE_OPS["sum"],
               common.DTYPE_CODES[np.dtype(np.float32)])

    def run(key, rank):
        errors[rank] = native.extension.collective_on_host(
            key, "stall test", rank, n, *sum_f32, inputs[rank], outputs[rank], run_id=1, op_id=0)
        ends[rank] = time.perf_counter()
        snapshots[rank] = outputs[rank].copy()

    stalls = native.extension.stalls_taken()
    with jaxring.config.override(timeout_seconds=timeout, algorithm=algorithm):
        # Device 1 stalls in the first piece it claims; should device 0 have claimed them all
        # before device 1 began (a scheduler's whim), nothing stalled, and the test goes again.
        for attempt in range(3):
            key = int(rng.integers(1 << 40, 1 << 50))  # a fresh in-process communicator
            native.extension.stall_next_piece(key, 1, stall)
            try:
                start = time.perf_counter()
                on_threads(run, [(key, rank) for rank in range(n)])
            finally:
                native.extension.stall_next_piece(key, -1, 0.0)
            if native.extension.stalls_taken() > stalls:
                break
        else:
            pytest.fail("device 1 began no piece in 3 attempts")
    waiting_for = "rank(s) [1] to finish" if algorithm == "direct" else "rank 1 to reach"
    assert f"timed out after 1 s waiting for {waiting_for}" in errors[0], errors[0]
    # Device 1 names who gave up and why.
    assert "rank 0 gave up on this collective" in errors[1], errors[1]
    assert f"timed out after 1 s waiting for {waiting_for}" in errors[1], errors[1]
    assert ends[0] - start >= stall, ends[0] - start
    assert ends[1] - start < stall + 0.7 * timeout, ends[1] - start
    np.testing.assert_array_equal(outputs[0], snapshots[0])  # the direct path's writes


def test_a_rank_later_than_a_peers_timeout_is_told_which_peer_gave_up_and_why():
    """Device 0 waits 0.5 s for device 1, which comes only after device 0 has returned: device 1
    fails at once, naming device 0 and device 0's own error."""
    n, timeout = 2, 0.5
    rng = np.random.default_rng(19)
    inputs = [rng.standard_normal(1000, dtype=np.float32) for _ in range(n)]
    outputs = [np.zeros(1000, np.float32) for _ in range(n)]
    codes = (common.COLLECTIVE_CODES["all_reduce"], common.REDUCE_OPS["sum"],
             common.DTYPE_CODES[np.dtype(np.float32)])
    key = int(rng.integers(1 << 40, 1 << 50))  # a fresh in-process communicator

    def run(rank):
        return native.extension.collective_on_host(
            key, "late test", rank, n, *codes, inputs[rank], outputs[rank], run_id=1, op_id=0)

    with jaxring.config.override(timeout_seconds=timeout):
        first = run(0)
        start = time.perf_counter()
        second = run(1)
        elapsed = time.perf_counter() - start
    assert "timed out after 0.5 s waiting for rank(s) [1] to arrive" in first, first
    assert ("rank 1 of 2): rank 0 gave up on this collective before every rank arrived"
            in second), second
    assert "The error on rank 0: " + first in second, second
    assert elapsed < timeout / 2, elapsed
    np.testing.assert_array_equal(outputs[1], np.zeros(1000, np.float32))


def test_scratch_pooled_between_calls_stays_within_scratch_pool_bytes():
    """The ring's scratch (float32 partial sums, one buffer per device) goes back to a pool after
    each call, which keeps at most scratch_pool_bytes: all three buffers by default, two under a
    cap of two, none once the cap is 0 (lowering it frees the excess at once). A small call
    does not take a pooled buffer more than twice its size. Every result against float64."""
    n, small, large = 3, 3000, 30_000
    m = mesh(n)
    f = shmap(lambda v: jaxring.all_reduce(v, "i"), m)
    rng = np.random.default_rng(31)

    def run(count):
        x = rng.standard_normal(n * count, dtype=np.float32)
        out = np.asarray(f(shard(x, m))).reshape(n, count)
        expected = x.astype(np.float64).reshape(n, count).sum(0)
        for device in range(n):
            assert_close(out[device], expected, np.float32, count=n)

    buffer, small_buffer = large * 4, (small * 4 + 63) // 64 * 64  # capacities: 64-byte lines
    with jaxring.config.override(algorithm="ring", scratch_pool_bytes=0):
        assert native.extension.pooled_scratch() == (0, 0)
        run(large)
        assert native.extension.pooled_scratch() == (0, 0)
        jaxring.config.update(scratch_pool_bytes=2 * buffer)
        run(large)
        assert native.extension.pooled_scratch() == (2, 2 * buffer)
        jaxring.config.update(scratch_pool_bytes=1 << 30)
        run(large)
        assert native.extension.pooled_scratch() == (3, 3 * buffer)
        run(small)  # finds no pooled buffer within twice its size: three more of its own
        assert native.extension.pooled_scratch() == (6, 3 * buffer + 3 * small_buffer)
        run(large)
        assert native.extension.pooled_scratch() == (6, 3 * buffer + 3 * small_buffer)
        jaxring.config.update(scratch_pool_bytes=buffer)  # the largest go first
        assert native.extension.pooled_scratch() == (3, 3 * small_buffer)


def test_a_rank_without_memory_for_its_scratch_fails_its_peers_at_once():
    """Device 1 of 3 finds no memory for the ring's scratch (a test hook fails its allocation):
    it returns at once, and so do its peers, whichever came first, naming device 1 and quoting its
    error, long before their 30 s timeout, and the meeting leaves the group once all three came.
    The communicator then runs the next all-reduce right, against float64."""
    n, count, timeout = 3, 50_000, 30.0
    rng = np.random.default_rng(23)
    inputs = [rng.standard_normal(count, dtype=np.float32) for _ in range(n)]
    outputs = [np.zeros(count, np.float32) for _ in range(n)]
    codes = (common.COLLECTIVE_CODES["all_reduce"], common.REDUCE_OPS["sum"],
             common.DTYPE_CODES[np.dtype(np.float32)])
    key = int(rng.integers(1 << 40, 1 << 50))  # a fresh in-process communicator
    errors = {}

    def run(rank, run_id):
        errors[rank] = native.extension.collective_on_host(
            key, "scratch test", rank, n, *codes, inputs[rank], outputs[rank], run_id=run_id,
            op_id=0)

    def run_all(run_id):
        on_threads(run, [(rank, run_id) for rank in range(n)], 2 * timeout)

    with jaxring.config.override(timeout_seconds=timeout, algorithm="ring"):
        native.extension.fail_next_scratch(key, 1)
        try:
            start = time.perf_counter()
            run_all(1)
            elapsed = time.perf_counter() - start
        finally:
            native.extension.fail_next_scratch(key, -1)
        assert "(rank 1 of 3): out of memory for 200000 bytes of scratch" in errors[1], errors[1]
        for rank in (0, 2):
            assert f"(rank {rank} of 3): rank 1 gave up on this collective before every rank " \
                   f"arrived, so it cannot run. The error on rank 1: {errors[1]}" in errors[rank], \
                errors[rank]
        assert elapsed < timeout / 4, elapsed
        assert native.extension.open_meetings(key) == 0  # the given-up meeting left the group
        run_all(2)
    assert errors == {0: "", 1: "", 2: ""}, errors
    assert native.extension.open_meetings(key) == 0
    expected = np.sum(np.asarray(inputs, np.float64), axis=0)
    for output in outputs:
        np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape, axes, group", [
    ((2, 4), ("a", "b"), "where 'a' = 1"),
    ((2, 2, 2), ("a", "c", "b"), "at index 3 of mesh axes 'a', 'c'"),
], ids=["one other axis", "two other axes"])
def test_a_timeout_names_the_group_of_the_devices_along_the_other_mesh_axes(shape, axes, group):
    """An all-reduce over 'b' runs in one group of devices per index along the other mesh axes,
    and the last device of the last group skips it. The error names the group as well as the
    rank: 'rank 3 of 4' alone could have been any group's."""
    m = jax.make_mesh(shape, axes, devices=jax.devices()[:8])
    last = shape[-1] - 1

    def f(v):
        skip = lax.axis_index(axes) == 7
        return lax.cond(skip, lambda v: v, lambda v: jaxring.all_reduce(v, "b"), v)

    g = jax.jit(jax.shard_map(f, mesh=m, in_specs=P(axes), out_specs=P(axes), check_vma=False))
    x = shard(np.arange(8, dtype=np.float32), m, P(axes))
    with jaxring.config.override(timeout_seconds=0.5):
        with pytest.raises(Exception, match=rf"on mesh axis 'b' {group} \(rank \d of "
                                            rf"{shape[-1]}\).*waiting for rank\(s\) \[{last}\]"):
            np.asarray(g(x))
    jaxring.reset_after_error()


def test_a_config_change_waits_for_programs_already_dispatched():
    """Each device reads the configuration when its call runs. A program dispatched inside an
    override whose last device reaches the ring after the block ended once ran ring on some
    devices and direct on the others; leaving the block now waits for the program."""
    m = mesh(4)
    x = shard(random_array(np.random.default_rng(5), (4 * 30_001,), np.float32), m)
    f = late_devices(m, {3: 0.3}, lambda v: jaxring.all_reduce(v, "i"))
    expected = np.asarray(x, np.float64).reshape(4, -1).sum(0)
    with jaxring.config.override(timeout_seconds=20.0):
        for outer, inner in (("direct", "ring"), ("ring", "direct")):
            with jaxring.config.override(algorithm=outer, pipeline_slice_bytes=4096):
                with jaxring.config.override(algorithm=inner):
                    y = f(x)
                out = np.asarray(y).reshape(4, -1)
            for device in range(4):
                assert_close(out[device], expected, np.float32, count=4)


def test_a_config_update_that_changes_nothing_does_not_wait():
    """Setting fields to the values they have changes nothing, so it waits for no program: a
    program whose last device is held on the host is still running after such an override is
    entered and left (it once waited for it, about 100 us of Python around every timed call of
    benchmarks/allreduce.py even with nothing running). Nor does an int equal to a field of
    seconds, which _validate would take. A float for a count is no such update: it is validated
    (and refused) as ever."""
    m = mesh(4)
    x = shard(random_array(np.random.default_rng(6), (4 * 1001,), np.float32), m)
    held = HeldDevices({3})
    f = late_devices(m, held, lambda v: jaxring.all_reduce(v, "i"))
    expected = np.asarray(x, np.float64).reshape(4, -1).sum(0)
    seconds = jaxring.config.get().timeout_seconds
    # A whole number of seconds, so that an int can equal it.
    whole = float(round(seconds)) if math.isfinite(seconds) and seconds >= 1 else 60.0
    with jaxring.config.override(timeout_seconds=whole):
        current = jaxring.config.get()
        y = f(x)
        try:
            with jaxring.config.override(algorithm=current.algorithm,
                                         timeout_seconds=current.timeout_seconds):
                assert not y.is_ready(), "entering an override that changes nothing waited"
            assert not y.is_ready(), "leaving an override that changes nothing waited"
            with jaxring.config.override(timeout_seconds=int(current.timeout_seconds)):
                assert not y.is_ready(), "an int equal to a field of seconds waited"
            assert jaxring.config.get() is current
        finally:
            held.release()
    out = np.asarray(y).reshape(4, -1)
    for device in range(4):
        assert_close(out[device], expected, np.float32, count=4)
    with pytest.raises(TypeError, match="spin_iterations must be"):
        jaxring.config.update(spin_iterations=float(current.spin_iterations))


def _check_recovery(m, x, error):
    """JAX hands a failed program's ordering token to the next program; after
    reset_after_error the next program runs normally."""
    f = shmap(lambda v: jaxring.all_reduce(v, "i"), m, out_specs=P())
    with pytest.raises(Exception, match=error):
        np.asarray(f(x))
    if runtime_tokens._installed:  # else the next program's outputs raise the error as it was
        g = shmap(lambda v: jaxring.all_gather(v, "i"), m)
        # On other devices too, and again: jax 0.12's own code raised it for the next program
        # only and then started a fresh token, so the one after ran before the reset.
        pair = mesh(2)
        h = shmap(lambda v: jaxring.all_reduce(v, "i"), pair, out_specs=P())
        for program, argument in ((g, x), (h, shard(np.ones((4, 3), np.float32), pair)),
                                  (h, shard(np.ones((4, 3), np.float32), pair)), (g, x)):
            with pytest.raises(Exception, match=r"an earlier program with jaxring calls failed, "
                                                r"so this one was not run; call "
                                                r"jaxring.reset_after_error\(\) .* Its error: .*"
                                                + error):
                program(argument)
    jaxring.reset_after_error()
    np.testing.assert_array_equal(np.asarray(f(x)), np.full((2, 3), 4.0, np.float32))


def test_derived_calls_are_named_after_the_call_they_derive_from():
    """Errors name each call's source line. The collectives that JVP, transpose and batching
    rules (or a hierarchical all-reduce's levels) bind for a user's call are named after that
    call's line, in one process (counted ids) and across processes (hashed ones)."""
    for comm in (types.SimpleNamespace(process_rank=None), types.SimpleNamespace(process_rank=0)):
        base, line = common.next_op_id(comm), sys._getframe().f_lineno
        site = f"{os.path.basename(__file__)}:{line} in {sys._getframe().f_code.co_name}"
        jvp = common.next_op_id(comm, base, "jvp")
        transpose = common.next_op_id(comm, jvp, "transpose")
        with common.op_ids_derived_from(base, "levels"):
            levels = [common.next_op_id(comm) for _ in range(2)]
        assert [native.extension.call_site(i) for i in (base, jvp, transpose, *levels)] == [
            site, f"{site}, its jvp", f"{site}, its jvp, its transpose",
            f"{site}, levels call 1", f"{site}, levels call 2"]
        assert len({base, jvp, transpose, *levels}) == 5
    # Two lines with one id (a hash collision) are both named, each once, and so is a call
    # derived from it however often it is traced.
    op_id = int(np.random.default_rng().integers(1 << 40, 1 << 50))
    for site in ("a.py:1 in f", "b.py:2 in g", "a.py:1 in f"):
        common.name_call_site(op_id, site)
    assert native.extension.call_site(op_id) == "a.py:1 in f or b.py:2 in g"
    for comm in (types.SimpleNamespace(process_rank=None), types.SimpleNamespace(process_rank=0)):
        jvps = {common.next_op_id(comm, op_id, "jvp") for _ in range(3)}
        assert {native.extension.call_site(i) for i in jvps} == {
            "a.py:1 in f or b.py:2 in g, its jvp"}
        # A call derived from an unnamed id (a test harness's) is left unnamed too.
        assert native.extension.call_site(common.next_op_id(comm, op_id + 1, "jvp")) == ""
    assert native.extension.call_site(op_id + 1) == ""


def test_mismatched_calls_raise_on_every_device_naming_both_sides():
    m = mesh(4)
    x = shard(np.ones((8, 3), np.float32), m)
    short = lambda v: jnp.concatenate([jaxring.all_reduce(v[:1], "i"), v[1:]])  # noqa: E731
    whole = lambda v: jaxring.all_reduce(v, "i")  # noqa: E731
    f = _rank_dependent(m, short, whole)
    with jaxring.config.override(timeout_seconds=30.0):
        with pytest.raises(Exception, match=r"mismatched collectives: rank 0 called "
                                            r"all_reduce\(sum\) op \d+ float32\[3\] "
                                            + called_at(short) + r" but rank 1 called "
                                            r"all_reduce\(sum\) op \d+ float32\[6\] "
                                            + called_at(whole)):
            np.asarray(f(x))
    _check_recovery(m, x, "mismatched collectives")


@pytest.mark.parametrize("differs, called", [("count", r"all_reduce\(sum\) op 0 float32\[6\]"),
                                             ("op", r"all_reduce\(max\) op 0 float32\[3\]"),
                                             ("dtype", r"all_reduce\(sum\) op 0 int32\[3\]")],
                         ids=["count", "op", "dtype"])
def test_every_rank_names_a_mismatch_at_once_whichever_field_differs(differs, called):
    """A program shows one device's error; on the host each rank's own is seen: every rank must
    name the mismatch at once, none wait out the timeout. Rank 1's call differs from the others'
    in one field of the header, with the same op id (across processes, where an op id is the
    calling line, `all_reduce(x, comm, "sum" if rank == 0 else "max")` makes such calls)."""
    n, errors = 4, {}
    key = int(np.random.default_rng().integers(1 << 40, 1 << 50))  # a fresh communicator

    def run(rank):
        size, op, dtype = 3, "sum", np.dtype(np.float32)
        if rank == 1:
            size, op, dtype = {"count": (6, op, dtype), "op": (size, "max", dtype),
                               "dtype": (size, op, np.dtype(np.int32))}[differs]
        errors[rank] = native.extension.collective_on_host(
            key, "mismatch test", rank, n, common.COLLECTIVE_CODES["all_reduce"],
            common.REDUCE_OPS[op], common.DTYPE_CODES[dtype], np.ones(size, dtype),
            np.zeros(size, dtype), run_id=1, op_id=0)

    start = time.monotonic()
    with jaxring.config.override(timeout_seconds=30.0):
        on_threads(run, [(rank,) for rank in range(n)])
    assert time.monotonic() - start < 10, "a rank waited instead of failing"
    for rank in range(n):
        assert re.search(r"mismatched collectives: rank 0 called all_reduce\(sum\) op 0 "
                         r"float32\[3\] but rank 1 called " + called,
                         errors.get(rank, "")), (rank, errors.get(rank))


# ---- configuration -----------------------------------------------------------------------------


def test_config_override_restores_and_reaches_native():
    before = jaxring.config.get()
    with jaxring.config.override(timeout_seconds=7.5, algorithm="ring"):
        native_config = native.extension.get_config()
        assert native_config["timeout_seconds"] == 7.5 and native_config["algorithm"] == "ring"
    assert jaxring.config.get() == before
    assert native.extension.get_config()["algorithm"] == before.algorithm
    for stores in ("plain", "streaming", "auto"):
        with jaxring.config.override(shm_stores=stores):
            assert native.extension.get_config()["shm_stores"] == stores
    with pytest.raises(ValueError, match="shm_stores must be 'auto', 'plain' or 'streaming'"):
        jaxring.config.update(shm_stores="fast")
    with jaxring.config.override(hand_off_after_seconds=0.25):
        assert native.extension.get_config()["hand_off_after_seconds"] == 0.25
    # Every numeric field's range, each error naming its field and value (one sentence once
    # listed every range); the bound itself is taken where it is allowed.
    ranges = {"timeout_seconds": "> 0", "pipeline_slice_bytes": "> 0",
              "mpi_direct_header_ranks": "> 0", "ring_threshold_bytes": ">= 0",
              "spin_iterations": ">= 0", "p2p_eager_bytes": ">= 0",
              "mpi_ring_threshold_bytes": ">= 0", "huge_page_bytes": ">= 0",
              "copy_input_bytes": ">= 0", "hand_off_after_seconds": ">= 0",
              "scratch_pool_bytes": ">= 0"}
    assert set(ranges) == {field for field, value in dataclasses.asdict(before).items()
                           if not isinstance(value, str)}
    for field, bound in ranges.items():
        kind = type(getattr(before, field))
        for value in ((kind(0),) if bound == "> 0" else (kind(-1),)) + (
                (float("nan"),) if kind is float else ()):
            with pytest.raises(ValueError, match=f"{field} must be {bound}, got {value}"):
                jaxring.config.update(**{field: value})
        if bound == ">= 0":
            with jaxring.config.override(**{field: kind(0)}) as config:
                assert getattr(config, field) == 0
    assert jaxring.config.get() == before
    # A value of the wrong type changes nothing, in Python or in the native library.
    for field, value in (("pipeline_slice_bytes", 1.5), ("spin_iterations", True),
                         ("timeout_seconds", "10"), ("algorithm", 1)):
        with pytest.raises(TypeError, match=f"{field} must be"):
            jaxring.config.update(**{field: value})
        assert jaxring.config.get() == before
        assert native.extension.get_config()[field] == getattr(before, field)
    # An int the native library's int64_t cannot hold, and a field that does not exist.
    with pytest.raises(ValueError, match=r"ring_threshold_bytes must be in \[-2\*\*63, 2\*\*63\)"):
        jaxring.config.update(ring_threshold_bytes=2**63)
    for value in (None, 1):
        with pytest.raises(TypeError, match="no field 'bogus'; the fields are timeout_seconds"):
            jaxring.config.update(bogus=value)
    assert jaxring.config.get() == before
    # NumPy's scalars are numbers too, and become Python's.
    with jaxring.config.override(pipeline_slice_bytes=np.int64(8192),
                                 timeout_seconds=np.float32(2.5)) as config:
        assert type(config.pipeline_slice_bytes) is int and config.pipeline_slice_bytes == 8192
        assert type(config.timeout_seconds) is float and config.timeout_seconds == 2.5
        assert native.extension.get_config()["pipeline_slice_bytes"] == 8192


def test_config_override_restores_only_the_fields_it_overrode():
    """Leaving an override set every field back to its value on entry, undoing an update made
    inside the block (or by another thread meanwhile) to a field the override never named."""
    before = jaxring.config.get()
    with jaxring.config.override(timeout_seconds=5.0):
        jaxring.config.update(p2p_eager_bytes=before.p2p_eager_bytes + 1)
        with jaxring.config.override(timeout_seconds=6.0, algorithm="ring"):
            assert jaxring.config.get().timeout_seconds == 6.0
        assert jaxring.config.get().timeout_seconds == 5.0
        assert jaxring.config.get().algorithm == before.algorithm
    try:
        after = jaxring.config.get()
        assert after.p2p_eager_bytes == before.p2p_eager_bytes + 1
        assert native.extension.get_config()["p2p_eager_bytes"] == before.p2p_eager_bytes + 1
        assert after.timeout_seconds == before.timeout_seconds
        assert dataclasses.replace(after, p2p_eager_bytes=before.p2p_eager_bytes) == before
    finally:
        jaxring.config.update(p2p_eager_bytes=before.p2p_eager_bytes)


def test_the_native_codes_name_every_supported_dtype_op_and_collective():
    """Python takes the native enums' values by name from _jaxring.codes(); a dtype's must be
    XLA's own element type, which the handlers read off their buffers."""
    from jax._src.lib import xla_client as xc

    assert set(common.DTYPE_CODES) == set(jaxring.SUPPORTED_DTYPES)
    xla_names = {"int32": "S32", "int64": "S64", "float16": "F16", "float32": "F32",
                 "float64": "F64", "bfloat16": "BF16"}
    for dtype, code in common.DTYPE_CODES.items():
        assert code == int(getattr(xc.PrimitiveType, xla_names[str(dtype)])), dtype
    assert list(common.REDUCE_OPS) == ["sum", "mean", "max", "min"]
    assert list(common.COLLECTIVE_CODES) == ["all_reduce", "reduce_scatter", "all_gather",
                                             "broadcast", "barrier", "ppermute", "send/recv"]
    assert len(set(common.COLLECTIVE_CODES.values())) == len(common.COLLECTIVE_CODES)


def test_cpu_kernels_config_chooses_the_build_and_refuses_what_this_cpu_lacks():
    supported = native.extension.cpu_kernels_supported()
    assert supported[:2] == ["auto", "baseline"]
    dtypes = [str(np.dtype(d)) for d in jaxring.SUPPORTED_DTYPES]
    with jaxring.config.override(cpu_kernels="auto"):
        # the widest build, except the baseline for streamed reductions of all but 16-bit floats
        assert native.extension.cpu_kernels_in_use() == {d: supported[-1] for d in dtypes}
        assert native.extension.cpu_kernels_in_use(streaming=True) == {
            d: supported[-1] if d in ("float16", "bfloat16") else "baseline" for d in dtypes}
    for kernels in supported[1:]:
        with jaxring.config.override(cpu_kernels=kernels):
            assert native.extension.get_config()["cpu_kernels"] == kernels
            for streaming in (False, True):
                assert native.extension.cpu_kernels_in_use(streaming=streaming) == {
                    d: kernels for d in dtypes}
    before = jaxring.config.get()
    allowed = ", ".join(repr(k) for k in supported)
    for bad in ["sse9", *(k for k in ("avx2", "avx512") if k not in supported)]:
        with pytest.raises(ValueError, match=f"cpu_kernels must be one of {allowed} on this CPU, "
                                             f"got '{bad}'"):
            jaxring.config.update(cpu_kernels=bad)
    assert jaxring.config.get() == before
    assert native.extension.get_config()["cpu_kernels"] == before.cpu_kernels


@pytest.mark.parametrize("n", [3, 8])
def test_calls_handed_off_to_jaxring_threads_give_the_same_results(n):
    """With hand_off_after_seconds=0 every call whose peers are not all there after its first
    spin and yield goes on on a jaxring thread and returns a future to XLA (cpu/handoff.h); with
    a limit no wait reaches, none does. Before its first call, device 0 waits on the host until a
    peer has handed off (or sleeps 3 ms, under the high limit), so that its peers wait for it,
    however the machine schedules them: a fixed delay was once shorter than a peer's first
    yield on a loaded machine. Every collective and point-to-point call, 20 times, must give the
    same bits either way and agree with its lax twin in every element."""
    m = mesh(n)
    ring = [(j, (j + 1) % n) for j in range(n)]

    hand_offs_before = []  # while set, device 0 waits on the host for a peer to hand off
    give_up = time.monotonic() + 60  # for the whole test, should peers never hand off

    def first_device_late(v, index):
        if index == 0 and hand_offs_before:
            while (native.extension.hand_off_count() <= hand_offs_before[0]
                   and time.monotonic() < give_up):
                time.sleep(1e-4)
        elif index == 0:
            time.sleep(0.003)
        return v

    def every_call(v):
        v = jax.pure_callback(first_device_late, jax.ShapeDtypeStruct(v.shape, v.dtype), v,
                              lax.axis_index("i"))
        out = {op: jaxring.all_reduce(v, "i", op) for op in ("sum", "max", "min")}
        if jnp.issubdtype(v.dtype, jnp.floating):
            out["mean"] = jaxring.all_reduce(v, "i", "mean")
        out["reduce_scatter"] = jaxring.reduce_scatter(v, "i")
        out["all_gather"] = jaxring.all_gather(v, "i")
        out["broadcast"] = jaxring.broadcast(v, "i", root=n - 1)
        jaxring.barrier("i")
        out["ppermute"] = jaxring.ppermute(v, "i", ring)
        jaxring.send(v * 2, "i", ring)
        out["recv"] = jaxring.recv(v, "i", ring)
        return out

    def twins(v):
        out = {"sum": lax.psum(v, "i"), "max": lax.pmax(v, "i"), "min": lax.pmin(v, "i")}
        if jnp.issubdtype(v.dtype, jnp.floating):
            out["mean"] = lax.pmean(v, "i")
        out["reduce_scatter"] = lax.psum_scatter(v, "i", tiled=True)
        out["all_gather"] = lax.all_gather(v, "i", tiled=True)
        out["broadcast"] = lax.all_gather(v, "i")[n - 1]
        out["ppermute"] = lax.ppermute(v, "i", ring)
        out["recv"] = lax.ppermute(v * 2, "i", ring)
        return out

    rng = np.random.default_rng(n)
    for dtype in (np.float32, np.int32):
        x = shard(random_array(rng, (n * n * 257,), dtype), m)
        expected = jax.tree.map(np.asarray, shmap(twins, m)(x))
        f = shmap(every_call, m)
        runs, hand_offs = {}, {}
        for limit in (0.0, 1e9):
            with jaxring.config.override(hand_off_after_seconds=limit):
                before = native.extension.hand_off_count()
                runs[limit] = []
                for _ in range(20):
                    hand_offs_before[:] = [native.extension.hand_off_count()] if limit == 0 else []
                    runs[limit].append(jax.tree.map(np.asarray, f(x)))
                hand_offs[limit] = native.extension.hand_off_count() - before
        first = runs[0.0][0]
        for out in runs[0.0] + runs[1e9]:
            for name, value in out.items():
                np.testing.assert_array_equal(value, first[name], err_msg=name)
                assert_close(value, expected[name], dtype, count=n)
        assert hand_offs[0.0] > 0 and hand_offs[1e9] == 0, hand_offs


def test_config_from_environment():
    code = "import jaxring; c = jaxring.config.get(); print(c.timeout_seconds, c.algorithm)"
    env = dict(os.environ, JAXRING_TIMEOUT_SECONDS="12.5", JAXRING_ALGORITHM="ring")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout.split()
    assert out == ["12.5", "ring"]
    for variable, value, kind in (("JAXRING_RING_THRESHOLD_BYTES", "1e9", "an int"),
                                  ("JAXRING_TIMEOUT_SECONDS", "", "a number")):
        failed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                env=dict(os.environ, **{variable: value}))
        assert failed.returncode != 0
        assert f"the environment's {variable}={value!r} is not {kind}" in failed.stderr


# ---- kernels: 16-bit conversions, exhaustively -------------------------------------------------


@pytest.mark.parametrize("name,dtype", [("half", np.float16), ("bfloat16", ml_dtypes.bfloat16)])
def test_16_bit_conversions_match_numpy_bit_for_bit(name, dtype):
    to_float = getattr(native.extension, f"{name}_to_float")
    from_float = getattr(native.extension, f"float_to_{name}")
    bits = np.arange(1 << 16, dtype=np.uint16)
    values = bits.view(dtype)
    widened = np.array([to_float(int(b)) for b in bits], dtype=np.float32)
    expected = values.astype(np.float32)
    same = (widened.view(np.uint32) == expected.view(np.uint32)) | (np.isnan(widened) &
                                                                     np.isnan(expected))
    assert same.all(), bits[~same][:10]
    # Rounding float32 -> 16 bits (to nearest even), on random and on halfway values.
    rng = np.random.default_rng(3)
    probes = np.concatenate([rng.standard_normal(20000).astype(np.float32) * 1e3,
                             rng.standard_normal(20000).astype(np.float32) * 1e-6,
                             (expected[np.isfinite(expected)][:-1] +
                              np.diff(expected[np.isfinite(expected)]) / 2).astype(np.float32)])
    # Infinities, and both sides of the overflow to infinity (float16: 65519 rounds down to
    # 65504, 65520 up to inf; bfloat16: float32's largest values round up to inf).
    big = np.float32(np.finfo(dtype).max)
    edges = np.array([np.inf, 65504, 65519, 65520, 65536, 1e5, big, np.nextafter(big, np.inf),
                      np.finfo(np.float32).max, 3.3961e38], dtype=np.float32)
    probes = np.concatenate([probes[np.isfinite(probes)], edges, -edges])
    narrowed = np.array([from_float(float(p)) for p in probes], dtype=np.uint16)
    with np.errstate(over="ignore"):  # numpy says so when it rounds to infinity, as it must
        np.testing.assert_array_equal(narrowed, probes.astype(dtype).view(np.uint16))
    nan = from_float(float("nan"))  # any NaN will do; numpy's payload may differ
    assert np.isnan(np.array([nan], np.uint16).view(dtype)[0].astype(np.float32))
