"""The GPU transports of process communicators (one GPU per process, launched by mpiexec):

* ``"ipc"``: processes on one node map each other's device workspace once (cudaIpc handles,
  exchanged here over MPI) and reduce in device memory, with no host copy
  (``xla_ffi/cuda/ipc.h``).
* ``"staged"``: between nodes, each collective runs on the host transport in chunks through
  pinned buffers allocated once, the copies to and from the device overlapping the network
  (``xla_ffi/cuda/staged.h``); with a CUDA-aware MPI (MPIX_Query_cuda_support, or
  ``JAXRING_CUDA_AWARE_MPI=1``) MPI gets device pointers instead (``xla_ffi/gpu/direct.h``).
* ``"host"``: the baseline: the whole call copied to the host and back, synchronously.

``"auto"`` (the default, or ``JAXRING_GPU_TRANSPORT``) is ipc on one node (up to 16 ranks) and
staged across nodes. barrier, ppermute, send and recv always take the host path. Every rank must run its
collectives on its GPU: a rank that runs them on the CPU while its peers use ipc or staged is
reported as a mismatch (or, for a call that fits one step, gets the same result).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os

from jaxring._src import common, native

GPU_TRANSPORTS = ("auto", "ipc", "staged", "host")
CUDA_AWARE_CHOICES = ("auto", "0", "1")
ENV_TRANSPORT = "JAXRING_GPU_TRANSPORT"
ENV_WORKSPACE = "JAXRING_GPU_WORKSPACE_BYTES"
ENV_STAGING = "JAXRING_GPU_STAGING_BYTES"
ENV_CUDA_AWARE = "JAXRING_CUDA_AWARE_MPI"
_ERROR_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class GpuOptions:
    """What a Communicator was asked for (arguments, else environment, else defaults)."""
    transport: str = "auto"
    workspace_bytes: int = 0  # cuda-ipc: per rank and parity; 0 = the native default
    staging_bytes: int = 0    # staged: per pinned chunk; 0 = the native default
    cuda_aware: str = "auto"

    @classmethod
    def resolve(cls, transport=None, workspace_bytes=None, staging_bytes=None,
                environ=os.environ) -> "GpuOptions":
        defaults = native.extension.gpu_defaults()
        transport = transport or environ.get(ENV_TRANSPORT, "auto")
        if transport not in GPU_TRANSPORTS:
            raise ValueError(f"jaxring.mpi: gpu_transport must be one of {GPU_TRANSPORTS}, "
                             f"got {transport!r}")
        cuda_aware = environ.get(ENV_CUDA_AWARE, "auto")
        if cuda_aware not in CUDA_AWARE_CHOICES:
            raise ValueError(f"jaxring.mpi: {ENV_CUDA_AWARE} must be one of "
                             f"{CUDA_AWARE_CHOICES}, got {cuda_aware!r}")
        workspace = _bytes_option("gpu_workspace_bytes", workspace_bytes, ENV_WORKSPACE,
                                  defaults["ipc_slot_bytes"], defaults["min_slot_bytes"], environ)
        staging = _bytes_option("gpu_staging_bytes", staging_bytes, ENV_STAGING,
                                defaults["staging_bytes"], defaults["min_slot_bytes"], environ)
        return cls(transport, workspace, staging, cuda_aware)


def _bytes_option(name, value, variable, default, minimum, environ) -> int:
    if value is None:
        text = environ.get(variable)
        if text is None:
            return default
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"jaxring.mpi: {variable} must be an integer number of bytes, "
                             f"got {text!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"jaxring.mpi: {name} must be an int, got {value!r}")
    if value < minimum or value % 16:
        raise ValueError(f"jaxring.mpi: {name} must be a multiple of 16 and at least {minimum} "
                         f"bytes, got {value}")
    return value


def choose_transport(requested: str, on_one_node: bool, gpus: list[bool]) -> str:
    """The GPU transport every rank uses, from what was requested, whether all ranks share a node,
    and which ranks have a GPU (every rank computes the same answer from the same inputs).
    "none" when no rank has a GPU."""
    if requested not in GPU_TRANSPORTS:
        raise ValueError(f"jaxring.mpi: gpu_transport must be one of {GPU_TRANSPORTS}, "
                         f"got {requested!r}")
    if not any(gpus):
        return "none"
    if not all(gpus):
        # Ranks on CPUs run whole host collectives; only the host path moves data the same way.
        return "host"
    max_ranks = native.extension.gpu_defaults()["ipc_max_ranks"]
    if requested == "auto":
        return "ipc" if on_one_node and len(gpus) <= max_ranks else "staged"
    if requested == "ipc" and not on_one_node:
        raise ValueError("jaxring.mpi: gpu_transport='ipc' needs every rank on one node (cudaIpc "
                         "handles cannot cross nodes); use 'staged' or 'auto'")
    if requested == "ipc" and len(gpus) > max_ranks:
        raise ValueError(f"jaxring.mpi: gpu_transport='ipc' takes at most {max_ranks} ranks, "
                         f"this communicator has {len(gpus)}; use 'staged' or 'auto'")
    return requested


def cuda_aware_mpi(choice: str, extension) -> tuple[bool, str]:
    """Whether MPI takes device pointers, and why we think so: the JAXRING_CUDA_AWARE_MPI
    override ("0"/"1"), else MPIX_Query_cuda_support through jaxring's MPI extension. Every rank
    must reach the same answer (the staged transport's set-up is collective either way)."""
    if choice not in CUDA_AWARE_CHOICES:
        raise ValueError(f"jaxring.mpi: {ENV_CUDA_AWARE} must be one of {CUDA_AWARE_CHOICES}, "
                         f"got {choice!r}")
    if choice != "auto":
        return choice == "1", f"{ENV_CUDA_AWARE}={choice}"
    if extension is None:
        return False, "no MPI extension to ask"
    return tuple(extension.cuda_aware())


def device_pointers_to_mpi(aware: bool, how: str, size: int, extension) -> tuple[bool, str]:
    """Whether the staged transport of `size` ranks hands MPI device pointers, given whether
    every rank's MPI takes them (`aware`, `how` we know): not without jaxring's MPI extension,
    nor past the ranks that one reduce kernel takes (the CUDA-aware path's set-up refused those,
    failing the communicator); pinned staging then, saying why."""
    if not aware:
        return False, how
    if extension is None:
        return False, f"{how}, but jaxring's MPI transport is unavailable: pinned staging"
    max_ranks = native.extension.gpu_defaults()["ipc_max_ranks"]
    if size > max_ranks:
        return False, (f"{how}, but the CUDA-aware path takes at most {max_ranks} ranks (one "
                       f"reduce kernel for every rank's piece): pinned staging")
    return True, how


def local_device() -> int:
    import jax

    return jax.local_devices(backend="cuda")[0].local_hardware_id


@functools.cache
def _library():
    library = native.cuda_library()
    library.JaxringCudaIpcHandleBytes.restype = ctypes.c_size_t
    library.JaxringCudaIpcCreate.argtypes = [
        ctypes.c_uint64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
        ctypes.c_char_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    library.JaxringCudaIpcOpen.argtypes = [ctypes.c_uint64, ctypes.c_char_p, ctypes.c_char_p,
                                           ctypes.c_size_t]
    library.JaxringCudaStagedCreate.argtypes = [
        ctypes.c_uint64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
        ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    library.JaxringCudaDetach.argtypes = [ctypes.c_uint64]
    return library


def _check(code: int, error: ctypes.Array) -> None:
    if code != 0:
        raise RuntimeError(error.value.decode(errors="replace"))


def attach(mpi_comm, key: int, rank: int, size: int, name: str, options: GpuOptions,
           on_one_node: bool, extension) -> tuple[str, bool, str]:
    """Sets up the GPU transport of a communicator (collective). Returns (transport, whether MPI
    is CUDA-aware, how that was determined); transport is "none" in processes without GPUs."""
    gpus = mpi_comm.allgather(native.has_cuda_backend())
    transport = choose_transport(options.transport, on_one_node, gpus)
    aware, how = (cuda_aware_mpi(options.cuda_aware, extension) if transport != "none"
                  else (False, "no GPU"))
    if not all(mpi_comm.allgather(aware)):
        aware = False  # device pointers only if every rank's MPI takes them
    if transport in ("none", "host"):
        return transport, aware, how
    library = _library()
    error = ctypes.create_string_buffer(_ERROR_BYTES)
    encoded = name.encode()
    try:
        if transport == "ipc":
            handle_bytes = library.JaxringCudaIpcHandleBytes()

            def create():
                handles = ctypes.create_string_buffer(handle_bytes)
                _check(library.JaxringCudaIpcCreate(key, rank, size, local_device(),
                                                    options.workspace_bytes, encoded, handles,
                                                    error, _ERROR_BYTES), error)
                return handles.raw

            what = f"the cuda-ipc GPU transport of {name}"
            mine = common.set_up_on_every_rank(mpi_comm, create, rank, what)
            everyone = b"".join(mpi_comm.allgather(mine))
            common.set_up_on_every_rank(mpi_comm, lambda: _check(library.JaxringCudaIpcOpen(
                key, everyone, error, _ERROR_BYTES), error), rank, what)
        else:
            # A CUDA-aware MPI gets device pointers, over messages of its own (collective).
            what = f"the staged GPU transport of {name}"
            messages = None
            aware, how = device_pointers_to_mpi(aware, how, size, extension)
            if aware:
                from mpi4py import MPI

                messages = common.set_up_on_every_rank(mpi_comm, lambda: extension.message_ops(
                    MPI._addressof(mpi_comm), name), rank, what)
            common.set_up_on_every_rank(mpi_comm, lambda: _check(library.JaxringCudaStagedCreate(
                key, rank, size, local_device(), options.staging_bytes, messages, encoded,
                error, _ERROR_BYTES), error), rank, what)
    except Exception:
        library.JaxringCudaDetach(key)
        raise
    return transport, aware, how


def detach(key: int) -> None:
    """Forgets the GPU transport of communicator `key`, if the CUDA library is loaded."""
    if _library.cache_info().currsize:
        _library().JaxringCudaDetach(key)
