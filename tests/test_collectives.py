"""Every collective x dtype x device count x awkward size, against float64 references and the lax
twins, with both algorithms and with the direct one reading small inputs from copies and in place
(the configuration is read when the collective runs, so one compiled program serves all)."""

import functools
import mmap
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring._src import common, native
from helpers import (AWKWARD_SIZES, DEVICE_COUNTS, DTYPES, assert_close, every_device, mesh,
                     on_threads, random_array, shard, shmap)

# name -> jaxring.config overrides. The direct algorithm copies inputs up to copy_input_bytes
# into the rendezvous and lets each device leave as soon as its own output is written.
VARIANTS = {
    "direct": {"algorithm": "direct"},
    "direct, read in place": {"algorithm": "direct", "copy_input_bytes": 0},
    "ring": {"algorithm": "ring"},
    # Many pipeline slices a step (the default 256 KiB slices make these sizes one slice).
    "ring, small slices": {"algorithm": "ring", "pipeline_slice_bytes": 100},
}


def _inputs(rng, n, dtype, trailing=(3,)):
    """Per-device blocks of several awkward sizes, stacked over n devices, plus a scalar on
    every device ("scalar": one element per device, squeezed to rank 0 inside shard_map)."""
    data = {f"size{size}": random_array(rng, (n * size, *trailing), dtype)
            for size in AWKWARD_SIZES}
    data["scalar"] = random_array(rng, (n,), dtype)
    return data


def _per_device(data):
    return {k: v[0] if k == "scalar" else v for k, v in data.items()}


def _run_variants(fn, *args, replicated=False):
    """fn's outputs under each variant; `replicated` (out_specs=P()): every device's copy,
    stacked on a new leading axis."""
    results = {}
    for name, overrides in VARIANTS.items():
        with jaxring.config.override(**overrides):
            results[name] = jax.tree.map(every_device if replicated else np.asarray, fn(*args))
    return results


