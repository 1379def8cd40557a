"""In-process collectives on CPU devices: jaxring against its lax twins, measured in one run.

    python benchmarks/allreduce.py            # 2, 4, 8 devices, 4 B .. 256 MiB per device
    python benchmarks/allreduce.py --quick    # a short run (the README's demo)
    python benchmarks/allreduce.py --min-bytes 256MiB --name runs/allreduce-cpu-<k>  # one size

For each device count and size it times (median of many repetitions, the cases taking turns call
by call so that all see the same machine, glibc malloc keeping freed memory as in
common.keep_freed_memory; inputs placed with device_put + NamedSharding): jaxring.all_reduce
(auto, which on CPU devices is the direct algorithm at every size, and the ring forced) against
lax.psum, jaxring.reduce_scatter against lax.psum_scatter, jaxring.all_gather against
lax.all_gather, each as a lone jitted call, beside each collective's effect floor (what any lone
call carrying jaxring's ordered effect costs at least), for all_reduce and reduce_scatter a local
floor (jaxring's own call with no communication), for reduce_scatter and all_gather a native
floor (the collective's local part in a native call with the effect), for reduce_scatter a read
floor (every input byte read, nothing written) and, from 16 MiB, a copy floor (what the memory
takes to move the bytes); and each collective against its twin inside one compiled loop that
donates its input, which leaves out the program launch (jaxring's all-reduce in place and with a
fresh output; reduce_scatter's read floor in the same loop; from 16 MiB the native floors, and
the read and native floors synchronised by a barrier each pass). It reports time, algbw and busbw
(nccl-tests definitions) against the copy bandwidth of this machine measured in the same run,
and writes
benchmarks/results/allreduce-cpu.{json,md,png}.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jaxring  # noqa: E402
from jaxring._src.common import make_varying  # noqa: E402
from common import (bus_factor, copy_ways, effect_floor_ratio, environment,  # noqa: E402
                    human_bytes, issue2_target, keep_freed_memory, medians_in_turns, parse_bytes,
                    memory_bandwidth_gbps, native_floor, output_bytes, steal_sentence,
                    with_jaxring_effect, write_results)

# (name, collective, jaxring algorithm or None for the lax twin, body)
CASES = [
    ("jaxring.all_reduce", "all_reduce", "auto", lambda v: jaxring.all_reduce(v, "i")),
    ("jaxring.all_reduce[ring]", "all_reduce", "ring", lambda v: jaxring.all_reduce(v, "i")),
    ("lax.psum", "all_reduce", None, lambda v: lax.psum(v, "i")),
    ("jaxring.reduce_scatter", "reduce_scatter", "auto", lambda v: jaxring.reduce_scatter(v, "i")),
    ("lax.psum_scatter", "reduce_scatter", None, lambda v: lax.psum_scatter(v, "i", tiled=True)),
    ("jaxring.all_gather", "all_gather", "auto", lambda v: jaxring.all_gather(v, "i")),
    ("lax.all_gather", "all_gather", None, lambda v: lax.all_gather(v, "i", tiled=True)),
]
TWIN = {"all_reduce": "lax.psum", "reduce_scatter": "lax.psum_scatter",
        "all_gather": "lax.all_gather"}
# The effect floor of each collective on n devices: a program that takes the collective's input,
# writes an output of its shape in one XLA pass (reduce_scatter's sums its n blocks, reading every
# input byte once; all_gather's concatenates n copies of the input, which XLA's CPU backend does
# with a memcpy per operand: `jnp.tile(v, n) + 1`, which earlier runs timed, took 1.15-1.25x
# jaxring's whole all_gather at 1-4 MiB on 4 and 8 devices, and the concatenation 0.86-0.93x in
# a probe), and carries jaxring's ordered effect without communicating
# (common.with_jaxring_effect). Every lone call of a collective that carries the effect, as issue 2
# asks of jaxring's, costs at least this; where it exceeds the twin's time, no such collective
# matches the twin in a lone call, however it moves the data. Not from huge_page_bytes (8 MiB) on:
# there jaxring advises its outputs onto huge pages, and the floor's XLA output, faulted in 4 KiB
# at a time, can cost more than jaxring's whole collective.
FLOOR = "effect floor"
# The local floor of all_reduce and reduce_scatter on n devices: jaxring's own all_gather on an
# axis of one device, each of the n devices copying an input of the collective's output size into
# its output. So the program carries the ordered effect and makes the same FFI call, onto an
# output that jaxring allocates and advises as it does the collective's, and writes it with
# jaxring's own copy, communicating nothing; it reads no more than it writes, and no more memory
# than the collective reads. It bounds where XLA's pass in the effect floor is a slower way to
# touch the bytes than jaxring's, and it shows what of a lone call is not communication. Not for
# all_gather: a one-device copy of its output's size reads n inputs of that size, n x the memory
# that the collective reads, which made it slower than jaxring's whole all_gather from 1 MiB on
# 4 and 8 devices (the eighth and ninth runs, which also timed it).
LOCAL = "local floor"
LOCAL_INPUT = {  # the local floor's float32 elements per device, from _elements' per device
    "all_reduce": lambda per_device, n: per_device,
    "reduce_scatter": lambda per_device, n: per_device // n,
}
# The native floor of reduce_scatter and all_gather on n devices: the local part of each with its
# communication taken out, in a native call that carries the ordered effect and writes an output
# allocated and advised as jaxring's with jaxring's kernels and copies (common.native_floor,
# xla_ffi/cpu/native_floor.cc): reduce_scatter's sums the input's n blocks, reading every input
# byte once as every reduce-scatter must; all_gather's writes n copies of the input, reading each
# piece of it once (GATHER_FLOOR_PIECE_BYTES): on n devices, each input read once and n blocks
# written to each output, as every all-gather must. With plain and with non-temporal stores; the
# floor is the faster.
NATIVE = "native floor"
NATIVE_OF = ("reduce_scatter", "all_gather")
# (collective, non-temporal stores) -> the case timing that way; lone and in the loop.
NATIVE_WAYS = {(collective, streamed): f"{NATIVE}[{collective}, {way}]"
               for collective in NATIVE_OF
               for way, streamed in (("plain", False), ("streamed", True))}


def native_rows(n: int, nbytes: int, seconds: dict, prefix: str = "",
                collectives=NATIVE_OF) -> list[dict]:
    """The `{prefix}native floor[collective]` rows of `collectives`: the faster of NATIVE_WAYS'
    times in `seconds` (case -> seconds per call, each way's case named with the same prefix),
    each way's kept beside it."""
    rows = []
    for collective in NATIVE_OF:
        if collective not in collectives:
            continue
        ways = {prefix + name: seconds[prefix + name]
                for (c, _), name in NATIVE_WAYS.items() if c == collective}
        rows.append({"devices": n, "bytes": _elements(collective, n, nbytes)[1],
                     "case": f"{prefix}{NATIVE}[{collective}]", "collective": collective,
                     "seconds": min(ways.values()), "ways_seconds": ways})
    return rows
# The read floor of reduce_scatter on n devices, lone and in the loop: a native call with the
# effect that reads every byte of this device's input once and writes only its output's first two
# elements (common.native_floor's reads_only), on every device at once. Every reduce-scatter reads
# all n inputs whole (each input element is a term of one output element) and writes its outputs
# besides, so none takes less; from 16 MiB, where the n inputs no longer fit the last-level cache,
# it is the memory's read bandwidth. In the loop it replaces the collective in the same loop as
# the two sides' (its output goes back into this device's block of the carry).
READ = "read floor"
READ_OF = ("reduce_scatter",)
# How many runs of lines the read floor reads side by side (kReadStreams, cpu/native_floor.cc),
# recorded in the results: the first runs that timed the read floor read one, which overstated
# what reading the bytes takes, and targets.py does not count their read floor.
READ_STREAMS = 4
# all_gather's native floor reads each piece of this many bytes of its input once and writes it
# n times (kDirectPieceBytes, ring/algorithms.h), recorded in the results: the runs before the 51st
# copied the whole input n times, reading it n times, which the read-once all-gather (run 49 on)
# beat at 16 MiB; targets.py does not count their all_gather native floors.
GATHER_FLOOR_PIECE_BYTES = 256 << 10
FLOOR_BODIES = {
    "all_reduce": lambda v, n: v + 1,
    # The sum of its n blocks: every input byte read once, as every reduce-scatter must.
    "reduce_scatter": lambda v, n: sum(jnp.split(v, n)),
    "all_gather": lambda v, n: jnp.concatenate([v] * n),
}


# The copy floor, from COPY_FLOOR_BYTES per device: every core copying n x the size between
# preallocated numpy buffers, the faster of common.copy_ways() (memcpy, and a copy with
# non-temporal stores, which memcpy here uses only above 288 MiB). An all-reduce of S bytes
# per device reads n*S bytes and writes n*S; a copy of n*S bytes moves exactly that, with no
# program, no fresh buffer and no waiting, so no all-reduce that writes a separate output can take
# less. (Not all-gather's: a device may read its S-byte input once and write it into every
# output, as jaxring's does from 16 MiB, reading S where a copy of n*S reads n*S.) It bounds the sizes where the effect
# floor does not, and measures what memory bandwidth the twin's time leaves. Not below 16 MiB:
# there n*S in and n*S out fit the last-level cache (32 MiB), where a collective can beat a copy
# through memory.
COPY = "copy floor"
COPY_FLOOR_BYTES = 16 << 20
COPY_FLOOR_OF = ("all_reduce",)
COPY_WAYS = copy_ways()
_CORES = len(os.sched_getaffinity(0))
_POOL = concurrent.futures.ThreadPoolExecutor(_CORES)


def copy_floor(src: np.ndarray, dst: np.ndarray, copy):
    """fn() copying `src` into `dst` with `copy(dst, src)` on every core, each a contiguous
    part."""
    bounds = np.linspace(0, src.size, _CORES + 1).astype(int)
    parts = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]

    def run():
        for done in [_POOL.submit(copy, dst[part], src[part]) for part in parts]:
            done.result()
    return run


