"""Point-to-point latency and bandwidth: jaxring.ppermute against lax.ppermute, measured in one run.

    python benchmarks/p2p.py            # 2, 4, 8 devices, 4 B .. 64 MiB per device
    python benchmarks/p2p.py --quick

Every measurement runs `steps` hops inside one compiled lax.scan, so program launch is excluded
and the time per step is the time of one hop:
- ring pass: every device sends to its right neighbour at once (the pipeline's hand-off);
- ping-pong: device 0 sends to device 1 and back (two hops per step; the other devices idle).
Bandwidth is bytes moved per device per hop time. Writes benchmarks/results/p2p-cpu.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jaxring  # noqa: E402
from common import (environment, human_bytes, median_seconds, memory_bandwidth_gbps,  # noqa: E402
                    write_results)

IMPLEMENTATIONS = {"jaxring.ppermute": jaxring.ppermute, "lax.ppermute": lax.ppermute}


def patterns(n: int) -> dict:
    ring = [(i, (i + 1) % n) for i in range(n)]
    return {
        "ring pass": (1, lambda permute, v: permute(v, "i", ring)),
        "ping-pong": (2, lambda permute, v: permute(permute(v, "i", [(0, 1)]), "i", [(1, 0)])),
    }


def hop_seconds(n: int, nbytes: int, pattern: str, permute) -> float:
    mesh = jax.make_mesh((n,), ("i",), devices=jax.devices()[:n])
    count = max(1, nbytes // 4)
    hops, step = patterns(n)[pattern]
    steps = int(np.clip((8 << 20) // max(nbytes, 1), 4, 200))

    def loop(v):
        return lax.scan(lambda c, _: (step(permute, c), None), v, length=steps)[0]

    f = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    x = jax.device_put(np.random.default_rng(0).standard_normal(n * count, np.float32),
                       NamedSharding(mesh, P("i")))
    seconds = median_seconds(lambda: f(x).block_until_ready(), min_repeats=5, budget_seconds=0.5)
    return seconds / (steps * hops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    device_counts = [2, 8] if args.quick else [2, 4, 8]
    sizes = [4, 4096, 1 << 20] if args.quick else [4 ** k for k in range(1, 14)]
    ceiling = memory_bandwidth_gbps()
    rows = []
    for n in device_counts:
        for pattern in patterns(n):
            for nbytes in sizes:
                for name, permute in IMPLEMENTATIONS.items():
                    seconds = hop_seconds(n, nbytes, pattern, permute)
                    rows.append({"n": n, "pattern": pattern, "bytes": nbytes, "impl": name,
                                 "hop_seconds": seconds, "gbps": nbytes / seconds / 1e9})
                ours, theirs = rows[-2]["hop_seconds"], rows[-1]["hop_seconds"]
                print(f"n={n} {pattern:9s} {human_bytes(nbytes):>9s}: jaxring "
                      f"{ours * 1e6:9.2f} us  lax {theirs * 1e6:9.2f} us  "
                      f"ratio {ours / theirs:5.2f}", flush=True)
    env = environment()
    write_results("p2p-cpu", {"environment": env, "copy_bandwidth_gbps": ceiling, "rows": rows},
                  markdown(rows, env, ceiling))
    plot(rows)


def markdown(rows, env, ceiling) -> str:
    lines = [
        "# Point-to-point: jaxring.ppermute vs lax.ppermute (CPU devices)", "",
        f"Device: {env['device']} ({env['cpu']}, {env['cores']} cores); python {env['python']}, "
        f"jax {env['jax']}, jaxlib {env['jaxlib']}; {env['date']}. "
        f"Copy bandwidth of this machine: {ceiling:.1f} GB/s.", "",
        "Time per hop inside one compiled `lax.scan` (launch excluded); ratio = jaxring / lax "
        "(below 1: jaxring faster). Bandwidth = bytes per device / hop time.", "",
        "| n | pattern | size | jaxring (us) | lax (us) | ratio | jaxring GB/s | lax GB/s |",
        "|---|---|---|---|---|---|---|---|"]
    for ours, theirs in zip(rows[::2], rows[1::2]):
        lines.append(
            f"| {ours['n']} | {ours['pattern']} | {human_bytes(ours['bytes'])} | "
            f"{ours['hop_seconds'] * 1e6:.2f} | {theirs['hop_seconds'] * 1e6:.2f} | "
            f"{ours['hop_seconds'] / theirs['hop_seconds']:.2f} | {ours['gbps']:.2f} | "
            f"{theirs['gbps']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(rows) -> None:
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
    fig.savefig(RESULTS_PNG, dpi=120)


RESULTS_PNG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "p2p-cpu.png")

if __name__ == "__main__":
    main()