@pytest.mark.parametrize("n", DEVICE_COUNTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_all_reduce(n, dtype, op):
    rng = np.random.default_rng([n, zlib.crc32(f"{dtype} {op}".encode())])
    m = mesh(n)
    data = _inputs(rng, n, dtype)
    f = shmap(lambda d: jaxring.all_reduce(_per_device(d), "i", op), m, out_specs=P())
    sharded = {k: shard(v, m) for k, v in data.items()}
    for algorithm, out in _run_variants(f, sharded, replicated=True).items():
        for key, stacked in data.items():
            ref = stacked.astype(np.float64).reshape(n, -1, *stacked.shape[1:])
            if key == "scalar":
                ref = ref.reshape(n)
            expected = {"sum": ref.sum(0), "mean": ref.mean(0), "max": ref.max(0),
                        "min": ref.min(0)}[op]
            result = out[key]  # every device's
            expected = np.broadcast_to(expected, result.shape)
            if op == "mean" and np.issubdtype(dtype, np.integer):
                assert result.dtype.kind == "f", "integer mean divides like lax.pmean"
                np.testing.assert_allclose(result, expected, rtol=1e-6)
                continue
            assert result.dtype == dtype, (algorithm, key)
            assert_close(result, expected, dtype, count=n if op in ("sum", "mean") else 1)


@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("dtype", [d for d in DTYPES if not np.issubdtype(d, np.integer)], ids=str)
@pytest.mark.parametrize("op", ["max", "min"])
def test_all_reduce_max_and_min_propagate_nan(n, dtype, op):
    """A NaN on any device makes that element NaN, as jnp.max over the devices' values would;
    every other element is the exact extreme, equal to lax.pmax/pmin's. (XLA's CPU all-reduce
    drops NaN instead: there lax.pmax returns the largest of the other values.) About one element
    in ten is NaN on each device, so some are NaN on several devices and some on one."""
    rng = np.random.default_rng(n)
    count = 1037
    x = random_array(rng, (n * count,), dtype)
    x[rng.random(n * count) < 0.1] = np.nan
    m = mesh(n)
    xs = shard(x, m)
    lax_op = lax.pmax if op == "max" else lax.pmin
    theirs = np.asarray(shmap(lambda v: lax_op(v, "i")[None], m)(xs))
    fold = np.maximum if op == "max" else np.minimum  # both propagate NaN
    expected = fold.reduce(x.astype(np.float64).reshape(n, count), axis=0)
    assert np.isnan(expected).any() and not np.isnan(expected).all()
    clean = ~np.isnan(expected)
    ours = _run_variants(shmap(lambda v: jaxring.all_reduce(v, "i", op)[None], m), xs)
    for variant, out in ours.items():
        for device in range(n):
            result = out[device].astype(np.float64)
            np.testing.assert_array_equal(result, expected, err_msg=variant)  # NaN == NaN here
            np.testing.assert_array_equal(result[clean], theirs[device][clean].astype(np.float64))


@pytest.mark.parametrize("n", DEVICE_COUNTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_reduce_matches_lax_psum(n, dtype):
    rng = np.random.default_rng(n)
    m = mesh(n)
    x = shard(random_array(rng, (n * 37, 5), dtype), m)
    ours = _run_variants(shmap(lambda v: jaxring.all_reduce(v, "i"), m, out_specs=P()), x,
                         replicated=True)
    theirs = every_device(shmap(lambda v: lax.psum(v, "i"), m, out_specs=P())(x))
    for algorithm, out in ours.items():
        assert out.shape == theirs.shape and out.dtype == theirs.dtype
        assert_close(out, theirs.astype(np.float64), dtype, count=2 * n, exact_reference=False)


@pytest.mark.parametrize("n", [3, 8])
@pytest.mark.parametrize("dtype", [np.int32, np.int64], ids=str)
def test_integer_sums_that_overflow_wrap_as_psum_does(n, dtype):
    """Two's complement wrapping (the kernels add integers as unsigned: a signed overflow is
    undefined behaviour in C++), every element against lax.psum and against numpy's wrapping."""
    info = np.iinfo(dtype)
    x = np.random.default_rng(n).integers(info.max // 2, info.max, size=(n * 1008,), dtype=dtype)
    x[::7] = info.min + np.arange(len(x[::7]), dtype=dtype)  # and some that wrap downwards
    m = mesh(n)
    xs = shard(x, m)
    expected = x.reshape(n, -1).sum(0, dtype=dtype)  # numpy wraps
    theirs = np.asarray(shmap(lambda v: lax.psum(v, "i"), m, out_specs=P())(xs))
    np.testing.assert_array_equal(theirs, expected)
    for algorithm, out in _run_variants(shmap(lambda v: jaxring.all_reduce(v, "i"), m,
                                              out_specs=P()), xs, replicated=True).items():
        for device in out:
            np.testing.assert_array_equal(device, expected, err_msg=algorithm)
    got = np.asarray(shmap(lambda v: jaxring.reduce_scatter(v, "i"), m)(xs))
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=str)
def test_mean_divides_the_sum_bit_for_bit(n, dtype):
    """"mean" is the sum divided by n, as lax.pmean computes it, to the bit: a power-of-two n
    multiplies by its exact reciprocal instead (kernels/reduce_cpu_impl.inc); 3 must still divide
    (x * (1/3) differs from x / 3 in the last bit for many x)."""
    rng = np.random.default_rng(n)
    m = mesh(n)
    host = random_array(rng, (n * 4099,), dtype)
    x = shard(host, m)
    for algorithm, overrides in VARIANTS.items():
        with jaxring.config.override(**overrides):
            total = every_device(shmap(lambda v: jaxring.all_reduce(v, "i"), m,
                                       out_specs=P())(x))
            mean = every_device(shmap(lambda v: jaxring.all_reduce(v, "i", "mean"), m,
                                      out_specs=P())(x))
            pmean = every_device(shmap(lambda v: lax.pmean(v, "i"), m, out_specs=P())(x))
        np.testing.assert_array_equal(mean, total / dtype(n), err_msg=algorithm)
        # lax.pmean's sum is XLA's, in another order: equal to within its roundings, not bits.
        assert_close(mean, pmean.astype(np.float64), dtype, count=2 * n, exact_reference=False)
        ref = host.astype(np.float64).reshape(n, -1).mean(0)
        assert_close(mean, np.broadcast_to(ref, mean.shape), dtype, count=n)


@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_all_reduce_large_enough_to_stream_its_stores(n, dtype, op):
    """Outputs of 16 MiB and more in all are written with streaming stores (StreamingPays in
    kernels/reduce_cpu.cc): on 2 devices in blocks (BlockElements), on 3 and 8 a 64-byte line at a
    time (StreamLines, kernels/reduce_cpu_impl.inc); 16-bit floats are not streamed. An odd count
    leaves a tail of every share unaligned. Every element of every device's result is checked
    against float64."""
    rng = np.random.default_rng(n)
    width = np.dtype(dtype).itemsize
    count = (16 << 20) // (n * width) + 13
    x = random_array(rng, (n * count,), dtype)
    m = mesh(n)
    f = shmap(lambda v: jaxring.all_reduce(v, "i", op)[None], m)
    with jaxring.config.override(algorithm="direct"):
        out = np.asarray(f(shard(x, m)))
    ref = x.astype(np.float64).reshape(n, count)
    expected = {"sum": ref.sum(0), "mean": ref.mean(0), "max": ref.max(0), "min": ref.min(0)}[op]
    for device in range(n):
        if op == "mean" and np.issubdtype(dtype, np.integer):
            np.testing.assert_allclose(out[device], expected, rtol=1e-6)
        else:
            assert_close(out[device], expected, dtype, count=n if op in ("sum", "mean") else 1)
    assert (out == out[0]).all(), "every device holds the same bits"


CPU_KERNELS = native.extension.cpu_kernels_supported()[1:]  # without "auto"


@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_every_build_of_the_kernels_writes_the_same_bits(n, dtype, op):
    """The reduction kernels are built for SSE2, AVX2 and AVX-512 (kernels/reduce_cpu_impl.inc);
    every build this CPU runs must write the baseline's bits, and those must match float64. The
    sizes cover vector tails, several 512-element blocks and, at 3 and 8 devices, the streamed
    line-at-a-time fold (16 MiB of outputs in all, float32 to int64: StreamLines)."""
    rng = np.random.default_rng([n, zlib.crc32(f"{dtype} {op}".encode())])
    big = (16 << 20) // (n * np.dtype(dtype).itemsize) + 5 if n > 2 else 0
    data = {size: random_array(rng, (n * size,), dtype) for size in (13, 1541, big) if size}
    m = mesh(n)
    f = shmap(lambda d: jaxring.all_reduce(d, "i", op), m, out_specs=P())
    sharded = {size: shard(x, m) for size, x in data.items()}
    outs = {}
    for kernels in CPU_KERNELS:
        with jaxring.config.override(cpu_kernels=kernels, algorithm="direct"):
            outs[kernels] = jax.tree.map(every_device, f(sharded))
    for size, x in data.items():
        ref = x.astype(np.float64).reshape(n, size)
        expected = {"sum": ref.sum(0), "mean": ref.mean(0), "max": ref.max(0),
                    "min": ref.min(0)}[op]
        expected = np.broadcast_to(expected, (n, size))  # every device's copy
        baseline = outs["baseline"][size]
        if op == "mean" and np.issubdtype(dtype, np.integer):
            np.testing.assert_allclose(baseline, expected, rtol=1e-6)
        else:
            assert_close(baseline, expected, dtype, count=n if op in ("sum", "mean") else 1)
        for kernels, out in outs.items():
            np.testing.assert_array_equal(out[size].view(np.uint8), baseline.view(np.uint8),
                                          err_msg=f"{kernels} against baseline, {size} elements")


@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int64], ids=str)
def test_all_gather_large_enough_to_stream_its_stores(n, dtype):
    """All-gather outputs of 16 MiB and more per device are copied with streaming stores, each
    piece of an input read once and written into every device's output (DirectAllGather); an odd
    count leaves every block's start and tail unaligned. Every element is checked."""
    rng = np.random.default_rng(n)
    count = (16 << 20) // (n * np.dtype(dtype).itemsize) + 13
    x = random_array(rng, (n * count,), dtype)
    m = mesh(n)
    f = shmap(lambda v: jaxring.all_gather(v, "i")[None], m)
    with jaxring.config.override(algorithm="direct"):
        out = np.asarray(f(shard(x, m)))
    for device in range(n):
        np.testing.assert_array_equal(out[device], x)


