"""A few-second training run for tests: 8 residual / 16 skip / 4 layers, dilations 1, 2, 1, 2."""

from __future__ import annotations

import dataclasses

from models.wavenet.configs import default


def get_config() -> default.Config:
    return dataclasses.replace(
        default.get_config(),
        model=default.ModelConfig(
            residual_channels=8, skip_channels=16, num_layers=4, dilation_cycle=2,
            output_channels=32,
        ),
        sample_rate=8000,
        crop_length=256,
        batch_size=4,
        learning_rate=3e-3,
        num_epochs=2,
        steps_per_epoch=15,
        eval_crops=8,
        utterances_per_voice=2,
        synthetic_seconds=2.0,
    )
