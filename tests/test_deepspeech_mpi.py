"""Deep Speech 2 trained across processes, as in the README: ``mpiexec -n 2 python -m
models.deepspeech.train``. Two processes (one device each, the communicator jaxring.mpi.world())
must train exactly like two devices in one process (the same slices of every batch, the same
reductions), and both ranks must end with the same parameters."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
pytestmark = pytest.mark.skipif(not Path(MPIEXEC).exists(), reason="no mpiexec (pip install mpich)")

# The tiny config shrunk as in test_deepspeech_train.py: 3 steps of 16 utterances per epoch.
# The paper's optimiser with a clipping norm that never binds, not Adam: Adam (and clipping)
# remove the gradient's scale, so processes that summed their gradients instead of averaging them
# would train alike.
OVERRIDES = {
    "train_utterances": 48, "test_utterances": 8, "conv_channels": "[4]",
    "conv_kernels": "[[5, 11]]", "rnn_layers": 1, "rnn_hidden": 16, "dense": 16, "batch_size": 16,
    "optimizer": "nesterov", "learning_rate": 0.005, "grad_clip_norm": 1e9,
    "frame_multiple": 320, "beam_utterances": 2, "epochs": 2,
}

# The command line's `train`, which also saves this process's final state (params, batch
# statistics, optimizer state) as rank<N>.npz in the folder given first. `python -c`, so that the
# repository root (the working directory) is on the path.
TRAIN_AND_SAVE_STATE = """
import os, sys
import jax, numpy as np
from models.deepspeech import main, train as training

out, train = sys.argv[1], training.train

def train_and_save_state(*args, **kwargs):
    history, state = train(*args, **kwargs)
    rank = 0
    if training.launched_processes() > 1:
        from mpi4py import MPI
        rank = MPI.COMM_WORLD.Get_rank()
    np.savez(os.path.join(out, f"rank{rank}.npz"), *map(np.asarray, jax.tree.leaves(state)))
    return history, state

training.train = train_and_save_state
main.main(sys.argv[2:])
"""


def train(workdir: Path, cache: Path, launcher=(), xla_flags="") -> subprocess.CompletedProcess:
    workdir.mkdir(parents=True)
    command = [*launcher, sys.executable, "-c", TRAIN_AND_SAVE_STATE, str(workdir), "train",
               "--config", "tiny", "--workdir", str(workdir), "--cache-dir", str(cache)]
    for key, value in OVERRIDES.items():
        command += ["--set", f"{key}={value}"]
    env = dict(os.environ, XLA_FLAGS=xla_flags, JAXRING_TIMEOUT_SECONDS="60")
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env,
                            cwd=ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def state(path: Path) -> list:
    with np.load(path) as stored:
        return [stored[f"arr_{i}"] for i in range(len(stored.files))]


def test_two_processes_train_like_two_devices_in_one(tmp_path):
    cache = tmp_path / "cache"  # written by rank 0 while rank 1 waits, then read by both
    processes, devices = tmp_path / "processes", tmp_path / "devices"
    train(processes, cache, launcher=(MPIEXEC, "-n", "2"))
    train(devices, cache, xla_flags="--xla_force_host_platform_device_count=2")

    # Only rank 0 writes the results: one config, one curve, one checkpoint per epoch.
    mpi_history = json.loads((processes / "learning_curve.json").read_text())
    in_process_history = json.loads((devices / "learning_curve.json").read_text())
    assert sorted(p.name for p in (processes / "checkpoints").iterdir()) == ["0", "1"]
    assert [h["epoch"] for h in mpi_history] == [1, 2] == [h["epoch"] for h in in_process_history]
    mpi_losses = [h["train_loss"] for h in mpi_history]
    np.testing.assert_allclose(mpi_losses, [h["train_loss"] for h in in_process_history],
                               rtol=1e-4)
    assert mpi_losses[1] < mpi_losses[0], mpi_losses  # it trained: the comparison means something

    # Every process applied the same update to the same parameters at every step.
    rank0, rank1 = state(processes / "rank0.npz"), state(processes / "rank1.npz")
    assert len(rank0) == len(rank1) > 10
    for a, b in zip(rank0, rank1):
        np.testing.assert_array_equal(a, b)
    in_process = state(devices / "rank0.npz")
    assert len(in_process) == len(rank0)
    for a, b in zip(rank0, in_process):
        # Identical here (2026-12-05): every reduction sums two values, in either order the
        # same bits; the bound leaves room for XLA compiling the two programs' arithmetic apart.
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