@pytest.mark.parametrize("n", [3, 8])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int64], ids=str)
def test_reduce_scatter_in_many_pieces(n, dtype):
    """Output blocks of 16/n MiB, 16 MiB in all, are cut into several pieces that any device may
    take over (LocalTransport::Share) and written with streaming stores (StreamingPays; 16-bit
    floats are not); an odd block size leaves every piece boundary but the first unaligned.
    Every element of every block is checked against float64."""
    rng = np.random.default_rng(n)
    block = (16 << 20) // (n * np.dtype(dtype).itemsize) + 13
    x = random_array(rng, (n * n * block,), dtype)
    m = mesh(n)
    f = shmap(lambda v: jaxring.reduce_scatter(v, "i"), m)
    with jaxring.config.override(algorithm="direct"):
        out = np.asarray(f(shard(x, m)))
    expected = x.astype(np.float64).reshape(n, n * block).sum(0)
    assert_close(out, expected, dtype, count=n)


@functools.cache
def _eviction_buffer():
    return np.ones(32 << 20, np.float32)


def _evict_caches():
    """Reads 128 MiB, four times the last-level cache of the machines measured on, so that what
    was cached before is no longer."""
    return float(_eviction_buffer().sum())


def test_the_cache_probe_tells_cached_from_evicted_lines():
    """LooksUncached (kernels/reduce_cpu.cc) times loads from a few lines of an array: lines just
    written are cached, lines evicted since are not. The lines are evicted with clflush
    (EvictFromCaches), which drops them from every cache in the machine: reading 128 MiB instead
    left them cached in a few CI runs (2-5 of 9 probes said evicted, five batches running),
    likely where the VM had moved the reading thread to a core under another last-level cache.
    Only where there is no clflush (not x86) is the array evicted by reading. The array lives in
    a fresh mapping, so that no earlier test can have advised it onto huge pages. A VM's
    scheduler can stall one probe of cached lines (1 in 5-20 here), so each side must hold in
    most of 9 tries, in one of up to five batches a second apart; a probe that cannot tell the
    two apart fails all five. The array is 1 MiB: 4 MiB just written was not always still cached
    on this VM (in one CI run every batch found it uncached in 4-8 of 9 tries; run by hand, one
    batch of five in two; 1 MiB held in 9 of 9 but one)."""
    data = np.frombuffer(mmap.mmap(-1, 1 << 20), np.float32)
    batches = []
    for _ in range(5):
        cached = evicted = 0
        for _ in range(9):
            data += 1
            cached += not native.extension.looks_uncached(data)
            if not native.extension.evict_from_caches(data):
                _evict_caches()
            evicted += native.extension.looks_uncached(data)
        if cached >= 6 and evicted >= 6:
            return
        batches.append((cached, evicted))
        time.sleep(1)
    pytest.fail(f"no batch told cached from evicted lines, (cached, evicted) of 9 each: {batches}")


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int64], ids=str)
def test_a_programs_first_collective_streams_into_an_uncached_output(n, dtype):
    """A program's first collective writes an output that the cache does not hold with streaming
    stores (OutputLooksUncached, cpu/host.cc), from 256 KiB per device up to 8 MiB, below
    StreamingPays' 16 MiB in all; the second collective of the same program is not probed and
    stores plainly. Odd counts leave every piece boundary unaligned. Each program runs after
    the caches are emptied until the probe has said yes for one of its first collective's n
    outputs (on a quiet machine, the first time), and every element of every result is
    checked."""
    rng = np.random.default_rng(n)
    block = (1 << 20) // np.dtype(dtype).itemsize + 13
    x = random_array(rng, (n * n * block,), dtype)
    m = mesh(n)
    programs = {
        "all_reduce": shmap(lambda v: (jaxring.all_reduce(v, "i")[None],
                                       jaxring.all_reduce(v * 2, "i")[None]), m),
        "reduce_scatter": shmap(lambda v: (jaxring.reduce_scatter(v, "i"),
                                           jaxring.reduce_scatter(v * 2, "i")), m),
        "all_gather": shmap(lambda v: (jaxring.all_gather(v[:block], "i")[None],
                                       jaxring.all_gather(v[:block] * 2, "i")[None]), m),
    }
    ref = x.astype(np.float64).reshape(n, n * block)
    gathered = x.reshape(n, n * block)[:, :block].reshape(-1)
    expected = {"all_reduce": np.broadcast_to(ref.sum(0), (n, n * block)),
                "reduce_scatter": ref.sum(0),
                "all_gather": np.broadcast_to(gathered, (n, n * block))}
    sharded = shard(x, m)
    for name, f in programs.items():
        jax.block_until_ready(f(sharded))  # compiled (and done) before the caches are emptied
        for attempt in range(20):  # the probe can miss for seconds on a busy VM (see above)
            before = native.extension.uncached_output_count()
            _evict_caches()
            first, second = jax.tree.map(np.asarray, f(sharded))
            probed_uncached = native.extension.uncached_output_count() - before
            assert probed_uncached <= n, f"{name}: more than the first collective was probed"
            if probed_uncached:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"{name}: no output looked uncached in 20 tries")
        for out, factor in [(first, 1), (second, 2)]:
            if name == "all_gather":
                np.testing.assert_array_equal(out, expected[name] * factor, err_msg=name)
            else:
                assert_close(out, expected[name] * factor, dtype, count=n)


