"""A layer-sharded pipeline over processes: jaxring.parallel.pipeline with a process communicator
for the axis, against one process running all the layers, measured in one run.

    mpiexec -bind-to core -n 2 python benchmarks/pipeline_mpi.py     # also -n 4

The workload of benchmarks/p2p.py's pipeline table (8 dense tanh layers of 256 units, 16 rows per
stream, 100 ticks per program). There, the stages are devices of one process, and XLA's CPU
runtime keeps about 1.55 cores busy for one device, so two devices that hand nothing on reach only
1.2-1.4x one device. Here every stage is a process with one device and its own XLA thread pool,
bound to its own core, so a stage's runtime stays on its core. Cases, taking turns run by run
(every run starts after a barrier and counts from the first rank's start to the last rank's end,
so that the no-hand-off ceiling pays for ranks that share a core, as the pipeline does):
- one process (rank 0; the others sleep) running all layers, one stream at a time, and the
  n streams batched together;
- no hand-off: every rank runs its own stage on its own stream and hands nothing on (the
  ceiling for any hand-off);
- the n-stage jaxring pipeline: rank r holds layers [rL/n, (r+1)L/n) and n streams go round the
  ring (pipeline_step with ring=True inside lax.scan), the activations moving over jaxring's MPI
  point-to-point path; every tick completes one pass in steady state.
Throughput is full passes (all layers, one stream) per second. Writes
benchmarks/results/pipeline_mpi-cpu-n{N}[-bound].{json,md}.
"""

from __future__ import annotations

import os
import sys
import time

os.environ["XLA_FLAGS"] = ""  # one CPU device per process

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jaxring.mpi  # noqa: E402
from jaxring.parallel import pipeline  # noqa: E402
from common import (PIPELINE_LAYERS, PIPELINE_ROWS, PIPELINE_TICKS,  # noqa: E402
                    PIPELINE_WIDTH, dense_layer, environment, medians_in_turns,
                    pipeline_workload, rank_binding, steal_sentence, takes_no_arguments,
                    write_results)

COMM = jaxring.mpi.world()
WORLD = MPI.COMM_WORLD


def cases(n: int, rank: int) -> dict:
    """name -> (run, passes per run)."""
    layers, streams = pipeline_workload(n)
    stage_fn = pipeline.scan_layers(dense_layer)
    whole = jax.tree.map(lambda leaf: jnp.asarray(leaf[0]), pipeline.stack_stages(layers, 1))
    mine = jax.tree.map(lambda leaf: jnp.asarray(leaf[rank:rank + 1]),
                        pipeline.stack_stages(layers, n))

    def ticks(tick):
        return jax.jit(lambda params, x: lax.scan(lambda c, _: (tick(params, c), None), x, None,
                                                  length=PIPELINE_TICKS)[0])

    all_layers = ticks(lambda params, c: stage_fn(params, c))
    own_stage = ticks(lambda params, c: stage_fn(pipeline.local_stage(params), c))
    ring = ticks(lambda params, c: pipeline.pipeline_step(stage_fn, params, c, COMM,
                                                          ring=True)[1])
    stream = jnp.asarray(streams[rank])
    batched = jnp.asarray(streams.reshape(n * PIPELINE_ROWS, PIPELINE_WIDTH))

    def on_rank_0(fn):
        """Runs fn on rank 0 while the other ranks sleep (an MPI wait would spin, and with more
        ranks than cores take the core rank 0 runs on)."""
        def run():
            if rank == 0:
                fn().block_until_ready()
                for other in range(1, n):
                    WORLD.send(None, dest=other, tag=7)
                return
            request = WORLD.irecv(source=0, tag=7)
            while not request.test()[0]:
                time.sleep(50e-6)
        return run

    return {
        "one process, one stream at a time": (
            on_rank_0(lambda: all_layers(whole, stream)), PIPELINE_TICKS),
        f"one process, {n} streams batched": (
            on_rank_0(lambda: all_layers(whole, batched)), n * PIPELINE_TICKS),
        f"no hand-off (ceiling), {n} processes": (
            lambda: own_stage(mine, stream).block_until_ready(), PIPELINE_TICKS),
        f"jaxring pipeline, {n} processes": (
            lambda: ring(mine, stream).block_until_ready(), PIPELINE_TICKS),
    }


def main() -> None:
    takes_no_arguments(__doc__)
    n, rank = COMM.size, COMM.rank
    table = cases(n, rank)
    medians = medians_in_turns({name: run for name, (run, _) in table.items()}, world=WORLD,
                               min_rounds=20)
    rows = [{"case": name, "passes_per_s": passes / medians[name]}
            for name, (_, passes) in table.items()]
    for row in rows:
        row["speedup"] = row["passes_per_s"] / rows[0]["passes_per_s"]
    binding = rank_binding(WORLD)
    if rank != 0:
        return
    env = environment(MPI)
    bound, env["binding"] = binding
    for row in rows:
        print(f"n={n} {row['case']:40s} {row['passes_per_s']:9.1f} passes/s  "
              f"x{row['speedup']:.2f}", flush=True)
    lines = [
        f"# Pipeline over {n} processes: jaxring.parallel.pipeline with a process communicator",
        "",
        f"{env['cpu']}, {env['cores']} cores; python {env['python']}, jax {env['jax']}; "
        f"{env['date']}; {env['binding']}.{steal_sentence(env)}", "",
        f"{PIPELINE_LAYERS} dense tanh layers of {PIPELINE_WIDTH} units, {PIPELINE_ROWS} rows per "
        f"stream, {PIPELINE_TICKS} ticks per program. Full passes (all layers, one stream) per "
        "second; speedup against one process running one stream at a time. Medians of at least "
        "20 runs, the cases taking turns; each run counts from the first rank's start to the "
        "last rank's end.", "",
        "| case | passes/s | speedup |", "|---|---|---|"]
    lines += [f"| {r['case']} | {r['passes_per_s']:.0f} | {r['speedup']:.2f} |" for r in rows]
    name = f"pipeline_mpi-cpu-n{n}" + ("-bound" if bound else "")
    write_results(name, {"environment": env, "processes": n, "rows": rows},
                  "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
