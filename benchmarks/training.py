"""Deep Speech 2 data-parallel training step on CPU devices: step time and the share of it spent
in gradient synchronisation, jaxring against lax.psum, measured in one run.

    python benchmarks/training.py            # 1, 2, 4, 8 devices, the tiny config
    python benchmarks/training.py --quick    # a short run, no files

For each device count n (weak scaling: a fixed number of utterances per device) it times, with
inputs placed by device_put + NamedSharding, the full training step three ways:

- jaxring: gradients fused into buckets and averaged by jaxring.all_reduce (the distributed
  optimizer of jaxring.parallel.data), as models/deepspeech/train.py runs;
- lax.psum: the same step with gradients averaged by lax.pmean leaf by leaf;
- no sync: the same step without gradient synchronisation (each replica keeps its own gradient),
  the floor that the two above add to;

and, alone, the gradient synchronisation of a gradient-shaped pytree: jaxring fused, jaxring one
call per leaf, and lax.pmean, each both as one jitted call and 10 times inside one program
(launch excluded). The sync share is the synchronisation's time alone over the jaxring
step time; the table also gives 1 - (no-sync step) / (jaxring step), which is noisier but
counts only what synchronising adds to a step. Batch-norm statistics go through jaxring in every variant. Results go to
benchmarks/results/training-cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import jaxring  # noqa: E402
from common import (environment, keep_freed_memory, medians_in_turns,  # noqa: E402
                    steal_sentence, write_results)
from jaxring.parallel import data as data_parallel  # noqa: E402
from models.deepspeech import configs, data  # noqa: E402
from models.deepspeech import train as training  # noqa: E402

AXIS = training.AXIS
SYNC_LOOP = 10  # gradient syncs per program in the launch-free measurement


def random_batch(rng, batch: int, frames: int, config) -> dict:
    """Utterances of `frames` frames with transcripts of a third as many characters (the rate
    of the synthesised speech) - random values: the step's cost does not depend on them."""
    labels = min(config.max_label_length, frames // 3)
    return {
        "features": rng.standard_normal((batch, frames, data.feature_size(config.sample_rate)))
        .astype(np.float32),
        "feature_mask": np.ones((batch, frames), np.float32),
        "labels": rng.integers(1, data.NUM_CLASSES, (batch, config.max_label_length)).astype(
            np.int32),
        "label_mask": (np.arange(config.max_label_length) < labels).astype(np.float32)[None]
        .repeat(batch, 0),
    }


def step_runner(step, state, batch):
    """One training step per call, each on the state the previous call left."""
    holder = {"state": state}

    def run():
        *new_state, loss = step(*holder["state"], batch)
        holder["state"] = new_state
        jax.block_until_ready((new_state, loss))  # the update too, not only the loss

    return run


def measure(n: int, config, per_device_batch: int, frames: int, repeats: int, budget: float):
    mesh = jax.make_mesh((n,), (AXIS,), devices=jax.devices()[:n])
    rng = np.random.default_rng(0)
    batch = jax.device_put(random_batch(rng, per_device_batch * n, frames, config),
                           NamedSharding(mesh, P(AXIS)))
    graphdef, params, batch_stats = nnx.split(training.create_model(config, 0), nnx.Param,
                                              nnx.BatchStat)
    optimizer = training.create_optimizer(config, steps_per_epoch=100)
    replicated = NamedSharding(mesh, P())
    steps = {
        "jaxring": training.make_train_step(graphdef, data_parallel.distributed(
            optimizer, AXIS, bucket_bytes=config.bucket_bytes), mesh),
        "lax.psum": training.make_train_step(graphdef, optimizer, mesh,
                                             gradient_sync=lambda g: lax.pmean(g, AXIS)),
        "no sync": training.make_train_step(graphdef, optimizer, mesh,
                                            gradient_sync=lambda g: g),
    }
    row = {"devices": n, "utterances_per_step": per_device_batch * n, "frames": frames,
           "parameters": int(sum(x.size for x in jax.tree.leaves(params))),
           "gradient_leaves": len(jax.tree.leaves(params))}
    runs = {}
    for name, step in steps.items():
        state = jax.device_put((params, batch_stats, optimizer.init(params)), replicated)
        state = jax.tree.map(lambda x: x.copy(), state)  # the step donates its inputs
        runs[f"step_ms[{name}]"] = step_runner(step, state, batch)
    for key, seconds in medians_in_turns(runs, budget, repeats).items():
        row[key] = 1e3 * seconds

    # Gradient synchronisation alone, on a gradient-shaped pytree of random values.
    grads = jax.device_put(jax.tree.map(
        lambda x: rng.standard_normal(x.shape).astype(np.float32), params), replicated)
    syncs = {
        "jaxring": lambda g: data_parallel.all_reduce_gradients(g, AXIS, "mean",
                                                                config.bucket_bytes),
        "jaxring per leaf": lambda g: jaxring.all_reduce(g, AXIS, "mean"),
        "lax.psum": lambda g: lax.pmean(g, AXIS),
    }
    runs, per_call = {}, {}
    for name, sync in syncs.items():
        fn = jax.jit(jax.shard_map(sync, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
        runs[f"sync_ms[{name}]"] = lambda f=fn: jax.block_until_ready(f(grads))
        per_call[f"sync_ms[{name}]"] = 1
        # The same, SYNC_LOOP times inside one program: what a step pays, without the launch.
        looped = jax.jit(jax.shard_map(
            lambda g, sync=sync: lax.fori_loop(0, SYNC_LOOP, lambda i, c: sync(c), g),
            mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
        runs[f"sync_loop_ms[{name}]"] = lambda f=looped: jax.block_until_ready(f(grads))
        per_call[f"sync_loop_ms[{name}]"] = SYNC_LOOP
    for key, seconds in medians_in_turns(runs, budget, repeats).items():
        row[key] = 1e3 * seconds / per_call[key]
    row["sync_share[jaxring]"] = row["sync_ms[jaxring]"] / row["step_ms[jaxring]"]
    # The same share read off the whole steps: what synchronising added to a step without it.
    row["step_share[jaxring]"] = 1 - row["step_ms[no sync]"] / row["step_ms[jaxring]"]
    row["step_share[lax.psum]"] = 1 - row["step_ms[no sync]"] / row["step_ms[lax.psum]"]
    row["sync_share[lax.psum]"] = row["sync_ms[lax.psum]"] / row["step_ms[lax.psum]"]
    return row


def markdown_table(rows, env, config_name) -> str:
    lines = [
        f"# Deep Speech 2 training step ({config_name} config), data-parallel on "
        f"{env['device']}", "",
        f"{env['cpu']}, {env['cores']} cores; python {env['python']}, jax {env['jax']}, "
        f"jaxlib {env['jaxlib']}; {env['date']}.{steal_sentence(env)}", "",
        "Weak scaling: a fixed number of utterances per device. Step times are medians, the "
        "variants taking turns step by step; "
        "'sync' is the gradient all-reduce of a gradient-shaped pytree timed alone, and its "
        "share is of the jaxring step. All devices share the machine's cores, so step time grows "
        "with n beyond the core count. 'In one program' times the same sync "
        f"{SYNC_LOOP} times inside one compiled loop, per sync: the cost a training step pays, "
        "without the program launch that a lone jitted call adds.", "",
        "| devices | utt/step | step jaxring (ms) | step lax.psum (ms) | step no sync (ms) | "
        "sync jaxring fused (ms) | sync jaxring per leaf (ms) | sync lax.psum (ms) | "
        "sync share jaxring | (step jaxring - no sync) / step jaxring | "
        "jaxring sync / psum sync | in one program: sync jaxring (ms) | sync lax.psum (ms) | "
        "jaxring / psum |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['devices']} | {r['utterances_per_step']} | {r['step_ms[jaxring]']:.1f} | "
            f"{r['step_ms[lax.psum]']:.1f} | {r['step_ms[no sync]']:.1f} | "
            f"{r['sync_ms[jaxring]']:.3f} | {r['sync_ms[jaxring per leaf]']:.3f} | "
            f"{r['sync_ms[lax.psum]']:.3f} | {100 * r['sync_share[jaxring]']:.2f}% | "
            f"{100 * r['step_share[jaxring]']:.1f}% | "
            f"{r['sync_ms[jaxring]'] / r['sync_ms[lax.psum]']:.2f} | "
            f"{r['sync_loop_ms[jaxring]']:.3f} | {r['sync_loop_ms[lax.psum]']:.3f} | "
            f"{r['sync_loop_ms[jaxring]'] / r['sync_loop_ms[lax.psum]']:.2f} |")
    r = rows[0]
    lines += ["", f"Model: {r['parameters']:,} parameters in {r['gradient_leaves']} gradient "
              f"leaves; {r['frames']} frames per utterance."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="1,2,4,8")
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--per-device-batch", type=int, default=8)
    parser.add_argument("--frames", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="2 and 8 devices, short, no files")
    parser.add_argument("--name", default="training-cpu")
    args = parser.parse_args(argv)
    config = configs.get_config(args.config)
    counts = [2, 8] if args.quick else [int(n) for n in args.devices.split(",")]
    repeats, budget = (3, 1.0) if args.quick else (10, 5.0)
    keep_freed_memory()
    rows = []
    for n in counts:
        row = measure(n, config, args.per_device_batch, args.frames, repeats, budget)
        rows.append(row)
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    env = environment()  # after measuring: it records the CPU steal over the run
    table = markdown_table(rows, env, args.config)
    print(table)
    if not args.quick:
        path = write_results(args.name, {"environment": env, "config": args.config,
                                         "rows": rows}, table)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