def test_evicting_from_the_caches_keeps_every_byte():
    """EvictFromCaches writes dirty lines back before it drops them: random bytes, flushed from
    unaligned starts to unaligned ends, read back the same."""
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, (1 << 20) + 77, np.uint8)
    expected = data.copy()
    for start, stop in [(0, data.size), (5, 4096 + 3), (63, 64 * 1000 + 1), (1000, 1001)]:
        data[start:stop] ^= 0x5A
        expected[start:stop] ^= 0x5A
        native.extension.evict_from_caches(data[start:stop])
        np.testing.assert_array_equal(data, expected)


def test_copy_streamed_copies_every_byte():
    """The benchmarks' streamed copy (the extension's copy_streamed, CopyStreamed) with unaligned
    starts and tails on both sides, and its size check."""

    rng = np.random.default_rng(7)
    for size in [0, 1, 15, 17, 4096 + 3, (1 << 20) + 5]:
        for src_offset, dst_offset in [(0, 0), (1, 3), (3, 0)]:
            src = rng.integers(0, 256, size + src_offset, np.uint8)[src_offset:]
            dst = np.zeros(size + dst_offset, np.uint8)[dst_offset:]
            native.extension.copy_streamed(dst, src)
            np.testing.assert_array_equal(dst, src, err_msg=f"{size} {src_offset} {dst_offset}")
    with pytest.raises(ValueError, match="differ in size"):
        native.extension.copy_streamed(np.zeros(4, np.float32), np.zeros(5, np.float32))


