"""WaveNet sampling speed: samples/s per stream and in total, and the real-time factor at 16 kHz,
for every sampler measured side by side in one run.

Variants: (a) naive (the whole receptive field recomputed per sample), the per-step Python loop,
(b) the plain incremental sampler (`lax.scan` + ring buffers: what a competent JAX user writes,
the rival), (c) layer-sharded over 2 devices with jaxring.ppermute (and with lax.ppermute, and on
1 device for the scaling ratio), (d) the fused C++ step with float32 and with float16 weights,
on one thread and on two, and (c) with (d): layer-sharded where each stage is the fused loop over
its layers, handing on every step through jaxring's point-to-point mailboxes (1 and 2 devices).
Weights are random: speed does not depend on their values.

    python benchmarks/sampling.py            # full run (about 25 minutes on 2 busy cores)
    python benchmarks/sampling.py --quick    # one config, fewer samples, no files (but --name)

On a GPU (JAX's default device) it measures the variants that run on one device of any platform:
(a), the Python loop, (b) and (d) with the CUDA kernel (xla_ffi/cuda/wavenet_sampler.h), and
writes benchmarks/results/sampling-gpu.*; `--one-device` selects the same set on CPU.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common  # noqa: E402
from models.wavenet import fused_sampler, model, pipeline_sampler, sampler  # noqa: E402
from models.wavenet.configs.default import ModelConfig  # noqa: E402

REAL_TIME_RATE = 16000  # samples/s of one real-time 16 kHz stream
CONFIGS = {  # residual / skip / layers
    "32/128/20": ModelConfig(residual_channels=32, skip_channels=128, num_layers=20),
    "64/256/20": ModelConfig(residual_channels=64, skip_channels=256, num_layers=20),
    "128/256/20": ModelConfig(residual_channels=128, skip_channels=256, num_layers=20),
}
RIVAL = "incremental"


def seconds_per_run(table: dict, repeats: int) -> dict:
    """name -> median wall time of its function, after one warm-up call each (compilation), the
    variants taking turns run by run (common.medians_in_turns): every ratio then compares the
    same stretch of this VM's drifting speed, not runs minutes apart."""
    return common.medians_in_turns(
        {name: (lambda fn=fn: jax.block_until_ready(fn())) for name, (fn, _) in table.items()},
        budget_seconds=0.0, min_rounds=repeats, warmups=1)


# The variants that run on one device of any platform (the rest need CPU devices: the thread
# teams of the C++ kernel, and 2 devices of one process for the layer-sharded samplers).
ONE_DEVICE = ("naive", "python_loop", "incremental", "fused_f32", "fused_f16")


def variants(weights, config, key, batch, steps, mesh1, mesh2):
    """name -> (function, samples per stream it draws). Without `mesh2`, ONE_DEVICE only."""
    s = steps
    out = {
        "naive": (lambda: sampler.sample_naive(weights, config, key, s["naive"], batch),
                  s["naive"]),
        "python_loop": (lambda: sampler.sample_python_loop(weights, config, key, s["loop"], batch),
                        s["loop"]),
        "incremental": (lambda: sampler.sample_incremental(weights, config, key, s["scan"],
                                                           batch), s["scan"]),
        "fused_f32": (lambda: fused_sampler.sample_fused(weights, config, key, s["fused"], batch),
                      s["fused"]),
        "fused_f16": (lambda: fused_sampler.sample_fused(weights, config, key, s["fused"], batch,
                                                         weight_dtype=jnp.float16), s["fused"]),
        # Two threads: a share of the streams each, or (one stream) half of every layer each.
        "fused_f16_2threads": (lambda: fused_sampler.sample_fused(
            weights, config, key, s["fused"], batch, weight_dtype=jnp.float16, threads=2),
            s["fused"]),
    }
    if mesh2 is None:
        return {name: out[name] for name in ONE_DEVICE}
    for name, mesh, permute in (("sharded_1dev", mesh1, "jaxring"),
                                ("sharded_2dev", mesh2, "jaxring"),
                                ("sharded_2dev_lax", mesh2, "lax")):
        out[name] = (lambda mesh=mesh, permute=permute: pipeline_sampler.sample_layer_sharded(
            weights, config, key, s["scan"], batch, mesh, "stage", permute=permute), s["scan"])
    # (c) with (d): each stage a fused C++ loop over its layers, handing on every step through
    # jaxring's point-to-point mailboxes (float16 weights, as fused_f16).
    for name, mesh in (("sharded_fused_1dev", mesh1), ("sharded_fused_2dev", mesh2)):
        out[name] = (lambda mesh=mesh: pipeline_sampler.sample_layer_sharded_fused(
            weights, config, key, s["fused"], batch, mesh, "stage", weight_dtype=jnp.float16),
            s["fused"])
    return out


