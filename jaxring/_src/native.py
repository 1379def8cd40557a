"""Loads the native extension and registers its FFI targets with XLA (once): the CPU handlers
from _jaxring, and, where JAX has a CUDA backend, the GPU handlers from libjaxring_cuda.so."""

from __future__ import annotations

import ctypes
import functools
import os

import jax
import jaxlib

try:
    from jaxring import _jaxring as extension
except ImportError as error:  # pragma: no cover - only when the build is missing
    raise ImportError(
        "jaxring's native library is not built; install with `pip install -e .` (see README)"
    ) from error


def check_jaxlib(built: str, installed: str) -> None:
    """Refuses a library compiled against the FFI headers of another jaxlib release than the one
    installed (their FFI API differs between releases: 0.10's is 0.3, 0.11's 0.4). pip's isolated
    build environment installs the newest jaxlib for the build, whatever the venv holds."""
    if built.split(".")[:2] != installed.split(".")[:2]:
        raise ImportError(
            f"jaxring's native library was compiled against jaxlib {built}'s FFI headers, but "
            f"jaxlib {installed} is installed: rebuild against it with `pip install "
            "--no-build-isolation -e .` (or install jaxlib " + built + ")")


check_jaxlib(getattr(extension, "jaxlib_version", lambda: jaxlib.__version__)(),
             jaxlib.__version__)

# The newest functions the Python code calls: a library built before them (an editable install
# not rebuilt after a pull) failed at import with a bare AttributeError.
_missing = [name for name in ("name_call_site", "call_site_address", "shm_leave")
            if not hasattr(extension, name)]
if _missing:
    raise ImportError(f"jaxring's native library is older than its Python code (it has no "
                      f"{', '.join(_missing)}): rebuild it with `pip install -e .`")

# FFI target -> exported symbol suffix, for the handlers both platforms have.
COLLECTIVE_TARGETS = {
    "jaxring_all_reduce": "AllReduce", "jaxring_reduce_scatter": "ReduceScatter",
    "jaxring_all_gather": "AllGather", "jaxring_broadcast": "Broadcast",
    "jaxring_barrier": "Barrier", "jaxring_ppermute": "Ppermute", "jaxring_send": "Send",
    "jaxring_recv": "Recv",
}
# Model kernels with a GPU counterpart: FFI target -> exported symbol of libjaxring_cuda.so.
MODEL_CUDA_TARGETS = {"jaxring_wavenet_sample": "JaxringWaveNetSampleCuda"}
CUDA_LIBRARY = os.path.join(os.path.dirname(extension.__file__), "libjaxring_cuda.so")


@functools.cache
def register_targets() -> None:
    targets = {**extension.cpu_targets(), **extension.model_cpu_targets()}
    for name, capsule in targets.items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    if has_cuda_backend():
        library = cuda_library()
        symbols = {name: f"Jaxring{symbol}Cuda" for name, symbol in COLLECTIVE_TARGETS.items()}
        for name, symbol in {**symbols, **MODEL_CUDA_TARGETS}.items():
            handler = getattr(library, symbol)
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform="CUDA")


def build_id(module=None) -> str:
    """The build id of a native module (default: the host library), a hash of the sources it was
    built from; a module built before build ids existed has none, and says so."""
    found = getattr(extension if module is None else module, "build_id", None)
    return found() if found is not None else "none (built before build ids)"


def check_same_build(library: str, build: str) -> None:
    """Refuses `library`, built from other sources than this host library: they share C structs
    (xla_ffi/common/host_call.h, gpu/direct.h) that another build may lay out differently."""
    if build != build_id():
        raise RuntimeError(
            f"jaxring: {library} was built from other sources (build {build}) than jaxring's "
            f"host library (build {build_id()}), a stale build: reinstall jaxring "
            "(pip install -e .) so that every library is rebuilt")


def has_cuda_backend() -> bool:
    """Whether JAX has a CUDA backend with at least one GPU in this process."""
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


@functools.cache
def cuda_library() -> ctypes.CDLL:
    """libjaxring_cuda.so, connected to this process's host library."""
    if not os.path.exists(CUDA_LIBRARY):
        raise RuntimeError("jaxring was built without CUDA (no nvcc at build time), so it has no "
                           "GPU handlers; rebuild with nvcc on the PATH")
    library = ctypes.CDLL(CUDA_LIBRARY)
    try:
        library.JaxringCudaBuildId.restype = ctypes.c_char_p
        cuda_build = library.JaxringCudaBuildId().decode()
    except AttributeError:
        cuda_build = "none (built before build ids)"
    check_same_build("libjaxring_cuda.so", cuda_build)
    library.JaxringCudaSetHostCall.argtypes = [ctypes.c_void_p]
    library.JaxringCudaSetHostCall(extension.host_call_address())
    library.JaxringCudaSetHostTimeout.argtypes = [ctypes.c_void_p]
    library.JaxringCudaSetHostTimeout(extension.host_timeout_address())
    library.JaxringCudaSetCallSiteSource.argtypes = [ctypes.c_void_p]
    library.JaxringCudaSetCallSiteSource(extension.call_site_address())
    return library
