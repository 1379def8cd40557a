"""The configuration every other one starts from: nv-wavenet's and Deep Voice's size (64 residual,
256 skip, 20 layers, dilations 1..512 twice), trained on 16 kHz espeak-ng speech."""

from __future__ import annotations

import dataclasses


def _check_counts(config, positive, non_negative) -> None:
    """Refuses a count below 1 (below 0 for `non_negative`), naming the field."""
    for names, least in ((positive, 1), (non_negative, 0)):
        for name in names:
            if getattr(config, name) < least:
                raise ValueError(f"{name} must be at least {least}, got {getattr(config, name)}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    residual_channels: int = 64
    skip_channels: int = 256
    num_layers: int = 20
    # Dilations are 1, 2, ..., 2**(dilation_cycle - 1), repeated until num_layers.
    dilation_cycle: int = 10
    # mu-law levels: the softmax size (8-bit mu-law as in the WaveNet paper, section 2.2).
    quantization_levels: int = 256
    # Width of the two output layers after the skip sum (nv-wavenet's "A").
    output_channels: int = 256
    # 0 turns conditioning off; otherwise the number of speakers / local feature channels.
    num_speakers: int = 0
    local_channels: int = 0

    def __post_init__(self):
        _check_counts(self, ("residual_channels", "skip_channels", "num_layers", "dilation_cycle",
                             "quantization_levels", "output_channels"),
                      ("num_speakers", "local_channels"))


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    sample_rate: int = 16000
    # Prediction targets per training crop; each crop also holds a receptive field less one of
    # earlier samples, their context (train.crop_nll).
    crop_length: int = 4096
    batch_size: int = 8
    learning_rate: float = 1e-3
    num_epochs: int = 20
    steps_per_epoch: int = 200
    eval_crops: int = 32
    seed: int = 0
    # Utterances synthesised per espeak-ng voice, and seconds of each synthetic signal kind.
    utterances_per_voice: int = 24
    synthetic_seconds: float = 20.0
    checkpoint_every_epochs: int = 1

    def __post_init__(self):
        # Zeros here trained on nothing and reported NaN losses, divided by zero after an epoch,
        # or failed in numpy or espeak-ng, after config.json had kept them (a review).
        _check_counts(self, ("sample_rate", "crop_length", "batch_size", "num_epochs",
                             "steps_per_epoch", "eval_crops", "utterances_per_voice",
                             "checkpoint_every_epochs"), ("seed",))
        if not self.synthetic_seconds >= 0:
            raise ValueError(f"synthetic_seconds must be at least 0, got {self.synthetic_seconds}")
        # Adam took a negative or zero rate without a word: it climbed the loss, or stood still.
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be above 0, got {self.learning_rate}")


def get_config() -> Config:
    return Config()
