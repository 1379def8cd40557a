"""(d) The fused sampler: many sample steps of every stream inside one C++ custom call
(`jaxring_wavenet_sample`, xla_ffi/models/wavenet_cpu.cc), weights packed once into the layout
that kernel streams through, per-layer ring-buffer queues passed in and out (aliased, so they stay
in place), and the uniform numbers of `sampler.uniform_noise` passed in so that it draws the same
samples as the JAX samplers.

The loop is a `lax.scan` over chunks of `chunk_steps` steps: one custom call per chunk, with that
chunk's noise generated just before it (the noise of a whole long sample would not fit in
memory). With `weight_dtype=jnp.float16` the kernel streams half the bytes; compare it against the
JAX samplers given `round_weights(weights, jnp.float16)`, the same numbers in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxring._src import native
from models.wavenet import model, sampler
from models.wavenet.configs.default import ModelConfig

TARGET = "jaxring_wavenet_sample"
STAGE_TARGET = "jaxring_wavenet_stage"
# The GPU kernel (xla_ffi/cuda/wavenet_sampler.h) run on the host, one host thread per GPU
# thread: a test of that kernel on machines without a GPU, far too slow for anything else.
GPU_EMULATION_TARGET = "jaxring_wavenet_sample_gpu_emulated"
# Columns per weight panel: 8 AVX2 vectors, one register tile of a single stream.
PANEL_WIDTH = 64


def round_weights(weights, dtype):
    """The weights rounded to `dtype` and back to float32."""
    return jax.tree.map(lambda w: w.astype(dtype).astype(jnp.float32), weights)


def column_panels(matrix):
    """`[rows, cols]` as consecutive row-major panels of PANEL_WIDTH columns (the last one
    narrower), flattened: the order in which the kernel streams a matrix."""
    cols = matrix.shape[1]
    return jnp.concatenate([matrix[:, start:start + PANEL_WIDTH].reshape(-1)
                            for start in range(0, cols, PANEL_WIDTH)])


def pack_weights(weights, config: ModelConfig, dtype=jnp.float32):
    """One flat array in the order the kernel reads it (the layout comment of wavenet_cpu.cc):
    embedding; per layer the gate [current; past] x 2R, the residual and skip matrices, their
    biases and the local-conditioning matrix; then the output layers. The gate bias is not here:
    it is `gate_bias_per_stream`."""
    layers = weights["layers"]
    parts = [weights["embedding"]]
    for index in range(config.num_layers):
        layer = model.layer_weights(layers, index)
        parts.append(column_panels(
            jnp.concatenate([layer["gate_current"], layer["gate_past"]], axis=0)))
        parts.append(column_panels(layer["residual"]))
        parts.append(column_panels(layer["skip"]))
        parts.append(jnp.concatenate([layer["residual_bias"], layer["skip_bias"]]))
        if config.local_channels:
            parts.append(column_panels(layer["local"]))
    output = weights["output"]
    parts += [column_panels(output["hidden"]), output["hidden_bias"],
              column_panels(output["logits"]), output["logits_bias"]]
    return jnp.concatenate([p.reshape(-1) for p in parts]).astype(dtype)


def gate_bias_per_stream(weights, batch: int, speaker=None):
    """`[layers, batch, 2R]`: each layer's gate bias plus the stream's speaker embedding."""
    layers = weights["layers"]
    bias = jnp.broadcast_to(layers["gate_bias"][:, None, :],
                            (layers["gate_bias"].shape[0], batch, layers["gate_bias"].shape[1]))
    if speaker is not None and "speaker_embedding" in layers:
        bias = bias + layers["speaker_embedding"][:, speaker, :]
    return bias.astype(jnp.float32)


def fused_steps(packed, config: ModelConfig, gate_bias, local, noise, token, queues, first_step,
                return_logits: bool, portable: bool = False, threads: int = 1,
                gpu_emulation: bool = False):
    """`noise.shape[0]` steps in one custom call. Returns tokens `[steps, batch]`, the queues and
    the logits `[steps, batch, levels]` (`[0, batch, levels]` unless `return_logits`).
    `portable` runs the plain C++ loops instead of the AVX2/FMA kernels. `threads` > 1: with at
    least that many streams, each thread samples a share of the streams; with fewer, the threads
    split every step's channels between them and meet once per layer (needs a core per
    thread: on a busy machine it is slower than one thread). `gpu_emulation` runs the GPU
    kernel on the host instead (GPU_EMULATION_TARGET); on a CUDA device the GPU kernel runs
    anyway."""
    target = GPU_EMULATION_TARGET if gpu_emulation else TARGET
    return _sampling_call(target, config, noise, queues, return_logits)(
        packed, gate_bias, local, noise, token, queues, jnp.asarray(first_step, jnp.int32),
        **_size_attributes(config), portable=portable, threads=np.int64(threads))


def _sampling_call(target: str, config: ModelConfig, noise, queues, return_logits: bool,
                   has_side_effect: bool = False):
    """The custom call of both sampling kernels: tokens `[steps, batch]`, the queues (aliased to
    operand 5) and the logits `[steps or 0, batch, levels]`."""
    native.register_targets()
    steps, batch = noise.shape
    return jax.ffi.ffi_call(
        target,
        (jax.ShapeDtypeStruct((steps, batch), jnp.int32),
         jax.ShapeDtypeStruct(queues.shape, jnp.float32),
         jax.ShapeDtypeStruct((steps if return_logits else 0, batch, config.quantization_levels),
                              jnp.float32)),
        input_output_aliases={5: 1}, has_side_effect=has_side_effect)


def _size_attributes(config: ModelConfig) -> dict:
    """The model's sizes, as both sampling kernels take them."""
    return dict(residual=np.int64(config.residual_channels), skip=np.int64(config.skip_channels),
                hidden=np.int64(config.output_channels),
                levels=np.int64(config.quantization_levels),
                local_channels=np.int64(config.local_channels),
                panel_width=np.int64(PANEL_WIDTH),
                dilations=np.asarray(model.dilations(config), np.int64))


