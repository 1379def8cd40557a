"""jaxring's CPU reduction kernels, built per instruction set, against lax.psum, in one run.

    python benchmarks/kernels.py   ->  benchmarks/results/kernels-cpu.{json,md}

jaxring compiles its reduction kernels for SSE2 (the x86-64 baseline), AVX2 and AVX-512 and runs
by default the widest the CPU supports, except SSE2 for the reductions of dtypes other than
float16/bfloat16 whose stores stream (`jaxring.config` `cpu_kernels`, kernels/reduce_cpu.cc). This
times jaxring.all_reduce with each build this CPU runs and with that default (`auto`), and
lax.psum, inside one compiled loop
(program launch left out, as in allreduce.py's loop table: the program donates its input, each
result feeds the next call), on 2, 4 and 8 CPU devices, float32 and bfloat16, the cases taking
turns call by call. bfloat16 (and float16) accumulate in float32, so every element is converted
twice: that, not memory, bounds their reductions, which is where wider vectors pay.
"""

from __future__ import annotations

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
from common import (environment, human_bytes, keep_freed_memory, medians_in_turns,  # noqa: E402
                    steal_sentence, takes_no_arguments, write_results)
from allreduce import donated_loop, loop_repeats  # noqa: E402
from jaxring._src import native  # noqa: E402

DEVICES = (2, 4, 8)
SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
PSUM = "lax.psum"


def measure(n: int, nbytes: int, dtype, builds: list[str]) -> dict:
    """Seconds per all-reduce of `nbytes` per device inside a compiled loop, per case."""
    mesh = jax.make_mesh((n,), ("i",), devices=jax.devices()[:n])
    sharding = NamedSharding(mesh, P("i"))
    count = nbytes // jnp.dtype(dtype).itemsize
    repeats = loop_repeats(nbytes)
    # Each pass multiplies the values by about n; starting near 2^-100 they stay finite (bfloat16
    # has float32's exponent range).
    start = np.asarray(np.random.default_rng(0).standard_normal(n * count) * 2.0 ** -100, dtype)
    programs = {"jaxring": donated_loop(lambda a: jaxring.all_reduce(a, "i"), mesh, repeats),
                PSUM: donated_loop(lambda a: lax.psum(a, "i"), mesh, repeats)}
    cases = {f"jaxring[{build}]": ("jaxring", build) for build in (*builds, "auto")}
    cases[PSUM] = (PSUM, "auto")
    held = {}

    def run(name):
        program = programs[cases[name][0]]

        def call():  # a warm-up without a fresh input donates the last output
            held[name] = program(held[name])
            held[name].block_until_ready()
        return call

    def context(name):
        held[name] = jax.device_put(start, sharding)  # a fresh input to donate, outside the clock
        held[name].block_until_ready()
        return jaxring.config.override(cpu_kernels=cases[name][1])

    medians = medians_in_turns({name: run(name) for name in cases}, budget_seconds=0.4,
                               context=context)
    return {name: seconds / repeats for name, seconds in medians.items()}


def auto_choice(in_use: dict) -> str:
    """'avx512 for float16, bfloat16; baseline for float32, ...' from {dtype: build}."""
    by_build = {}
    for dtype, build in in_use.items():
        by_build.setdefault(build, []).append(dtype)
    return "; ".join(f"{build} for {', '.join(dtypes)}" for build, dtypes in by_build.items())


def markdown(env: dict, builds: list[str], rows: list[dict]) -> str:
    columns = [*builds, "auto"]
    lines = [
        "# CPU reduction kernels per instruction set: jaxring.all_reduce vs lax.psum",
        "",
        f"Device: {env['device']}, {env['cores']} cores ({env['cpu']}); python {env['python']}, "
        f"jax {env['jax']}; {env['date']}.{steal_sentence(env)} Builds this CPU runs: "
        f"{', '.join(builds)}; `auto` takes {auto_choice(env['cpu_kernels'])} where the targets "
        f"stay in the cache, and {auto_choice(env['cpu_kernels_streaming'])} where they stream "
        "(16 MiB of outputs over all devices or more: here 16 MiB on 2 devices, 4 and 16 MiB on 4 "
        "and 8).",
        "",
        "Per all-reduce inside one compiled loop (program launch excluded; see the docstring of "
        "`benchmarks/kernels.py`), medians, the cases taking turns. `vs baseline`: each build's "
        "time, and `auto`'s, over the SSE2 build's; `vs psum`: `auto`'s time over lax.psum's "
        "(below 1: jaxring is faster). Every build writes the same bits "
        "(`test_every_build_of_the_kernels_writes_the_same_bits`).",
        "",
        "| dtype | n | size | " + " | ".join(f"jaxring[{b}] (us)" for b in columns)
        + " | lax.psum (us) | " + " | ".join(f"{b} vs baseline" for b in columns[1:])
        + " | vs psum |",
        "|---|---|---|" + "---|" * (2 * len(columns) + 1),
    ]
    for r in rows:
        t = r["seconds"]
        base = t["jaxring[baseline]"]
        lines.append(
            f"| {r['dtype']} | {r['devices']} | {human_bytes(r['bytes'])} | "
            + " | ".join(f"{t[f'jaxring[{b}]'] * 1e6:.1f}" for b in columns)
            + f" | {t[PSUM] * 1e6:.1f} | "
            + " | ".join(f"{t[f'jaxring[{b}]'] / base:.2f}" for b in columns[1:])
            + f" | {t['jaxring[auto]'] / t[PSUM]:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    takes_no_arguments(__doc__)
    keep_freed_memory()
    builds = native.extension.cpu_kernels_supported()[1:]  # without "auto"
    rows = []
    for dtype_name, dtype in DTYPES.items():
        for n in DEVICES:
            for nbytes in SIZES:
                seconds = measure(n, nbytes, dtype, builds)
                rows.append({"dtype": dtype_name, "devices": n, "bytes": nbytes,
                             "seconds": seconds})
                print(f"{dtype_name} n={n} {human_bytes(nbytes):>8}: " + "  ".join(
                    f"{name} {s * 1e6:.1f} us" for name, s in seconds.items()), flush=True)
    env = environment()  # after measuring: it records the CPU steal over the run
    write_results("kernels-cpu", {"environment": env, "builds": builds, "rows": rows},
                  markdown(env, builds, rows))


if __name__ == "__main__":
    main()
