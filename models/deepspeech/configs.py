"""Deep Speech 2 configurations, from `tiny` (trains on 2 CPU cores in minutes) to `paper`.

`get_config(name, **overrides)` returns a frozen Config; the command line's ``--set key=value``
lands in `overrides`.
"""

from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass(frozen=True)
class Config:
    # Data: synthesised speech (models/deepspeech/data.py).
    train_utterances: int = 6000
    test_utterances: int = 400
    sample_rate: int = 8000
    data_seed: int = 0
    frame_multiple: int = 32  # time is padded to a multiple of this, so few shapes reach jit
    max_label_length: int = 48

    # Model (models/deepspeech/model.py). Kernels and strides are (time, frequency).
    conv_channels: tuple = (16,)
    conv_kernels: tuple = ((11, 21),)
    conv_strides: tuple = ((2, 2),)
    rnn_layers: int = 2
    rnn_hidden: int = 128
    dense: int = 128

    # Optimisation. The paper (section 3.1): Nesterov momentum, gradients clipped by global norm,
    # learning rate annealed by a constant factor each epoch.
    optimizer: str = "nesterov"  # or "adam"
    learning_rate: float = 3e-3
    momentum: float = 0.9
    learning_rate_decay_per_epoch: float = 1 / 1.2
    grad_clip_norm: float = 100.0
    batch_size: int = 32  # global: split evenly over the data-parallel replicas
    epochs: int = 10
    seed: int = 0
    sortagrad: bool = True

    # Data parallelism (jaxring/parallel/data.py).
    num_devices: int = 1
    bucket_bytes: int = 64 << 20

    # Evaluation.
    beam_width: int = 8
    beam_utterances: int = 100  # prefix beam search runs in Python: a subset is enough to report

    def replace(self, **overrides) -> Config:
        fields = {f.name: f for f in dataclasses.fields(self)}
        parsed = {}
        for key, value in overrides.items():
            if key not in fields:
                raise ValueError(f"unknown config key {key!r}; known: {sorted(fields)}")
            default = getattr(self, key)
            if isinstance(value, str):
                try:
                    value = (json.loads(value.lower()) if isinstance(default, bool)
                             else json.loads(value) if isinstance(default, tuple)
                             else type(default)(value) if not isinstance(default, str) else value)
                except ValueError:  # json's errors too
                    value = None  # refused below, naming the key
            if isinstance(default, tuple):
                value = _as_tuples(list(value)) if isinstance(value, (list, tuple)) else value
            if not _same_kind(value, default):
                raise ValueError(f"config key {key!r} takes {_kind(default)} (its default is "
                                 f"{json.dumps(default)}), got {overrides[key]!r}")
            parsed[key] = value
        return dataclasses.replace(self, **parsed)

    def __post_init__(self):
        """Refuses settings that describe no model, or another one than config.json would
        record; train.check_trainable refuses those that would train nothing."""
        for key in ("conv_channels", "conv_kernels", "conv_strides"):  # lists, from Python
            object.__setattr__(self, key, _as_tuples(getattr(self, key)))
        for key in _POSITIVE:
            if getattr(self, key) < 1:
                raise ValueError(f"config key {key!r} must be at least 1, got "
                                 f"{getattr(self, key)}")
        layers = {key: getattr(self, key) for key in ("conv_channels", "conv_kernels",
                                                      "conv_strides")}
        if len({len(value) for value in layers.values()}) != 1:
            raise ValueError("conv_channels, conv_kernels and conv_strides give one entry per "
                             "convolution, so they must be as long as each other, got "
                             + ", ".join(f"{k}={json.dumps(v)}" for k, v in layers.items()))
        if not all(_positive_int(c) for c in self.conv_channels):
            raise ValueError(f"conv_channels must be positive ints, got "
                             f"{json.dumps(self.conv_channels)}")
        for key in ("conv_kernels", "conv_strides"):
            if not all(isinstance(pair, tuple) and len(pair) == 2 and all(map(_positive_int, pair))
                       for pair in getattr(self, key)):
                raise ValueError(f"{key} must be [time, frequency] pairs of positive ints, got "
                                 f"{json.dumps(getattr(self, key))}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _as_tuples(value):
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def _kind(default) -> str:
    return {tuple: "a JSON list", int: "an int", float: "a number", bool: "true or false",
            str: "a string"}[type(default)]


def _same_kind(value, default) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return type(value) is type(default)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(default))


OPTIMIZERS = ("nesterov", "adam")

# Counts and sizes below 1 failed deep in data loading or training (no arrays to concatenate, a
# modulo by zero) instead of naming the key.
_POSITIVE = ("train_utterances", "test_utterances", "sample_rate", "frame_multiple",
             "max_label_length", "rnn_layers", "rnn_hidden", "dense", "batch_size", "num_devices",
             "bucket_bytes", "beam_width")


CONFIGS = {
    # Trains to a low character error rate on held-out voices in minutes on 2 CPU cores: two
    # data-parallel replicas (one per core) and Adam, which needs fewer steps than Nesterov
    # momentum to get there.
    "tiny": Config(optimizer="adam", learning_rate=2e-3, num_devices=2, epochs=3),
    # The same task with room to spare: more utterances, wider GRUs, 20 epochs.
    "small": Config(
        train_utterances=20000, conv_channels=(32, 32), conv_kernels=((11, 41), (11, 21)),
        conv_strides=((2, 2), (1, 2)), rnn_layers=3, rnn_hidden=384, dense=384, epochs=20),
    # The paper's English model sizes (Table 7: 3 convolutions, 7 bidirectional recurrent
    # layers, one dense layer; figures 2 and 3 for kernels and strides), at 16 kHz.
    "paper": Config(
        train_utterances=200000, test_utterances=2000, sample_rate=16000,
        conv_channels=(32, 32, 96), conv_kernels=((11, 41), (11, 21), (11, 21)),
        conv_strides=((2, 2), (1, 2), (1, 2)), rnn_layers=7, rnn_hidden=1760, dense=1760,
        learning_rate=6e-4, momentum=0.99, batch_size=512, epochs=20, max_label_length=200),
}


def get_config(name: str, **overrides) -> Config:
    if name not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; choose from {sorted(CONFIGS)}")
    return CONFIGS[name].replace(**overrides)
