"""Where the small-message time goes: the fixed cost of one program run against the cost of one
more collective inside it, for jaxring and lax, on 2 and 8 CPU devices with 4-byte messages.

    python benchmarks/overhead.py   ->  benchmarks/results/overhead-cpu.{json,md}

Two rows isolate jaxring's fixed cost. "empty program + jaxring's effect" carries jaxring's
ordered effect (the runtime token JAX passes from program to program) and communicates nothing:
its difference to the empty program is what the effect costs at dispatch. "effect stripped" runs
the same all-reduce custom call without the token: a measurement only, since programs dispatched
back to back without it can deadlock PJRT CPU's device threads (see README, "Dispatch"). "JAX's
dispatch path" runs the same jitted all-reduce through JAX's Python path on every call, as it ran
before jaxring remembered what that path finds (jaxring/_src/runtime_tokens.py).
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax._src import core  # noqa: E402
from jax._src.interpreters import mlir  # noqa: E402
from jax._src.lib.mlir.dialects import hlo  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jaxring  # noqa: E402
from common import (environment, median_seconds, steal_sentence,  # noqa: E402
                    takes_no_arguments, with_jaxring_effect, write_results)
from jaxring._src import common as jr  # noqa: E402
from jaxring._src import native  # noqa: E402

# ---- the all-reduce custom call without the token (measurement only; the effect without a
# collective is common.with_jaxring_effect) ------------------------------------------------

stripped_p = core.Primitive("overhead_all_reduce_without_effect")
stripped_p.def_abstract_eval(
    lambda rank, group, x, *, comm, op_id: jr.with_varying_axes(
        x, jr.varying_axes(x) - frozenset(comm.axes)))


def _stripped_lowering(ctx, rank, group, x, *, comm, op_id):
    """jaxring's all-reduce custom call with a fresh token instead of the program-order one."""
    native.register_targets()
    sub_ctx = ctx.replace(avals_in=[core.abstract_token, *ctx.avals_in],
                          avals_out=[core.abstract_token, *ctx.avals_out])
    results = jax.ffi.ffi_lowering("jaxring_all_reduce", has_side_effect=True)(
        sub_ctx, hlo.create_token(), rank, group, x, comm=np.int64(comm.key),
        comm_name=comm.name, size=np.int64(comm.size), op_id=np.int64(op_id),
        op=np.int64(jr.REDUCE_OPS["sum"]))
    return results[1:]


mlir.register_lowering(stripped_p, _stripped_lowering, platform="cpu")


def all_reduce_without_effect(x, axis_name):
    comm = jr.communicator("overhead", axis_name)
    rank, group = comm.rank_and_group()
    return stripped_p.bind(rank, group, jr.make_varying(x, comm.axes), comm=comm,
                           op_id=jr.next_op_id(comm))


# ---- the measurement ------------------------------------------------------------------------------


def chain(reduce, k):
    def body(v):
        for _ in range(k):
            v = reduce(v)
        return v
    return body


def cases():
    """name -> (body, how many all-reduces it chains; 0: the body returns x + 1)."""
    out = {
        "empty program (x + 1)": (lambda v: v + 1, 0),
        "empty program + jaxring's effect": (lambda v: with_jaxring_effect(v + 1), 0),
        "jaxring.barrier only": (lambda v: (jaxring.barrier("i"), v + 1)[1], 0),
        "1 x jaxring.all_reduce, effect stripped": (lambda v: all_reduce_without_effect(v, "i"), 1),
    }
    for k in (1, 2, 8):
        out[f"{k} x jaxring.all_reduce"] = (chain(lambda v: jaxring.all_reduce(v, "i"), k), k)
        out[f"{k} x lax.psum"] = (chain(lambda v: lax.psum(v, "i"), k), k)
    return out


JAX_PATH = "1 x jaxring.all_reduce, JAX's dispatch path"


def through_jax_dispatch(f):
    """f, called through JAX's own Python path of a jitted call every time: runtime_tokens'
    _remembered_runs, which runs a repeated call's executable at once, is set aside."""
    import jax._src.pjit as jax_pjit

    remembering = jax_pjit._run_python_pjit
    jax_run = getattr(remembering, "jax_run", remembering)

    def call(v):
        jax_pjit._run_python_pjit = jax_run
        try:
            return f(v)
        finally:
            jax_pjit._run_python_pjit = remembering
    return call


def best_of_rounds(fns: dict, x) -> dict:
    """Each case's best median over 3 rounds; the rounds interleave the cases, so drift on a
    shared machine hits all of them."""
    seconds = {name: [] for name in fns}
    for _ in range(3):
        for name, f in fns.items():
            seconds[name].append(median_seconds(lambda: f(x).block_until_ready(),
                                                budget_seconds=0.4))
    return {name: float(min(s)) for name, s in seconds.items()}


