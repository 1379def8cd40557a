"""All-reduce between GPU processes: jaxring's GPU transports against mpi4jax, in one run.

    mpiexec -n 2 python benchmarks/allreduce_gpu.py      # then -n 4; --quick: short, no files

Every process uses its first visible GPU, as jaxring's GPU communicators do: on a node with
several, give each rank its own with CUDA_VISIBLE_DEVICES (a wrapper that sets it from the local
rank, e.g. MPI_LOCALRANKID or OMPI_COMM_WORLD_LOCAL_RANK). It measures
- the reduce kernel (JaxringCudaReduce: 2 and 4 operands into 1) against a device-to-device copy
  (cudaMemcpyAsync) of the same size, in the same run, on rank 0 alone; bandwidth counts the
  bytes read and written (a copy moves 2x its size, a k-operand reduce (k+1)x);
- jaxring.all_reduce inside jax.jit on GPU arrays over the cuda-ipc transport (no host copy),
  the staged transport (pinned, pipelined host staging) and the host path (the whole call copied
  to the host and back);
- mpi4jax.allreduce(x, MPI.SUM) inside jax.jit (host-staged unless MPI is CUDA-aware);
- mpi4py's comm.Allreduce on numpy buffers (host memory, the floor of any host-staged method),
for float32 messages of 4 KiB .. 256 MiB per rank. Every sample starts after a barrier and counts
from the first rank's start to the last rank's end. Writes
benchmarks/results/allreduce_gpu-<gpu>-n{N}.{json,md,png}.

Without a visible CUDA GPU it exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import sys

# Several processes share one GPU: none may take XLA's default 75% of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (RESULTS, bus_factor, environment, human_bytes,  # noqa: E402
                    keep_freed_memory, medians_in_turns, plot_time_per_size, write_results)

keep_freed_memory()  # before JAX starts its threads: warm reuse of freed host buffers, alike

import jax  # noqa: E402
import numpy as np  # noqa: E402


def gpu_or_exit():
    try:
        return jax.devices("cuda")[0]
    except RuntimeError:
        platforms = sorted({d.platform for d in jax.devices()})
        print("allreduce_gpu.py: no CUDA GPU visible (JAX sees "
              f"{', '.join(platforms)}); run it on a machine with a GPU and jax[cuda13], see the "
              "README's GPU section", file=sys.stderr)
        sys.exit(2)


GPU = gpu_or_exit()

from mpi4py import MPI  # noqa: E402

import jaxring  # noqa: E402
import jaxring.mpi  # noqa: E402

WORLD = MPI.COMM_WORLD
TRANSPORTS = {
    "jaxring[ipc]": "ipc",
    "jaxring[staged]": "staged",
    "jaxring[host]": "host",
}
COMMS = {name: jaxring.mpi.Communicator(WORLD.Dup(), label=name, gpu_transport=transport)
         for name, transport in TRANSPORTS.items()}
if COMMS["jaxring[staged]"].cuda_aware_mpi:
    # jaxring[staged] hands device pointers to MPI; also time the pinned pipeline it replaces.
    asked = os.environ.get("JAXRING_CUDA_AWARE_MPI")
    os.environ["JAXRING_CUDA_AWARE_MPI"] = "0"
    COMMS["jaxring[staged, pinned]"] = jaxring.mpi.Communicator(
        WORLD.Dup(), label="staged, pinned", gpu_transport="staged")
    if asked is None:
        del os.environ["JAXRING_CUDA_AWARE_MPI"]
    else:
        os.environ["JAXRING_CUDA_AWARE_MPI"] = asked


# ---- the reduce kernel against a copy ---------------------------------------------------------

class Cuda:
    """The few CUDA runtime calls the kernel measurement needs, through ctypes."""

    def __init__(self):
        from jaxring._src import native

        self.jaxring = native.cuda_library()
        self.jaxring.JaxringCudaReduce.restype = ctypes.c_int
        self.jaxring.JaxringCudaReduce.argtypes = [
            ctypes.c_uint8, ctypes.c_uint8, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
            ctypes.c_void_p]
        self.rt = ctypes.CDLL("libcudart.so.13")  # already loaded by JAX's CUDA plugin
        self.rt.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                            ctypes.c_int, ctypes.c_void_p]
        self.rt.cudaEventElapsedTime.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p,
                                                 ctypes.c_void_p]
        self.rt.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.rt.cudaEventSynchronize.argtypes = [ctypes.c_void_p]

    def check(self, code, what):
        if code != 0:
            raise RuntimeError(f"{what}: CUDA error {code}")

    def seconds(self, launch, repeats: int) -> float:
        """Median time of `launch()` on the default stream, by CUDA events."""
        start, stop = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.rt.cudaEventCreate(ctypes.byref(start)), "cudaEventCreate")
        self.check(self.rt.cudaEventCreate(ctypes.byref(stop)), "cudaEventCreate")
        launch()
        samples = []
        for _ in range(repeats):
            self.rt.cudaEventRecord(start, None)
            launch()
            self.rt.cudaEventRecord(stop, None)
            self.check(self.rt.cudaEventSynchronize(stop), "cudaEventSynchronize")
            ms = ctypes.c_float()
            self.rt.cudaEventElapsedTime(ctypes.byref(ms), start, stop)
            samples.append(ms.value / 1e3)
        return float(np.median(samples))


def kernel_rows(sizes, repeats: int) -> list[dict]:
    cuda = Cuda()
    rows = []
    for nbytes in sizes:
        count = nbytes // 4
        buffers = [jax.device_put(np.random.default_rng(k).standard_normal(count, np.float32), GPU)
                   for k in range(5)]
        for b in buffers:
            b.block_until_ready()
        ptrs = [b.unsafe_buffer_pointer() for b in buffers]
        out = ptrs[4]

        def copy():
            cuda.check(cuda.rt.cudaMemcpyAsync(out, ptrs[0], nbytes, 3, None), "cudaMemcpyAsync")

        seconds = cuda.seconds(copy, repeats)
        rows.append({"impl": "device-to-device copy", "bytes": nbytes, "seconds": seconds,
                     "bandwidth_gbps": 2 * nbytes / seconds / 1e9})
        for operands in (2, 4):
            srcs = (ctypes.c_void_p * operands)(*ptrs[:operands])
            dsts = (ctypes.c_void_p * 1)(out)

            def reduce():
                cuda.check(cuda.jaxring.JaxringCudaReduce(11, 0, srcs, operands, dsts, 1, count,
                                                          0, None), "JaxringCudaReduce")

            seconds = cuda.seconds(reduce, repeats)
            rows.append({"impl": f"reduce kernel, {operands} operands", "bytes": nbytes,
                         "seconds": seconds,
                         "bandwidth_gbps": (operands + 1) * nbytes / seconds / 1e9})
        del buffers
    return rows


# ---- all-reduce between processes -------------------------------------------------------------

def implementations():
    import mpi4jax

    jitted = {name: jax.jit(lambda v, c=comm: jaxring.all_reduce(v, c))
              for name, comm in COMMS.items()}
    theirs = jax.jit(lambda v: mpi4jax.allreduce(v, MPI.SUM, comm=WORLD))

    outputs = {}  # per shape, allocated once outside the clock, as an mpi4py program would

    def mpi4py_sum(x):
        out = outputs.get(x.shape)
        if out is None:
            out = outputs[x.shape] = np.empty_like(x)
        WORLD.Allreduce(x, out, op=MPI.SUM)

    impls = {name: (lambda x, xj, f=f: f(xj).block_until_ready()) for name, f in jitted.items()}
    impls["mpi4jax.allreduce"] = lambda x, xj: theirs(xj).block_until_ready()
    impls["mpi4py Allreduce (host memory)"] = lambda x, xj: mpi4py_sum(x)
    return impls


def check_results(xj, n, checked: int = 1 << 18):
    """Every transport's answer against float64 numpy before it is timed (the first and last
    `checked` elements, which covers the first and last step of every plan)."""
    x = np.asarray(xj)
    ends = lambda v: np.concatenate([v[:checked], v[-checked:]])  # noqa: E731
    everyone = np.stack(WORLD.allgather(ends(x))).astype(np.float64).sum(0)
    for name, comm in COMMS.items():
        y = ends(np.asarray(jax.jit(lambda v: jaxring.all_reduce(v, comm))(xj), np.float64))
        np.testing.assert_allclose(y, everyone, rtol=1e-5 * n, atol=1e-5 * n, err_msg=name)


def mps_is_running() -> bool:
    """Whether a CUDA MPS server takes this node's GPU work (its control pipe exists), so that
    the processes' kernels share the GPU at once instead of in time slices."""
    pipes = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipes, "control"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="three sizes; writes no files unless --name")
    parser.add_argument("--sizes", type=int, nargs="*", help="bytes per rank (default 4 KiB..256 MiB)")
    parser.add_argument("--name", default=None,
                        help="results file (default allreduce_gpu-<gpu>-n{N}[-mps])")
    args = parser.parse_args()
    n, rank = WORLD.size, WORLD.rank
    sizes = args.sizes or ([4 << 10, 1 << 20, 16 << 20] if args.quick else
                           [4 ** k * 1024 for k in range(1, 10)])  # 4 KiB .. 256 MiB
    kernels = []
    if rank == 0:  # alone on the GPU: the others wait
        kernels = kernel_rows(sorted({max(s, 1 << 20) for s in sizes} | {64 << 20, 256 << 20}),
                              repeats=10 if args.quick else 30)
        for r in kernels:
            print(f"{r['impl']:>28s} {human_bytes(r['bytes']):>9s}: {r['bandwidth_gbps']:.0f} GB/s",
                  flush=True)
    WORLD.Barrier()
    rows = []
    for nbytes in sizes:
        x = np.random.default_rng(rank).standard_normal(nbytes // 4).astype(np.float32)
        xj = jax.device_put(x, GPU)
        check_results(xj, n)
        medians = medians_in_turns(
            {name: lambda fn=fn: fn(x, xj) for name, fn in implementations().items()},
            world=WORLD)
        for name, seconds in medians.items():
            algbw = nbytes / seconds / 1e9
            rows.append({"impl": name, "bytes": nbytes, "seconds": seconds, "algbw_gbps": algbw,
                         "busbw_gbps": algbw * bus_factor("all_reduce", n)})
        if rank == 0:
            line = "  ".join(f"{r['impl']} {r['seconds'] * 1e6:.0f} us"
                             for r in rows if r["bytes"] == nbytes)
            print(f"n={n} {human_bytes(nbytes):>9s}: {line}", flush=True)
    if rank == 0 and not (args.quick and args.name is None):  # not over the committed runs
        env = environment(MPI)
        env["device"] = GPU.device_kind
        env["cuda_aware_mpi"] = [COMMS["jaxring[staged]"].cuda_aware_mpi,
                                 COMMS["jaxring[staged]"].cuda_aware_mpi_source]
        env["mps"] = mps_is_running()
        slug = re.sub(r"[^a-z0-9]+", "-", GPU.device_kind.lower()).strip("-")
        name = args.name or f"allreduce_gpu-{slug}-n{n}" + ("-mps" if env["mps"] else "")
        write_results(name, {"environment": env, "ranks": n, "kernels": kernels, "rows": rows},
                      markdown(kernels, rows, env, n))
        plot_time_per_size(rows, f"all-reduce, {n} processes on one {env['device']}",
                           RESULTS / f"{name}.png")
        print(f"wrote {RESULTS / name}.{{json,md,png}}")


def markdown(kernels, rows, env, n) -> str:
    sharing = "under MPS" if env.get("mps") else "in time slices (no MPS)"
    lines = [f"# All-reduce between {n} GPU processes on one {env['device']}, {sharing}", "",
             f"python {env['python']}, jax {env['jax']}, mpi4jax {env.get('mpi4jax', '?')}; "
             f"{env['mpi']}; CUDA-aware MPI: "
             f"{env['cuda_aware_mpi'][0]} ({env['cuda_aware_mpi'][1]}); {env['date']}.", ""]
    if kernels:
        copy = {r["bytes"]: r for r in kernels if r["impl"] == "device-to-device copy"}
        lines += ["## Reduce kernel against a device-to-device copy (rank 0 alone)", "",
                  "Bandwidth counts bytes read and written: a copy moves 2x its size, a k-operand "
                  "reduce (k+1)x.", "",
                  "| size | kernel | GB/s | copy GB/s | of copy |", "|---|---|---|---|---|"]
        for r in kernels:
            if r["impl"] == "device-to-device copy":
                continue
            c = copy[r["bytes"]]
            lines.append(f"| {human_bytes(r['bytes'])} | {r['impl']} | {r['bandwidth_gbps']:.0f} "
                         f"| {c['bandwidth_gbps']:.0f} | "
                         f"{r['bandwidth_gbps'] / c['bandwidth_gbps']:.0%} |")
        lines.append("")
    names = list(dict.fromkeys(r["impl"] for r in rows))
    by = {(r["impl"], r["bytes"]): r for r in rows}
    lines += ["## all_reduce, float32, median over samples", "",
              "| size | " + " | ".join(f"{m} (us)" for m in names) +
              " | ipc busbw (GB/s) | ipc vs mpi4jax | staged vs mpi4jax | ipc vs staged |",
              "|---|" + "---|" * (len(names) + 4)]
    for nbytes in sorted({r["bytes"] for r in rows}):
        ipc, staged = by[("jaxring[ipc]", nbytes)], by[("jaxring[staged]", nbytes)]
        rival = by[("mpi4jax.allreduce", nbytes)]
        cells = " | ".join(f"{by[(m, nbytes)]['seconds'] * 1e6:.0f}" for m in names)
        lines.append(f"| {human_bytes(nbytes)} | {cells} | {ipc['busbw_gbps']:.1f} | "
                     f"{rival['seconds'] / ipc['seconds']:.1f}x | "
                     f"{rival['seconds'] / staged['seconds']:.1f}x | "
                     f"{staged['seconds'] / ipc['seconds']:.1f}x |")
    lines += ["", "vs columns: the rival's time over ours (above 1: ours is faster). busbw = "
              "algbw x 2(n-1)/n (nccl-tests). All processes share one GPU: its memory bandwidth "
              "is the ceiling of the ipc transport, measured above as the copy bandwidth."]
    return "\n".join(lines) + "\n"



if __name__ == "__main__":
    main()
