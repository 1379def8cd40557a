"""Named configurations: `get_config(name)` returns one of them."""

from __future__ import annotations

import importlib


def get_config(name: str = "default"):
    return importlib.import_module(f"models.wavenet.configs.{name}").get_config()
