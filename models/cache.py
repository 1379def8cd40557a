"""Writing the models' data caches, which runs started at the same time may share."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np


def save_npz(path: str | Path, **arrays) -> None:
    """``np.savez(path, **arrays)`` through a temporary file of this writer's own in the same
    folder, renamed into place at the end. Two runs that make one cache at once both finish (the
    last rename wins; they write the same data), where with one shared temporary name the first
    rename left the other run nothing to rename; and a run stopped mid-write leaves no partial
    file that later runs would take for the cache."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.", suffix=".tmp")
    try:
        os.fchmod(handle, 0o644)  # mkstemp's 0o600 would keep a shared cache from other users
        with os.fdopen(handle, "wb") as file:
            np.savez(file, **arrays)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
