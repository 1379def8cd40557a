"""Helpers every benchmark shares: timing, bandwidth definitions, the memory ceiling, and the
record of the machine and versions that goes with every result."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' busbw = algbw x factor: what each link must carry for the collective."""
    if n == 1:
        return 1.0
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    return 1.0


def median_seconds(fn, min_repeats: int = 10, budget_seconds: float = 0.6) -> float:
    """Median wall time of fn() (which must block until its result is ready)."""
    fn()
    fn()  # warm-up: compilation and first-touch page faults
    start = time.perf_counter()
    fn()
    estimate = time.perf_counter() - start
    repeats = int(min(500, max(min_repeats, budget_seconds / max(estimate, 1e-6))))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def memory_bandwidth_gbps(nbytes: int = 256 << 20) -> float:
    """Copy bandwidth of this machine, counting the bytes read and written (a STREAM copy)."""
    src = np.ones(nbytes // 8, np.float64)
    dst = np.empty_like(src)
    seconds = median_seconds(lambda: np.copyto(dst, src), min_repeats=5, budget_seconds=1.0)
    return 2 * nbytes / seconds / 1e9


# The pipeline workload of benchmarks/p2p.py and benchmarks/pipeline_mpi.py: PIPELINE_LAYERS
# dense tanh layers of PIPELINE_WIDTH units on PIPELINE_ROWS rows per stream, PIPELINE_TICKS
# ticks per measured program.
PIPELINE_LAYERS, PIPELINE_WIDTH, PIPELINE_ROWS, PIPELINE_TICKS = 8, 256, 16, 100


def dense_layer(params, h):
    import jax.numpy as jnp

    return jnp.tanh(h @ params["w"] + params["b"])


def pipeline_workload(streams: int) -> tuple[list[dict], np.ndarray]:
    """The layers (a list of {"w", "b"}) and `streams` input streams [streams, ROWS, WIDTH]."""
    rng = np.random.default_rng(0)
    width = PIPELINE_WIDTH
    layers = [{"w": (rng.standard_normal((width, width)) / 16).astype(np.float32),
               "b": rng.standard_normal(width).astype(np.float32)}
              for _ in range(PIPELINE_LAYERS)]
    return layers, rng.standard_normal((streams, PIPELINE_ROWS, width)).astype(np.float32)


_EFFECT_ONLY = None


def with_jaxring_effect(x):
    """`x`, carrying jaxring's ordered effect and doing nothing else (a measurement-only
    primitive). A program with it pays what JAX's dispatch of a program with an ordered effect
    costs (the runtime token handed in and out, and JAX's Python path instead of its C++ fast
    path), which every program with a jaxring collective pays too: `with_jaxring_effect(f(x))`,
    where f reads the collective's input and writes an output of its shape, is a floor under any
    lone call of a collective that carries the effect, however it moves the data."""
    global _EFFECT_ONLY
    if _EFFECT_ONLY is None:
        from jax._src import core
        from jax._src.interpreters import mlir

        from jaxring._src import common as jr

        primitive = core.Primitive("benchmark_jaxring_effect_only")
        primitive.def_effectful_abstract_eval(lambda v: (v, {jr.collective_effect}))

        def lowering(ctx, v):
            ctx.set_tokens_out(ctx.tokens_in)
            return [v]

        mlir.register_lowering(primitive, lowering)
        _EFFECT_ONLY = primitive
    return _EFFECT_ONLY.bind(x)


_NATIVE_FLOOR = None


def native_floor(x, collective: str, n: int, streamed: bool = False,
                 reads_only: bool = False):
    """What a lone reduce_scatter or all_gather of `x` over n devices does on each device with
    its communication taken out, carrying jaxring's ordered effect (a measurement-only primitive
    lowered to the FFI target jaxring_benchmark_native_floor, xla_ffi/cpu/native_floor.cc):
    reduce_scatter sums x's n blocks, reading every input byte once; all_gather writes n copies
    of x, reading each 256 KiB piece of it once. Its output is allocated and advised as
    jaxring's, and written with jaxring's reduction kernels or copies, with plain or
    non-temporal (`streamed`) stores. `reads_only` (with reduce_scatter): read every input byte
    once and write nothing but the output's first two elements (the bits of the sum mod 2^64 of
    the input's bytes as 64-bit words, a last half word byte by byte), less than any
    reduce-scatter does. float32 only."""
    global _NATIVE_FLOOR
    import jax
    from jax._src import core
    from jax._src.interpreters import mlir

    from jaxring._src import common as jr
    from jaxring._src import native

    if _NATIVE_FLOOR is None:
        for name, capsule in native.extension.benchmark_cpu_targets().items():
            jax.ffi.register_ffi_target(name, capsule, platform="cpu")
        primitive = core.Primitive("benchmark_jaxring_native_floor")

        def abstract_eval(v, *, collective, n, streamed, reads_only):
            size = v.shape[0] // n if collective == "reduce_scatter" else v.shape[0] * n
            return v.update(shape=(size,)), {jr.collective_effect}

        def lowering(ctx, v, *, collective, n, streamed, reads_only):
            sub = ctx.replace(avals_in=[core.abstract_token, *ctx.avals_in],
                              avals_out=[core.abstract_token, *ctx.avals_out])
            token, out = jax.ffi.ffi_lowering("jaxring_benchmark_native_floor",
                                              has_side_effect=True)(
                sub, ctx.tokens_in.get(jr.collective_effect), v,
                collective=np.int64(jr.COLLECTIVE_CODES[collective]), size=np.int64(n),
                streamed=np.int64(streamed), reads_only=np.int64(reads_only))
            ctx.set_tokens_out(mlir.TokenSet({jr.collective_effect: token}))
            return [out]

        primitive.def_effectful_abstract_eval(abstract_eval)
        mlir.register_lowering(primitive, lowering, platform="cpu")
        _NATIVE_FLOOR = primitive
    return _NATIVE_FLOOR.bind(x, collective=collective, n=n, streamed=streamed,
                              reads_only=reads_only)


def effect_floor_ratio(floor_seconds: float, reference_seconds: float, nbytes: int,
                       huge_page_bytes: int) -> str:
    """The effect floor over a reference time as a table cell, or "-" from `huge_page_bytes` on:
    jaxring advises outputs that large onto huge pages, which the floor's XLA output is not, so
    there the floor bounds nothing."""
    return f"{floor_seconds / reference_seconds:.2f}" if nbytes < huge_page_bytes else "-"


def output_bytes(collective: str, n: int, nbytes: int) -> int:
    """Bytes per device of the output of allreduce.py's row of `nbytes` (the all-reduce's and
    reduce-scatter's input, the all-gather's output): a reduce-scatter's is 1/n of its input.
    The effect floor bounds a lone call only below huge_page_bytes of output."""
    return nbytes // n if collective == "reduce_scatter" else nbytes


def issue2_target(nbytes: int) -> float:
    """Issue 2's bound on jaxring's time over its lax twin's at `nbytes` per device: at most 1.0x,
    and 0.8x from 16 MiB."""
    return 0.8 if nbytes >= 16 << 20 else 1.0


def issue3_target(mpi4jax_seconds: float, mpi4py_seconds: float, nbytes: int) -> float:
    """The time issue 3 asks of jaxring's all-reduce across processes: no slower than mpi4py for
    small messages; from 1 MiB, 5x faster than mpi4jax and 2x faster than mpi4py."""
    if nbytes < 1 << 20:
        return mpi4py_seconds
    return min(mpi4jax_seconds / 5, mpi4py_seconds / 2)


def looped_floor(rows: list[dict], nbytes: int, kinds) -> float | None:
    """The fastest of allreduce_mpi.py's loop-table floors whose names start with `kinds` (a
    string or tuple) at `nbytes`, per all-reduce, or None where there is none."""
    return min((r["seconds"] for r in rows if r["bytes"] == nbytes and r.get("per_op")
                and r["impl"].startswith(kinds)), default=None)


# Lone floors across processes (allreduce_mpi.py). A lone jitted program that reads the input,
# writes the output in one XLA elementwise pass and carries jaxring's ordered effect,
# communicating nothing (with_jaxring_effect): every lone call of a collective that carries the
# effect costs at least this, however it moves the data.
EFFECT_FLOOR = "effect floor"
# A lone jitted program that carries jaxring's ordered effect and returns its input, which XLA
# copies into a fresh output: what launching any program with the effect and writing an output
# of the input's size costs, the least a lone call of a collective that carries the effect can
# take, whatever it does with the bytes.
LAUNCH_FLOOR = "launch floor"
# Every rank staging its input in shared memory and reading as much of the others' as any
# all-reduce must into its output, in a loop (allreduce_mpi.exchange_floors), and once into a
# fresh output (fresh_exchange_floors).
EXCHANGE_FLOOR = "exchange floor"
FRESH_EXCHANGE_FLOOR = "exchange floor, fresh output"


def exchange_reads(ranks: int) -> float:
    """How much of its message each rank of the exchange floor reads from shared memory: 2(n -
    1)/n, the fewest reads of any all-reduce between n processes (jaxring::RunExchange,
    xla_ffi/ring/staged.h, says why). Result files record it as `exchange_reads`; those without
    it come from an exchange that read the message once, the same only at n = 2."""
    return 2 * (ranks - 1) / ranks


# Every rank copying its input as often as it takes to move the bytes a staged all-reduce must
# read and write, in a loop, up to 4 MiB (allreduce_mpi.traffic_floor).
TRAFFIC_FLOOR = "traffic floor"


def launch_floors(rows: list[dict], nbytes: int,
                  huge_page_bytes: int) -> dict[str, float | None]:
    """The floors under a lone all-reduce of `nbytes` in one run of allreduce_mpi.py that start
    with its launch: `launch`, the least `effect floor` or `launch floor` at this size or a
    smaller one below `huge_page_bytes` (a lone call's launch does not shrink as the message
    grows; XLA copies the launch floor's input into its output 2-3x slower than numpy at 1-4 MiB,
    so at its own size it would overstate the launch, and from `huge_page_bytes` it pages its
    output in 4 KiB at a time where jaxring's takes huge pages: a run of large sizes alone has no
    launch floor); `launch+exchange`, the launch followed by the larger of the loop
    table's `exchange floor` and the lone `exchange floor, fresh output`; and `launch+traffic`,
    the launch followed by the loop table's `traffic floor` (up to 4 MiB). A lone call launches,
    then moves its data, and moves at least what one in a loop moves, so the loop table's floors
    bound that part as they bound the loop's rows. None where a floor was not measured."""
    lone = {(r["impl"], r["bytes"]): r["seconds"] for r in rows if not r.get("per_op")}
    launch = min((t for (m, b), t in lone.items()
                  if b <= nbytes and b < huge_page_bytes and m in (EFFECT_FLOOR, LAUNCH_FLOOR)),
                 default=None)
    if launch is None:
        return {"launch": None, "launch+exchange": None, "launch+traffic": None}
    fresh = [t for (m, b), t in lone.items()
             if b == nbytes and m.startswith(FRESH_EXCHANGE_FLOOR)]
    moved = max(looped_floor(rows, nbytes, EXCHANGE_FLOOR) or 0.0, min(fresh, default=0.0))
    traffic = looped_floor(rows, nbytes, TRAFFIC_FLOOR)
    return {"launch": launch, "launch+exchange": launch + moved if moved else None,
            "launch+traffic": launch + traffic if traffic else None}


def _cpu_times() -> list[int] | None:
    """The "cpu" line of /proc/stat: user, nice, system, idle, iowait, irq, softirq, steal, ..."""
    try:
        with open("/proc/stat") as stat:
            return [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None


_CPU_TIMES_AT_START = _cpu_times()


def cpu_steal_percent() -> float | None:
    """Share of this machine's CPU time that the hypervisor gave to other guests since this module
    was imported (the steal column of /proc/stat). Runs of this shared VM that differ by 2x in
    speed differ in it, so it comes with every result; None where there is no /proc/stat."""
    now = _cpu_times()
    if now is None or _CPU_TIMES_AT_START is None or len(now) < 8:
        return None
    delta = [b - a for a, b in zip(_CPU_TIMES_AT_START, now)]
    total = sum(delta[:8])
    return round(100.0 * delta[7] / total, 2) if total > 0 else 0.0


def rank_binding(world) -> tuple[bool, str] | None:
    """Whether the ranks of the mpi4py communicator `world` are bound to cores (mpiexec
    -bind-to core), and a sentence saying to which; on rank 0 only (None elsewhere). A
    collective call: every rank makes it."""
    cores = world.gather(sorted(os.sched_getaffinity(0)), root=0)
    if world.rank != 0:
        return None
    bound = any(len(c) < os.cpu_count() for c in cores)
    return bound, (f"ranks bound to cores {cores} (mpiexec -bind-to core)" if bound else
                   "ranks not bound to cores")


def steal_sentence(env: dict) -> str:
    steal = env.get("cpu_steal_percent")
    return ("" if steal is None else
            f" CPU steal during the run (time the hypervisor gave other guests): {steal:.1f}%.")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (under a VM, the host's part), or the machine."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def code_version() -> str:
    """The jaxring commit that ran, with "+changes" where the tree differed from it; "unknown"
    outside a git checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root,
                                capture_output=True, text=True, timeout=10, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def environment(mpi=None) -> dict:
    """The machine and the versions a result was measured with; given mpi4py's `MPI`, also the
    MPI library's and the MPI packages' (mpi4jax: None where it is not installed)."""
    import importlib.metadata

    import jax
    import jaxlib

    import jaxring
    from jaxring._src import native

    devices = jax.devices()
    versions = {}
    if mpi is not None:
        versions["mpi"] = mpi.Get_library_version().strip(" \n\x00").splitlines()[0]
        for package in ("mpi4py", "mpi4jax"):
            try:
                versions[package] = importlib.metadata.version(package)
            except importlib.metadata.PackageNotFoundError:
                versions[package] = None
    return {
        "device": (f"cpu x{len(devices)} host devices" if devices[0].platform == "cpu" else
                   f"{devices[0].device_kind} x{len(devices)}"),
        "cpu": cpu_model(),
        "cpu_kernels": native.extension.cpu_kernels_in_use(),
        "cpu_kernels_streaming": native.extension.cpu_kernels_in_use(streaming=True),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "numpy": np.__version__,
        "jaxring_commit": code_version(),
        "jaxring_build_id": native.build_id(),  # a hash of the native sources that ran
        # Settings that differ from jaxring.config's defaults (JAXRING_* variables, say).
        "jaxring_config_changed": {key: value for key, value in vars(jaxring.config.get()).items()
                                   if value != getattr(jaxring.config.Config(), key)},
        "date": time.strftime("%Y-%m-%d"),
        "cpu_steal_percent": cpu_steal_percent(),
        **versions,
    }


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}"
        n /= 1024
    return f"{n} B"


def parse_bytes(text: str) -> int:
    """A size on a command line: bytes, or a number with B, KiB, MiB or GiB ("256MiB")."""
    units = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10, "B": 1}
    stripped = text.strip()
    for unit, scale in units.items():
        if stripped.endswith(unit):
            stripped, factor = stripped[:-len(unit)], scale
            break
    else:
        factor = 1
    try:
        return int(float(stripped) * factor)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (bytes, or with B, KiB, MiB or GiB)") from None


def takes_no_arguments(doc: str) -> None:
    """For a script that takes no options: --help prints its docstring, and anything else given
    is refused, instead of the script running in full (and overwriting its committed results)."""
    argparse.ArgumentParser(description=doc,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()


def write_results(name: str, payload: dict, markdown: str) -> Path:
    json_path = RESULTS / f"{name}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)  # a name may hold a folder: runs/...
    json_path.write_text(json.dumps(payload, indent=1))
    (RESULTS / f"{name}.md").write_text(markdown)
    return json_path


def keep_freed_memory() -> None:
    """Pins glibc malloc, where it is, so that freed memory is reused warm, as MALLOC_ARENA_MAX,
    MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ would: one arena (M_ARENA_MAX), blocks up to
    32 MiB from the heap (M_MMAP_THRESHOLD, the largest glibc allows) and no trimming below 1 GiB
    (M_TRIM_THRESHOLD). Otherwise whichever implementation's fresh 1-32 MiB buffer lands on memory
    glibc has just trimmed or unmapped, or on a heap that has not held such a block before, pays
    a page fault per 4 KiB (about 3 ms at 4 MiB on this VM), and which one that is changes from
    call to call and run to run. The arena matters because XLA allocates a program's outputs on
    whichever pool thread runs it: with an arena per thread, a block freed into one arena is no
    use to the next call allocating from another, which grows its heap onto fresh pages instead.
    With the default arenas, lone 16 MiB calls of lax.psum on 2 devices faulted on about one call
    in seven, and its median on 8 devices moved between 7.8 and 21.8 ms from run to run (seven
    runs); with one arena, 8.3-9.3 ms (five runs).
    Call it before the first jax computation (before XLA starts its threads). It applies to every
    implementation a benchmark measures, alike."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(-8, 1)         # M_ARENA_MAX
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD (the largest glibc allows)
        libc.mallopt(-1, 1 << 30)   # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: nothing to pin


def copy_ways() -> dict:
    """The two ways a copy floor copies, name -> copy(dst, src); a floor takes the faster. glibc's
    memcpy, and non-temporal stores (jaxring's CopyStreamed), which skip reading the destination
    first: this glibc's memcpy uses them only above 288 MiB, and from 16 MiB the streamed copy
    took 0.72-0.77x memcpy's time here."""
    from jaxring._jaxring import copy_streamed

    return {"memcpy": np.copyto, "streamed": copy_streamed}


def group_seconds(world, start: float, end: float, one_clock: bool) -> float:
    """The time a group of ranks took over one sample, from each rank's perf_counter() `start`
    (taken after a barrier) and `end`: from the first rank's start to the last rank's end when
    every rank runs on one machine (`one_clock`: perf_counter is CLOCK_MONOTONIC there, one clock
    for all processes), else the slowest rank's own end - start. The two agree for a collective,
    whose ranks end together and whose first starter waits for the last. They differ for work
    the ranks do each on its own (a floor, a pipeline stage with no hand-off) when ranks
    outnumber cores: a rank that waits for a core after the barrier starts its clock only once
    it runs, so each rank's own time leaves out the others' turns on its core, and with 4 ranks
    on 2 cores the slowest rank's time of 4 independent cache-resident copies was half the
    group's (51 against 100 us a call at 1 MiB)."""
    from mpi4py import MPI

    if not one_clock:
        return world.allreduce(end - start, op=MPI.MAX)
    latest = np.empty(2)
    world.Allreduce(np.array([-start, end]), latest, op=MPI.MAX)
    return float(latest[1] + latest[0])


def medians_in_turns(cases: dict, budget_seconds: float = 0.5, min_rounds: int = 8,
                     context=None, world=None, warmups: int = 2) -> dict:
    """Median time of each case's fn() (which must block until its result is ready), the cases
    taking turns: every round times each case once, so that all cases see the same machine (this
    VM's speed drifts by 2x over minutes, and medians taken minutes apart would compare the
    drift). `context(name)`, if given, is entered around each timed call but outside the clock
    (e.g. a jaxring.config override). Stops after `budget_seconds` per case and `min_rounds`, or
    300 rounds. Each round takes the cases in a fresh random order (the same on every rank), so
    that no case is always timed right after the same other case and inherits its aftermath: a
    case after a cache-flushing one measured 6-11% slower than the same case after itself.
    (Starting each round one case later, as an earlier version did, kept every case after the
    same neighbour in all rounds but one in len(cases).) With an mpi4py
    `world`: every call starts after a barrier and counts from the first rank's start to the last
    rank's end (`group_seconds`), and rank 0's clock decides when to stop, so that all ranks stop
    together."""
    import contextlib

    context = context or (lambda name: contextlib.nullcontext())
    if world is not None:
        from mpi4py import MPI
        node = world.Split_type(MPI.COMM_TYPE_SHARED)
        one_clock = world.allreduce(node.size == world.size, op=MPI.LAND)
        node.Free()
    for name, fn in cases.items():
        for _ in range(warmups):  # compilation and first-touch page faults
            with context(name):  # around each call, as around each timed one (a fresh input)
                fn()
    samples = {name: [] for name in cases}
    deadline = time.perf_counter() + budget_seconds * len(cases)
    names = list(cases)
    shuffle = random.Random(0)  # seeded: every rank draws the same orders
    for rounds in range(1, 301):
        for name in shuffle.sample(names, len(names)):
            fn = cases[name]
            with context(name):
                if world is not None:
                    world.Barrier()
                start = time.perf_counter()
                fn()
                end = time.perf_counter()
                samples[name].append(end - start if world is None else
                                     group_seconds(world, start, end, one_clock))
        done = rounds >= min_rounds and time.perf_counter() >= deadline
        if world is not None:
            done = world.bcast(done, root=0)
        if done:
            break
    return {name: statistics.median(times) for name, times in samples.items()}


def plot_time_per_size(rows, title: str, path) -> None:
    """Time against bytes per rank, one log-log curve per implementation (`impl`), leaving out
    the per-operation rows measured inside a loop (`per_op`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name in dict.fromkeys(r["impl"] for r in rows if not r.get("per_op")):
        sel = [r for r in rows if r["impl"] == name]
        ax.loglog([r["bytes"] for r in sel], [r["seconds"] * 1e6 for r in sel], "o-", label=name)
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("time (us)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