@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
def test_the_benchmarks_native_floor_computes_what_it_claims(streamed):
    """benchmarks/allreduce.py's native floor must do the local work it claims: reduce_scatter's
    sums each device's n blocks, all_gather's writes n copies of each device's input, in 256 KiB
    pieces (the last one short: 4 x 70001 floats per device)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from common import native_floor

    n, block = 4, 70001
    m = mesh(n)
    x = np.random.default_rng(3).standard_normal(n * n * block).astype(np.float32)
    per_device = x.reshape(n, n, block)
    for collective, expected in [
            ("reduce_scatter", per_device.astype(np.float64).sum(1).reshape(-1)),
            ("all_gather", np.tile(per_device.reshape(n, 1, n * block), (1, n, 1)).reshape(-1))]:
        f = shmap(lambda v, c=collective: native_floor(v, c, n, streamed), m)
        out = np.asarray(f(shard(x, m)))
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5, err_msg=collective)


def test_the_benchmarks_read_floor_reads_every_input_byte():
    """The read floor (native_floor's reads_only) must read each device's whole input: its first
    two output elements hold the bits of the sum (mod 2^64) of the input's bytes as 64-bit words,
    a last half word byte by byte. Per-device sizes cover whole 64-byte blocks, whole words after
    them, and a half word."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from common import native_floor

    n = 3
    m = mesh(n)
    f = shmap(lambda v: native_floor(v, "reduce_scatter", n, reads_only=True), m)
    for block in (16, 7, 1001):  # 192 bytes a device; 84: 64 + 2 words + a half; 12012
        x = np.random.default_rng(block).standard_normal(n * n * block).astype(np.float32)
        out = np.asarray(f(shard(x, m))).reshape(n, block)
        for device, data in enumerate(x.reshape(n, n * block)):
            raw = data.tobytes()
            whole = len(raw) // 8 * 8
            total = (int(np.frombuffer(raw[:whole], np.uint64).sum(dtype=np.uint64))
                     + sum(raw[whole:])) % 2**64
            assert out[device, :2].view(np.uint64)[0] == total, (block, device)


def _mappings():
    """The process's mappings, from /proc/self/smaps: (low, high, AnonHugePages in KiB, whether
    advised onto huge pages (VmFlags `hg`)). madvise splits a mapping where the advice begins and
    ends, so a mapping is advised whole or not at all."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    found = []
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(v, 16) for v in head.split("-"))
            found.append([low, high, 0, False])
        elif head == "AnonHugePages:":
            found[-1][2] = int(line.split()[1])
        elif head == "VmFlags:":
            found[-1][3] = "hg" in line.split()[1:]
    return found


def _overlapping(mappings, start, end):
    """The mappings that overlap [start, end)."""
    return [m for m in mappings if m[0] < end and start < m[1]]


def _advised_bytes(mappings, start, end):
    """How many bytes of [start, end) lie in advised mappings (mappings never overlap)."""
    return sum(max(0, min(end, high) - max(start, low))
               for low, high, _, advised in mappings if advised)


def _transparent_huge_pages():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


@pytest.mark.skipif(_transparent_huge_pages() != "madvise",
                    reason="needs transparent huge pages in madvise mode")
@pytest.mark.parametrize("collective", ["all_reduce", "all_gather"])
def test_large_outputs_are_written_to_huge_pages(collective):
    """Outputs of huge_page_bytes and more are advised onto transparent huge pages before their
    first write (cpu/handlers.cc), and with the knob at 0 they are not: the mapping that holds
    each device's output is advised (and then holds huge pages, where the kernel found free ones
    in one of three tries) in the one case, and neither in the other. The data is exact either
    way."""
    n = 2
    count = (40 << 20) // 4
    rng = np.random.default_rng(3)
    m = mesh(n)
    if collective == "all_reduce":
        x = rng.standard_normal(n * count).astype(np.float32)
        f = shmap(lambda v: jaxring.all_reduce(v, "i")[None], m)
        expected = x.reshape(n, count).sum(0)
    else:
        x = rng.standard_normal(n * count // n).astype(np.float32)
        f = shmap(lambda v: jaxring.all_gather(v, "i")[None], m)
        expected = x
    huge = 2 << 20
    for threshold in (0, 8 << 20):
        for _ in range(3):  # huge pages need 2 MiB of free contiguous memory, not always there
            xs = shard(x, m)
            before = _mappings()
            with jaxring.config.override(huge_page_bytes=threshold):
                out = f(xs)
                out.block_until_ready()
            after = _mappings()
            got_huge = True
            for piece in out.addressable_shards:
                np.testing.assert_array_equal(np.asarray(piece.data)[0], expected)
                start = piece.data.unsafe_buffer_pointer()
                end = start + piece.data.nbytes
                inner = ((start + huge - 1) // huge * huge, end // huge * huge)
                if threshold:
                    assert _advised_bytes(after, *inner) == inner[1] - inner[0], inner
                else:
                    # glibc may hand out memory that an earlier output advised (a large free
                    # chunk at the top of its heap), so with the knob at 0 no advice may be new,
                    # and no page outside advised mappings may be huge.
                    mine = _overlapping(after, start, end)
                    new = [(max(low, start), min(high, end)) for low, high, _, adv in mine if adv]
                    assert all(_advised_bytes(before, a, b) == b - a for a, b in new), new
                    assert all(kib == 0 for _, _, kib, adv in mine if not adv)
                got_huge &= any(kib > 0 for _, _, kib, _ in _overlapping(after, start, end))
            if got_huge or threshold == 0:
                break
        if threshold:
            assert got_huge


@pytest.mark.parametrize("n", DEVICE_COUNTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_reduce_scatter(n, dtype, dim, op):
    rng = np.random.default_rng(7 * n + dim)
    m = mesh(n)
    shape = [n * 3, 4 * n + 0, 2]
    shape[dim] = n * n * 3  # per-device block divisible by n along dim
    x = random_array(rng, (n * shape[0], *shape[1:]), dtype)
    xs = shard(x, m)
    ours = _run_variants(shmap(lambda v: jaxring.reduce_scatter(v, "i", op, dim), m), xs)
    theirs = np.asarray(shmap(lambda v: lax.psum_scatter(v, "i", scatter_dimension=dim,
                                                         tiled=True), m)(xs))
    per_device = x.astype(np.float64).reshape(n, *shape)
    expected = getattr(per_device, op)(0)  # the full reduction
    expected = np.concatenate(np.split(expected, n, axis=dim), axis=0)  # device blocks, stacked
    for algorithm, out in ours.items():
        assert out.shape == theirs.shape
        if op == "mean" and np.issubdtype(dtype, np.integer):
            assert out.dtype.kind == "f", "integer mean divides like lax.pmean"
            np.testing.assert_allclose(out, expected, rtol=1e-6)
            continue
        assert out.dtype == theirs.dtype
        assert_close(out, expected, dtype, count=n if op in ("sum", "mean") else 1)


@pytest.mark.parametrize("n", DEVICE_COUNTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_all_gather(n, dtype, axis):
    rng = np.random.default_rng(11 * n)
    m = mesh(n)
    for size in AWKWARD_SIZES:
        x = random_array(rng, (n * size, 3, 2), dtype)
        gathered = np.concatenate(np.split(x, n, axis=0), axis=axis)  # what each device gets
        expected = np.concatenate([gathered] * n, axis=0)
        ours = _run_variants(shmap(lambda v: jaxring.all_gather(v, "i", axis=axis), m), shard(x, m))
        for algorithm, out in ours.items():
            np.testing.assert_array_equal(out, expected, err_msg=f"{algorithm} size {size}")
        if size:  # lax cannot gather empty blocks
            theirs = shmap(lambda v: lax.all_gather(v, "i", axis=axis, tiled=True), m)(shard(x, m))
            np.testing.assert_array_equal(ours["ring"], np.asarray(theirs))


@pytest.mark.parametrize("n", [1, 3, 4])
def test_untiled_all_gather_and_reduce_scatter_match_lax(n):
    """tiled=False, lax's default: all_gather stacks the inputs along a new dimension `axis`,
    reduce_scatter takes a dimension of one entry per device and removes it. Values and
    gradients against lax's, on random inputs."""
    rng = np.random.default_rng(40 + n)
    m = mesh(n)
    x = shard(random_array(rng, (n * 3, 5), np.float64), m)
    for axis in (0, 1, 2, -1, -3):
        untiled = np.False_ if axis == 2 else False  # NumPy's bool too, as lax takes it
        ours = shmap(lambda v: jaxring.all_gather(v, "i", axis=axis, tiled=untiled), m)(x)
        theirs = shmap(lambda v: lax.all_gather(v, "i", axis=axis, tiled=False), m)(x)
        assert ours.shape == theirs.shape, axis
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs), err_msg=f"{axis}")
    scalars = shmap(lambda v: jaxring.all_gather(v[0, 0], "i", tiled=False)[None], m)(x)
    np.testing.assert_array_equal(
        np.asarray(scalars), np.asarray(shmap(lambda v: lax.all_gather(v[0, 0], "i")[None], m)(x)))
    y = shard(random_array(rng, (n * 2, n, 3), np.float64), m)
    for dim, op in ((1, "sum"), (1, "max"), (0, "sum")):
        # lax.psum_scatter: a sum over a dimension of n entries; dim 0 takes a block of n rows
        v_of = (lambda v: v) if dim == 1 else (lambda v: v.reshape(n, 2 * 3))
        ours = shmap(lambda v: jaxring.reduce_scatter(v_of(v), "i", op, dim, tiled=False), m)(y)
        reduce = {"sum": lambda v: lax.psum_scatter(v, "i", scatter_dimension=dim, tiled=False),
                  "max": lambda v: jnp.max(lax.all_gather(v, "i"), 0).take(
                      lax.axis_index("i"), axis=dim)}[op]
        theirs = shmap(lambda v: reduce(v_of(v)), m)(y)
        assert ours.shape == theirs.shape, (dim, op)
        assert_close(np.asarray(ours), np.asarray(theirs), np.float64, count=n)
    # Negative dimensions count from the end, down to -ndim, tiled or not (lax.psum_scatter
    # takes none: its lowering refuses them).
    w = shard(random_array(rng, (n * n, 2, 3), np.float64), m)
    for v, dim, tiled in ((w, -3, True), (y, -2, True), (y, -2, False)):
        ours = shmap(lambda a: jaxring.reduce_scatter(a, "i", "sum", dim, tiled), m)(v)
        theirs = shmap(lambda a: lax.psum_scatter(a, "i", scatter_dimension=dim % 3,
                                                  tiled=tiled), m)(v)
        assert ours.shape == theirs.shape, (dim, tiled)
        assert_close(np.asarray(ours), np.asarray(theirs), np.float64, count=n)
    grad = lambda f: jax.jit(jax.grad(lambda v: jnp.sum(jax.shard_map(  # noqa: E731
        f, mesh=m, in_specs=P("i"), out_specs=P("i"))(v) ** 2)))(y)
    assert_close(np.asarray(grad(lambda v: jaxring.reduce_scatter(v, "i", "sum", 1, tiled=False))),
                 np.asarray(grad(lambda v: lax.psum_scatter(v, "i", scatter_dimension=1,
                                                            tiled=False))), np.float64, count=n)
    assert_close(np.asarray(grad(lambda v: jaxring.all_gather(v, "i", axis=1, tiled=False))),
                 np.asarray(grad(lambda v: lax.all_gather(v, "i", axis=1, tiled=False))),
                 np.float64, count=n)
    with pytest.raises(ValueError, match=rf"untiled, dimension 0 of shape \(2, {n}, 3\) must "
                                         rf"equal the {n} devices"):
        shmap(lambda v: jaxring.reduce_scatter(v, "i", tiled=False), m)(y)
    with pytest.raises(TypeError, match=r"tiled must be True or False, got 1"):
        shmap(lambda v: jaxring.all_gather(v, "i", tiled=1), m)(y)