def measure(n: int) -> list[dict]:
    mesh = jax.make_mesh((n,), ("i",), devices=jax.devices()[:n])
    x = jax.device_put(np.arange(n, dtype=np.float32), NamedSharding(mesh, P("i")))
    fns, reductions = {}, {}
    for name, (body, k) in cases().items():
        fns[name] = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
        reductions[name] = k
    fns[JAX_PATH], reductions[JAX_PATH] = through_jax_dispatch(fns["1 x jaxring.all_reduce"]), 1
    total = n * (n - 1) / 2
    for name, f in fns.items():  # every row is checked; nothing is timed unchecked
        k = reductions[name]
        expected = np.full(n, total * n ** (k - 1)) if k else np.arange(n) + 1
        np.testing.assert_array_equal(np.asarray(f(x)), expected.astype(np.float32),
                                      err_msg=name)
    rows = [{"devices": n, "case": name, "seconds": seconds}
            for name, seconds in best_of_rounds(fns, x).items()]
    for r in rows:
        print(f"n={n} {r['case']:42s} {r['seconds'] * 1e6:8.1f} us", flush=True)
    return rows


def one_device_floor() -> list[dict]:
    """What any jitted call costs a process with one device (an MPI rank): the floor under a lone
    small collective across processes, whatever carries the data."""
    x = jax.device_put(np.ones(1, np.float32), jax.devices()[0])
    fns = {"empty program (x + 1)": jax.jit(lambda v: v + 1),
           "empty program + jaxring's effect": jax.jit(lambda v: with_jaxring_effect(v + 1))}
    for name, f in fns.items():
        np.testing.assert_array_equal(np.asarray(f(x)), [2.0], err_msg=name)
    rows = [{"devices": 1, "case": name, "seconds": seconds}
            for name, seconds in best_of_rounds(fns, x).items()]
    for r in rows:
        print(f"1 device: {r['case']:40s} {r['seconds'] * 1e6:8.1f} us", flush=True)
    return rows


def summary(rows: list[dict], n: int) -> list[str]:
    t = {r["case"]: r["seconds"] for r in rows if r["devices"] == n}
    us = {k: v * 1e6 for k, v in t.items()}
    per_ours = (us["8 x jaxring.all_reduce"] - us["1 x jaxring.all_reduce"]) / 7
    per_lax = (us["8 x lax.psum"] - us["1 x lax.psum"]) / 7
    effect = us["empty program + jaxring's effect"] - us["empty program (x + 1)"]
    return [
        f"**{n} devices.** Per extra collective in the same program: jaxring {per_ours:.1f} us, "
        f"lax.psum {per_lax:.1f} us. The ordered effect alone adds {effect:.1f} us to an empty "
        f"program ({us['empty program (x + 1)']:.1f} us). One all-reduce: jaxring "
        f"{us['1 x jaxring.all_reduce']:.1f} us (through JAX's own dispatch path "
        f"{us[JAX_PATH]:.1f} us), the same call with the "
        f"effect stripped {us['1 x jaxring.all_reduce, effect stripped']:.1f} us, lax.psum "
        f"{us['1 x lax.psum']:.1f} us.", ""]


def main() -> None:
    takes_no_arguments(__doc__)
    rows = measure(2) + measure(8)
    floor = one_device_floor()
    env = environment()
    md = ["# Small-message cost: per program vs per collective (CPU devices, 4 B)", "",
          f"Device: {env['device']}, {env['cores']} cores; jax {env['jax']}; {env['date']}."
          f"{steal_sentence(env)} "
          "Best of 3 interleaved rounds of medians.", "",
          "| case | 2 devices (us) | 8 devices (us) |", "|---|---|---|"]
    names = list(dict.fromkeys(r["case"] for r in rows))
    t = {(r["devices"], r["case"]): r["seconds"] * 1e6 for r in rows}
    md += [f"| {name} | {t[2, name]:.1f} | {t[8, name]:.1f} |" for name in names] + [""]
    md += summary(rows, 2) + summary(rows, 8)
    md += ["| one device (an MPI rank) | median (us) |", "|---|---|",
           *[f"| {r['case']} | {r['seconds'] * 1e6:.1f} |" for r in floor],
           "", "A lone jitted call in a process with one device costs at least the first row, "
           "and one with a jaxring collective at least the second, whatever carries the data; "
           "mpi4py's Allreduce of a few bytes on numpy buffers takes a few tens of us or less "
           "(the effect floor against mpi4py in benchmarks/results/allreduce_mpi-cpu-n2.md).",
           ""]
    md += ["\"effect stripped\" is a measurement only: without the token, programs dispatched "
           "back to back can deadlock PJRT CPU's device threads (README, \"Dispatch\"). What "
           "separates jaxring from lax.psum for a lone small call is JAX's dispatch of a "
           "program with an ordered effect, not the collective.", ""]
    write_results("overhead-cpu", {"environment": env, "rows": rows + floor}, "\n".join(md))
    print("\n".join(md[-6:]))


if __name__ == "__main__":
    main()
