"""The GPU side. Without a GPU (CI): the CUDA library is built and exports every handler and
set-up function; lowering for CUDA emits jaxring's custom calls for process communicators and
refuses the devices of one process; the host-side logic of the GPU transports (options, transport
selection, CUDA-aware MPI detection, step planning, two-shot shares) is checked here, and their
header exchange under mpiexec in tests/mpi/test_mpi_gpu_host.py. With a GPU: the multi-process
suite of tests/mpi (every op x dtype against float64 numpy, plus tests/mpi/test_mpi_gpu.py:
determinism, transports against each other, errors) on 1, 2 and 4 processes sharing the GPU, for
every GPU transport, and the kernels under compute-sanitizer."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxring
import jaxring.mpi
from jaxring._src import common, gpu, native
from helpers import DTYPES, mesh, shard
from test_mpi import assert_every_rank_ran_the_suite, mpiexec

HERE = Path(__file__).resolve().parent
SOURCES = HERE.parent / "xla_ffi"
COLLECTIVES = {kind: common.COLLECTIVE_CODES[kind]
               for kind in ("all_reduce", "reduce_scatter", "all_gather", "broadcast")}
DTYPE_CODES = common.DTYPE_CODES


@pytest.mark.skipif(not os.path.exists(native.CUDA_LIBRARY),
                    reason="jaxring was built without nvcc: no CUDA library")
def test_cuda_library_exports_every_handler():
    symbols = subprocess.run(["nm", "-D", "--defined-only", native.CUDA_LIBRARY],
                             capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in symbols.splitlines() if line.strip()}
    expected = {f"Jaxring{name}Cuda" for name in native.COLLECTIVE_TARGETS.values()}
    expected |= set(native.MODEL_CUDA_TARGETS.values()) | {"JaxringCudaBuildId"}
    set_up = {"JaxringCudaSetHostCall", "JaxringCudaReduce", "JaxringCudaIpcHandleBytes",
              "JaxringCudaIpcCreate", "JaxringCudaIpcOpen", "JaxringCudaStagedCreate",
              "JaxringCudaDetach"}
    assert expected | set_up <= exported


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
    # CPU devices: a GPU machine may have one GPU, and lowering for cuda needs no GPU here.
    m = jax.make_mesh((2,), ("i",), devices=jax.devices("cpu")[:2])
    f = jax.shard_map(lambda v: jaxring.all_reduce(v, "i"), mesh=m, in_specs=P("i"),
                      out_specs=P())
    with pytest.raises(NotImplementedError, match="one process per GPU"):
        lowered_for_cuda(f, shard(np.ones(4, np.float32), m))




# ---- host-side logic of the GPU transports (no GPU needed) ------------------------------------

def test_gpu_options_come_from_arguments_then_environment_then_defaults():
    defaults = native.extension.gpu_defaults()
    options = gpu.GpuOptions.resolve(environ={})
    assert options == gpu.GpuOptions("auto", defaults["ipc_slot_bytes"],
                                     defaults["staging_bytes"], "auto")
    env = {"JAXRING_GPU_TRANSPORT": "staged", "JAXRING_GPU_WORKSPACE_BYTES": "65536",
           "JAXRING_GPU_STAGING_BYTES": "8192", "JAXRING_CUDA_AWARE_MPI": "1"}
    assert gpu.GpuOptions.resolve(environ=env) == gpu.GpuOptions("staged", 65536, 8192, "1")
    assert gpu.GpuOptions.resolve("ipc", 1 << 20, None, environ=env) == gpu.GpuOptions(
        "ipc", 1 << 20, 8192, "1")


@pytest.mark.parametrize("kwargs, env, message", [
    ({"transport": "nccl"}, {}, r"gpu_transport must be one of \('auto', 'ipc', 'staged', "
                                r"'host'\), got 'nccl'"),
    ({}, {"JAXRING_GPU_TRANSPORT": "IPC"}, "got 'IPC'"),
    ({}, {"JAXRING_CUDA_AWARE_MPI": "yes"}, r"JAXRING_CUDA_AWARE_MPI must be one of"),
    ({"workspace_bytes": 100}, {}, "gpu_workspace_bytes must be a multiple of 16 and at least"),
    ({"staging_bytes": 4096 + 8}, {}, "gpu_staging_bytes must be a multiple of 16"),
    ({}, {"JAXRING_GPU_WORKSPACE_BYTES": "lots"}, "must be an integer number of bytes, got 'lots'"),
])
def test_bad_gpu_options_are_refused_with_the_allowed_values(kwargs, env, message):
    with pytest.raises(ValueError, match=message):
        gpu.GpuOptions.resolve(environ=env, **kwargs)


def test_a_communicator_refuses_an_unknown_gpu_transport():
    with pytest.raises(ValueError, match="gpu_transport must be one of"):
        jaxring.mpi.Communicator(jaxring.mpi.world().mpi_comm, gpu_transport="nvlink")


@pytest.mark.parametrize("requested, one_node, gpus, chosen", [
    ("auto", True, [True, True], "ipc"),
    ("auto", False, [True, True], "staged"),
    ("staged", True, [True, True], "staged"),
    ("host", True, [True, True], "host"),
    ("ipc", True, [True, True, True], "ipc"),
    ("auto", True, [False, False], "none"),
    ("ipc", False, [False], "none"),           # no GPU anywhere: nothing to set up
    ("auto", True, [True, False], "host"),     # CPU ranks run whole host collectives
    ("staged", False, [False, True], "host"),
    ("auto", True, [True] * 17, "staged"),     # more ranks than one reduce kernel reads
])
def test_gpu_transport_selection(requested, one_node, gpus, chosen):
    assert gpu.choose_transport(requested, one_node, gpus) == chosen


def test_ipc_across_nodes_and_unknown_transports_are_refused():
    with pytest.raises(ValueError, match="needs every rank on one node"):
        gpu.choose_transport("ipc", False, [True, True])
    with pytest.raises(ValueError, match="gpu_transport must be one of"):
        gpu.choose_transport("shm", True, [True])
    with pytest.raises(ValueError, match="takes at most 16 ranks, this communicator has 17"):
        gpu.choose_transport("ipc", True, [True] * 17)


def test_cuda_aware_mpi_detection_and_override():
    assert gpu.cuda_aware_mpi("1", None) == (True, "JAXRING_CUDA_AWARE_MPI=1")
    assert gpu.cuda_aware_mpi("0", object()) == (False, "JAXRING_CUDA_AWARE_MPI=0")
    assert gpu.cuda_aware_mpi("auto", None) == (False, "no MPI extension to ask")
    with pytest.raises(ValueError, match="must be one of"):
        gpu.cuda_aware_mpi("maybe", None)
    extension, why_not = jaxring.mpi._mpi_extension()
    if extension is None:
        pytest.skip(why_not)
    aware, how = gpu.cuda_aware_mpi("auto", extension)
    assert isinstance(aware, bool) and "MPIX_Query_cuda_support" in how


def test_device_pointers_go_to_mpi_only_where_the_cuda_aware_path_can_take_them():
    """Past 16 ranks (one reduce kernel takes every rank's piece) the CUDA-aware path's set-up
    refused, and a communicator of 17 GPU processes with a CUDA-aware MPI could not be made."""
    max_ranks = native.extension.gpu_defaults()["ipc_max_ranks"]
    extension = object()
    assert gpu.device_pointers_to_mpi(True, "asked", max_ranks, extension) == (True, "asked")
    assert gpu.device_pointers_to_mpi(False, "no", max_ranks, extension) == (False, "no")
    aware, how = gpu.device_pointers_to_mpi(True, "asked", max_ranks + 1, extension)
    assert not aware and re.fullmatch(rf"asked, but the CUDA-aware path takes at most "
                                      rf"{max_ranks} ranks .*: pinned staging", how), how
    aware, how = gpu.device_pointers_to_mpi(True, "JAXRING_CUDA_AWARE_MPI=1", 2, None)
    assert not aware and "MPI transport is unavailable: pinned staging" in how, how


def test_a_cpu_process_communicator_has_no_gpu_transport():
    comm = jaxring.mpi.world()
    expected = "none" if not native.has_cuda_backend() else comm.gpu_transport
    assert comm.gpu_transport == expected
    if expected == "none":
        assert "GPU" not in repr(comm)


STEP_SIZES = [0, 1, 7, 8, 1001, 4096, 65_537, 300_001]


def capacity_elements(transport, kind, n, nbytes, width):
    """What one step may move per block, from the buffer layout in xla_ffi/gpu/plan.h."""
    pieces = n if kind == "reduce_scatter" or (transport == "staged" and kind == "all_gather") else 1
    return nbytes // width // pieces


def check_plan(transport, kind, n, block, nbytes, dtype):
    """The steps of a call with blocks of `block` elements cover each once, in order, and fit."""
    width = dtype.itemsize
    count = block * n if kind == "reduce_scatter" else block
    steps = native.extension.gpu_plan(transport, COLLECTIVES[kind], n, count, nbytes,
                                      DTYPE_CODES[dtype])
    assert len(steps) >= 1
    covered = 0
    capacity = capacity_elements(transport, kind, n, nbytes, width)
    for i, (first, length, _) in enumerate(steps):
        assert first == covered, (steps[max(0, i - 1):i + 1], i)
        assert 0 <= length <= capacity
        if i + 1 < len(steps):  # every step but the last keeps 16-byte alignment
            assert length * width % 16 == 0 and length > 0
        covered += length
    assert covered == block


@pytest.mark.parametrize("transport", ["ipc", "staged"])
@pytest.mark.parametrize("kind", list(COLLECTIVES))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_steps_cover_every_element_once_and_fit_their_buffers(transport, kind, n):
    for dtype in DTYPES:
        for nbytes in (4096, 4096 + 16, 1 << 16, 1 << 20):
            for block in STEP_SIZES:
                check_plan(transport, kind, n, block, nbytes, dtype)


@pytest.mark.parametrize("transport", ["ipc", "staged"])
@pytest.mark.parametrize("kind", list(COLLECTIVES))
@pytest.mark.parametrize("n", [2, 16, 17])
def test_plans_and_shares_of_more_than_two_to_the_31_elements(transport, kind, n):
    """Counts, offsets and shares past 32 bits (a 12 GiB float32 call), as int64 all the way."""
    block = 3 * 2**30 + 7
    for dtype in (np.dtype(np.float32), np.dtype(np.float16)):
        check_plan(transport, kind, n, block, 32 << 20, dtype)
    if kind == "all_reduce":
        begins = native.extension.gpu_share(block, n, DTYPE_CODES[np.dtype(np.float32)])
        shares = np.diff(begins)
        assert begins[0] == 0 and begins[-1] == block and (shares >= 0).all()
        assert all(b * 4 % 16 == 0 for b in begins[:-1])
        assert shares.max() - shares.min() < 8, shares


def test_an_empty_call_still_takes_one_step_so_that_headers_are_exchanged():
    for kind in COLLECTIVES.values():
        assert native.extension.gpu_plan("ipc", kind, 4, 0, 4096, 11) == [(0, 0, "one-shot"
                                                                           if kind == 0 else "")]


def test_one_shot_for_small_steps_and_two_ranks_two_shot_for_large_steps():
    one_shot = native.extension.gpu_defaults()["ipc_one_shot_bytes"]
    f32 = DTYPE_CODES[np.dtype(np.float32)]
    big = 8 << 20
    assert {a for *_, a in native.extension.gpu_plan("ipc", 0, 4, one_shot // 4, big, f32)} == {
        "one-shot"}
    assert {a for *_, a in native.extension.gpu_plan("ipc", 0, 4, one_shot // 4 + 4, big, f32)} == {
        "two-shot"}
    assert {a for *_, a in native.extension.gpu_plan("ipc", 0, 2, big // 4, big, f32)} == {
        "one-shot"}
    # A large call in small slots: two-shot steps with a one-shot remainder.
    plan = native.extension.gpu_plan("ipc", 0, 4, (1 << 20) + 5, 1 << 20, f32)
    assert [a for *_, a in plan] == ["two-shot", "two-shot", "two-shot", "two-shot", "one-shot"]


def test_bad_slot_sizes_are_refused_by_the_planner():
    with pytest.raises(ValueError, match="at least 4096"):
        native.extension.gpu_plan("ipc", 0, 2, 10, 1024, 11)
    with pytest.raises(ValueError, match="multiple of 16"):
        native.extension.gpu_plan("staged", 0, 2, 10, 4100, 11)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 16])
def test_two_shot_shares_partition_a_step_on_16_byte_boundaries(n):
    for dtype in DTYPES:
        for count in STEP_SIZES:
            begins = native.extension.gpu_share(count, n, DTYPE_CODES[dtype])
            assert begins[0] == 0 and begins[-1] == count and len(begins) == n + 1
            assert all(a <= b for a, b in zip(begins, begins[1:]))
            assert all(b * dtype.itemsize % 16 == 0 for b in begins[:-1] if b < count)
            # Balanced: shares are whole vectors but the last, which takes the tail.
            shares, vector = np.diff(begins), max(1, 16 // dtype.itemsize)
            assert shares.max() - shares.min() < 2 * vector, (count, shares)


@pytest.mark.skipif(not os.path.exists(native.CUDA_LIBRARY),
                    reason="jaxring was built without nvcc: no CUDA library")
def test_a_cuda_library_from_another_build_is_refused(monkeypatch):
    """The CUDA library calls the host library through C structs (common/host_call.h) that
    another build may lay out differently, so it must come from the same sources."""
    library = native.cuda_library()
    assert library.JaxringCudaBuildId().decode() == native.extension.build_id()
    native.cuda_library.cache_clear()
    monkeypatch.setattr(native.extension, "build_id", lambda: "fedcba9876543210")
    try:
        with pytest.raises(RuntimeError, match=(
                r"libjaxring_cuda.so was built from other sources \(build [0-9a-f]{16}\) than "
                r"jaxring's host library \(build fedcba9876543210\), a stale build")):
            native.cuda_library()
    finally:
        native.cuda_library.cache_clear()


def test_a_library_compiled_against_another_jaxlib_release_is_refused():
    """The handlers are compiled against the installed jaxlib's FFI headers, whose API changes
    between releases; pip's isolated build environment may bring another jaxlib than the venv's."""
    import jaxlib

    built = native.extension.jaxlib_version()
    assert built.split(".")[:2] == jaxlib.__version__.split(".")[:2]
    native.check_jaxlib("0.10.2", "0.10.1")  # a patch release shares the headers
    with pytest.raises(ImportError, match=r"compiled against jaxlib 0\.10\.2's FFI headers, but "
                                          r"jaxlib 0\.11\.2 is installed: rebuild against it "
                                          r"with `pip install --no-build-isolation -e \.`"):
        native.check_jaxlib("0.10.2", "0.11.2")


@pytest.mark.skipif(shutil.which("cmake") is None, reason="no cmake on the PATH")
def test_the_build_id_is_a_hash_of_every_native_source(tmp_path):
    """The installed library's id is the hash of the sources here (a stale build fails this),
    and changing any one source changes it."""
    def build_id(sources):
        subprocess.run(["cmake", f"-DSOURCE_DIR={sources}", f"-DOUTPUT={tmp_path / 'id.cc'}",
                        "-P", str(SOURCES / "build_id.cmake")], check=True, timeout=60)
        return re.search(r'return "([0-9a-f]{16})"', (tmp_path / "id.cc").read_text()).group(1)

    assert build_id(SOURCES) == native.extension.build_id()
    copy = shutil.copytree(SOURCES, tmp_path / "xla_ffi")
    (copy / "transports" / "local.cc").write_text(
        (SOURCES / "transports" / "local.cc").read_text() + "\n")
    assert build_id(copy) != native.extension.build_id()


def test_gpu_errors_are_explained_without_a_cuda_library():
    if os.path.exists(native.CUDA_LIBRARY):
        pytest.skip("this build has the CUDA library")
    with pytest.raises(RuntimeError, match="built without CUDA"):
        native.cuda_library()


def test_the_gpu_benchmark_says_so_when_no_gpu_is_visible():
    if native.has_cuda_backend():
        pytest.skip("a GPU is visible")
    result = subprocess.run([sys.executable, str(HERE.parent / "benchmarks" / "allreduce_gpu.py")],
                            capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no CUDA GPU visible (JAX sees cpu)" in result.stderr


# ---- on a GPU ----------------------------------------------------------------------------------

# Processes that share the GPU allocate on demand, so that suites may also run side by side
# (pytest -n): a fixed fraction each would add up past the card's memory.
GPU_SHARING = {"JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
GPU_CONFIGS = {
    # transport, extra environment: default slots (one step; two-shot above 256 KiB with 4
    # ranks), slots small enough to cut the suite's larger sizes into many steps, and staging.
    "ipc": ("ipc", {}),
    "ipc-small-slots": ("ipc", {"JAXRING_GPU_WORKSPACE_BYTES": str(512 << 10)}),
    "ipc-tiny-slots": ("ipc", {"JAXRING_GPU_WORKSPACE_BYTES": "4096"}),
    "staged": ("staged", {"JAXRING_GPU_STAGING_BYTES": str(256 << 10)}),
    "staged-over-mpi": ("staged", {"JAXRING_GPU_STAGING_BYTES": str(64 << 10),
                                   "JAXRING_MPI_TRANSPORT": "mpi"}),
    "host": ("host", {}),
    # Pretend nodes of 2 ranks: "auto" is staged across them, ipc within (hierarchical levels).
    "auto-two-nodes": ("auto", {"JAXRING_MPI_RANKS_PER_NODE": "2"}),
}


@pytest.mark.gpu
@pytest.mark.skipif(not native.has_cuda_backend(), reason="no CUDA GPU visible")
@pytest.mark.parametrize("config", list(GPU_CONFIGS))
@pytest.mark.parametrize("n", [1, 2, 4], ids=["n1", "n2", "n4"])
def test_the_multiprocess_suite_on_gpu_processes_sharing_one_gpu(n, config):
    transport, extra = GPU_CONFIGS[config]
    extra = dict(extra)
    ranks_per_node = int(extra.pop("JAXRING_MPI_RANKS_PER_NODE", "0"))
    expected = transport
    if transport == "auto":
        expected = "staged" if 0 < ranks_per_node < n else "ipc"
    env = {**GPU_SHARING, "JAXRING_GPU_TRANSPORT": transport,
           "JAXRING_EXPECT_GPU_TRANSPORT": expected, **extra}
    mpi_transport = env.pop("JAXRING_MPI_TRANSPORT", "auto")
    result = mpiexec(n, "-m", "pytest", "-q", "-x", "-rA", "-p", "no:cacheprovider",
                     str(HERE / "mpi"),
                     timeout=540, transport=mpi_transport, ranks_per_node=ranks_per_node,
                     env=env)
    assert_every_rank_ran_the_suite(result, n, HERE / "mpi")


def mpi_is_cuda_aware() -> bool:
    extension, _ = jaxring.mpi._mpi_extension()
    return extension is not None and extension.cuda_aware()[0]


@pytest.mark.gpu
@pytest.mark.skipif(not native.has_cuda_backend(), reason="no CUDA GPU visible")
@pytest.mark.skipif(not mpi_is_cuda_aware(), reason="MPIX_Query_cuda_support: this MPI does not "
                    "take device pointers (e.g. Open MPI built with CUDA/UCX does)")
@pytest.mark.parametrize("n", [2, 4], ids=["n2", "n4"])
def test_the_multiprocess_suite_on_the_cuda_aware_path(n):
    env = {**GPU_SHARING, "JAXRING_GPU_TRANSPORT": "staged", "JAXRING_EXPECT_GPU_TRANSPORT": "staged",
           "JAXRING_CUDA_AWARE_MPI": "1", "JAXRING_GPU_STAGING_BYTES": str(64 << 10)}
    result = mpiexec(n, "-m", "pytest", "-q", "-x", "-rA", "-p", "no:cacheprovider",
                     str(HERE / "mpi"),
                     timeout=540, env=env)
    assert_every_rank_ran_the_suite(result, n, HERE / "mpi")


SANITIZER = shutil.which("compute-sanitizer") or (
    "/usr/local/cuda/bin/compute-sanitizer"
    if os.path.exists("/usr/local/cuda/bin/compute-sanitizer") else None)


@pytest.mark.gpu
@pytest.mark.skipif(not native.has_cuda_backend(), reason="no CUDA GPU visible")
@pytest.mark.skipif(SANITIZER is None, reason="no compute-sanitizer on the PATH or in /usr/local/cuda")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "initcheck", "synccheck"])
def test_reduce_kernels_under_compute_sanitizer(tool):
    """Every op x dtype x operand count of JaxringCudaReduce, aligned and misaligned, against
    numpy (tests/gpu_kernels_check.py), with the sanitizer's error exit code."""
    result = subprocess.run(
        [SANITIZER, "--tool", tool, "--error-exitcode", "99", "--target-processes", "all",
         sys.executable, str(HERE / "gpu_kernels_check.py"), "--quick"],
        capture_output=True, text=True, timeout=540,
        env=dict(os.environ, JAX_PLATFORMS="cuda", XLA_PYTHON_CLIENT_PREALLOCATE="false"))
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    assert "kernels agree with numpy" in result.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not native.has_cuda_backend(), reason="no CUDA GPU visible")
@pytest.mark.skipif(SANITIZER is None, reason="no compute-sanitizer on the PATH or in /usr/local/cuda")
@pytest.mark.parametrize("transport", ["ipc", "staged"])
def test_two_gpu_processes_under_memcheck(transport):
    """The transports' copies and kernels (including reads of a peer's mapped workspace) under
    memcheck, 2 processes, a few calls of every collective (tests/gpu_collectives_check.py)."""
    env = dict(os.environ, JAX_PLATFORMS="cuda", XLA_PYTHON_CLIENT_PREALLOCATE="false",
               JAXRING_GPU_TRANSPORT=transport, JAXRING_GPU_WORKSPACE_BYTES="65536",
               JAXRING_GPU_STAGING_BYTES="65536", JAXRING_TIMEOUT_SECONDS="600")
    from test_mpi import MPIEXEC
    result = subprocess.run(
        [MPIEXEC, "-n", "2", SANITIZER, "--tool", "memcheck", "--error-exitcode", "99",
         sys.executable, str(HERE / "gpu_collectives_check.py")],
        capture_output=True, text=True, timeout=540, env=env, cwd=HERE.parent)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    assert "collectives agree with numpy" in result.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not native.has_cuda_backend(), reason="no CUDA GPU visible")