def _elements(collective: str, n: int, nbytes: int) -> tuple[int, int]:
    """float32 elements per device of the input for `nbytes`, and the size a row reports:
    reduce_scatter's input must divide by n; all_gather's size is its output."""
    count = max(1, nbytes // 4)
    if collective == "reduce_scatter":
        per_device = max(n, count // n * n)
        return per_device, per_device * 4
    if collective == "all_gather":
        per_device = max(1, count // n)
        return per_device, per_device * 4 * n
    return count, count * 4


def _min_rounds(nbytes: int) -> int:
    """Rounds every case is timed at least. From 16 MiB the time budget runs out within the
    minimum, which then decides; with 10 rounds, three runs of the same 64 MiB reduce_scatter loop
    on 2 devices in one process gave 0.56x, 0.65x and 0.84x the twin's time, so the rows judged
    against issue 2's 0.8x get 20."""
    return 20 if issue2_target(nbytes) < 1 else 10


# From this size per device the lone cases share their inputs, one array per shape: they must all
# be held while the cases take turns, and one per case, 17 of 8 x 256 MiB on 8 devices, would
# not fit this machine's 24 GiB. Every case only reads its input, and at these sizes none stays
# in the 32 MiB last-level cache from one turn to the next, so sharing changes nothing a case
# pays. Below it every case keeps its own input, as the stored runs were measured.
SHARED_INPUT_BYTES = 128 << 20


def new_sizes(n: int, sizes: list[int]) -> list[tuple[int, frozenset]]:
    """(size, the collectives to time at it) for each of `sizes` on n devices: those whose
    measured size (_elements) no smaller one already gives. reduce_scatter's input rounds up to n
    elements and all_gather's output to n, so on 4 and 8 devices 4 B and 16 B are one size."""
    seen, plan = set(), []
    for size in sizes:
        measured = {(c, _elements(c, n, size)[1]) for c in TWIN}
        plan.append((size, frozenset(c for c, _ in measured - seen)))
        seen |= measured
    return plan


def measure(n: int, nbytes: int, collectives=frozenset(TWIN)) -> list[dict]:
    """Every case of `collectives` at `nbytes` per device, the cases taking turns call by
    call."""
    mesh = jax.make_mesh((n,), ("i",), devices=jax.devices()[:n])
    runs, sizes, shared = {}, {}, {}
    cases = [case for case in CASES if case[1] in collectives]
    floors = [(f"{FLOOR}[{collective}]", collective, None,
               lambda v, floor=floor: with_jaxring_effect(floor(v, n)))
              for collective, floor in FLOOR_BODIES.items() if collective in collectives]

    def program(body, per_device, on=mesh, spec=P("i")):
        def make():
            return jax.device_put(
                np.random.default_rng(0).standard_normal(n * per_device, np.float32),
                NamedSharding(on, spec))
        if nbytes < SHARED_INPUT_BYTES:
            x = make()
        else:
            key = (per_device, on, spec)
            if key not in shared:
                shared[key] = make()
            x = shared[key]
        f = jax.jit(jax.shard_map(body, mesh=on, in_specs=spec, out_specs=spec))
        return lambda: f(x).block_until_ready()

    for name, collective, algorithm, body in cases + floors:
        per_device, sizes[name] = _elements(collective, n, nbytes)
        runs[name] = program(body, per_device)
    alone = jax.make_mesh((n, 1), ("i", "j"), devices=jax.devices()[:n])
    locals_ = [(f"{LOCAL}[{collective}]", collective) for collective in LOCAL_INPUT
               if collective in collectives]
    for name, collective in locals_:
        per_device, sizes[name] = _elements(collective, n, nbytes)
        runs[name] = program(lambda v: jaxring.all_gather(v, "j"),
                             LOCAL_INPUT[collective](per_device, n), alone, P(("i", "j")))
    natives = {key: name for key, name in NATIVE_WAYS.items() if key[0] in collectives}
    for (collective, streamed), name in natives.items():
        per_device, _ = _elements(collective, n, nbytes)
        runs[name] = program(lambda v, c=collective, s=streamed: native_floor(v, c, n, s),
                             per_device)
    reads = [(f"{READ}[{collective}]", collective) for collective in READ_OF
             if collective in collectives]
    for name, collective in reads:
        per_device, sizes[name] = _elements(collective, n, nbytes)
        runs[name] = program(lambda v, c=collective: native_floor(v, c, n, reads_only=True),
                             per_device)
    copy_of = [collective for collective in COPY_FLOOR_OF if collective in collectives]
    copies = ({f"{COPY}[{way}]": copy for way, copy in COPY_WAYS.items()}
              if nbytes >= COPY_FLOOR_BYTES and copy_of else {})
    if copies:  # one pair of buffers for every way (2 x 2 GiB at 256 MiB on 8 devices)
        src = np.ones(n * nbytes // 4, np.float32)
        dst = np.empty_like(src)
    for name, copy in copies.items():
        runs[name] = copy_floor(src, dst, copy)
    algorithms = {name: algorithm or "auto" for name, _, algorithm, _ in cases + floors}
    algorithms.update(dict.fromkeys([*copies, *natives.values(),
                                     *(name for name, _ in locals_ + reads)], "auto"))
    medians = medians_in_turns(runs, budget_seconds=0.6, min_rounds=_min_rounds(nbytes),
                               context=lambda name: jaxring.config.override(
                                   algorithm=algorithms[name]))
    rows = []
    for name, collective in [(c[0], c[1]) for c in cases + floors] + locals_ + reads:
        algbw = sizes[name] / medians[name] / 1e9
        rows.append({"devices": n, "bytes": sizes[name], "case": name, "collective": collective,
                     "seconds": medians[name], "algbw_GBps": algbw,
                     "busbw_GBps": algbw * bus_factor(collective, n)})
    rows += native_rows(n, nbytes, medians, collectives=collectives)
    if copies:
        rows += [{"devices": n, "bytes": nbytes, "case": f"{COPY}[{collective}]",
                  "collective": collective, "seconds": min(medians[c] for c in copies),
                  "copies_seconds": {c: medians[c] for c in copies}}
                 for collective in copy_of]
    return rows


def _own_block(gathered, n):
    """This device's block of an all-gather's result."""
    block = gathered.shape[0] // n
    return lax.dynamic_slice_in_dim(gathered, lax.axis_index("i") * block, block)


def _into_own_block(full, scattered):
    """`full` with this device's block replaced by a reduce-scatter's result `scattered` (XLA
    updates the loop carry in place, writing one block)."""
    block = scattered.shape[0]
    return lax.dynamic_update_slice_in_dim(full, scattered, lax.axis_index("i") * block, 0)


# name -> (collective, one pass of the loop: the carry in, the next carry out). Each result feeds
# the next call. jaxring reduces the all-reduce's carry in place (its default); [fresh] writes a
# fresh output instead. reduce_scatter's result goes back into this device's block of its input
# and all_gather's is cut down to this device's block, the same for both sides: each writes only
# a block. (Tiling reduce_scatter's result back to the input's size, as an earlier version did,
# cost more than the twin's whole pass from 16 MiB: the rows measured jnp.tile.)
LOOP_CASES = {
    "jaxring.all_reduce": ("all_reduce", lambda v, n: jaxring.all_reduce(v, "i")),
    "jaxring.all_reduce[fresh]": ("all_reduce",
                                  lambda v, n: jaxring.all_reduce(v, "i", in_place=False)),
    "lax.psum": ("all_reduce", lambda v, n: lax.psum(v, "i")),
    "jaxring.reduce_scatter": ("reduce_scatter",
                               lambda v, n: _into_own_block(v, jaxring.reduce_scatter(v, "i"))),
    "lax.psum_scatter": ("reduce_scatter",
                         lambda v, n: _into_own_block(v, lax.psum_scatter(v, "i", tiled=True))),
    "jaxring.all_gather": ("all_gather", lambda v, n: _own_block(jaxring.all_gather(v, "i"), n)),
    "lax.all_gather": ("all_gather",
                       lambda v, n: _own_block(lax.all_gather(v, "i", tiled=True), n)),
    f"{READ}[reduce_scatter]": ("reduce_scatter", lambda v, n: _into_own_block(
        v, native_floor(v, "reduce_scatter", n, reads_only=True))),
}
# From LOOP_NATIVE_BYTES, where the target is 0.8x the twin, the loop also times the native floors
# in place of the collective, with plain and with non-temporal stores (a row each way, and
# `native floor[collective]`, the faster): reduce_scatter's sums the n blocks of this device's
# input, all_gather's writes n copies of it, and the loop then treats their results as the
# collectives' (into this device's block of the carry; cut down to this device's block). Every
# reduce-scatter reads all n inputs and writes its output, every all-gather reads n inputs and
# writes n blocks, and the loop's own work is the same on every side, so no collective in that
# loop takes less. Below 16 MiB every loop row meets its target in most runs.
LOOP_NATIVE_BYTES = 16 << 20
# From LOOP_NATIVE_BYTES the loop also times the synchronised floors, `synced read floor` and
# `synced native floor`: each pass of those floors followed by jaxring.barrier on the axis. The
# floors above never wait for a peer, so with more devices than cores a device thread runs
# several passes in one time slice and rereads its own input from the last-level cache. No
# collective's loop can: each pass reads every device's input, which exists only once that
# device has arrived, so a device waits for all of its peers once a pass at least, and between
# two of its passes the others read theirs (n x 16 MiB, several times the 32 MiB cache). Timed
# in turns in one process (12 rounds, 16 MiB), the barrier after each pass cost 0.4-1.1 ms a
# pass on 4 and 8 devices, against 18-34 us at 256 KiB-1 MiB (benchmarks/TARGETS.md), where
# everything fits the cache: the cost is the lost reuse, not the barrier's own hand-off. In 40
# rounds, a 4-byte lax.psum in its place (XLA's rendezvous) cost as much or more in each of 9
# pairs (3 floors on 2, 4 and 8 devices; up to 13% more), so jaxring's barrier does not inflate
# the floor.
SYNCED = "synced "


def _native_pass(collective: str, streamed: bool):
    """One loop pass of `collective`'s native floor, its result treated as the collective's."""
    if collective == "reduce_scatter":
        return lambda v, n: _into_own_block(v, native_floor(v, collective, n, streamed))
    return lambda v, n: _own_block(native_floor(v, collective, n, streamed), n)


def _synced(one_pass):
    """`one_pass`, then a jaxring.barrier over axis "i" (the synchronised floors' pass)."""
    def synced_pass(v, n):
        result = one_pass(v, n)
        jaxring.barrier("i")
        return result
    return synced_pass


def loop_repeats(nbytes: int) -> int:
    """Passes of a loop program (measure_in_loop says why this many)."""
    if nbytes > 64 << 20:
        return 2
    return int(min(64, max(8, (128 << 20) // nbytes)))


def donated_loop(step, mesh, repeats: int):
    """A jitted shard_map program over axis "i" of `mesh` that runs `carry = step(carry)`
    `repeats` times and donates its input, which becomes the loop carry."""
    body = lambda v: lax.fori_loop(  # noqa: E731
        0, repeats, lambda _, a: make_varying(step(a), ("i",)), v)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")),
                   donate_argnums=0)


def measure_in_loop(n: int, nbytes: int, collectives=frozenset(TWIN)) -> list[dict]:
    """Per collective of `collectives` inside one compiled loop that feeds each result to the next, with nothing
    else in the loop: the collective's own cost, without the program launch that dominates a lone
    call's. The loop runs at least 64 times up to 2 MiB and fewer above (8 from 16 MiB to 64 MiB):
    each program still pays one launch, jaxring's dearer for its ordered effect, and a short loop
    would count an eighth of it in every call. Above 64 MiB it runs twice: a pass takes 50 ms or
    more there, hundreds of launches. The program donates its input, which becomes the loop carry
    and then the output, as a training step's state does: without that, XLA copies the
    argument into the carry and writes a fresh output on every launch, which at 64 MiB on 8
    devices cost 180 ms a program, more than the eight passes' collectives. Each timed call gets
    a fresh copy of the input, made outside the clock. A reduction multiplies the values by about
    n each pass, so they start near 2^-100: after 64 passes on 8 devices they are still finite
    float32 numbers. Sizes as in the lone tables: the input per device, all_gather's output."""
    mesh = jax.make_mesh((n,), ("i",), devices=jax.devices()[:n])
    sharding = NamedSharding(mesh, P("i"))
    repeats = loop_repeats(nbytes)
    runs, sizes, inputs = {}, {}, {}
    cases = {name: case for name, case in LOOP_CASES.items() if case[0] in collectives}
    natives = {}
    if nbytes >= LOOP_NATIVE_BYTES:
        for (collective, streamed), name in NATIVE_WAYS.items():
            if collective not in collectives:
                continue
            one_pass = _native_pass(collective, streamed)
            natives[name] = (collective, one_pass)
            natives[SYNCED + name] = (collective, _synced(one_pass))
        for collective in READ_OF:
            if collective not in collectives:
                continue
            read = f"{READ}[{collective}]"
            natives[SYNCED + read] = (collective, _synced(LOOP_CASES[read][1]))
    starts = {}  # per_device -> the start values, which the cases of that size share (read only)
    for name, (collective, one_pass) in {**cases, **natives}.items():
        per_device, sizes[name] = _elements(collective, n, nbytes)
        if per_device not in starts:
            starts[per_device] = (np.random.default_rng(0).standard_normal(
                n * per_device, np.float32) * 2.0 ** -100)
        # the start values, and the array the next call donates
        inputs[name] = [starts[per_device], None]
        f = donated_loop(lambda a, one_pass=one_pass: one_pass(a, n), mesh, repeats)

        def run(f=f, held=inputs[name]):
            held[1] = f(held[1])  # donates the fresh input fresh_input placed
            held[1].block_until_ready()
        runs[name] = run

    @contextlib.contextmanager
    def fresh_input(name):
        held = inputs[name]
        held[1] = jax.device_put(held[0], sharding)
        held[1].block_until_ready()
        yield
        held[1] = None  # the output, which no call takes (each gets a fresh input): memory back

    medians = medians_in_turns(runs, budget_seconds=0.6, min_rounds=_min_rounds(nbytes),
                               context=fresh_input)
    rows = [{"devices": n, "bytes": sizes[name], "case": name, "collective": cases[name][0],
             "seconds": medians[name] / repeats} for name in cases]
    if natives:
        seconds = {name: medians[name] / repeats for name in natives}
        rows += (native_rows(n, nbytes, seconds, collectives=collectives)
                 + native_rows(n, nbytes, seconds, SYNCED, collectives))
        for collective in READ_OF:
            if collective not in collectives:
                continue
            name = f"{SYNCED}{READ}[{collective}]"
            rows.append({"devices": n, "bytes": sizes[name], "case": name,
                         "collective": collective, "seconds": seconds[name]})
    return rows


def loop_markdown(rows: list[dict]) -> str:
    by_key = {(r["devices"], r["bytes"], r["case"]): r["seconds"] for r in rows}
    lines = ["## Inside one compiled loop (program launch excluded)", "",
             "Per call, each result fed to the next with nothing else in the loop. Every program"
             " donates its input, which becomes the loop carry, as a training step's state does"
             " (without that, XLA copies the argument into the carry and writes a fresh output on"
             " every launch, which from 16 MiB costs as much as several passes and pulls every"
             " ratio there towards 1). jaxring writes"
             " each all-reduce's result over its operand, the loop carry (`in_place`, its default"
             " for values the program owns); `[fresh]` forces a fresh output, which XLA then"
             " copies back into the carry, as it does `lax.psum`'s. reduce_scatter's result goes"
             " back into this device's block of the carry (updated in place) and all_gather's is"
             " cut down to this device's block before the next call, on both sides. (Tiling"
             " reduce_scatter's result back to the input's size, as earlier runs did, cost more"
             " from 16 MiB than the twin's whole pass: those rows timed `jnp.tile`.)"
             f" `{READ}[reduce_scatter]`: the same loop with a native call that reads all of this"
             " device's input and writes nothing but two elements in place of the collective;"
             " every reduce-scatter reads at least that (the lone tables' read floor)."
             f" `{NATIVE}` (reduce_scatter and all_gather, from"
             f" {human_bytes(LOOP_NATIVE_BYTES)}): the same loop with the collective's local part"
             " in a native call in its place (the n blocks of this device's input summed; n copies"
             " of it), the faster of plain and non-temporal stores; no collective in that loop"
             f" takes less. `{SYNCED}...` (from {human_bytes(LOOP_NATIVE_BYTES)}): the read and"
             " native floors with a jaxring.barrier after each pass. Every collective's device"
             " waits for all of its peers once a pass (their inputs exist only once they have"
             " arrived), so, unlike the unsynchronised floors, it cannot run several passes in a"
             " row over its own input while that input is still cached. `-`: not timed at that"
             " size.", ""]
    for collective, twin in TWIN.items():
        ours = [c for c, (kind, _) in LOOP_CASES.items() if kind == collective and c != twin]
        ours += ([f"{NATIVE}[{collective}]", f"{SYNCED}{NATIVE}[{collective}]"]
                 if collective in NATIVE_OF else [])
        ours += [f"{SYNCED}{READ}[{collective}]"] if collective in READ_OF else []
        lines += [f"### {collective}", "",
                  "| n | size | " + " | ".join(f"{c} (us)" for c in ours) + f" | {twin} (us) | "
                  + " | ".join(f"ratio {c.split('.')[1]}" if c.startswith("jaxring.")
                               else f"{c.split(' floor')[0]} / twin" for c in ours) + " |",
                  "|" + "---|" * (3 + 2 * len(ours))]
        for n, size in sorted({(r["devices"], r["bytes"]) for r in rows
                               if r.get("collective", "all_reduce") == collective}):
            theirs = by_key[(n, size, twin)]
            times = [by_key.get((n, size, c)) for c in ours]
            lines.append(f"| {n} | {human_bytes(size)} | "
                         + " | ".join("-" if t is None else f"{t * 1e6:.1f}" for t in times)
                         + f" | {theirs * 1e6:.1f} | "
                         + " | ".join("-" if t is None else f"{t / theirs:.2f}" for t in times)
                         + " |")
        lines.append("")
    return "\n".join(lines)


def markdown(env: dict, ceiling: float, rows: list[dict], huge_pages: int) -> str:
    lines = [
        "# In-process collectives on CPU devices: jaxring vs lax",
        "",
        f"Device: {env['device']}, {env['cores']} cores ({env['cpu']}); python {env['python']}, "
        f"jax {env['jax']}, jaxlib {env['jaxlib']}; {env['date']}.{steal_sentence(env)}",
        f"Memory copy bandwidth measured in the same run: **{ceiling:.1f} GB/s** (read + write).",
        "",
        "Times are medians; `ratio` is jaxring time / lax twin time (below 1 is faster).",
        "algbw and busbw follow nccl-tests (algbw: bytes / time, with a reduce-scatter's input"
        " and an all-gather's output as its bytes; busbw: all-reduce algbw x 2(n-1)/n,"
        " reduce-scatter and all-gather algbw x (n-1)/n), in GB/s (10^9 bytes); `busbw / copy`"
        " is jaxring's busbw over the memory copy bandwidth above.",
        "",
        f"`{FLOOR}`: a program that takes the collective's input, writes an output of its shape"
        " in one XLA pass (all_reduce's adds 1; reduce_scatter's sums its n blocks, reading every"
        " input byte once as every reduce-scatter must; all_gather's concatenates n copies of"
        " the input, a memcpy each) and carries"
        " jaxring's ordered effect, communicating nothing"
        " (`common.with_jaxring_effect`). Every lone call of a collective that carries the effect"
        " costs at least this, unless XLA's pass is a slower way to touch the bytes than the"
        " collective's own: where jaxring takes less, the floor bounds nothing (`targets.py`"
        " counts only the floors that stand). `floor / twin` above 1: no collective with the"
        " effect, however it moves the data, matches the lax twin in a lone call on this"
        " machine; the time goes to JAX's dispatch of a program with an ordered effect"
        " (`overhead-cpu.md`). From 8 MiB outputs (`huge_page_bytes`) it bounds nothing (`-`):"
        " jaxring's outputs are then advised"
        " onto huge pages, and the floor's XLA output, faulted in 4 KiB at a time, can cost more"
        " than jaxring's whole collective (README, \"Page faults\").",
        "",
        f"`{LOCAL}` (all_reduce and reduce_scatter): jaxring's own all_gather on an axis of one"
        " device, each device copying an input of the collective's output size into its output:"
        " the same ordered effect, FFI call and output (allocated and advised as the"
        " collective's), written with jaxring's own copy, and no communication. It reads no"
        " more than it writes, and no more memory than the collective reads, so it bounds a lone"
        " call wherever XLA's pass in the effect floor is the slower way to touch the bytes;"
        " `local / twin` above 1: no collective with the effect matches the twin there. Where"
        " it comes out above jaxring's whole collective, the collective's communication cost"
        " nothing measurable.",
        "",
        f"`{NATIVE}` (reduce_scatter and all_gather): the local part of the collective with its"
        " communication taken out, in a native call that carries the ordered effect and writes"
        " an output allocated and advised as jaxring's (`common.native_floor`): reduce_scatter's"
        " sums the input's n blocks with jaxring's kernels, reading every input byte once as"
        " every reduce-scatter must; all_gather's writes n copies of the input, over no more"
        " memory than the collective reads; the faster of plain and non-temporal stores."
        " `native / twin` above 1: no collective with the effect matches the twin there.",
        "",
        f"`{READ}` (reduce_scatter): a native call with the effect that reads every byte of the"
        " device's input once and writes nothing but two elements of its output"
        " (`common.native_floor`'s reads_only), on every device at once. Every reduce-scatter"
        " reads all n inputs whole and writes its outputs besides, so none takes less;"
        " `read / twin` above a target ratio: no reduce-scatter with the effect reaches that"
        " target at that size on this machine.",
        "",
        f"`{COPY}` (all_reduce, from {human_bytes(COPY_FLOOR_BYTES)}): every core"
        " copying n x the size between preallocated numpy buffers, the faster of glibc's memcpy"
        " and a copy with non-temporal stores (which skip reading the destination first; this"
        " glibc's memcpy uses them only above 288 MiB). An all-reduce reads n x"
        " the size and writes as much into its outputs, so none takes less, effect or not, once"
        " that no longer fits the last-level cache."
        " `copy / twin` above a target ratio: no all-reduce that writes a separate output"
        " reaches that target at that size on this machine. (Runs 0 to 94 timed it for"
        " all_gather too, which a read-once all-gather beats: it bounds no all-gather.)",
        "",
    ]
    by_key = {(r["devices"], r["bytes"], r["case"]): r for r in rows}
    for collective, twin in TWIN.items():
        ours = [c[0] for c in CASES if c[1] == collective and c[0] != twin]
        floor = f"{FLOOR}[{collective}]"
        extra = [kind for kind, of in ((LOCAL, LOCAL_INPUT), (NATIVE, NATIVE_OF),
                                       (READ, READ_OF), (COPY, COPY_FLOOR_OF)) if collective in of]
        lines += [f"## {collective}", "",
                  "| n | size | " + " | ".join(f"{c} (us)" for c in ours) + f" | {twin} (us) | "
                  + f"{FLOOR} (us) | " + "".join(f"{kind} (us) | " for kind in extra)
                  + " | ".join(f"ratio {c.split('.')[1]}" for c in ours) + " | floor / twin | "
                  + "".join(f"{kind.split()[0]} / twin | " for kind in extra)
                  + f"algbw jaxring | busbw jaxring | busbw {twin} | busbw / copy |",
                  "|" + "---|" * (6 + 2 * len(ours) + 3 + 2 * len(extra))]
        keys = sorted({(r["devices"], r["bytes"]) for r in rows if r["collective"] == collective})
        for n, size in keys:
            t = by_key[(n, size, twin)]["seconds"]
            cells = [f"{by_key[(n, size, c)]['seconds'] * 1e6:.1f}" for c in ours]
            ratios = [f"{by_key[(n, size, c)]['seconds'] / t:.2f}" for c in ours]
            f = by_key[(n, size, floor)]["seconds"]
            bound = effect_floor_ratio(f, t, output_bytes(collective, n, size), huge_pages)
            mine, twins = by_key[(n, size, ours[0])], by_key[(n, size, twin)]
            seconds = [by_key.get((n, size, f"{kind}[{collective}]"), {}).get("seconds")
                       for kind in extra]
            lines.append(f"| {n} | {human_bytes(size)} | " + " | ".join(cells)
                         + f" | {t * 1e6:.1f} | {f * 1e6:.1f} | "
                         + "".join(f"{s * 1e6:.1f} | " if s else "| " for s in seconds)
                         + " | ".join(ratios) + f" | {bound} | "
                         + "".join(f"{s / t:.2f} | " if s else "| " for s in seconds)
                         + f"{mine['algbw_GBps']:.2f} | {mine['busbw_GBps']:.2f} | "
                         + f"{twins['busbw_GBps']:.2f} | {mine['busbw_GBps'] / ceiling:.2f} |")
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict], ceiling: float, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({r["devices"] for r in rows})
    fig, axes = plt.subplots(1, len(counts), figsize=(5 * len(counts), 4), squeeze=False)
    for ax, n in zip(axes[0], counts):
        for case in ("jaxring.all_reduce", "jaxring.all_reduce[ring]", "lax.psum"):
            pts = sorted((r["bytes"], r["seconds"]) for r in rows
                         if r["devices"] == n and r["case"] == case)
            ax.loglog([p[0] for p in pts], [p[1] * 1e6 for p in pts], marker="o", label=case)
        ax.set_title(f"all-reduce, {n} CPU devices")
        ax.set_xlabel("bytes per device")
        ax.set_ylabel("median time (us)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"jaxring vs lax.psum (memory copy bandwidth {ceiling:.1f} GB/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="2,4,8")
    parser.add_argument("--min-bytes", type=parse_bytes, default=4,
                        help="smallest size per device (4 B x a power of 4), e.g. 256MiB")
    parser.add_argument("--max-bytes", type=parse_bytes, default=256 << 20)
    parser.add_argument("--quick", action="store_true", help="8 devices, 4 B .. 4 MiB, no files")
    parser.add_argument("--name", default="allreduce-cpu")
    args = parser.parse_args(argv)
    keep_freed_memory()
    counts = [8] if args.quick else [int(n) for n in args.devices.split(",")]
    max_bytes = 4 << 20 if args.quick else args.max_bytes
    sizes = [4]
    while sizes[-1] * 4 <= max_bytes:
        sizes.append(sizes[-1] * 4)
    sizes = [size for size in sizes if size >= args.min_bytes]
    if not sizes:
        parser.error(f"no size from --min-bytes {args.min_bytes} to --max-bytes {max_bytes}")

    env = environment()
    ceiling = memory_bandwidth_gbps()
    print(f"{env['device']}; memory copy bandwidth {ceiling:.1f} GB/s", flush=True)
    plans = {n: new_sizes(n, sizes) for n in counts}
    rows = []
    for n in counts:
        for size, collectives in plans[n]:
            new = measure(n, size, collectives)
            rows += new
            psum = next(r for r in new if r["case"] == "lax.psum")["seconds"]
            ours = next(r for r in new if r["case"] == "jaxring.all_reduce")
            print(f"n={n} {human_bytes(size):>9}: all_reduce {ours['seconds'] * 1e6:9.1f} us "
                  f"(psum {psum * 1e6:9.1f} us, ratio {ours['seconds'] / psum:.2f}, "
                  f"busbw {ours['busbw_GBps']:.2f} GB/s)", flush=True)
    if args.quick:
        return
    loop_rows = []
    for n in counts:
        for size, collectives in plans[n]:
            new = measure_in_loop(n, size, collectives)
            loop_rows += new
            t = {r["case"]: r["seconds"] for r in new}
            print(f"n={n} {human_bytes(size):>9} in a loop, ratio to the twin: " + ", ".join(
                f"{c} {t[f'jaxring.{c}'] / t[twin]:.2f}"
                for c, twin in TWIN.items() if c in collectives), flush=True)
    env = environment()  # the CPU steal over the run, now that it is over
    text = (markdown(env, ceiling, rows, jaxring.config.get().huge_page_bytes) + "\n"
            + loop_markdown(loop_rows))
    path = write_results(args.name, {"environment": env, "memory_copy_GBps": ceiling,
                                     "config": jaxring.config.get().__dict__, "rows": rows,
                                     "in_loop_rows": loop_rows,
                                     "read_floor_streams": READ_STREAMS,
                                     "gather_floor_piece_bytes": GATHER_FLOOR_PIECE_BYTES}, text)
    plot(rows, ceiling, path.with_suffix(".png"))
    print(f"wrote {path.with_suffix('.*')}")


if __name__ == "__main__":
    main()
