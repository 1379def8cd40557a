"""(c) Layer-sharded sampling: the layers are split into n contiguous groups, one per device of a
mesh axis, and each device keeps its group's weights and queues. Inside `jax.shard_map` one
`lax.scan` runs the clock; at every tick each stage runs `sampler.layer_group_step` for one
microbatch of streams and hands its output to the next stage with `jaxring.ppermute` around a
ring: stage j -> j + 1 carries the residual and the partial skip sum, and the last stage -> stage
0 carries the output layer's hidden activations, from which stage 0 takes the logits, samples the
token and embeds it. The output layers are split between the last stage (skip -> hidden) and
stage 0 (hidden -> logits) so that the stages do about equal work.

Streams are split into M = gcd(batch, n) microbatches; microbatch m enters stage 0 for time step
t at tick t n + m, so with M = n every stage is busy at every tick (stream group m is at stage
(tick - m) mod n); with M < n (fewer streams than stages) the pipeline idles part of the time.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring._src import common
from models.wavenet import fused_sampler, model, sampler
from models.wavenet.configs.default import ModelConfig

# The one switch between jaxring's point-to-point path and XLA's own collective permute.
PERMUTES = {"jaxring": jaxring.ppermute, "lax": lax.ppermute}


def stage_layout(config: ModelConfig, num_stages: int):
    """Per stage and layer slot, the dilation `[n, group]`, and per slot the queue length (the
    largest dilation any stage has there)."""
    if config.num_layers % num_stages:
        raise ValueError(f"layer-sharded sampling: {config.num_layers} layers cannot be split "
                         f"evenly over {num_stages} devices; use a divisor of the layer count")
    stage_dilations = np.asarray(model.dilations(config)).reshape(num_stages, -1)
    return stage_dilations, stage_dilations.max(axis=0)


@sampler.checked
@functools.partial(jax.jit, static_argnames=("config", "num_samples", "batch", "mesh", "axis",
                                             "return_logits", "permute"))
def sample_layer_sharded(weights, config: ModelConfig, key, num_samples: int, batch: int,
                         mesh, axis: str, speaker=None, local=None, return_logits: bool = False,
                         permute: str = "jaxring"):
    """Samples `[batch, num_samples]` (and logits) with the layers sharded over `mesh`'s `axis`;
    the same samples as `sampler.sample_incremental`."""
    n = mesh.shape[axis]
    stage_dilations, queue_lengths = stage_layout(config, n)
    microbatches = math.gcd(batch, n)
    per_microbatch = batch // microbatches
    residual, skip = config.residual_channels, config.skip_channels
    hidden, levels = config.output_channels, config.quantization_levels
    message_width = max(residual + skip, hidden)
    if num_samples == 0:  # the pipeline would index a time axis of none
        tokens = jnp.zeros((batch, 0), jnp.int32)
        return (tokens, jnp.zeros((batch, 0, levels), jnp.float32)) if return_logits else tokens
    ticks = num_samples * n + microbatches
    pass_on = functools.partial(PERMUTES[permute], axis_name=axis,
                                perm=[(s, (s + 1) % n) for s in range(n)])

    stage_layers = jax.tree.map(lambda w: w.reshape((n, -1) + w.shape[1:]), weights["layers"])
    # Queue row (slot * M + microbatch): each microbatch has its own ring per layer.
    queues = [jnp.zeros((n, length * microbatches, per_microbatch, residual), jnp.float32)
              for length in queue_lengths]
    # No speaker means no speaker term, as in the other samplers (not speaker 0's embedding).
    if speaker is not None:
        speaker = speaker.reshape(microbatches, per_microbatch)
    channels = config.local_channels
    local = sampler.time_major(
        jnp.zeros((batch, num_samples, channels), jnp.float32) if local is None else local)

    def stage_program(layers, dilations, queues, embedding, output, speaker, local):
        layers = jax.tree.map(lambda w: w[0], layers)
        dilations, queues = dilations[0], [q[0] for q in queues]
        stage = lax.axis_index(axis)
        last = n - 1

        def first_stage_head(message, t, m):
            """Stage 0: logits of step t - 1 from the hidden activations, its token, embedded."""
            logits = message[:, :hidden] @ output["logits"] + output["logits_bias"]
            noise = lax.dynamic_slice_in_dim(
                sampler.uniform_noise(key, t - 1, batch), m * per_microbatch, per_microbatch)
            token = jnp.where(t == 0, model.start_token(config),
                              sampler.sample_token(logits, noise))
            return token, logits

        def tick(carry, k):
            queues, message = carry
            relative = k - stage
            slot, t = relative % n, relative // n
            m = jnp.minimum(slot, microbatches - 1)
            active = (relative >= 0) & (slot < microbatches) & (t < num_samples)
            token, logits = lax.cond(
                stage == 0, first_stage_head,
                lambda message, t, m: (jnp.zeros((per_microbatch,), jnp.int32),
                                       jnp.zeros((per_microbatch, levels), jnp.float32)),
                message, t, m)
            h = jnp.where(stage == 0, embedding[token], message[:, :residual])
            skip_in = jnp.where(stage == 0, 0.0, message[:, residual:residual + skip])
            t_now = jnp.clip(t, 0, num_samples - 1)
            rows = [(t_now % dilations[i]) * microbatches + m for i in range(len(queues))]
            local_now = lax.dynamic_slice_in_dim(local[t_now], m * per_microbatch,
                                                 per_microbatch) if channels else None
            h, skip_partial, queues = sampler.layer_group_step(
                layers, queues, rows, h, None if speaker is None else speaker[m], local_now,
                write=active)
            skip_sum = skip_in + skip_partial

            def last_stage_head(h, skip_sum):
                out = jax.nn.relu(jax.nn.relu(skip_sum) @ output["hidden"] + output["hidden_bias"])
                return jnp.pad(out, ((0, 0), (0, message_width - hidden)))

            def hand_on(h, skip_sum):
                out = jnp.concatenate([h, skip_sum], axis=1)
                return jnp.pad(out, ((0, 0), (0, message_width - residual - skip)))

            message = lax.cond(stage == last, last_stage_head, hand_on, h, skip_sum)
            message = pass_on(message)
            return (queues, message), (token, logits if return_logits else None)

        message = jnp.zeros((per_microbatch, message_width), jnp.float32)
        _, (tokens, logits) = lax.scan(tick, (queues, message), jnp.arange(ticks))
        if not return_logits:
            logits = jnp.zeros((ticks, per_microbatch, 0), jnp.float32)
        # Only stage 0's outputs are samples: replicate them (once, after the loop).
        return jax.tree.map(lambda x: lax.psum(jnp.where(stage == 0, x, 0), axis),
                            (tokens, logits))

    sharded = P(axis)
    replicated = P()
    program = jax.shard_map(
        stage_program, mesh=mesh,
        in_specs=(sharded, sharded, [sharded] * len(queues), replicated, replicated, replicated,
                  replicated),
        out_specs=(replicated, replicated), check_vma=False)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    tokens, logits = program(
        put(stage_layers, sharded), put(jnp.asarray(stage_dilations, jnp.int32), sharded),
        [put(q, sharded) for q in queues], weights["embedding"], weights["output"], speaker,
        local)
    # Stage 0 emits step t - 1 of microbatch m at tick t n + m.
    emitted = (np.arange(1, num_samples + 1)[:, None] * n + np.arange(microbatches)[None, :])
    tokens = tokens[emitted].reshape(num_samples, batch).T
    if not return_logits:
        return tokens
    return tokens, jnp.swapaxes(logits[emitted].reshape(num_samples, batch, levels), 0, 1)


@sampler.checked
@functools.partial(jax.jit, static_argnames=("config", "num_samples", "batch", "mesh", "axis",
                                             "return_logits", "weight_dtype", "chunk_steps",
                                             "stream_groups"))
def sample_layer_sharded_fused(weights, config: ModelConfig, key, num_samples: int, batch: int,
                               mesh, axis: str, speaker=None, local=None,
                               return_logits: bool = False, weight_dtype=jnp.float32,
                               chunk_steps: int = 1024, stream_groups: int | None = None):
    """(c) with (d): layer-sharded sampling where every stage is the fused C++ loop
    (`fused_sampler.stage_steps`). Device j of `mesh`'s `axis` runs its contiguous share of the
    layers for a whole chunk of steps, handing each step to device j + 1 (and the sampled tokens
    from the last device back to device 0) through jaxring's point-to-point mailboxes. The
    streams go through in `stream_groups` groups (default: one per stage), so with at least as
    many streams as stages every stage is busy. At most one group per stream circulates, and
    with several stages at most 9 x stages - 1 groups (the ring of mailboxes between the stages,
    8 messages each, and a group in each stage's hands, holds no more); a larger
    `stream_groups` means that many. The same
    samples as `sampler.sample_incremental` (and `fused_sampler.sample_fused`) for the same
    weights, weight dtype and key, whatever the groups."""
    n = mesh.shape[axis]
    if not 1 <= n <= config.num_layers:
        raise ValueError(f"layer-sharded sampling: {n} stages for {config.num_layers} layers; "
                         "each stage needs at least one layer")
    groups = n if stream_groups is None else stream_groups
    sampler.check_count("stream_groups", groups)
    packed = fused_sampler.pack_weights(weights, config, weight_dtype)
    gate_bias = fused_sampler.gate_bias_per_stream(weights, batch, speaker)

    def stage_program(packed, gate_bias, local=None):
        if local is None:  # no conditioning: zeros made here, not passed in (see below)
            local = jnp.zeros((batch, num_samples, config.local_channels), jnp.float32)
        comm = common.communicator("wavenet stage", axis)
        stage, group = comm.rank_and_group()
        op_id = common.next_op_id(comm)

        def steps_fn(local, noise, token, queues, first_step):
            tokens, queues, logits = fused_sampler.stage_steps(
                packed, config, gate_bias, local, noise, token, queues, first_step,
                return_logits, stage, group, comm, op_id, groups)
            # The last stage sampled; every stage carries its tokens into the next chunk.
            tokens, logits = jaxring.broadcast((tokens, logits), axis, root=n - 1)
            return tokens, queues, logits

        return fused_sampler.run_chunks(steps_fn, config, key, num_samples, batch, local,
                                        chunk_steps)

    # Without local conditioning the zeros are made inside the program: with no local channels
    # they have no elements, and jaxlib 0.11.2 crashes compiling any use of a zero-size
    # argument of a shard_map body.
    args = (packed, gate_bias) if local is None else (packed, gate_bias, local)
    program = jax.shard_map(stage_program, mesh=mesh, in_specs=(P(),) * len(args),
                            out_specs=(P(), P()), check_vma=False)
    tokens, logits = program(*args)
    return (tokens, logits) if return_logits else tokens
