"""Test setup: 8 CPU devices in this process (set before jax initialises), float64 enabled, and a
short collective timeout so that a test of a missing peer fails fast instead of hanging."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAXRING_TIMEOUT_SECONDS", "60")
# On a GPU machine the test process must not take the GPU memory its mpiexec children need.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