def plot(path, rows, names):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({r["config"] for r in rows}, key=list(CONFIGS).index)
    figure, axes = plt.subplots(1, len(configs), figsize=(5 * len(configs), 4), squeeze=False)
    for axis, config in zip(axes[0], configs):
        for name in names:
            points = [(r["batch"], r["total_samples_per_s"]) for r in rows
                      if r["config"] == config and r["variant"] == name]
            if points:
                axis.plot(*zip(*points), "o-", label=name)
        axis.axhline(REAL_TIME_RATE, color="grey", linestyle="--", label="1 stream real time")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("streams (batch)")
        axis.set_ylabel("samples/s, all streams")
        axis.set_title(f"WaveNet {config}")
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="one config, fewer samples; writes files only with --name")
    parser.add_argument("--configs", nargs="*", default=None, choices=list(CONFIGS))
    parser.add_argument("--batches", nargs="*", type=int, default=None)
    parser.add_argument("--variants", nargs="*", default=None)
    parser.add_argument("--one-device", action="store_true",
                        help="only the variants that run on one device (always so on a GPU)")
    parser.add_argument("--name", default=None, help="results file (default sampling-PLATFORM)")
    args = parser.parse_args()
    if args.batches is not None and min(args.batches, default=1) < 1:
        parser.error(f"--batches must be at least 1, got {args.batches}")
    devices = jax.devices()
    platform = devices[0].platform
    one_device = args.one_device or platform != "cpu" or len(devices) < 2
    results_name = args.name or f"sampling-{'gpu' if platform in ('cuda', 'gpu') else platform}"
    configs = args.configs or (["64/256/20"] if args.quick else list(CONFIGS))
    batches = args.batches or ([1, 4] if args.quick else [1, 4, 16])
    steps = ({"naive": 2, "loop": 100, "scan": 1000, "fused": 2000} if args.quick else
             {"naive": 2, "loop": 200, "scan": 4000, "fused": 16000})
    repeats = 1 if args.quick else 3
    mesh1 = jax.make_mesh((1,), ("stage",), devices=devices[:1])
    mesh2 = None if one_device else jax.make_mesh((2,), ("stage",), devices=devices[:2])
    key = jax.random.key(0)

    rows = []
    names = None
    for config_name in configs:
        config = CONFIGS[config_name]
        weights = model.init_weights(config)
        for batch in batches:
            table = variants(weights, config, key, batch, steps, mesh1, mesh2)
            unknown = sorted(set(args.variants or ()) - set(table))
            if unknown:  # measuring none of them printed an empty table
                parser.error(f"--variants {' '.join(unknown)}: not a variant of this run "
                             f"({', '.join(table)})")
            names = names or list(table)
            table = {name: v for name, v in table.items()
                     if not args.variants or name in args.variants}
            medians = seconds_per_run(table, repeats)
            for name, (fn, samples) in table.items():
                seconds = medians[name]
                per_stream = samples / seconds
                rows.append({"config": config_name, "batch": batch, "variant": name,
                             "samples_per_stream": samples, "seconds": seconds,
                             "samples_per_s_per_stream": per_stream,
                             "total_samples_per_s": per_stream * batch,
                             "real_time_factor": per_stream / REAL_TIME_RATE})
                print(f"{config_name:>10} B={batch:<3} {name:<17} {per_stream:10.0f} samples/s "
                      f"per stream, {per_stream * batch:10.0f} total, "
                      f"{per_stream / REAL_TIME_RATE:6.3f}x real time", flush=True)

    def find(config, batch, variant):
        for r in rows:
            if (r["config"], r["batch"], r["variant"]) == (config, batch, variant):
                return r["total_samples_per_s"]
        return None

    for r in rows:
        rival = find(r["config"], r["batch"], RIVAL)
        r["vs_incremental"] = r["total_samples_per_s"] / rival if rival else None

    lines = [
        "# WaveNet sampling (benchmarks/sampling.py)",
        "",
        f"{common.environment()}",
        "",
        "Samples/s per stream and in total; real-time factor = samples/s per stream / 16,000. "
        f"`vs (b)` is the ratio to the plain incremental sampler ({RIVAL}: one `lax.scan` with "
        f"ring buffers) measured in the same run. Medians of {repeats} runs, the variants taking "
        "turns run by run. Random weights (speed does not depend on them).",
        "",
        "| config | streams | variant | samples/s per stream | samples/s total "
        "| real-time factor (16 kHz) | vs (b) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['vs_incremental']:.2f}x" if r["vs_incremental"] else "-"
        lines.append(f"| {r['config']} | {r['batch']} | {r['variant']} | "
                     f"{r['samples_per_s_per_stream']:,.0f} | {r['total_samples_per_s']:,.0f} | "
                     f"{r['real_time_factor']:.3f} | {ratio} |")
    lines += ["", "Ratios within this run:", ""]
    for config_name in configs:
        for batch in batches:
            incremental, naive = find(config_name, batch, RIVAL), find(config_name, batch, "naive")
            sharded = [(kind, find(config_name, batch, f"sharded{kind}_1dev"),
                        find(config_name, batch, f"sharded{kind}_2dev"))
                       for kind in ("", "_fused")]
            fastest = max((r for r in rows if r["config"] == config_name and r["batch"] == batch),
                          key=lambda r: r["total_samples_per_s"], default=None)
            parts = []
            if incremental and naive:
                parts.append(f"incremental / naive {incremental / naive:.0f}x "
                             f"(receptive field {model.receptive_field(CONFIGS[config_name])})")
            for kind, one, two in sharded:
                if one and two:
                    parts.append(f"layer-sharded{kind.replace('_', ' ')} 2 devices / 1 device "
                                 f"{two / one:.2f}x")
            if fastest and incremental:
                parts.append(f"fastest ({fastest['variant']}) / incremental "
                             f"{fastest['total_samples_per_s'] / incremental:.2f}x")
            if parts:
                lines.append(f"- {config_name}, {batch} streams: " + "; ".join(parts))
    markdown = "\n".join(lines) + "\n"
    print(markdown)
    if args.quick and args.name is None:  # not over the committed full run's results
        return
    payload = {"environment": common.environment(), "steps": steps, "rows": rows}
    path = common.write_results(results_name, payload, markdown)
    plot(path.with_suffix(".png"), rows, names or [])
    print(f"wrote {path}, .md and .png")


if __name__ == "__main__":
    main()
