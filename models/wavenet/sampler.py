"""Samplers. All of them draw the same samples for the same weights and key, up to float
rounding (models/wavenet/README.md: a near-tie in the CDF can part two samplers' streams):

- `sample_naive`: recompute the whole receptive field for every sample (the baseline);
- `sample_incremental`: Fast WaveNet (Paine et al. 2016, arXiv:1611.09482): each layer keeps a
  queue of its past inputs, so one sample costs one pass through the layers; the whole loop is
  one `lax.scan`;
- `sample_python_loop`: the same step, jitted once and called from a Python loop per sample;
- `models.wavenet.pipeline_sampler`: layer groups on different devices (layer-sharded);
- `models.wavenet.fused_sampler`: the whole loop inside one C++ custom call.

Sampling rule: inverse-CDF sampling from the softmax, with one uniform number per stream and time
step, drawn by `jax.random` from `fold_in(key, t)`, so that every sampler, whatever its loop
structure, sees the same numbers. (Gumbel-max would need one random number per level: 256 per
sample, whose generation alone cost more than a fused network step.)
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from models.wavenet import model
from models.wavenet.configs.default import ModelConfig


def uniform_noise(key, step, batch: int):
    """The numbers in [0, 1) that pick time step `step`'s samples, `[batch]`."""
    return jax.random.uniform(jax.random.fold_in(key, step), (batch,), jnp.float32)


def sample_token(logits, uniform):
    """The first level whose running sum of exp(logit - max) exceeds `uniform` times the total:
    a draw from softmax(logits). The fused kernel computes the same (wavenet_cpu.cc)."""
    unnormalised = jnp.exp(logits - logits.max(axis=-1, keepdims=True))
    cdf = jnp.cumsum(unnormalised, axis=-1)
    below = jnp.sum(cdf <= uniform[..., None] * cdf[..., -1:], axis=-1)
    return jnp.minimum(below, logits.shape[-1] - 1).astype(jnp.int32)


def check_count(name: str, value, least: int = 1) -> None:
    """Refuses a sampler's count argument that is not an int of at least `least` (a bool is
    none)."""
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
            or value < least):
        raise ValueError(f"{name} must be an int of at least {least}, got {value!r}")


def check_inputs(config: ModelConfig, num_samples: int, batch: int, speaker=None,
                 local=None) -> None:
    """What every sampler takes: `batch` streams of `num_samples` samples, each with one speaker
    id in [0, num_speakers) (`speaker` `[batch]`, where the model has speakers) and local
    conditioning of one frame per sample, `[batch, num_samples, local_channels]`. Speaker ids are
    checked where they are concrete (each jitted sampler checks them before it traces,
    `checked`): inside a program an id out of range would take another speaker's embedding, as
    JAX's indexing wraps negative ids and clamps the rest. (A batch of 0 returned empty arrays
    from some samplers and divided by zero in others; a shorter local conditioning was padded
    with zeros by one sampler, refused by another and silently reused from its start by the
    fused ones.)"""
    check_count("batch", batch)
    check_count("num_samples", num_samples, least=0)
    want = (batch, num_samples, config.local_channels)
    if local is not None and tuple(local.shape) != want:
        raise ValueError(f"local conditioning must have shape [batch, num_samples, "
                         f"local_channels] = {want}, got {tuple(local.shape)}")
    if speaker is None:
        return
    if not config.num_speakers:
        raise ValueError("this model has no speaker embedding (num_speakers is 0): pass "
                         "speaker=None")
    shape = tuple(np.shape(speaker))
    dtype = np.dtype(speaker.dtype if hasattr(speaker, "dtype") else np.asarray(speaker).dtype)
    if shape != (batch,) or not np.issubdtype(dtype, np.integer):
        raise ValueError(f"speaker must be [batch] = ({batch},) integer ids, got {dtype.name}"
                         f"{list(shape)}")
    if not isinstance(speaker, jax.core.Tracer):
        ids = np.asarray(speaker)
        outside = ids[(ids < 0) | (ids >= config.num_speakers)]
        if outside.size:
            raise ValueError(f"speaker ids must lie in [0, {config.num_speakers}) (the model's "
                             f"num_speakers), got {sorted(set(outside.tolist()))}")