def stage_steps(packed, config: ModelConfig, gate_bias, local, noise, token, queues, first_step,
                return_logits: bool, stage, group, comm, op_id: int, stream_groups: int,
                portable: bool = False):
    """`fused_steps` for one stage of a layer-sharded sampler (`jaxring_wavenet_stage`): device
    `stage` of the `comm.size` devices of a mesh axis runs its contiguous share of the layers
    and hands every step on through jaxring's point-to-point mailboxes; streams go through in
    `stream_groups` groups. Only the last stage's tokens and logits are the samples (the other
    stages return zeros)."""
    # A side effect: the stages talk to each other, so XLA must neither drop nor merge calls.
    return _sampling_call(STAGE_TARGET, config, noise, queues, return_logits,
                          has_side_effect=True)(
        packed, gate_bias, local, noise, token, queues, jnp.asarray(first_step, jnp.int32),
        stage, group, **_size_attributes(config), portable=portable, comm=np.int64(comm.key),
        comm_name=comm.native_name, size=np.int64(comm.size), op_id=np.int64(op_id),
        stream_groups=np.int64(stream_groups))


def run_chunks(steps_fn, config: ModelConfig, key, num_samples: int, batch: int, local,
               chunk_steps: int):
    """The sampling loop of the fused samplers: a `lax.scan` over chunks of steps, each chunk's
    uniform numbers generated just before it. `steps_fn(local, noise, token, queues,
    first_step) -> (tokens, queues, logits)` runs one chunk. Returns tokens `[batch, samples]`
    and logits `[batch, samples, levels]`."""
    sampler.check_count("chunk_steps", chunk_steps)
    channels = config.local_channels
    local = jnp.zeros((batch, num_samples, channels), jnp.float32) if local is None else local
    local = sampler.time_major(local.astype(jnp.float32))
    levels = config.quantization_levels
    queues = jnp.zeros((sum(model.dilations(config)), batch, config.residual_channels),
                       jnp.float32)
    token = jnp.full((batch,), model.start_token(config), jnp.int32)

    def chunk(carry, first_step, length):
        queues, token = carry
        steps = first_step + jnp.arange(length, dtype=jnp.int32)
        noise = jax.vmap(lambda t: sampler.uniform_noise(key, t, batch))(steps)
        local_chunk = lax.dynamic_slice_in_dim(local, first_step, length, axis=0)
        tokens, queues, logits = steps_fn(local_chunk, noise, token, queues, first_step)
        return (queues, tokens[-1]), (tokens, logits)

    if num_samples == 0:
        return (jnp.zeros((batch, 0), jnp.int32),
                jnp.zeros((batch, 0, levels), jnp.float32))
    length = min(chunk_steps, num_samples)
    full_chunks, remainder = divmod(num_samples, length)
    starts = jnp.arange(full_chunks, dtype=jnp.int32) * length
    carry, (tokens, logits) = lax.scan(lambda c, s: chunk(c, s, length), (queues, token), starts)
    tokens = tokens.reshape(-1, batch)
    logits = logits.reshape(-1, batch, levels)
    if remainder:
        _, (last_tokens, last_logits) = chunk(carry, jnp.int32(full_chunks * length), remainder)
        tokens = jnp.concatenate([tokens, last_tokens])
        logits = jnp.concatenate([logits, last_logits])
    return tokens.T, jnp.swapaxes(logits, 0, 1)


@sampler.checked
@functools.partial(jax.jit, static_argnames=("config", "num_samples", "batch", "return_logits",
                                             "weight_dtype", "chunk_steps", "portable",
                                             "threads", "gpu_emulation"))
def sample_fused(weights, config: ModelConfig, key, num_samples: int, batch: int = 1,
                 speaker=None, local=None, return_logits: bool = False,
                 weight_dtype=jnp.float32, chunk_steps: int = 1024, portable: bool = False,
                 threads: int = 1, gpu_emulation: bool = False):
    """Samples `[batch, num_samples]` (and logits), like `sampler.sample_incremental`."""
    sampler.check_count("threads", threads)
    packed = pack_weights(weights, config, weight_dtype)
    gate_bias = gate_bias_per_stream(weights, batch, speaker)

    def steps_fn(local, noise, token, queues, first_step):
        return fused_steps(packed, config, gate_bias, local, noise, token, queues, first_step,
                           return_logits, portable, threads, gpu_emulation)

    tokens, logits = run_chunks(steps_fn, config, key, num_samples, batch, local, chunk_steps)
    return (tokens, logits) if return_logits else tokens
