"""Where the small-message time goes: the fixed cost of one program run against the cost of one
more collective inside it, for jaxring and lax, on 8 CPU devices with 4-byte messages.

    python benchmarks/overhead.py   ->  benchmarks/results/overhead-cpu.{json,md}
"""

from __future__ import annotations

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
from common import environment, median_seconds, write_results  # noqa: E402


def chain(reduce, k):
    def body(v):
        for _ in range(k):
            v = reduce(v)
        return v
    return body


def main() -> None:
    mesh = jax.make_mesh((8,), ("i",))
    x = jax.device_put(np.ones(8, np.float32), NamedSharding(mesh, P("i")))
    cases = {
        "empty program (x + 1)": lambda v: v + 1,
        "jaxring.barrier only": lambda v: (jaxring.barrier("i"), v + 1)[1],
    }
    for k in (1, 2, 8):
        cases[f"{k} x jaxring.all_reduce"] = chain(lambda v: jaxring.all_reduce(v, "i"), k)
        cases[f"{k} x lax.psum"] = chain(lambda v: lax.psum(v, "i"), k)
    rows = []
    for name, body in cases.items():
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
        seconds = median_seconds(lambda: f(x).block_until_ready(), budget_seconds=1.0)
        rows.append({"case": name, "seconds": seconds})
        print(f"{name:28s} {seconds * 1e6:8.1f} us", flush=True)
    t = {r["case"]: r["seconds"] for r in rows}
    per_ours = (t["8 x jaxring.all_reduce"] - t["1 x jaxring.all_reduce"]) / 7
    per_lax = (t["8 x lax.psum"] - t["1 x lax.psum"]) / 7
    fixed_ours = t["1 x jaxring.all_reduce"] - per_ours
    fixed_lax = t["1 x lax.psum"] - per_lax
    env = environment()
    md = [
        "# Small-message cost: per program vs per collective (8 CPU devices, 4 B)", "",
        f"Device: {env['device']}, {env['cores']} cores; jax {env['jax']}; {env['date']}.", "",
        "| case | median (us) |", "|---|---|",
        *[f"| {r['case']} | {r['seconds'] * 1e6:.1f} |" for r in rows], "",
        f"Per extra collective in the same program: jaxring {per_ours * 1e6:.1f} us, "
        f"lax.psum {per_lax * 1e6:.1f} us.",
        f"Fixed cost of a program containing collectives: jaxring {fixed_ours * 1e6:.1f} us, "
        f"lax {fixed_lax * 1e6:.1f} us (an empty program: {t['empty program (x + 1)'] * 1e6:.1f} us).",
        "The suspected source of jaxring's fixed cost (not yet isolated) is JAX's ordered-effect runtime token, passed between "
        "program runs and set up in Python on every dispatch.", ""]
    write_results("overhead-cpu", {"environment": env, "rows": rows,
                                   "per_collective_s": {"jaxring": per_ours, "lax": per_lax},
                                   "fixed_s": {"jaxring": fixed_ours, "lax": fixed_lax}},
                  "\n".join(md))
    print("\n".join(md[-4:]))


if __name__ == "__main__":
    main()