def checked(jitted):
    """`jitted`, a jitted sampler, behind `check_inputs` on the arguments it is called or
    lowered with, before JAX traces them: the speaker ids are then concrete, unless the caller
    itself traces the sampler."""
    signature = inspect.signature(jitted)

    def check(args, kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        check_inputs(given["config"], given["num_samples"], given["batch"], given["speaker"],
                     given["local"])

    @functools.wraps(jitted)
    def sample(*args, **kwargs):
        check(args, kwargs)
        return jitted(*args, **kwargs)

    def lower(*args, **kwargs):
        check(args, kwargs)
        return jitted.lower(*args, **kwargs)

    sample.lower = lower
    return sample


def time_major(local):
    """Local conditioning `[batch, time, channels]` -> `[time, batch, channels]` (scan order)."""
    return None if local is None else jnp.swapaxes(local, 0, 1)


# ---------------------------------------------------------------------------------------------
# (a) naive: the full network over the last receptive field, per sample.


@checked
@functools.partial(jax.jit, static_argnames=("config", "num_samples", "batch", "return_logits"))
def sample_naive(weights, config: ModelConfig, key, num_samples: int, batch: int = 1,
                 speaker=None, local=None, return_logits: bool = False):
    """Samples `[batch, num_samples]` (and logits `[batch, num_samples, levels]`)."""
    window = model.receptive_field(config)
    length = num_samples + window
    inputs = jnp.full((batch, length), model.start_token(config), jnp.int32)
    if local is not None:
        local = jnp.pad(local, ((0, 0), (0, length - local.shape[1]), (0, 0)))

    def step(inputs, t):
        # Output t sees inputs t - window + 1 ... t only, so the window [start, start + window)
        # gives exactly the full-sequence logits at t; before t = window - 1 it starts at 0.
        start = jnp.maximum(0, t - window + 1)
        window_inputs = lax.dynamic_slice_in_dim(inputs, start, window, axis=1)
        window_local = None if local is None else lax.dynamic_slice_in_dim(
            local, start, window, axis=1)
        skip = model.skip_sum(weights, config, window_inputs, speaker, window_local)
        skip_now = lax.dynamic_index_in_dim(skip, t - start, axis=1, keepdims=False)
        logits = model.output_logits(weights["output"], skip_now)
        token = sample_token(logits, uniform_noise(key, t, batch))
        inputs = lax.dynamic_update_index_in_dim(inputs, token, t + 1, axis=1)
        return inputs, (token, logits if return_logits else None)

    _, (tokens, logits) = lax.scan(step, inputs, jnp.arange(num_samples, dtype=jnp.int32))
    tokens = tokens.T
    return (tokens, jnp.swapaxes(logits, 0, 1)) if return_logits else tokens


# ---------------------------------------------------------------------------------------------
# (b) incremental: per-layer ring buffers of past layer inputs.


def init_queues(config: ModelConfig, batch: int, layer_dilations) -> list:
    """One ring buffer `[dilation, batch, residual]` per layer: its inputs of the last `dilation`
    steps, slot `t % dilation` holding step t's. Zeros are the convolution's causal padding."""
    return [jnp.zeros((d, batch, config.residual_channels), jnp.float32) for d in layer_dilations]


def layer_group_step(layers: dict, queues: list, rows, h, speaker=None, local_now=None,
                     write=True):
    """One time step through a group of consecutive layers (stacked weights `[group, ...]`).
    `rows[i]` is layer i's queue row for this step: it holds the layer's input `dilation` steps
    ago and receives its input now (unless `write` is false). Returns the group's output
    residual, the sum of its skip outputs and the updated queues. A pipeline stage is exactly
    this function."""
    skip_sum = 0.0
    new_queues = []
    for index, (row, queue) in enumerate(zip(rows, queues)):
        layer = model.layer_weights(layers, index)
        h_past = lax.dynamic_index_in_dim(queue, row, axis=0, keepdims=False)
        stored = h if write is True else jnp.where(write, h, h_past)
        new_queues.append(lax.dynamic_update_index_in_dim(queue, stored, row, axis=0))
        conditioning = model.layer_conditioning(layer, speaker, local_now)
        h, skip = model.gated_residual_layer(layer, h, h_past, conditioning)
        skip_sum = skip_sum + skip
    return h, skip_sum, new_queues


def incremental_step(weights, config: ModelConfig, key, queues, token, t, speaker=None,
                     local_now=None):
    """One sample for every stream: the previous token in, the next token and its logits out."""
    h = weights["embedding"][token]
    rows = [t % dilation for dilation in model.dilations(config)]
    _, skip_sum, queues = layer_group_step(weights["layers"], queues, rows, h, speaker, local_now)
    logits = model.output_logits(weights["output"], skip_sum)
    token = sample_token(logits, uniform_noise(key, t, token.shape[0]))
    return queues, token, logits


@checked
@functools.partial(jax.jit, static_argnames=("config", "num_samples", "batch", "return_logits"))
def sample_incremental(weights, config: ModelConfig, key, num_samples: int, batch: int = 1,
                       speaker=None, local=None, return_logits: bool = False):
    """Samples `[batch, num_samples]` (and logits), the whole loop one `lax.scan`."""
    queues = init_queues(config, batch, model.dilations(config))
    token = jnp.full((batch,), model.start_token(config), jnp.int32)

    def step(carry, inputs):
        t, local_now = inputs
        queues, token = carry
        queues, token, logits = incremental_step(weights, config, key, queues, token, t,
                                                 speaker, local_now)
        return (queues, token), (token, logits if return_logits else None)

    steps = jnp.arange(num_samples, dtype=jnp.int32)
    _, (tokens, logits) = lax.scan(step, (queues, token), (steps, time_major(local)))
    tokens = tokens.T
    return (tokens, jnp.swapaxes(logits, 0, 1)) if return_logits else tokens


def sample_python_loop(weights, config: ModelConfig, key, num_samples: int, batch: int = 1,
                       speaker=None, local=None):
    """The per-step baseline: the incremental step jitted once, called once per sample."""
    check_inputs(config, num_samples, batch, speaker, local)
    step = _jitted_step(config)
    queues = init_queues(config, batch, model.dilations(config))
    token = jnp.full((batch,), model.start_token(config), jnp.int32)
    tokens = []
    for t in range(num_samples):
        local_now = None if local is None else local[:, t]
        queues, token = step(weights, key, queues, token, jnp.int32(t), speaker, local_now)
        tokens.append(token)
    return jnp.stack(tokens, axis=1)


@functools.cache
def _jitted_step(config: ModelConfig):
    def step(weights, key, queues, token, t, speaker, local_now):
        queues, token, _ = incremental_step(weights, config, key, queues, token, t, speaker,
                                            local_now)
        return queues, token

    return jax.jit(step, donate_argnums=(2,))
