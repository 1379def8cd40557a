"""32 residual / 128 skip / 20 layers at 8 kHz: trains to a falling NLL on two CPU cores in
minutes."""

from __future__ import annotations

import dataclasses

from models.wavenet.configs import default


def get_config() -> default.Config:
    return dataclasses.replace(
        default.get_config(),
        model=default.ModelConfig(residual_channels=32, skip_channels=128, num_layers=20),
        sample_rate=8000,
        crop_length=2048,
        batch_size=4,
        num_epochs=5,
        steps_per_epoch=100,
        utterances_per_voice=12,
        synthetic_seconds=10.0,
    )
