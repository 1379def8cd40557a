"""The configuration every other one starts from: nv-wavenet's and Deep Voice's size (64 residual,
256 skip, 20 layers, dilations 1..512 twice), trained on 16 kHz espeak-ng speech."""

from __future__ import annotations

import dataclasses


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


def get_config() -> Config:
    return Config()
