"""Point-to-point latency and bandwidth: jaxring.ppermute against lax.ppermute, measured in one run.

    python benchmarks/p2p.py            # 2, 4, 8 devices, 4 B .. 64 MiB per device
    python benchmarks/p2p.py --quick    # 2 and 8 devices, three sizes, no files (but --name)

Every measurement runs 16 to 200 steps inside one compiled lax.scan, so that the program launch
is spread over many hops, and the time per step is the time of one hop:
- ring pass: every device sends to its right neighbour at once (the pipeline's hand-off);
- ping-pong: device 0 sends to device 1 and back (two hops per step; the other devices idle).
Bandwidth is bytes moved per device per hop time.

It also measures the pipeline (jaxring.parallel.pipeline): an n-stage ring of identical dense
layers with n interleaved streams, against the same layers on one device running the same
streams one after another, and batched together. The cases of each table row group take turns,
one call each per round (common.medians_in_turns), so that every ratio compares the same stretch of
this VM's drifting speed. Writes benchmarks/results/p2p-cpu.{json,md,png}.
"""

from __future__ import annotations

import argparse
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
from jaxring.parallel import pipeline  # noqa: E402
from common import (PIPELINE_LAYERS, PIPELINE_ROWS, PIPELINE_TICKS,  # noqa: E402
                    PIPELINE_WIDTH, RESULTS, dense_layer, environment, human_bytes,
                    keep_freed_memory, medians_in_turns, memory_bandwidth_gbps, pipeline_workload,
                    steal_sentence, write_results)

IMPLEMENTATIONS = {"jaxring.ppermute": jaxring.ppermute, "lax.ppermute": lax.ppermute}


def patterns(n: int) -> dict:
    ring = [(i, (i + 1) % n) for i in range(n)]
    return {
        "ring pass": (1, lambda permute, v: permute(v, "i", ring)),
        "ping-pong": (2, lambda permute, v: permute(permute(v, "i", [(0, 1)]), "i", [(1, 0)])),
    }


def hop_case(n: int, nbytes: int, pattern: str, permute):
    """(run, hops per run): `run()` makes `steps` steps of the pattern in one program."""
    mesh = jax.make_mesh((n,), ("i",), devices=jax.devices()[:n])
    count = max(1, nbytes // 4)
    hops, step = patterns(n)[pattern]
    # At least 16 steps, so that the launch (dearer for jaxring's ordered effect, by ~0.2 ms)
    # adds little to a hop; 4 steps added ~45 us to every 4 MiB hop.
    steps = int(np.clip((32 << 20) // max(nbytes, 1), 16, 200))

    def loop(v):
        return lax.scan(lambda c, _: (step(permute, c), None), v, length=steps)[0]

    f = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    x = jax.device_put(np.random.default_rng(0).standard_normal(n * count, np.float32),
                       NamedSharding(mesh, P("i")))
    return (lambda: f(x).block_until_ready()), steps * hops


def pipeline_rows(n: int) -> list[dict]:
    """Full passes (all layers, one stream) per second: an n-stage ring with n streams delivers
    one per tick in steady state; one device runs them one stream at a time, or batched."""
    layers, streams = pipeline_workload(n)
    stage_fn = pipeline.scan_layers(dense_layer)
    whole = pipeline.stack_stages(layers, 1)
    whole = jax.tree.map(lambda leaf: jnp.asarray(leaf[0]), whole)
    one_device = jax.jit(lambda x: lax.scan(lambda c, _: (stage_fn(whole, c), None), x,
                                            length=PIPELINE_TICKS)[0])
    batched = streams.reshape(n * PIPELINE_ROWS, PIPELINE_WIDTH)
    # case -> (run, passes per run); the cases take turns.
    cases = {
        "one device, one stream at a time": (
            lambda: one_device(streams[0]).block_until_ready(), PIPELINE_TICKS),
        f"one device, {n} streams batched": (
            lambda: one_device(batched).block_until_ready(), n * PIPELINE_TICKS),
    }
    mesh = jax.make_mesh((n,), ("i",), devices=jax.devices()[:n])
    stacked = jax.device_put(pipeline.stack_stages(layers, n), NamedSharding(mesh, P("i")))
    ring = [(s, (s + 1) % n) for s in range(n)]

    def jaxring_tick(params, carry):
        return pipeline.pipeline_step(stage_fn, params, carry, "i", ring=True)[1]

    def lax_tick(params, carry):
        return lax.ppermute(stage_fn(pipeline.local_stage(params), carry), "i", ring)

    def no_hand_off(params, carry):
        return stage_fn(pipeline.local_stage(params), carry)

    # The ceiling: every device runs its stage on its own stream and hands nothing on, so the
    # devices only share the cores. No pipeline of XLA-compiled stages can beat it.
    x = jax.device_put(streams, NamedSharding(mesh, P("i")))
    for name, tick in (("no hand-off (ceiling)", no_hand_off), ("jaxring pipeline", jaxring_tick),
                       ("lax.ppermute pipeline", lax_tick)):
        def body(params, x, tick=tick):
            return lax.scan(lambda c, _: (tick(params, c), None), x[0], None,
                            length=PIPELINE_TICKS)[0][None]

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("i"), P("i")), out_specs=P("i")))
        cases[f"{name}, {n} stages"] = (lambda f=f: f(stacked, x).block_until_ready(),
                                        PIPELINE_TICKS)
    medians = medians_in_turns({name: run for name, (run, _) in cases.items()})
    rows = [{"case": name, "passes_per_s": passes / medians[name]}
            for name, (_, passes) in cases.items()]
    for row in rows:
        row["n"] = n
        row["speedup_vs_one_stream"] = row["passes_per_s"] / rows[0]["passes_per_s"]
        print(f"n={n} {row['case']:40s} {row['passes_per_s']:9.1f} passes/s  "
              f"x{row['speedup_vs_one_stream']:.2f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer device counts and sizes; writes no files unless --name")
    parser.add_argument("--name", default=None, help="results file (default p2p-cpu)")
    args = parser.parse_args()
    device_counts = [2, 8] if args.quick else [2, 4, 8]
    sizes = [4, 4096, 1 << 20] if args.quick else [4 ** k for k in range(1, 14)]
    keep_freed_memory()
    ceiling = memory_bandwidth_gbps()
    rows = []
    for n in device_counts:
        for pattern in patterns(n):
            for nbytes in sizes:
                cases = {name: hop_case(n, nbytes, pattern, permute)
                         for name, permute in IMPLEMENTATIONS.items()}
                medians = medians_in_turns({name: run for name, (run, _) in cases.items()})
                for name, (_, hops) in cases.items():
                    seconds = medians[name] / hops
                    rows.append({"n": n, "pattern": pattern, "bytes": nbytes, "impl": name,
                                 "hop_seconds": seconds, "gbps": nbytes / seconds / 1e9})
                ours, theirs = rows[-2]["hop_seconds"], rows[-1]["hop_seconds"]
                print(f"n={n} {pattern:9s} {human_bytes(nbytes):>9s}: jaxring "
                      f"{ours * 1e6:9.2f} us  lax {theirs * 1e6:9.2f} us  "
                      f"ratio {ours / theirs:5.2f}", flush=True)
    pipeline_results = [row for n in device_counts for row in pipeline_rows(n)]
    if args.quick and args.name is None:  # not over the committed full run's results
        return
    env = environment()
    write_results(args.name or "p2p-cpu", {"environment": env, "copy_bandwidth_gbps": ceiling,
                                           "rows": rows, "pipeline": pipeline_results},
                  markdown(rows, env, ceiling) + pipeline_markdown(pipeline_results))
    plot(rows, args.name or "p2p-cpu")


