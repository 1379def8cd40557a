"""The WaveNet network (van den Oord et al. 2016, "WaveNet: A Generative Model for Raw Audio").

Input: the previous mu-law code of each time step (an embedding, equivalent to a 1x1 convolution
of its one-hot vector). Then `num_layers` gated residual layers, each a causal dilated
convolution of kernel size 2 (section 2.1) with a tanh x sigmoid gate (section 2.3, equation 2)
and optional global (speaker) and local conditioning (section 2.5), a residual connection and a
skip output (section 2.4). The skip outputs are summed and go through ReLU, a dense layer, ReLU
and a dense layer to the softmax logits over the mu-law codes (the paper's figure 4; the sizes of
nv-wavenet's `A` channels).

The math lives in pure functions of a weights dictionary so that training (parallel over time)
and every sampler (one time step at a time) run the same code: `gated_residual_layer` works on
`[batch, time, channels]` and on `[batch, channels]` alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.wavenet.configs.default import ModelConfig


def dilations(config: ModelConfig) -> tuple[int, ...]:
    return tuple(2 ** (i % config.dilation_cycle) for i in range(config.num_layers))


def receptive_field(config: ModelConfig) -> int:
    """Samples that one output sees: itself plus each layer's dilation (kernel size 2)."""
    return 1 + sum(dilations(config))


def start_token(config: ModelConfig) -> int:
    """The input before the first sample: the mu-law code of silence."""
    return config.quantization_levels // 2


def layer_weights(layers: dict, index) -> dict:
    """One layer's weights out of the stacked `[num_layers, ...]` arrays."""
    return {name: value[index] for name, value in layers.items()}


def layer_conditioning(layer: dict, speaker=None, local=None, time_axis: bool = False):
    """What conditioning adds to the gate pre-activation: V_k h of the paper's equations 3-4.
    `speaker` is `[batch]` ints; `local` is `[batch, (time,) local_channels]` at the sample rate.
    `time_axis`: the gate is `[batch, time, 2R]` (all steps at once), not `[batch, 2R]` (one
    step), so the speaker's `[batch, 2R]` embedding gets a time axis to broadcast over, with or
    without local conditioning (without it, the embedding would meet the gate's time axis: an
    error, or, when batch == time, every stream given stream t's embedding at step t)."""
    bias = 0.0
    if speaker is not None and "speaker_embedding" in layer:
        bias = layer["speaker_embedding"][speaker]
        if time_axis:
            bias = bias[:, None, :]
    if local is not None and "local" in layer:
        bias = bias + local @ layer["local"]
    return bias


def gated_residual_layer(layer: dict, h, h_past, conditioning=0.0):
    """One residual layer. `h` is the layer input now, `h_past` the same input `dilation` steps
    ago (zero before the start). Returns the next layer's input and this layer's skip output."""
    residual_channels = h.shape[-1]
    gate = h @ layer["gate_current"] + h_past @ layer["gate_past"] + layer["gate_bias"]
    gate = gate + conditioning
    activation = jnp.tanh(gate[..., :residual_channels]) * jax.nn.sigmoid(
        gate[..., residual_channels:])
    h_next = h + activation @ layer["residual"] + layer["residual_bias"]
    skip = activation @ layer["skip"] + layer["skip_bias"]
    return h_next, skip


def output_logits(output: dict, skip_sum):
    hidden = jax.nn.relu(jax.nn.relu(skip_sum) @ output["hidden"] + output["hidden_bias"])
    return hidden @ output["logits"] + output["logits_bias"]


def shift_right(x, steps: int):
    """x[:, t - steps] along axis 1, zero for t < steps: the causal (left) padding of a dilated
    convolution."""
    return jnp.pad(x, ((0, 0), (steps, 0), (0, 0)))[:, : x.shape[1]]


def forward(weights: dict, config: ModelConfig, inputs, speaker=None, local=None):
    """Logits `[batch, time, levels]` for inputs `[batch, time]` (each the previous code), all time
    steps at once."""
    return output_logits(weights["output"], skip_sum(weights, config, inputs, speaker, local))


def skip_sum(weights: dict, config: ModelConfig, inputs, speaker=None, local=None):
    """The summed skip outputs `[batch, time, skip_channels]`: everything but the output layers."""
    h = weights["embedding"][inputs]
    total = 0.0
    for index, dilation in enumerate(dilations(config)):
        layer = layer_weights(weights["layers"], index)
        h, skip = gated_residual_layer(
            layer, h, shift_right(h, dilation),
            layer_conditioning(layer, speaker, local, time_axis=True))
        total = total + skip
    return total


class WaveNet(nnx.Module):
    """Holds the weights as NNX parameters; the math is `forward` above."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        residual, skip = config.residual_channels, config.skip_channels
        gate, layers = 2 * residual, config.num_layers
        levels, hidden = config.quantization_levels, config.output_channels

        def normal(shape, fan_in):
            return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) / fan_in**0.5)

        def zeros(shape):
            return nnx.Param(jnp.zeros(shape, jnp.float32))

        self.embedding = normal((levels, residual), 1.0)
        layer_params = {
            # The two taps of the kernel-size-2 dilated convolution, each [in, out].
            "gate_current": normal((layers, residual, gate), 2 * residual),
            "gate_past": normal((layers, residual, gate), 2 * residual),
            "gate_bias": zeros((layers, gate)),
            "residual": normal((layers, residual, residual), residual),
            "residual_bias": zeros((layers, residual)),
            "skip": normal((layers, residual, skip), residual * layers),
            "skip_bias": zeros((layers, skip)),
        }
        if config.num_speakers:
            layer_params["speaker_embedding"] = normal((layers, config.num_speakers, gate), 1.0)
        if config.local_channels:
            layer_params["local"] = normal((layers, config.local_channels, gate),
                                           config.local_channels)
        self.layers = nnx.Dict(layer_params)
        self.output = nnx.Dict({
            "hidden": normal((skip, hidden), skip),
            "hidden_bias": zeros((hidden,)),
            "logits": normal((hidden, levels), hidden),
            "logits_bias": zeros((levels,)),
        })

    def weights(self) -> dict:
        """The weights as a plain dictionary of arrays (what the samplers take)."""
        return {
            "embedding": self.embedding[...],
            "layers": {name: param[...] for name, param in self.layers.items()},
            "output": {name: param[...] for name, param in self.output.items()},
        }

    def __call__(self, inputs, speaker=None, local=None):
        return forward(self.weights(), self.config, inputs, speaker, local)


def init_weights(config: ModelConfig, seed: int = 0) -> dict:
    return WaveNet(config, rngs=nnx.Rngs(seed)).weights()
