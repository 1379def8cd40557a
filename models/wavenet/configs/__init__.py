"""Named configurations: `get_config(name)` returns one of them."""

from __future__ import annotations

import importlib


NAMES = ("tiny", "small", "default", "large")


def get_config(name: str = "default"):
    if name not in NAMES:
        raise ValueError(f"unknown WaveNet config {name!r}; choose from {', '.join(NAMES)}")
    return importlib.import_module(f"models.wavenet.configs.{name}").get_config()
