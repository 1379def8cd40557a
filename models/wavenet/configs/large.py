"""128 residual / 256 skip / 20 layers: the larger size of issue 7's benchmark."""

from __future__ import annotations

import dataclasses

from models.wavenet.configs import default


def get_config() -> default.Config:
    return dataclasses.replace(
        default.get_config(),
        model=default.ModelConfig(residual_channels=128, skip_channels=256, num_layers=20),
    )
