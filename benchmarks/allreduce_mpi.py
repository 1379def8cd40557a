"""All-reduce across processes: jaxring against mpi4jax and mpi4py, measured in one run.

    mpiexec -n 2 python benchmarks/allreduce_mpi.py      # also -n 4; --quick: a short run, no files
    mpiexec -bind-to core -n 2 python benchmarks/allreduce_mpi.py   # ranks pinned: *-bound.*

Each process has one CPU device. For float32 messages of 4 B .. 64 MiB per rank it times
- jaxring.all_reduce(x, jaxring.mpi.world()) inside jax.jit (the shared-memory transport),
  with the default wait (brief spin, yield, then sleep) and with pure spinning;
- the same over jaxring's MPI transport (the one between nodes; transport="mpi"), with its
  automatic choice and with recursive doubling and the ring forced, to place the switch point;
- with 4 ranks, the hierarchical all-reduce on two pretend nodes of 2 ranks (shared memory
  within a node, MPI between);
- mpi4jax.allreduce(x, MPI.SUM) inside jax.jit;
- mpi4py's comm.Allreduce on numpy buffers;
- up to 16 MiB, also per all-reduce inside one compiled loop (up to 1024 all-reduces, fewer
  from 32 KiB so that a program stays near 32 MiB of messages; mpi4py: a Python loop), which
  leaves out the program launch that dominates a lone small jitted call (about 0.25 ms, under
  0.3 us per all-reduce over 1024): the steady state of a training step.
Every sample starts after a barrier and counts from the first rank's start to the last rank's
end (common.group_seconds), so that the floors, which every rank runs on its own, pay for ranks
that share a core as a collective does; the implementations take turns, one call each per round,
so that every ratio compares the same stretch of time. glibc's malloc
is told to keep freed memory (mallopt, as MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ would):
otherwise whichever implementation's fresh 1-32 MiB buffer lands on trimmed or unmapped memory
pays a page fault per 4 KiB (about 3 ms at 4 MiB on this VM), and which one that is changes from
run to run. It applies to every implementation alike, in the same processes. Reports time, algbw and busbw
(nccl-tests definitions) against the copy bandwidth of this machine, and writes
benchmarks/results/allreduce_mpi-cpu-n{N}.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = ""  # one CPU device per process

import jax  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jaxring  # noqa: E402
import jaxring.mpi  # noqa: E402
from common import (EFFECT_FLOOR, EXCHANGE_FLOOR, FRESH_EXCHANGE_FLOOR,  # noqa: E402
                    LAUNCH_FLOOR, RESULTS, TRAFFIC_FLOOR, bus_factor, copy_ways, environment,
                    exchange_reads, human_bytes, issue3_target, keep_freed_memory,
                    launch_floors, looped_floor, medians_in_turns, memory_bandwidth_gbps,
                    plot_time_per_size, rank_binding, steal_sentence, with_jaxring_effect,
                    write_results)

keep_freed_memory()
COMM = jaxring.mpi.world()
WORLD = MPI.COMM_WORLD
OVER_MPI = jaxring.mpi.Communicator(WORLD.Dup(), label="over MPI", transport="mpi")
# With 4 ranks: two pretend nodes of 2, shared memory within and MPI between them.
TWO_NODES = (jaxring.mpi.Communicator(WORLD.Dup(), label="2 nodes", ranks_per_node=WORLD.size // 2)
             if WORLD.size >= 4 and WORLD.size % 2 == 0 else None)
SPIN_FOREVER = 1 << 40


def implementations():
    import mpi4jax

    jaxring_sum = jax.jit(lambda v: jaxring.all_reduce(v, COMM))
    over_mpi_sum = jax.jit(lambda v: jaxring.all_reduce(v, OVER_MPI))
    two_nodes_sum = jax.jit(lambda v: jaxring.all_reduce(v, TWO_NODES))
    mpi4jax_sum = jax.jit(lambda v: mpi4jax.allreduce(v, MPI.SUM, comm=WORLD))
    effect_floor = jax.jit(lambda v: with_jaxring_effect(v + 1))
    launch_floor = jax.jit(with_jaxring_effect)

    outputs = {}  # per shape, allocated once outside the clock, as an mpi4py program would

    def mpi4py_sum(x):
        out = outputs.get(x.shape)
        if out is None:
            out = outputs[x.shape] = np.empty_like(x)
        WORLD.Allreduce(x, out, op=MPI.SUM)

    # name -> (run(numpy input, jax input), jaxring.config overrides while it is measured)
    return {
        "jaxring.all_reduce": (lambda x, xj: jaxring_sum(xj).block_until_ready(), {}),
        "jaxring.all_reduce[spin]": (lambda x, xj: jaxring_sum(xj).block_until_ready(),
                                     {"spin_iterations": SPIN_FOREVER}),
        "jaxring[mpi]": (lambda x, xj: over_mpi_sum(xj).block_until_ready(), {}),
        "jaxring[mpi, doubling]": (lambda x, xj: over_mpi_sum(xj).block_until_ready(),
                                   {"algorithm": "direct"}),
        "jaxring[mpi, ring]": (lambda x, xj: over_mpi_sum(xj).block_until_ready(),
                               {"algorithm": "ring"}),
        **({} if TWO_NODES is None else {
            "jaxring[2 nodes, hierarchical]": (lambda x, xj: two_nodes_sum(xj).block_until_ready(),
                                               {})}),
        "mpi4jax.allreduce": (lambda x, xj: mpi4jax_sum(xj).block_until_ready(), {}),
        "mpi4py Allreduce": (lambda x, xj: mpi4py_sum(x), {}),
        EFFECT_FLOOR: (lambda x, xj: effect_floor(xj).block_until_ready(), {}),
        LAUNCH_FLOOR: (lambda x, xj: launch_floor(xj).block_until_ready(), {}),
    }


LOOP_MAX_BYTES = 16 << 20
COPY_FLOOR = "copy floor"
COPY_FLOOR_BYTES = 16 << 20
EXCHANGE_CHUNKS = (256 << 10, 1 << 20)  # bytes per step; 128-512 KiB ran alike


def loop_count(nbytes: int) -> int:
    """All-reduces per program in the launch-free measurement: 1024 for small messages (so the
    launch adds under 0.3 us to each), else about 32 MiB of messages (at least 4)."""
    return max(4, min(1024, (32 << 20) // max(nbytes, 1)))


def looped(reduce, loops):
    """`reduce` of the same input `loops` times inside one compiled program, as mpi4py's loop
    calls Allreduce on the same buffers: the same work for every implementation, with nothing
    else in the loop (the ordered effect keeps the calls in sequence and in the loop)."""
    return jax.jit(lambda v: jax.lax.fori_loop(1, loops, lambda i, c: reduce(v), reduce(v)))


def loop_implementations(loops):
    """Per all-reduce inside one compiled loop, up to LOOP_MAX_BYTES: the cost without the
    program launch (about 0.25 ms for any program with an ordered effect, jaxring's and
    mpi4jax's alike), which a training step with many collectives pays only once."""
    import mpi4jax

    ours = looped(lambda c: jaxring.all_reduce(c, COMM), loops)
    ours_mpi = looped(lambda c: jaxring.all_reduce(c, OVER_MPI), loops)
    theirs = looped(lambda c: mpi4jax.allreduce(c, MPI.SUM, comm=WORLD), loops)

    def mpi4py_loop(x):
        out = np.empty_like(x)
        for _ in range(loops):
            WORLD.Allreduce(x, out, op=MPI.SUM)

    # name -> (run(numpy input, jax input), jaxring.config overrides while it is measured)
    return {
        "jaxring.all_reduce in a loop": (lambda x, xj: ours(xj).block_until_ready(), {}),
        # Plain stores into shared memory throughout: what the timed choice between plain and
        # streaming stores (ShmCommunicator::CopyIn) saves when this VM's cores sit on two dies.
        "jaxring.all_reduce, plain stores, in a loop": (
            lambda x, xj: ours(xj).block_until_ready(), {"shm_stores": "plain"}),
        "jaxring[mpi] in a loop": (lambda x, xj: ours_mpi(xj).block_until_ready(), {}),
        "mpi4jax.allreduce in a loop": (lambda x, xj: theirs(xj).block_until_ready(), {}),
        "mpi4py Allreduce in a loop": (lambda x, xj: mpi4py_loop(x), {}),
    }


def copying(nbytes: int, copies: int, copy=np.copyto):
    """run(x, xj) copying an input-sized buffer `copies` times on this rank with `copy(dst, src)`,
    as every rank does at once (every sample starts after a barrier)."""
    src = np.random.default_rng(0).standard_normal(max(1, nbytes // 4), np.float32)
    dst = np.empty_like(src)

    def run(x, xj):
        for _ in range(copies):
            copy(dst, src)
    return run


def traffic_floor(nbytes: int, n: int, loops: int):
    """The memory system's floor for an all-reduce between processes while its data stays in the
    cache (up to 4 MiB), timed like the loops: every rank at once copies an input-sized buffer as
    many times as it takes to read and write as many bytes as each rank must per all-reduce when
    processes cannot read each other's buffers. Every byte another rank needs is then staged in
    shared memory and read there, so at the least a rank reads its input (S), the other ranks'
    shares of its own share of the reduction ((n-1)/n S) and their results for the other shares
    ((n-1)/n S), and writes the shares it stages ((n-1)/n S), its result for the others (S/n) and
    its output (S): (5 - 2/n) S in all, which jaxring's shared-memory transport moves exactly. A
    copy of S moves 2 S; its working set (2 S) is smaller than the all-reduce's, so it runs at
    least as fast per byte, and it neither waits for other ranks nor takes cache lines from their
    cores. Timed like every case, from the first rank's start to the last rank's end: where ranks
    outnumber cores, ranks that share a core copy in turns, as they do an all-reduce's work."""
    return copying(nbytes, max(1, round(loops * (5 - 2 / n) / 2)))


def copy_floors(nbytes: int, loops: int) -> dict:
    """The memory system's floor for an all-reduce of the same input again and again once the
    ranks' inputs and outputs no longer fit the last-level cache (from COPY_FLOOR_BYTES): every
    rank at once copies its input into an output-sized buffer once per all-reduce. Every
    all-reduce reads each input byte and writes each output byte at least once, and with n
    inputs and n outputs of 16 MiB (64-128 MiB against a 32 MiB cache) those bytes come from and
    go to memory; the copy moves exactly them and nothing else, each of common.copy_ways(), of
    which the floor is the faster."""
    return {f"{COPY_FLOOR}[{way}]": copying(nbytes, loops, copy)
            for way, copy in copy_ways().items()}


def exchange_floors(nbytes: int, loops: int) -> dict:
    """The least data movement between processes, timed the way the loops are: every rank at once
    copies its input into its shared-memory slot and, once its left neighbours have done the
    same, copies the first neighbour's into an output, adding the second's over the last (n - 2)/n
    of the elements (jaxring's RunExchange, through COMM's slots and progress flags, chunk by
    chunk). Every element of a rank's all-reduce output depends on each other rank's input, which
    the rank cannot read where it lies: so each rank must read its input (S), write S into shared
    memory for the others, read what other ranks wrote there, and write its output (S), reading
    only after the writer has finished. Of those reads, any all-reduce makes 2(n - 1) per element
    over the n ranks, 2(n - 1)/n S per rank on average (common.exchange_reads; the proof is
    RunExchange's comment in xla_ffi/ring/staged.h). The exchange does exactly that and nothing
    else; unlike the traffic floor, which counts the same bytes, it pays for taking cache lines
    from another core, which costs up to 3x more where the VM's two cores sit on different dies.
    (A rank can read another's buffer where it lies only through the kernel, by cross-memory
    attach, which copied at 10-11 GB/s here, slower than this floor: README, "Across
    processes".)
    For each of EXCHANGE_CHUNKS (up to the size) with plain and with non-temporal stores into
    shared memory; the floor is the fastest. Only on the shared-memory transport."""
    from jaxring._jaxring import shm_exchange

    if COMM.transport != "shm":
        return {}
    src = np.random.default_rng(COMM.rank).standard_normal(max(1, nbytes // 4), np.float32)
    dst = np.empty_like(src)
    floors = {}
    for chunk in sorted({min(c, nbytes) for c in EXCHANGE_CHUNKS}):
        for way, streamed in (("plain", False), ("streamed", True)):
            floors[f"{EXCHANGE_FLOOR}[{way}, {human_bytes(chunk)} steps]"] = (
                lambda x, xj, chunk=chunk, streamed=streamed:
                shm_exchange(COMM.key, dst, src, chunk, streamed, loops))
    return floors


def fresh_exchange_floors(nbytes: int) -> dict:
    """For the lone table from COPY_FLOOR_BYTES: one exchange (exchange_floors) into a fresh
    output, as a lone call's output is. From 32 MiB glibc maps every block afresh, and the kernel
    zeroes each page of it on its first write, for every implementation alike; the fresh output
    here is advised onto huge pages as jaxring advises its own outputs (huge_page_bytes), which
    faults them in fastest. In 256 KiB steps, with plain and with non-temporal stores; the floor
    is the faster. Only on the shared-memory transport."""
    from jaxring._jaxring import advise_huge_pages, shm_exchange

    if COMM.transport != "shm":
        return {}
    src = np.random.default_rng(COMM.rank).standard_normal(max(1, nbytes // 4), np.float32)

    def run(streamed):
        dst = np.empty_like(src)
        advise_huge_pages(dst)  # as jaxring advises its own outputs
        shm_exchange(COMM.key, dst, src, 256 << 10, streamed, 1)

    return {f"{FRESH_EXCHANGE_FLOOR}[{way}]": (lambda x, xj, streamed=streamed: run(streamed), {})
            for way, streamed in (("plain", False), ("streamed", True))}


def quiet_ceiling(world) -> float:
    """The copy bandwidth, on rank 0 (0.0 elsewhere), measured while the other ranks sleep: not
    while they compile their first programs, nor while they spin in MPI's barrier."""
    world.Barrier()
    ceiling = memory_bandwidth_gbps() if world.rank == 0 else 0.0
    arrived = world.Ibarrier()
    while not arrived.Test():
        time.sleep(0.005)
    return ceiling


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="four sizes; writes no files unless --name")
    parser.add_argument("--sizes", type=int, nargs="*", help="bytes per rank (default: 4 B..64 MiB)")
    parser.add_argument("--name", default=None,
                        help="results file (default allreduce_mpi-cpu-n{N}[-bound])")
    parser.add_argument("--render", nargs="+", metavar="NAME",
                        help="measure nothing: rewrite each results/NAME.md from its JSON")
    args = parser.parse_args()
    if args.render:
        for name in args.render:
            run = json.loads((RESULTS / f"{name}.json").read_text())
            (RESULTS / f"{name}.md").write_text(markdown(
                run["rows"], run["environment"], run["ranks"], run["copy_bandwidth_gbps"]))
        return
    n = COMM.size
    sizes = args.sizes or ([4, 4096, 1 << 20, 4 << 20] if args.quick else
                           [4 ** k for k in range(1, 14)])
    ceiling = quiet_ceiling(WORLD)
    rows = []
    for nbytes in sizes:
        x = np.random.default_rng(COMM.rank).standard_normal(max(1, nbytes // 4), np.float32)
        xj = jax.device_put(x)
        cases = implementations()
        if nbytes >= COPY_FLOOR_BYTES:
            cases.update(fresh_exchange_floors(nbytes))
        medians = medians_in_turns(
            {name: lambda fn=fn: fn(x, xj) for name, (fn, _) in cases.items()}, world=WORLD,
            context=lambda name: jaxring.config.override(**cases[name][1]))
        for name, seconds in medians.items():
            algbw = nbytes / seconds / 1e9
            rows.append({"impl": name, "bytes": nbytes, "seconds": seconds, "algbw_gbps": algbw,
                         "busbw_gbps": algbw * bus_factor("all_reduce", n)})
        if nbytes <= LOOP_MAX_BYTES:
            loops = loop_count(nbytes)
            floors = (copy_floors(nbytes, loops) if nbytes >= COPY_FLOOR_BYTES else
                      {TRAFFIC_FLOOR: traffic_floor(nbytes, n, loops)})
            floors.update(exchange_floors(nbytes, loops))
            cases = {**loop_implementations(loops),
                     **{name: (run, {}) for name, run in floors.items()}}
            medians = medians_in_turns(
                {name: lambda fn=fn: fn(x, xj) for name, (fn, _) in cases.items()}, world=WORLD,
                context=lambda name: jaxring.config.override(**cases[name][1]))
            for name, seconds in medians.items():
                rows.append({"impl": name, "bytes": nbytes, "seconds": seconds / loops,
                             "per_op": True, "loops": loops})
        if COMM.rank == 0:
            line = "  ".join(f"{r['impl']} {r['seconds'] * 1e6:.1f} us"
                             for r in rows if r["bytes"] == nbytes)
            print(f"n={n} {human_bytes(nbytes):>9s}: {line}", flush=True)
    binding = rank_binding(WORLD)
    # Not over the committed runs, which targets.py and scaling_model.py read.
    if COMM.rank == 0 and not (args.quick and args.name is None):
        env = environment(MPI)
        bound, env["binding"] = binding
        name = args.name or f"allreduce_mpi-cpu-n{n}" + ("-bound" if bound else "")
        write_results(name, {"environment": env, "ranks": n, "copy_bandwidth_gbps": ceiling,
                             "exchange_reads": exchange_reads(n), "rows": rows},
                      markdown(rows, env, n, ceiling))
        plot_time_per_size(rows, f"all-reduce, {n} processes", RESULTS / f"{name}.png")


def lone_floor(rows, nbytes: int, huge_pages: int) -> float | None:
    """The largest floor under a lone all-reduce of `nbytes` in this run that jaxring's own time
    there does not refute: the effect floor (below huge_pages), the loop table's copy floor, and
    the launch, alone and followed by the exchange or the traffic (common.launch_floors)."""
    by = {(r["impl"], r["bytes"]): r["seconds"] for r in rows if not r.get("per_op")}
    floors = [by[(EFFECT_FLOOR, nbytes)] if nbytes < huge_pages else None,
              looped_floor(rows, nbytes, COPY_FLOOR),
              *launch_floors(rows, nbytes, huge_pages).values()]
    standing = [f for f in floors if f is not None and f <= by[("jaxring.all_reduce", nbytes)]]
    return max(standing, default=None)


def markdown(rows, env, n, ceiling) -> str:
    names = list(dict.fromkeys(r["impl"] for r in rows if not r.get("per_op")))
    floors = (TRAFFIC_FLOOR, COPY_FLOOR, EXCHANGE_FLOOR)
    looped_names = list(dict.fromkeys(r["impl"] for r in rows
                                      if r.get("per_op") and not r["impl"].startswith(floors)))

    by = {(r["impl"], r["bytes"]): r for r in rows}
    huge_pages = jaxring.config.get().huge_page_bytes
    lines = [
        f"# All-reduce across {n} processes (one CPU device each): jaxring vs mpi4jax vs mpi4py",
        "",
        f"{env['cpu']}, {env['cores']} cores; python {env['python']}, jax {env['jax']}; "
        f"{env['mpi']}, mpi4jax {env.get('mpi4jax', '?')}; {env['date']}; {env['binding']}. "
        f"Copy bandwidth: {ceiling:.1f} GB/s."
        f"{steal_sentence(env)} "
        "Median time from the first rank's start to the last rank's end (after a barrier), the "
        "implementations taking turns call by call; glibc malloc keeps freed "
        "memory (mallopt) in every process. busbw = algbw x 2(n-1)/n.", "",
        "| size | " + " | ".join(f"{m} (us)" for m in names) +
        " | jaxring busbw (GB/s) | vs mpi4jax | vs mpi4py | jaxring[mpi] vs mpi4py | target (us) "
        "| floor / target |",
        "|---|" + "---|" * (len(names) + 6)]
    for nbytes in sorted({r["bytes"] for r in rows}):
        ours = by[("jaxring.all_reduce", nbytes)]
        cells = " | ".join(f"{by[(m, nbytes)]['seconds'] * 1e6:.1f}" if (m, nbytes) in by
                           else "" for m in names)
        target = issue3_target(by[("mpi4jax.allreduce", nbytes)]["seconds"],
                               by[("mpi4py Allreduce", nbytes)]["seconds"], nbytes)
        floor = lone_floor(rows, nbytes, huge_pages)
        bound = "-" if floor is None else f"{floor / target:.2f}"
        lines.append(
            f"| {human_bytes(nbytes)} | {cells} | {ours['busbw_gbps']:.2f} | "
            f"{by[('mpi4jax.allreduce', nbytes)]['seconds'] / ours['seconds']:.1f}x | "
            f"{by[('mpi4py Allreduce', nbytes)]['seconds'] / ours['seconds']:.1f}x | "
            f"{by[('mpi4py Allreduce', nbytes)]['seconds'] / by[('jaxring[mpi]', nbytes)]['seconds']:.1f}x | "
            f"{target * 1e6:.1f} | {bound} |")
    lines += ["", "vs columns: the rival's time over jaxring's (above 1: jaxring is faster).", "",
              f"`{EFFECT_FLOOR}`: a lone jitted program that reads the input, writes the output in "
              "one XLA elementwise pass and carries jaxring's ordered effect, communicating "
              "nothing (`common.with_jaxring_effect`); every lone call of a collective with the "
              "effect costs at least this, unless XLA's pass is a slower way to touch the bytes "
              "than the collective's own: where jaxring takes less, as from 4 KiB it often "
              "does, the floor bounds nothing (`targets.py` counts only the floors that stand). "
              f"`{LAUNCH_FLOOR}`: a lone jitted program that carries the effect and returns its "
              "input, which XLA copies into a fresh output. "
              f"`{FRESH_EXCHANGE_FLOOR}` (from {human_bytes(COPY_FLOOR_BYTES)}): the loop "
              "table's exchange, once, into a fresh output advised onto huge pages as jaxring's "
              "are: from 32 MiB a fresh output is a new mapping, which the kernel zeroes page "
              "by page for every implementation (`fresh_exchange_floors`). "
              "`target`: the time issue 3 asks for, mpi4py's below "
              "1 MiB (no slower than mpi4py), from 1 MiB the smaller of mpi4py's / 2 and "
              "mpi4jax's / 5. `floor / target`: the largest floor under a lone call that "
              "jaxring's time does not refute (`lone_floor`: the effect floor below "
              "`huge_page_bytes`, 8 MiB, where jaxring's outputs start to be advised onto huge "
              "pages and fault in faster than the floor's XLA output; the launch, the least "
              "effect or launch floor at this size or a smaller one; the loop table's copy "
              "floor, since a lone all-reduce, too, reads every input byte and writes every "
              "output byte; and the launch followed by the larger of the loop table's exchange "
              "floor and the fresh-output exchange, or by its traffic floor, since a lone call "
              "launches and then moves at least what one in a loop moves). Above 1: no "
              "collective carrying the effect reaches the target in a lone call, however it "
              "moves the data.", "",
              "## Per all-reduce inside one compiled loop (program launch excluded)", "",
              "Each implementation all-reduces the same input again and again, with nothing else "
              "in the loop (mpi4py: a Python loop of Allreduce on the same numpy buffers).", "",
              f"`floor`: up to 4 MiB the `{TRAFFIC_FLOOR}`, every rank at once copying its input "
              "as often as it takes to move as many bytes as it must read and write per all-reduce "
              f"when processes cannot read each other's buffers, (5 - 2/{n}) x the size "
              "(`traffic_floor` in the script); while the copies stay in the cache, no "
              "all-reduce between processes that stage through shared memory takes less. From "
              f"16 MiB the `{COPY_FLOOR}`, every rank at once copying its input once into an "
              "output-sized buffer, the faster of glibc's memcpy and non-temporal stores "
              "(`copy_floors`): every all-reduce reads each input byte and "
              "writes each output byte, and there the ranks' inputs and outputs no longer fit "
              "the cache, so no all-reduce takes less. Both floors are timed like every other "
              "case, from the first rank's start to the last rank's end, so that ranks sharing "
              "a core take turns at their copies as they do at an all-reduce. (The traffic floor "
              "bounds nothing at 16 MiB: its whole-buffer copies go through memory, while "
              "jaxring's transport works in 1 MiB chunks that stay in the cache.) "
              f"`{EXCHANGE_FLOOR}`: every rank at once stages its input in shared memory and, "
              "once its two left neighbours have, copies the first's into an output, adding the "
              f"second's over the last (n - 2)/n of the elements, so that it reads "
              f"{exchange_reads(n):g} x the size from shared memory, the fewest reads of any "
              "all-reduce; in 256 KiB or 1 MiB steps with plain or non-temporal stores, the "
              "fastest of the four (`exchange_floors`): the least any all-reduce between "
              "processes must move from core to core, which the traffic floor leaves out. "
              "`floor` in the ratios is the "
              "larger of the two floors. `target` is the time issue 3 asks for (mpi4py's below "
              "1 MiB; from it, the lesser of mpi4jax's / 5 and mpi4py's / 2, as `targets.py` "
              "judges it); `floor / target` above 1: no all-reduce reaches it. "
              "`plain stores` forces plain stores into shared memory; where it is slower than "
              "the default, this VM's two cores sat on different dies of the host while it was "
              "measured (README, \"Across processes\").", "",
              "| size | all-reduces per program | " +
              " | ".join(f"{m} (us)" for m in looped_names) +
              " | traffic or copy floor (us) | exchange floor (us) | vs mpi4jax | vs mpi4py "
              "| jaxring / floor | target (us) | floor / target |",
              "|---|---|" + "---|" * (len(looped_names) + 7)]
    for nbytes in sorted({r["bytes"] for r in rows if r.get("per_op")}):
        cells = " | ".join(f"{by[(m, nbytes)]['seconds'] * 1e6:.1f}" for m in looped_names)
        ours = by[("jaxring.all_reduce in a loop", nbytes)]["seconds"]
        theirs = by[("mpi4jax.allreduce in a loop", nbytes)]["seconds"]
        memory = looped_floor(rows, nbytes, (TRAFFIC_FLOOR, COPY_FLOOR))
        exchange = looped_floor(rows, nbytes, EXCHANGE_FLOOR)
        floor = max(memory, exchange or 0.0)
        mpi4py = by[("mpi4py Allreduce in a loop", nbytes)]["seconds"]
        target = issue3_target(theirs, mpi4py, nbytes)
        lines.append(
            f"| {human_bytes(nbytes)} | {by[(looped_names[0], nbytes)]['loops']} | {cells} | "
            f"{memory * 1e6:.1f} | {'-' if exchange is None else f'{exchange * 1e6:.1f}'} | "
            f"{theirs / ours:.1f}x | {mpi4py / ours:.1f}x | "
            f"{ours / floor:.2f} | {target * 1e6:.1f} | {floor / target:.2f} |")
    return "\n".join(lines) + "\n"



if __name__ == "__main__":
    main()
