"""Loads the native extension and registers its FFI targets with XLA (once)."""

from __future__ import annotations

import functools

import jax

try:
    from jaxring import _jaxring as extension
except ImportError as error:  # pragma: no cover - only when the build is missing
    raise ImportError(
        "jaxring's native library is not built; install with `pip install -e .` (see README)"
    ) from error


@functools.cache
def register_targets() -> None:
    targets = {**extension.cpu_targets(), **extension.model_cpu_targets()}
    for name, capsule in targets.items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
