"""The GPU side. Without a GPU (CI): the CUDA library is built and exports every handler, and
lowering for CUDA emits jaxring's custom calls for process communicators and refuses the devices
of one process. With a GPU: the multi-process suite of tests/mpi runs on GPU processes."""

import os
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxring
import jaxring.mpi
from jaxring._src import native
from helpers import mesh, shard
from test_mpi import mpiexec

HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(not os.path.exists(native.CUDA_LIBRARY),
                    reason="jaxring was built without nvcc: no CUDA library")
def test_cuda_library_exports_every_handler():
    symbols = subprocess.run(["nm", "-D", "--defined-only", native.CUDA_LIBRARY],
                             capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in symbols.splitlines() if line.strip()}
    expected = {f"Jaxring{name}Cuda" for name in native.COLLECTIVE_TARGETS.values()}
    assert expected | {"JaxringCudaSetHostCall", "JaxringCudaReduce"} <= exported


def lowered_for_cuda(f, *args) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_lowering_for_cuda_emits_the_custom_calls_for_process_communicators():
    comm = jaxring.mpi.world()
    x = np.ones(8, np.float32)
    # (all_reduce over one process is the identity and emits nothing; all_gather still calls.)
    text = lowered_for_cuda(lambda v: jaxring.all_gather(v, comm), x)
    assert "jaxring_all_gather" in text
    text = lowered_for_cuda(
        lambda v: jaxring.ppermute(v, comm, [(0, 0)]) + jaxring.broadcast(v, comm, root=0), x)
    assert "jaxring_ppermute" in text and "jaxring_broadcast" in text


def test_lowering_for_cuda_refuses_the_devices_of_one_process():
    m = mesh(2)
    f = jax.shard_map(lambda v: jaxring.all_reduce(v, "i"), mesh=m, in_specs=P("i"),
                      out_specs=P())
    with pytest.raises(NotImplementedError, match="one process per GPU"):
        lowered_for_cuda(f, shard(np.ones(4, np.float32), m))


@pytest.mark.gpu
@pytest.mark.skipif(not native.has_cuda_backend(), reason="no CUDA GPU visible")
@pytest.mark.parametrize("n", [1, 2, 4])
def test_the_multiprocess_suite_on_gpu_processes_sharing_one_gpu(n):
    result = mpiexec(n, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(HERE / "mpi"),
                     timeout=900, env={"JAX_PLATFORMS": "cuda",
                                       "XLA_PYTHON_CLIENT_MEM_FRACTION": str(round(0.8 / n, 2))})
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