@pytest.mark.parametrize("model,weight_dtype,batch,chunk_steps", [
    ("conditioned", "float32", 3, 8), ("conditioned", "float16", 5, 1000), ("odd", "float32", 2, 8),
])
def test_the_fused_wavenet_sampler_on_the_gpu_equals_naive(model, weight_dtype, batch,
                                                           chunk_steps):
    """The CUDA kernel of jaxring_wavenet_sample (xla_ffi/cuda/wavenet_kernels.cu) draws the same
    samples as the naive JAX sampler on the same GPU, with logits within float tolerance: with
    speaker and local conditioning, float16 weights, chunks that cut the queues' rings, and
    channel counts that are not multiples of the panel width."""
    import jax.numpy as jnp
    import test_wavenet as wn

    config = wn.CONDITIONED if model == "conditioned" else wn.ODD
    dtype = jnp.float16 if weight_dtype == "float16" else None
    # Full float32 products in XLA's reference too (not TF32), as in the kernel.
    with jax.default_device(jax.devices("cuda")[0]), jax.default_matmul_precision("highest"):
        weights, key, speaker, local, naive = wn.reference(config, batch, seed=21,
                                                           weight_dtype=dtype)
        fused = wn.fused_sampler.sample_fused(
            weights, config, key, wn.NUM_SAMPLES, batch, speaker, local, return_logits=True,
            weight_dtype=dtype or jnp.float32, chunk_steps=chunk_steps)
        assert fused[0].devices() == {jax.devices("cuda")[0]}
    wn.assert_same_samples(fused, naive)


def test_slots_too_small_for_the_ranks_are_refused_by_the_planner():
    """16 bytes a rank is the least a slot may give (plan.cc CheckSlotBytes): 4096 bytes serve
    256 ranks, not 257. Without the check (a mutation review), a float64 reduce_scatter's steps
    past that got 0 elements and planned ({0, 0}) to move nothing, with no error."""
    f64 = DTYPE_CODES[np.dtype(np.float64)]
    rs = COLLECTIVES["reduce_scatter"]
    assert native.extension.gpu_plan("staged", rs, 256, 256 * 2, 4096, f64) == [(0, 2, "")]
    for transport, what in (("staged", "gpu_staging_bytes"), ("ipc", "gpu_workspace_bytes")):
        with pytest.raises(ValueError, match=rf"{what} of 4096 bytes is too small for 257 ranks "
                                             r"\(at least 16 bytes per rank\)"):
            native.extension.gpu_plan(transport, rs, 257, 257 * 2, 4096, f64)