@pytest.mark.parametrize("n", DEVICE_COUNTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_broadcast(n, dtype):
    """Every awkward size and a scalar, from the first, a middle and the last device; every
    device's output must be the root's block, bit for bit."""
    rng = np.random.default_rng([13 * n, zlib.crc32(str(dtype).encode())])
    m = mesh(n)
    data = _inputs(rng, n, dtype)
    for root in sorted({0, n // 2, n - 1}):
        index = np.int64(root) if root == n - 1 else root  # numpy integers are roots too
        out = shmap(lambda d: jax.tree.map(lambda v: jaxring.broadcast(v, "i", root=index)[None],
                                           _per_device(d)), m)(shard(data, m))
        for name, x in data.items():
            blocks = x.reshape(n, -1, *x.shape[1:])
            expected = np.broadcast_to(blocks[root], blocks.shape)
            if name == "scalar":
                expected = expected[:, 0]
            np.testing.assert_array_equal(np.asarray(out[name]), expected, err_msg=name)


@pytest.mark.parametrize("n", [3, 8])
def test_broadcast_in_many_pieces(n):
    """A 1 MiB broadcast is cut into pieces that any device may write into any output
    (LocalTransport::Share); an odd size leaves every piece boundary but the first unaligned."""
    rng = np.random.default_rng(n)
    count = (1 << 20) // 4 + 13
    x = random_array(rng, (n * count,), np.float32)
    m = mesh(n)
    for root in (0, n - 1):
        out = np.asarray(shmap(lambda v: jaxring.broadcast(v, "i", root=root), m)(shard(x, m)))
        np.testing.assert_array_equal(out, np.tile(x[root * count:(root + 1) * count], n))


def test_scalar_all_gather_and_size_zero():
    n = 4
    m = mesh(n)
    x = shard(np.arange(n, dtype=np.float32), m)
    out = shmap(lambda v: jaxring.all_gather(v[0], "i"), m)(x)
    np.testing.assert_array_equal(np.asarray(out), np.tile(np.arange(n, dtype=np.float32), n))
    empty = shard(np.zeros((0, 3), np.float32), m)
    assert shmap(lambda v: jaxring.all_reduce(v, "i"), m, out_specs=P())(empty).shape == (0, 3)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_barrier_orders_and_returns(n):
    m = mesh(n)
    x = shard(np.arange(n * 2, dtype=np.float32), m)

    def body(v):
        jaxring.barrier("i")
        y = jaxring.all_reduce(v, "i")
        jaxring.barrier("i")
        return y

    out = shmap(body, m, out_specs=P())(x)
    np.testing.assert_array_equal(np.asarray(out), np.arange(n * 2).reshape(n, 2).sum(0))


@pytest.mark.parametrize("n", [2, 3, 8])
def test_barrier_waits_for_the_last_device(n):
    """The barrier's native call on host threads (a program would hide when each device
    returns): the last device arrives 0.3 s late, and no device may leave before it came."""
    key = int(np.random.default_rng().integers(1 << 40, 1 << 50))  # a fresh communicator
    code = (common.COLLECTIVE_CODES["barrier"], 0, common.DTYPE_CODES[np.dtype(np.float32)])
    arrived, left, errors = {}, {}, {}

    def run(rank):
        if rank == n - 1:
            time.sleep(0.3)
        arrived[rank] = time.perf_counter()
        errors[rank] = native.extension.collective_on_host(
            key, "barrier test", rank, n, *code, np.zeros(0, np.float32),
            np.zeros(0, np.float32), run_id=1, op_id=0)
        left[rank] = time.perf_counter()

    on_threads(run, [(rank,) for rank in range(n)])
    assert errors == {rank: "" for rank in range(n)}
    assert min(left.values()) >= arrived[n - 1], (arrived, left)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_copied_and_in_place_inputs_give_the_same_bits(n):
    """Inputs up to copy_input_bytes are copied into the rendezvous and every device reduces the
    whole message itself; above it, or with copy_input_bytes=0, each device reduces its share of
    the peers' buffers in place and writes it into every output. Both fold the devices in the same
    order, so every device's result has the same bits either way. Each size is forced both ways:
    the default threshold's size, and n elements more per device."""

    limit = jaxring.config.get().copy_input_bytes // 4
    always, never = {"copy_input_bytes": 1 << 40}, {"copy_input_bytes": 0}
    for overrides in (always, never):
        with jaxring.config.override(**overrides):
            assert native.extension.get_config()["copy_input_bytes"] == overrides["copy_input_bytes"]
    rng = np.random.default_rng(n)
    m = mesh(n)
    bodies = {
        "all_reduce sum": lambda v: jaxring.all_reduce(v, "i"),
        "all_reduce mean": lambda v: jaxring.all_reduce(v, "i", "mean"),
        "all_reduce max": lambda v: jaxring.all_reduce(v, "i", "max"),
        "reduce_scatter": lambda v: jaxring.reduce_scatter(v, "i"),
        "all_gather": lambda v: jaxring.all_gather(v, "i"),
        "broadcast": lambda v: jaxring.broadcast(v, "i", root=n - 1),
    }
    for count in (limit // n * n, limit // n * n + n):  # at the threshold and just past it
        x = random_array(rng, (n * count,), np.float32)
        blocks = x.astype(np.float64).reshape(n, count)
        expected = {"all_reduce sum": np.tile(blocks.sum(0), n),
                    "all_reduce mean": np.tile(blocks.mean(0), n),
                    "all_reduce max": np.tile(blocks.max(0), n),
                    "reduce_scatter": blocks.sum(0),
                    "all_gather": np.tile(blocks.reshape(-1), n),
                    "broadcast": np.tile(blocks[n - 1], n)}
        for name, body in bodies.items():
            f = shmap(body, m)
            with jaxring.config.override(algorithm="direct", **always):
                copied = np.asarray(f(shard(x, m)))
            with jaxring.config.override(algorithm="direct", **never):
                in_place = np.asarray(f(shard(x, m)))
            np.testing.assert_array_equal(copied, in_place, err_msg=f"{name}, {count} per device")
            assert_close(copied, expected[name], np.float32,
                         count=n if name.startswith("all_reduce") or name == "reduce_scatter"
                         else 1)
