"""Shared test utilities: meshes of n devices, random inputs per dtype, and tolerances (the one
table of them)."""

from __future__ import annotations

import functools
import os
import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxring

DTYPES = [np.dtype(d) for d in jaxring.SUPPORTED_DTYPES]
DEVICE_COUNTS = [1, 2, 3, 4, 8]
# Per-device leading sizes: empty, one, prime, not divisible by any device count (each one pipeline
# slice at the default slice size; test_collectives' small-slice variant cuts them into many).
AWKWARD_SIZES = [0, 1, 7, 1001]

# Relative tolerance of one reduction against a float64 reference, by dtype. 16-bit types
# accumulate in float32 and round once, so one unit in the last place of the dtype suffices.
RTOL = {
    np.dtype(np.float16): 2**-10,
    np.dtype(jnp.bfloat16): 2**-7,
    np.dtype(np.float32): 1e-5,
    np.dtype(np.float64): 1e-12,
    np.dtype(np.int32): 0,
    np.dtype(np.int64): 0,
}


def called_at(function) -> str:
    """A regex of how jaxring's errors name the call on the first line of `function` (a one-line
    lambda): "(called at file.py:line in name)"."""
    code = function.__code__
    return re.escape(f"(called at {os.path.basename(code.co_filename)}:{code.co_firstlineno} in "
                     f"{code.co_name})")


# What errors may print after a call that a test harness makes with an op id of its own: the
# source line that a mesh program traced earlier in the process named that id after.
ANY_SITE = r"(?: \(called at [^)]*\))?"


@functools.cache
def mesh(n: int, axis: str = "i"):
    return jax.make_mesh((n,), (axis,), devices=jax.devices()[:n])


def shard(x, m, spec=P("i")):
    return jax.device_put(x, NamedSharding(m, spec))


def random_array(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-1000, 1000, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def half_ulp(values_f64, dtype) -> np.ndarray:
    """Half the spacing of `dtype`'s values at each of `values_f64` (float64): the most that
    rounding a float64 value to `dtype` can move it."""
    info = jnp.finfo(dtype)
    _, exponent = np.frexp(np.abs(values_f64))  # |v| = m * 2**exponent, 0.5 <= m < 1
    spacing = np.ldexp(1.0, exponent - 1 - int(info.nmant))
    return 0.5 * np.maximum(spacing, float(info.smallest_subnormal))


def assert_close(actual, expected_f64, dtype, count: int = 1, exact_reference: bool = True):
    """Checks every element against a reference, with a tolerance that grows with the number of
    values summed. Against an exact (float64) reference a 16-bit result, accumulated in float32
    and rounded once, is within half a unit in the last place of the dtype (plus float32's
    accumulation error, absolute as sums may cancel): a sum accumulated in 16 bits, rounded at
    every step, is not. Against a lax twin, which accumulates in 16 bits, it may differ by
    `count` roundings."""
    dtype = np.dtype(dtype)
    actual = np.asarray(actual).astype(np.float64)
    expected = np.asarray(expected_f64, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if RTOL[dtype] == 0:
        np.testing.assert_array_equal(actual, expected)
        return
    scale = np.maximum(np.abs(expected), 1.0)
    error = np.abs(actual - expected)
    if dtype.itemsize == 2 and exact_reference:
        bound = half_ulp(expected, dtype) + 2**-14 * scale
    else:
        bound = RTOL[dtype] * count * scale
    bad = np.argwhere(~(error <= bound))
    assert bad.size == 0, (
        f"{len(bad)} of {error.size} elements off, first at {bad[0].tolist()}: "
        f"{actual[tuple(bad[0])]} vs {expected[tuple(bad[0])]} (bound {bound[tuple(bad[0])]})")


def every_device(a) -> np.ndarray:
    """A replicated output (out_specs=P()) as every device's own copy, stacked on a new leading
    axis: np.asarray reads one device's copy only, and a wrong result on the others would pass."""
    shards = a.addressable_shards
    assert all(s.data.shape == a.shape for s in shards), "not replicated"
    return np.stack([np.asarray(s.data) for s in sorted(shards, key=lambda s: s.device.id)])


def shmap(f, m, in_specs=P("i"), out_specs=P("i")):
    return jax.jit(jax.shard_map(f, mesh=m, in_specs=in_specs, out_specs=out_specs))


def late_devices(m, delays: dict, collective):
    """A jitted shard_map program over mesh `m` in which each device sleeps `delays[rank]` seconds
    (0 if absent) on the host, then runs `collective`. `delays` is read on every call, so a test
    may change it between calls of the compiled program."""
    def sleep(v, rank):
        time.sleep(delays.get(int(rank), 0.0))
        return v

    def f(v):
        v = jax.pure_callback(sleep, jax.ShapeDtypeStruct(v.shape, v.dtype), v,
                              jax.lax.axis_index("i"))
        return collective(v)
    return shmap(f, m)


class HeldDevices:
    """`delays` for late_devices that holds the given ranks on the host until release() (or 30 s,
    after which they go on): a device late for as long as a test needs, however slowly the test's
    own thread runs."""

    def __init__(self, ranks):
        self.ranks, self.released = set(ranks), threading.Event()

    def get(self, rank, default=0.0):
        if rank in self.ranks:
            self.released.wait(30.0)
        return default

    def release(self):
        self.released.set()


def on_threads(target, args_per_thread, timeout: float = 60.0) -> None:
    """Runs target(*args) on a thread per `args` at once (ranks calling a native collective on the
    host) and waits for all of them; one still running after `timeout` fails the test."""
    threads = [threading.Thread(target=target, args=args, daemon=True)
               for args in args_per_thread]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
        assert not thread.is_alive(), "a native wait outlived its timeout"