def markdown(rows, env, ceiling) -> str:
    lines = [
        "# Point-to-point: jaxring.ppermute vs lax.ppermute (CPU devices)", "",
        f"Device: {env['device']} ({env['cpu']}, {env['cores']} cores); python {env['python']}, "
        f"jax {env['jax']}, jaxlib {env['jaxlib']}; {env['date']}. "
        f"Copy bandwidth of this machine: {ceiling:.1f} GB/s.{steal_sentence(env)}", "",
        "Time per hop inside one compiled `lax.scan` of 16 to 200 steps (the launch spread over "
        "them), medians with jaxring "
        "and lax taking turns call by call; ratio = jaxring / lax (below 1: jaxring faster). "
        "Bandwidth = bytes per device / hop time.", "",
        "| n | pattern | size | jaxring (us) | lax (us) | ratio | jaxring GB/s | lax GB/s |",
        "|---|---|---|---|---|---|---|---|"]
    for ours, theirs in zip(rows[::2], rows[1::2]):
        lines.append(
            f"| {ours['n']} | {ours['pattern']} | {human_bytes(ours['bytes'])} | "
            f"{ours['hop_seconds'] * 1e6:.2f} | {theirs['hop_seconds'] * 1e6:.2f} | "
            f"{ours['hop_seconds'] / theirs['hop_seconds']:.2f} | {ours['gbps']:.2f} | "
            f"{theirs['gbps']:.2f} |")
    return "\n".join(lines) + "\n"


def pipeline_markdown(rows) -> str:
    lines = [
        "", f"## Pipeline: {PIPELINE_LAYERS} dense tanh layers ({PIPELINE_WIDTH} units, "
        f"{PIPELINE_ROWS} rows per stream)", "",
        "Full passes (all layers, one stream) per second. An n-stage ring with n interleaved "
        "streams delivers one pass per tick; one device runs the same streams one after another "
        "or batched together; the cases take turns. Speedup is against one device, one stream "
        "at a time.", "",
        "| n | case | passes/s | speedup |", "|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['n']} | {row['case']} | {row['passes_per_s']:.0f} | "
                     f"{row['speedup_vs_one_stream']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(rows, name: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["n"], r["pattern"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.6), squeeze=False)
    for ax, (n, pattern) in zip(axes[0], keys):
        for name, style in zip(IMPLEMENTATIONS, ("o-", "s--")):
            sel = [r for r in rows if r["n"] == n and r["pattern"] == pattern and r["impl"] == name]
            ax.loglog([r["bytes"] for r in sel], [r["hop_seconds"] * 1e6 for r in sel], style,
                      label=name)
        ax.set_title(f"{pattern}, {n} devices")
        ax.set_xlabel("bytes per device")
        ax.set_ylabel("time per hop (us)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=120)


if __name__ == "__main__":
    main()
