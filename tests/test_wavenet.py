"""WaveNet: mu-law, causality, every sampler against the naive one, the fused C++ step, and a
short training run whose loss falls."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shutil
import sys
import time
import wave
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxring
from helpers import mesh

# `models` is not an installed package: import it from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models.wavenet import audio, fused_sampler, model, pipeline_sampler, sampler  # noqa: E402
from models.wavenet.configs import get_config  # noqa: E402

# Logits of two samplers differ only by float32 summation order (and the kernel's exp).
LOGIT_RTOL = LOGIT_ATOL = 1e-4
NUM_SAMPLES = 37  # more than the receptive field of every config below, and not a power of two

TINY = get_config("tiny").model
# Conditioning on, channel counts the AVX2 kernels take (multiples of 8), dilations 1, 2, 4.
CONDITIONED = dataclasses.replace(TINY, residual_channels=16, num_layers=6, dilation_cycle=3,
                                  num_speakers=3, local_channels=8)
# Speaker conditioning alone: the speaker's embedding is the only term without a time axis.
SPEAKERS_ONLY = dataclasses.replace(TINY, num_speakers=3)
# Channel counts that are not multiples of 8: the kernel's portable path.
ODD = dataclasses.replace(TINY, residual_channels=6, skip_channels=10, output_channels=12,
                          num_layers=3)


def test_dilations_double_within_each_cycle_from_1():
    config = dataclasses.replace(TINY, num_layers=7, dilation_cycle=3)
    assert model.dilations(config) == (1, 2, 4, 1, 2, 4, 1)
    assert model.receptive_field(config) == 16


def conditioning(config, batch, num_samples, seed):
    rng = np.random.default_rng(seed)
    speaker = local = None
    if config.num_speakers:
        speaker = jnp.asarray(rng.integers(0, config.num_speakers, batch), jnp.int32)
    if config.local_channels:
        local = jnp.asarray(rng.standard_normal((batch, num_samples, config.local_channels)),
                            jnp.float32)
    return speaker, local


def random_weights(config, seed):
    """Initial weights with random (not zero) biases, so that every term is exercised."""
    weights = model.init_weights(config, seed)
    keys = iter(jax.random.split(jax.random.key(seed + 100), 64))
    return jax.tree.map(
        lambda w: w + 0.1 * jax.random.normal(next(keys), w.shape, jnp.float32) if w.ndim <= 2
        else w, weights)


def reference(config, batch, seed, weight_dtype=None, reference_sampler=None):
    """Random weights (rounded to `weight_dtype` if given), a key, conditioning for `batch`
    streams, and the reference sampler's (default: naive) tokens and logits, from `seed`."""
    weights = random_weights(config, seed)
    if weight_dtype is not None:
        weights = fused_sampler.round_weights(weights, weight_dtype)
    key = jax.random.key(seed + 1)
    speaker, local = conditioning(config, batch, NUM_SAMPLES, seed + 2)
    expected = (reference_sampler or sampler.sample_naive)(
        weights, config, key, NUM_SAMPLES, batch, speaker, local, return_logits=True)
    return weights, key, speaker, local, expected


def assert_same_samples(actual, expected):
    (tokens, logits), (expected_tokens, expected_logits) = actual, expected
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected_logits),
                               rtol=LOGIT_RTOL, atol=LOGIT_ATOL)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(expected_tokens))


@pytest.fixture(scope="module", params=[TINY, CONDITIONED], ids=["tiny", "conditioned"])
def case(request):
    config, batch = request.param, 3
    return (config, batch) + reference(config, batch, seed=1)


# ---------------------------------------------------------------------------------------------


def test_mu_law_round_trip():
    codes = np.arange(256)
    np.testing.assert_array_equal(audio.mu_law_encode(audio.mu_law_decode(codes)), codes)
    x = np.random.default_rng(0).uniform(-1, 1, 10000)
    decoded = audio.mu_law_decode(audio.mu_law_encode(x))
    # In the companded domain the error is at most half a quantisation step, 1/255.
    def compress(v):
        return np.sign(v) * np.log1p(255 * np.abs(v)) / np.log1p(255)

    assert np.all(np.abs(compress(decoded) - compress(x)) <= 1 / 255 + 1e-6)
    assert np.all(np.diff(audio.mu_law_encode(np.sort(x))) >= 0)
    assert audio.mu_law_encode(0.0) == model.start_token(TINY)


def test_wav_round_trip(tmp_path):
    x = np.random.default_rng(1).uniform(-1, 1, 800).astype(np.float32)
    path = audio.write_wav(tmp_path / "x.wav", x, 8000)
    y, rate = audio.read_wav(path)
    assert rate == 8000
    np.testing.assert_allclose(y, x, atol=1 / 32767)


def test_causality_and_receptive_field():
    config = CONDITIONED
    weights = random_weights(config, seed=3)
    rng = np.random.default_rng(4)
    length, field = 40, model.receptive_field(config)
    inputs = rng.integers(0, 256, (2, length))
    speaker, local = conditioning(config, 2, length, seed=5)
    forward = jax.jit(model.forward, static_argnums=1)
    base = np.asarray(forward(weights, config, jnp.asarray(inputs), speaker, local))
    for position in (0, 17, length - 1):
        changed = inputs.copy()
        changed[:, position] = (changed[:, position] + 128) % 256
        changed_local = local.at[:, position].add(1.0)
        for new_inputs, new_local, reach in ((changed, local, field),
                                             (inputs, changed_local, None)):
            out = np.asarray(forward(weights, config, jnp.asarray(new_inputs), speaker,
                                     new_local))
            differs = np.any(out != base, axis=(0, 2))
            assert not differs[:position].any(), f"output before {position} saw its input"
            assert differs[position], f"output {position} ignores its own input"
            assert not differs[position + field:].any(), "output beyond the receptive field"
            if reach is not None and position + reach - 1 < length:
                # The input reaches exactly receptive_field - 1 steps ahead (all past taps).
                assert differs[position + reach - 1], "receptive field smaller than computed"


def test_the_training_loss_counts_only_targets_with_a_whole_receptive_field():
    """train.crop_nll against the NLL of the same targets computed from the whole stream, in
    float64 from the forward pass's logits: a crop's counted targets see the same past as in the
    stream, so the two agree; a target whose receptive field reached before its crop would see
    zeros there instead (as every crop's first targets did before the context margin)."""
    from models.wavenet import input_pipeline, train

    config = get_config("tiny")
    net, _ = train.create_model(config)
    rng = np.random.default_rng(6)
    stream = rng.integers(0, 256, 500)
    context, length = model.receptive_field(config.model) - 1, 30
    crops = input_pipeline.random_crops(stream, 5, length, np.random.default_rng(7), context)
    assert crops.shape == (5, context + length + 1)
    logits = np.asarray(jax.jit(model.forward, static_argnums=1)(
        net.weights(), config.model, jnp.asarray(stream[None, :-1])))[0].astype(np.float64)
    starts = [int(np.flatnonzero(np.all(
        np.lib.stride_tricks.sliding_window_view(stream, crops.shape[1]) == crop, axis=1))[0])
        for crop in crops]
    expected = []
    for start in starts:
        for t in range(start + context, start + context + length):  # input t predicts t + 1
            z = logits[t] - logits[t].max()
            expected.append(np.log(np.exp(z).sum()) - z[stream[t + 1]])
    np.testing.assert_allclose(float(train.crop_nll(net, jnp.asarray(crops), context)),
                               np.mean(expected), rtol=1e-5)
    # The held-out NLL, evaluated 2 crops at a time (the last batch holds one): every target
    # weighs the same, not every batch.
    np.testing.assert_allclose(train.held_out_nll(net, jnp.asarray(crops), 2, context),
                               np.mean(expected), rtol=1e-5)


@pytest.mark.parametrize("batch,length", [(4, 4), (3, 40)], ids=["batch=time", "batch<time"])
def test_speaker_conditioning_without_local(batch, length):
    """With a speaker and no local conditioning, the full forward pass equals each stream run
    alone (batch 1: nothing to confuse the speaker axis with) and the incremental sampler's
    logits for the same inputs, at every step; the naive sampler (the forward pass over windows)
    draws the incremental sampler's samples."""
    config = SPEAKERS_ONLY
    weights = random_weights(config, seed=21)
    speaker, _ = conditioning(config, batch, length, seed=22)
    key = jax.random.key(23)
    tokens, logits = sampler.sample_incremental(weights, config, key, length, batch, speaker,
                                                return_logits=True)
    inputs = jnp.concatenate(
        [jnp.full((batch, 1), model.start_token(config), jnp.int32), tokens[:, :-1]], axis=1)
    forward = jax.jit(model.forward, static_argnums=1)
    full = np.asarray(forward(weights, config, inputs, speaker))
    for stream in range(batch):
        alone = forward(weights, config, inputs[stream:stream + 1], speaker[stream:stream + 1])
        np.testing.assert_allclose(full[stream], np.asarray(alone)[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(full, np.asarray(logits), rtol=LOGIT_RTOL, atol=LOGIT_ATOL)
    naive = sampler.sample_naive(weights, config, key, length, batch, speaker,
                                 return_logits=True)
    assert_same_samples(naive, (tokens, logits))


def test_no_speaker_means_no_speaker_term():
    """A model with speaker embeddings sampled with speaker=None draws what the model without
    the embeddings draws, in the samplers that split the conditioning from the model's code (the
    layer-sharded one once used speaker 0's embedding)."""
    config, batch = dataclasses.replace(SPEAKERS_ONLY, local_channels=8), 4
    weights = random_weights(config, seed=25)
    key = jax.random.key(26)
    _, local = conditioning(config, batch, NUM_SAMPLES, seed=27)
    without = dataclasses.replace(config, num_speakers=0)
    stripped = dict(weights, layers={name: value for name, value in weights["layers"].items()
                                     if name != "speaker_embedding"})
    expected = sampler.sample_incremental(stripped, without, key, NUM_SAMPLES, batch, None,
                                          local, return_logits=True)
    stages = mesh(2, "stage")
    for sample in (fused_sampler.sample_fused,
                   functools.partial(pipeline_sampler.sample_layer_sharded, mesh=stages,
                                     axis="stage"),
                   functools.partial(pipeline_sampler.sample_layer_sharded_fused, mesh=stages,
                                     axis="stage", chunk_steps=8)):
        assert_same_samples(sample(weights, config, key, NUM_SAMPLES, batch, speaker=None,
                                   local=local, return_logits=True), expected)


def test_zero_samples_from_every_sampler():
    """The fused samplers divided by a chunk of min(chunk_steps, 0) steps."""
    config, batch = CONDITIONED, 3
    weights = random_weights(config, seed=29)
    key = jax.random.key(30)
    speaker, local = conditioning(config, batch, 0, seed=31)
    stages = mesh(2, "stage")
    for sample in (sampler.sample_incremental, fused_sampler.sample_fused,
                   functools.partial(pipeline_sampler.sample_layer_sharded, mesh=stages,
                                     axis="stage"),
                   functools.partial(pipeline_sampler.sample_layer_sharded_fused, mesh=stages,
                                     axis="stage", chunk_steps=8)):
        tokens, logits = sample(weights, config, key, 0, batch, speaker=speaker, local=local,
                                return_logits=True)
        assert tokens.shape == (batch, 0) and logits.shape == (batch, 0, config.quantization_levels)


def test_every_sampler_refuses_local_conditioning_of_another_length_or_channel_count():
    """Local conditioning gives one frame per sample. One shorter than the samples asked for was
    padded with zeros by the naive sampler, refused by the incremental one (by lax.scan) and
    reused from its start by the fused ones, silently; longer was taken by some. Every sampler
    now refuses both with the shape it needs, and another channel count too (a mutation that
    checked only the batch and the length failed deep inside instead, in dot_general or the
    kernel)."""
    config, batch, num_samples = CONDITIONED, 2, 12
    weights = random_weights(config, seed=33)
    key = jax.random.key(34)
    speaker, _ = conditioning(config, batch, num_samples, seed=35)
    bad = [conditioning(config, batch, frames, seed=35)[1]
           for frames in (num_samples - 7, num_samples + 3)]
    bad += [jnp.zeros((batch, num_samples, channels), jnp.float32)
            for channels in (config.local_channels - 3, config.local_channels + 2)]
    for local in bad:
        for sample in every_sampler():
            with pytest.raises(ValueError, match=rf"local conditioning must have shape \[batch, "
                                                 rf"num_samples, local_channels\] = \({batch}, "
                                                 rf"{num_samples}, {config.local_channels}\), "
                                                 rf"got \({batch}, {local.shape[1]}, "
                                                 rf"{local.shape[2]}\)"):
                sample(weights, config, key, num_samples, batch, speaker=speaker, local=local)


def every_sampler(chunk_steps: int = 5) -> tuple:
    """Every sampler, called as sample(weights, config, key, num_samples, batch, ...)."""
    stages = mesh(2, "stage")
    return (sampler.sample_naive, sampler.sample_incremental, sampler.sample_python_loop,
            functools.partial(fused_sampler.sample_fused, chunk_steps=chunk_steps),
            functools.partial(pipeline_sampler.sample_layer_sharded, mesh=stages, axis="stage"),
            functools.partial(pipeline_sampler.sample_layer_sharded_fused, mesh=stages,
                              axis="stage", chunk_steps=chunk_steps))


@pytest.mark.parametrize("ids,bad", [([0, 3], "[3]"), ([-1, 2], "[-1]"), ([7, -2], "[-2, 7]")])
def test_every_sampler_refuses_speaker_ids_out_of_range(ids, bad):
    """An id outside [0, num_speakers) took another speaker's embedding (JAX's indexing wraps
    negative ids and clamps the rest), silently: the sample of speaker 3 of 3 was speaker 2's.
    Every sampler now refuses it, jitted or not, naming the ids; the same call with ids in range
    samples."""
    config, batch, num_samples = SPEAKERS_ONLY, 2, 3
    weights = random_weights(config, seed=36)
    key = jax.random.key(37)
    for sample in every_sampler():
        with pytest.raises(ValueError, match=rf"speaker ids must lie in \[0, 3\) \(the model's "
                                             rf"num_speakers\), got {re.escape(bad)}"):
            sample(weights, config, key, num_samples, batch, speaker=jnp.asarray(ids))
        tokens = sample(weights, config, key, num_samples, batch,
                        speaker=np.clip(np.asarray(ids, np.int32), 0, 2))
        assert np.asarray(tokens).shape == (batch, num_samples)


def test_every_sampler_refuses_a_bad_speaker_argument():
    """Speakers for a model without speaker embeddings were ignored; a speaker array of another
    length than the batch, or of floats, failed deep inside or was broadcast. Each is refused,
    and a batch below 1 (which returned empty arrays from some samplers), and a negative
    num_samples."""
    weights = random_weights(SPEAKERS_ONLY, seed=38)
    plain = dataclasses.replace(SPEAKERS_ONLY, num_speakers=0)
    key = jax.random.key(39)
    for sample in every_sampler():
        with pytest.raises(ValueError, match=r"this model has no speaker embedding "
                                             r"\(num_speakers is 0\): pass speaker=None"):
            sample(random_weights(plain, seed=38), plain, key, 3, 2, speaker=jnp.zeros(2, int))
        for speaker, got in ((jnp.zeros(3, jnp.int32), r"int32\[3\]"),
                             (jnp.zeros(2, jnp.float32), r"float32\[2\]")):
            with pytest.raises(ValueError, match=rf"speaker must be \[batch\] = \(2,\) "
                                                 rf"integer ids, got {got}"):
                sample(weights, SPEAKERS_ONLY, key, 3, 2, speaker=speaker)
        with pytest.raises(ValueError, match=r"batch must be an int of at least 1, got 0"):
            sample(weights, SPEAKERS_ONLY, key, 3, 0)
        with pytest.raises(ValueError, match=r"num_samples must be an int of at least 0, got -1"):
            sample(weights, SPEAKERS_ONLY, key, -1, 2)


def test_incremental_equals_naive(case):
    config, batch, weights, key, speaker, local, naive = case
    incremental = sampler.sample_incremental(weights, config, key, NUM_SAMPLES, batch, speaker,
                                             local, return_logits=True)
    assert_same_samples(incremental, naive)


def test_python_loop_equals_naive(case):
    config, batch, weights, key, speaker, local, naive = case
    tokens = sampler.sample_python_loop(weights, config, key, NUM_SAMPLES, batch, speaker, local)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(naive[0]))


@pytest.mark.parametrize("devices,permute", [(2, "jaxring"), (3, "jaxring"), (2, "lax")])
def test_layer_sharded_equals_naive(case, devices, permute):
    config, batch, weights, key, speaker, local, naive = case
    if config.num_layers % devices:  # "conditioned" (6 layers) covers 3 devices
        pytest.skip(f"{config.num_layers} layers do not split over {devices} devices")
    sharded = pipeline_sampler.sample_layer_sharded(
        weights, config, key, NUM_SAMPLES, batch, mesh(devices, "stage"), "stage", speaker,
        local, return_logits=True, permute=permute)
    assert_same_samples(sharded, naive)


@pytest.mark.parametrize("batch", [4])
def test_layer_sharded_full_pipeline(batch):
    """Batch 4 on 2 devices fills the pipeline with 2 microbatches (the `case` tests cover 3
    streams on 2 devices, one microbatch, and on 3 devices, three)."""
    config = CONDITIONED
    weights, key, speaker, local, expected = reference(config, batch, seed=13,
                                                       reference_sampler=sampler.sample_incremental)
    sharded = pipeline_sampler.sample_layer_sharded(
        weights, config, key, NUM_SAMPLES, batch, mesh(2, "stage"), "stage", speaker, local,
        return_logits=True)
    assert_same_samples(sharded, expected)


def test_layer_sharded_rejects_uneven_split():
    with pytest.raises(ValueError, match="cannot be split evenly over 4 devices"):
        pipeline_sampler.stage_layout(CONDITIONED, 4)


# Chunks of 5 and 7 steps: no dilation divides them, so a kernel that placed a layer's queue
# by the step within its chunk instead of the step since the start would go wrong.
@pytest.mark.parametrize("portable,chunk_steps", [(False, 5), (True, NUM_SAMPLES)],
                         ids=["avx2-chunks", "portable-one-call"])
def test_fused_equals_naive(case, portable, chunk_steps):
    config, batch, weights, key, speaker, local, naive = case
    fused = fused_sampler.sample_fused(weights, config, key, NUM_SAMPLES, batch, speaker, local,
                                       return_logits=True, chunk_steps=chunk_steps,
                                       portable=portable, threads=1 if portable else 2)
    assert_same_samples(fused, naive)


@pytest.mark.parametrize("batch,threads", [(5, 2)])
def test_fused_float16_weights_equal_naive_on_rounded_weights(batch, threads):
    config = CONDITIONED
    weights, key, speaker, local, naive = reference(config, batch, seed=8,
                                                    weight_dtype=jnp.float16)
    fused = fused_sampler.sample_fused(weights, config, key, NUM_SAMPLES, batch, speaker, local,
                                       return_logits=True, weight_dtype=jnp.float16,
                                       threads=threads)
    assert_same_samples(fused, naive)


@pytest.mark.parametrize("batch,threads", [(1, 2), (2, 3)])
def test_fused_team_of_threads_equals_naive(batch, threads):
    """Fewer streams than threads: the threads split every step's channels between them."""
    config = CONDITIONED
    weights, key, speaker, local, naive = reference(config, batch, seed=16)
    fused = fused_sampler.sample_fused(weights, config, key, NUM_SAMPLES, batch, speaker, local,
                                       return_logits=True, threads=threads)
    assert_same_samples(fused, naive)


@pytest.mark.parametrize("model,weight_dtype,batch,chunk_steps", [
    ("conditioned", None, 3, 7), ("conditioned", jnp.float16, 2, NUM_SAMPLES), ("odd", None, 2, 5),
], ids=["conditioned-chunks", "conditioned-float16", "odd-channels"])
def test_gpu_kernel_emulated_on_the_host_equals_naive(model, weight_dtype, batch, chunk_steps):
    """The CUDA sampling kernel (xla_ffi/cuda/wavenet_sampler.h), run on the host with a thread
    per GPU thread meeting at every __syncthreads, draws the naive sampler's samples: speaker and
    local conditioning, float16 weights, chunks that cut the queues' rings, channel counts that
    are not multiples of the panel width or of the block's threads."""
    config = CONDITIONED if model == "conditioned" else ODD
    weights, key, speaker, local, naive = reference(config, batch, seed=31,
                                                    weight_dtype=weight_dtype)
    emulated = fused_sampler.sample_fused(
        weights, config, key, NUM_SAMPLES, batch, speaker, local, return_logits=True,
        weight_dtype=weight_dtype or jnp.float32, chunk_steps=chunk_steps, gpu_emulation=True)
    assert_same_samples(emulated, naive)


def test_fused_odd_channel_counts_equal_naive():
    weights = random_weights(ODD, seed=11)
    key = jax.random.key(12)
    naive = sampler.sample_naive(weights, ODD, key, NUM_SAMPLES, 2, return_logits=True)
    fused = fused_sampler.sample_fused(weights, ODD, key, NUM_SAMPLES, 2, return_logits=True,
                                       threads=3)
    assert_same_samples(fused, naive)


@pytest.mark.parametrize("devices", [1, 2, 3])
def test_layer_sharded_fused_equals_naive(case, devices):
    """Each stage a fused loop over its layers; chunks of 5 steps, so tokens cross the chunk
    boundary from the last stage to the first, and no dilation divides a chunk."""
    config, batch, weights, key, speaker, local, naive = case
    sharded = pipeline_sampler.sample_layer_sharded_fused(
        weights, config, key, NUM_SAMPLES, batch, mesh(devices, "stage"), "stage", speaker,
        local, return_logits=True, chunk_steps=5)
    assert_same_samples(sharded, naive)


@pytest.mark.parametrize("devices,groups", [(2, 3), (3, 1)])
def test_layer_sharded_fused_float16_groups_equal_naive(devices, groups):
    """float16 weights; stream groups of uneven size (5 streams in 3 groups) and one group
    passing alone through three stages."""
    config, batch = CONDITIONED, 5
    weights, key, speaker, local, naive = reference(config, batch, seed=19,
                                                    weight_dtype=jnp.float16)
    sharded = pipeline_sampler.sample_layer_sharded_fused(
        weights, config, key, NUM_SAMPLES, batch, mesh(devices, "stage"), "stage", speaker,
        local, return_logits=True, weight_dtype=jnp.float16, stream_groups=groups)
    assert_same_samples(sharded, naive)


@pytest.mark.parametrize("devices", [2, 3])
def test_layer_sharded_fused_more_groups_than_its_mailboxes_hold_equal_naive(devices):
    """A group per stream, more groups than the ring of mailboxes between the stages holds (8
    messages each, and one in each stage's hands: 9 x stages - 1). Every stage sends on before
    it receives, so with every mailbox full each waited for room in the next stage's until the
    timeout; at most that many groups now circulate, the same samples."""
    config, batch = TINY, 9 * devices + 2
    weights, key, speaker, local, naive = reference(config, batch, seed=23,
                                                    reference_sampler=sampler.sample_incremental)
    with jaxring.config.override(timeout_seconds=10.0):
        sharded = pipeline_sampler.sample_layer_sharded_fused(
            weights, config, key, NUM_SAMPLES, batch, mesh(devices, "stage"), "stage", speaker,
            local, return_logits=True, stream_groups=batch)
    assert_same_samples(sharded, naive)


def test_layer_sharded_fused_chunks_may_take_longer_than_the_timeout():
    """The timeout bounds each wait for a message between the stages, not a whole chunk: one
    chunk of 80000 steps failed after timeout_seconds with a timeout naming a stage that had
    sent tens of thousands of messages. The timeout here is a quarter of the chunk's time (a
    wait takes microseconds), and the chunk must take longer than it for the test to count."""
    weights, key, steps = model.init_weights(TINY, 5), jax.random.key(6), 80_000
    stages = mesh(2, "stage")

    def sample(chunk_steps):
        return np.asarray(pipeline_sampler.sample_layer_sharded_fused(
            weights, TINY, key, steps, 2, stages, "stage", chunk_steps=chunk_steps))

    chunked = sample(4000)
    sample(steps)  # compiled
    start = time.perf_counter()
    whole = sample(steps)
    timeout = (time.perf_counter() - start) / 4
    with jaxring.config.override(timeout_seconds=timeout):
        start = time.perf_counter()
        again = sample(steps)
        took = time.perf_counter() - start
    assert took > timeout, (took, timeout)
    np.testing.assert_array_equal(again, whole)
    np.testing.assert_array_equal(again, chunked)


@pytest.mark.parametrize("field,value", [("stream_groups", 0), ("stream_groups", -3),
                                         ("stream_groups", 1.5), ("stream_groups", True),
                                         ("chunk_steps", 0), ("chunk_steps", -3)])
def test_layer_sharded_fused_refuses_counts_below_one(field, value):
    """0, -3 and 1.5 groups ran as one group; 0 steps a chunk divided by zero, -3 failed in a
    slice."""
    with pytest.raises(ValueError, match=rf"{field} must be an int of at least 1, got {value}"):
        pipeline_sampler.sample_layer_sharded_fused(
            model.init_weights(TINY), TINY, jax.random.key(0), 4, 2, mesh(2, "stage"), "stage",
            **{field: value})


@pytest.mark.parametrize("field,value", [("chunk_steps", 0), ("threads", 0), ("threads", 1.5),
                                         ("threads", True), ("batch", 0)])
def test_fused_refuses_counts_below_one(field, value):
    """threads of 0, 1.5 or True ran unchecked; a batch of 0 divided by zero."""
    arguments = {"num_samples": 4, "batch": 2, field: value}
    with pytest.raises(ValueError, match=rf"{field} must be an int of at least 1, got {value}"):
        fused_sampler.sample_fused(model.init_weights(TINY), TINY, jax.random.key(0), **arguments)


def test_the_configs_refuse_counts_below_one():
    """Zeros trained on nothing with NaN losses, or failed after an epoch or in numpy; each is
    refused as the config is made, naming its field."""
    with pytest.raises(ValueError, match=r"num_layers must be at least 1, got 0"):
        dataclasses.replace(TINY, num_layers=0)
    with pytest.raises(ValueError, match=r"num_speakers must be at least 0, got -1"):
        dataclasses.replace(TINY, num_speakers=-1)
    with pytest.raises(ValueError, match=r"steps_per_epoch must be at least 1, got 0"):
        dataclasses.replace(get_config("tiny"), steps_per_epoch=0)
    # Adam climbed the loss with a negative rate and stood still with 0; a negative seed failed
    # in numpy after the data was made.
    for rate in (0.0, -1e-3, float("nan")):
        with pytest.raises(ValueError, match=rf"learning_rate must be above 0, got {rate}"):
            dataclasses.replace(get_config("tiny"), learning_rate=rate)
    with pytest.raises(ValueError, match=r"seed must be at least 0, got -1"):
        dataclasses.replace(get_config("tiny"), seed=-1)
    assert dataclasses.replace(get_config("tiny"), seed=0, learning_rate=1e-9).seed == 0


def test_sampling_refuses_another_sample_rate_than_the_run_trained_at(tmp_path):
    """--set sample_rate=16000 on a run trained at 8 kHz wrote a WAV that played at twice the
    speed, with twice the samples --seconds asked for."""
    from models.wavenet import main, train

    config = get_config("tiny")
    train.save_config(config, tmp_path)
    rate = 2 * config.sample_rate
    with pytest.raises(SystemExit, match=rf"--set sample_rate={rate}: sampling uses the model and "
                                         rf"sample rate the run in .* trained \(.*, "
                                         rf"{config.sample_rate} Hz\)"):
        main.main(["sample", "--workdir", str(tmp_path), "--set", f"sample_rate={rate}"])


def test_layer_sharded_fused_needs_a_layer_per_stage():
    config = dataclasses.replace(TINY, num_layers=2, dilation_cycle=2)
    with pytest.raises(ValueError, match="3 stages for 2 layers"):
        pipeline_sampler.sample_layer_sharded_fused(
            model.init_weights(config), config, jax.random.key(0), 4, 1, mesh(3, "stage"),
            "stage")


def test_fused_rejects_weights_of_the_wrong_size():
    config = TINY
    weights = model.init_weights(config)
    packed = fused_sampler.pack_weights(weights, config)[:-1]
    queues = jnp.zeros((sum(model.dilations(config)), 1, config.residual_channels), jnp.float32)
    with pytest.raises(Exception, match="packed weights have"):
        jax.block_until_ready(fused_sampler.fused_steps(
            packed, config, fused_sampler.gate_bias_per_stream(weights, 1),
            jnp.zeros((4, 1, 0), jnp.float32), jnp.zeros((4, 1), jnp.float32),
            jnp.zeros((1,), jnp.int32), queues, 0, False))


def test_data_builds_are_identical(tmp_path):
    """Two builds of the tiny data set in fresh work directories, one after the other in this
    process, give the same streams: espeak-ng's random numbers are seeded, and it speaks in
    fresh processes, so what it said before changes no clip."""
    from models.wavenet import input_pipeline

    config = get_config("tiny")
    first = input_pipeline.load_dataset(config, tmp_path / "first")
    second = input_pipeline.load_dataset(config, tmp_path / "second")
    for split in input_pipeline.SPLITS:
        assert len(first[split]) > config.sample_rate
        np.testing.assert_array_equal(first[split], second[split])


def test_held_out_voice_split_holds_only_its_speech(monkeypatch, tmp_path):
    """The "test" stream, whose NLL the README reports as the held-out voice's, holds that voice's
    speech and silence only; the held-out synthetic clips have their own stream (they once ended
    the test stream, 15% of `small`'s, and pulled its NLL below the voice's own)."""
    from models.wavenet import audio, input_pipeline

    def speech(voices, per_voice, rate, rng):
        level = 0.25 if voices == input_pipeline.TEST_VOICES else 0.5
        return [np.full(rate // 4, level, np.float32) for _ in range(len(voices) * per_voice)]

    def synthetic(seconds, rate, rng):
        return [np.full(rate // 2, -0.5, np.float32) for _ in range(int(seconds * 2))]

    monkeypatch.setattr(input_pipeline, "speech", speech)
    monkeypatch.setattr(input_pipeline, "synthetic", synthetic)
    config = get_config("tiny")
    data = input_pipeline.load_dataset(config, tmp_path)
    levels = config.model.quantization_levels
    code = {value: int(audio.mu_law_encode(np.float32(value), levels))
            for value in (0.0, 0.25, 0.5, -0.5)}
    assert set(np.unique(data["test"])) == {code[0.0], code[0.25]}
    assert set(np.unique(data["test_synthetic"])) == {code[0.0], code[-0.5]}
    assert set(np.unique(data["train"])) == {code[0.0], code[0.5], code[-0.5]}


def test_speech_choices_do_not_depend_on_clip_lengths(monkeypatch):
    """What is said, how, and each clip's noise come from the seed alone: a clip that comes out
    longer shifts no later choice (the noise once drew as many numbers as the clip had samples)."""
    from models import espeak
    from models.wavenet import input_pipeline

    def speech(length):
        asked = []

        def speak(requests, sample_rate):
            asked.extend(requests)
            return (np.full(length + i, 0.5, np.float32) for i in range(len(requests)))

        monkeypatch.setattr(espeak, "speak", speak)
        clips = input_pipeline.speech(input_pipeline.TRAIN_VOICES, 2, 8000,
                                      np.random.default_rng(0))
        return asked, clips

    asked_short, short = speech(100)
    asked_long, long = speech(3000)
    assert asked_short == asked_long
    for clip, longer in zip(short, long, strict=True):
        np.testing.assert_array_equal(clip, longer[:len(clip)])


def test_the_command_line_trains_and_every_sampler_draws_the_same_samples(tmp_path, capsys):
    """models.wavenet.main: a short training run, then the fused sampler and the two
    layer-sharded ones (2 stages) from its checkpoint, which must write the same WAV files."""
    from models.wavenet import main

    workdir = tmp_path / "run"
    main.main(["train", "--config", "tiny", "--workdir", str(workdir),
               "--set", "num_epochs=1", "steps_per_epoch=2"])
    written = {}
    for name in ("fused", "layer_sharded", "layer_sharded_fused"):
        # No --config for the first: the work directory's is used (the default, small, is
        # another model, which could not restore the checkpoint).
        config = ["--config", "tiny"] if name != "fused" else []
        main.main(["sample", *config, "--workdir", str(workdir), "--sampler", name,
                   "--stages", "2", "--streams", "2", "--seconds", "0.05",
                   "--out", str(tmp_path / "out")])
        written[name] = [(tmp_path / "out" / f"{name}-{s}.wav").read_bytes() for s in (0, 1)]
    assert written["fused"][0] != written["fused"][1]  # two streams, two draws
    assert written["layer_sharded"] == written["fused"]
    assert written["layer_sharded_fused"] == written["fused"]
    # Another model than the run's: refused with the reason, for sampling and for resuming.
    with pytest.raises(SystemExit, match="--config small: the run in .* trained another model"):
        main.main(["sample", "--config", "small", "--workdir", str(workdir)])
    with pytest.raises(ValueError, match="holds a run of another model or sample rate"):
        main.main(["train", "--config", "small", "--workdir", str(workdir)])
    with pytest.raises(ValueError, match="holds a run of another model or sample rate"):
        main.main(["train", "--workdir", str(workdir), "--set", "sample_rate=16000"])
    # Resumed without --config: the run's own configuration, one more epoch.
    capsys.readouterr()
    main.main(["train", "--workdir", str(workdir), "--set", "num_epochs=2", "steps_per_epoch=2"])
    assert "resumed from the checkpoint of epoch 1" in capsys.readouterr().out
    assert json.loads((workdir / "metrics.json").read_text())[-1]["epoch"] == 2
    # A run that stopped before its first checkpoint binds nothing: another model may start.
    from models.wavenet import train

    (tmp_path / "unfinished").mkdir()
    train.save_config(get_config("small"), tmp_path / "unfinished")
    main.main(["train", "--config", "tiny", "--workdir", str(tmp_path / "unfinished"),
               "--set", "num_epochs=1", "steps_per_epoch=1"])
    assert train.stored_config(tmp_path / "unfinished").model == get_config("tiny").model


@pytest.mark.parametrize("argv, message", [
    (["--set", "num_epochs=three", "train"], r"--set num_epochs=three: num_epochs takes a value "
                                             r"of type int"),
    (["train", "--set", "nofield=1"], r"--set nofield=1: takes FIELD=VALUE for one of"),
    (["train", "--set", "model=1"], r"--set model=1: takes FIELD=VALUE for one of"),
    (["sample", "--seconds", "-1"], r"--seconds must be positive"),
    (["sample", "--seconds", "nan"], r"--seconds must be positive and finite"),
    (["sample", "--seconds", "inf"], r"--seconds must be positive and finite"),
    (["train", "--set", "crop_length=0"], r"--set crop_length=0: crop_length must be at least 1, "
                                          r"got 0"),
    (["train", "--set", "checkpoint_every_epochs=0"], r"checkpoint_every_epochs must be at "
                                                      r"least 1"),
    (["train", "--set", "synthetic_seconds=-1"], r"synthetic_seconds must be at least 0"),
    (["sample", "--streams", "0"], r"--streams and --stages at least 1"),
    (["--config", "nosuch", "train"], r"invalid choice: 'nosuch'"),
    (["sample"], r"no checkpoint under")])
def test_bad_command_lines_are_refused_before_anything_is_written(tmp_path, capsys, argv,
                                                                   message):
    """A --set value of another kind (num_epochs=three) was saved in config.json and failed every
    later resume; an unknown field, a bad --config, --seconds or --streams failed deep inside or
    wrote empty WAVs; a --set before the command swallowed it; sampling from a mistyped work
    directory created it. Each is refused naming what is wrong, and the work directory stays
    unmade."""
    from models.wavenet import main

    workdir = tmp_path / "run"
    with pytest.raises((SystemExit, FileNotFoundError)) as error:
        main.main([*argv, "--workdir", str(workdir)])
    assert re.search(message, str(error.value) + capsys.readouterr().err), error.value
    assert not workdir.exists()


def test_an_int_for_a_float_field_is_stored_as_a_float():
    """--set learning_rate=1 was stored as the int 1, after which the run's own config refused
    every float for it (a review of the type check)."""
    from models.wavenet import main

    config = main.apply_overrides(get_config("tiny"), ["learning_rate=1"])
    assert type(config.learning_rate) is float and config.learning_rate == 1.0
    assert main.apply_overrides(config, ["learning_rate=0.001"]).learning_rate == 0.001


def test_training_loss_falls_and_resumes(tmp_path, monkeypatch):
    """Two epochs, the second stopped as it saves its checkpoint, then a run of three resumed
    from the first epoch's checkpoint, against three epochs in one go on the same data: the
    resumed epochs see the same crops, so only a restore of the weights and of Adam's moments and
    step count gives the same losses and held-out NLL. The stopped run had written its history
    of both epochs first; the resumed run keeps the first (a checkpoint written before its
    history once resumed with that epoch missing from it)."""
    from models.wavenet import train

    config = get_config("tiny")
    three_epochs = dataclasses.replace(config, num_epochs=3)
    straight = train.train_and_evaluate(three_epochs, tmp_path / "straight")
    shutil.copytree(tmp_path / "straight" / "data", tmp_path / "resumed" / "data")
    save = train.ocp.CheckpointManager.save

    class Stopped(Exception):
        pass

    def stopped_at_epoch_2(manager, step, *args, **kwargs):
        if step == 2:
            raise Stopped("as epoch 2's checkpoint was saved")
        return save(manager, step, *args, **kwargs)

    monkeypatch.setattr(train.ocp.CheckpointManager, "save", stopped_at_epoch_2)
    with pytest.raises(Stopped):
        train.train_and_evaluate(config, tmp_path / "resumed")
    monkeypatch.undo()
    assert json.loads((tmp_path / "resumed" / "metrics.json").read_text()) == straight[:2]
    # The run must restore epoch 1 (training it again from scratch would give the same history).
    restored, restore = [], train.restore
    monkeypatch.setattr(train, "restore", lambda *a: restored.append(restore(*a)) or restored[-1])
    resumed = train.train_and_evaluate(three_epochs, tmp_path / "resumed")
    assert restored == [1]
    assert [h["epoch"] for h in resumed] == [1, 2, 3]
    assert resumed[0] == straight[0]
    for epoch in (1, 2):
        np.testing.assert_allclose(resumed[epoch]["step_losses"], straight[epoch]["step_losses"],
                                   rtol=1e-6)
        for metric in ("test_nll", "test_synthetic_nll"):
            np.testing.assert_allclose(resumed[epoch][metric], straight[epoch][metric],
                                       rtol=1e-6)
    steps = [loss for h in resumed for loss in h["step_losses"]]
    assert np.mean(steps[-5:]) < np.mean(steps[:5]) - 0.05
    assert resumed[-1]["test_nll"] < resumed[0]["test_nll"]
    assert (tmp_path / "resumed" / "learning_curve.png").stat().st_size > 0


# Kills ws10 (gpu_emulation ignored), ws11 (portable ignored), ws12 (threads ignored) and ws13
# (weight_dtype ignored): the tests that compare those paths with the naive sampler cannot tell
# them from the default path, whose samples are the same, so the program must show that the
# options reach the kernel.
@pytest.mark.parametrize("portable,threads,weight_dtype,gpu_emulation", [
    (True, 3, jnp.float16, True), (False, 1, jnp.float32, False)])
def test_fused_passes_its_options_to_the_kernel(portable, threads, weight_dtype, gpu_emulation):
    weights = model.init_weights(TINY, 0)
    text = fused_sampler.sample_fused.lower(
        weights, TINY, jax.random.key(0), 4, 2, portable=portable, threads=threads,
        weight_dtype=weight_dtype, gpu_emulation=gpu_emulation).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @jaxring_wavenet" in line]
    assert len(calls) == 1, calls
    target = fused_sampler.GPU_EMULATION_TARGET if gpu_emulation else fused_sampler.TARGET
    assert f"custom_call @{target}(" in calls[0]
    assert f"portable = {'true' if portable else 'false'}" in calls[0]
    assert f"threads = {threads} : i64" in calls[0]
    packed = re.search(r"\(tensor<\d+x(\w+)>", calls[0].split(" : ")[-1]).group(1)
    assert packed == ("f16" if weight_dtype == jnp.float16 else "f32")


# Kills ws13 behaviourally too: with weight_dtype=float16 the kernel rounds the packed weights
# it is given unrounded (the existing test rounds them first, so a float32 kernel passes it).
# The gate bias and speaker embeddings reach the kernel in float32 (gate_bias_per_stream), so
# only they are rounded beforehand here.
def test_fused_float16_rounds_the_packed_weights_it_is_given_unrounded():
    config, batch = CONDITIONED, 2
    weights = random_weights(config, seed=8)
    key = jax.random.key(9)
    speaker, local = conditioning(config, batch, NUM_SAMPLES, seed=10)
    rounded = fused_sampler.round_weights(weights, jnp.float16)
    given = dict(weights, layers=dict(weights["layers"], **{
        name: rounded["layers"][name] for name in ("gate_bias", "speaker_embedding")}))
    expected = sampler.sample_naive(rounded, config, key, NUM_SAMPLES, batch, speaker, local,
                                    return_logits=True)
    unrounded = sampler.sample_naive(given, config, key, NUM_SAMPLES, batch, speaker, local,
                                     return_logits=True)
    # the test can tell: rounding moves the logits by more than the tolerance
    assert not np.allclose(np.asarray(expected[1]), np.asarray(unrounded[1]), rtol=LOGIT_RTOL,
                           atol=LOGIT_ATOL)
    fused = fused_sampler.sample_fused(given, config, key, NUM_SAMPLES, batch, speaker, local,
                                       return_logits=True, weight_dtype=jnp.float16)
    assert_same_samples(fused, expected)


# Kills au02 (mu_law_encode without its clip to [-1, 1]).
def test_mu_law_encode_clips_out_of_range_audio():
    codes = audio.mu_law_encode(np.array([-5.0, -1.0001, -1.0, 1.0, 1.0001, 5.0]))
    np.testing.assert_array_equal(codes, [0, 0, 0, 255, 255, 255])
    np.testing.assert_array_equal(audio.mu_law_encode(np.array([-2.0, 2.0]), levels=16), [0, 15])


# Kills au05 (write_wav truncating instead of rounding): 16-bit PCM is the nearest level, and
# the round trip is within half a level (the existing test allows a whole one).
def test_wav_samples_round_to_the_nearest_pcm_level(tmp_path):
    x = np.array([0.6 / 32767, -0.6 / 32767, 1000.7 / 32767, -1000.7 / 32767, 1.0, -1.0, 2.0])
    path = audio.write_wav(tmp_path / "x.wav", x, 8000)
    with wave.open(str(path), "rb") as source:
        pcm = np.frombuffer(source.readframes(source.getnframes()), "<i2")
    np.testing.assert_array_equal(pcm, [1, -1, 1001, -1001, 32767, -32767, 32767])
    x = np.random.default_rng(1).uniform(-1, 1, 800)
    y, _ = audio.read_wav(audio.write_wav(tmp_path / "y.wav", x, 8000))
    assert np.abs(y - x).max() <= 0.5 / 32767 + 1e-9


# Kills ip01 (random_crops never starting at the last start) and ip02 (evaluation_crops
# accepting a stream as long as the span, with a negative start): the shortest stream that holds
# a crop gives that one crop, one sample shorter is refused.
def test_crops_of_the_shortest_stream_that_holds_them():
    from models.wavenet import input_pipeline

    context, length = 3, 5
    stream = np.arange(context + length + 1)
    rng = np.random.default_rng(0)
    crops = input_pipeline.random_crops(stream, 4, length, rng, context)
    np.testing.assert_array_equal(crops, np.tile(stream, (4, 1)))
    np.testing.assert_array_equal(
        input_pipeline.evaluation_crops(stream, 3, length, context), np.tile(stream, (3, 1)))
    with pytest.raises(ValueError, match=r"a held-out stream of 8 samples is too short for a "
                                         r"crop of 9 \(context 3 \+ length 5 \+ 1\)"):
        input_pipeline.evaluation_crops(stream[:-1], 3, length, context)
    # every start is drawn, the last one included
    stream = np.arange(context + length + 3)
    starts = {int(c[0]) for c in input_pipeline.random_crops(stream, 200, length, rng, context)}
    assert starts == {0, 1, 2}


# Kills ip04 (the training clips left in order: speech, then every synthetic clip).
def test_training_stream_interleaves_speech_and_synthetic_clips(monkeypatch, tmp_path):
    from models.wavenet import input_pipeline

    def speech(voices, per_voice, rate, rng):
        return [np.full(rate // 4, 0.5, np.float32) for _ in range(len(voices) * per_voice)]

    def synthetic(seconds, rate, rng):
        return [np.full(rate // 4, -0.5, np.float32) for _ in range(int(seconds * 2))]

    monkeypatch.setattr(input_pipeline, "speech", speech)
    monkeypatch.setattr(input_pipeline, "synthetic", synthetic)
    config = get_config("tiny")
    train = input_pipeline.load_dataset(config, tmp_path)["train"]
    clip, silence = config.sample_rate // 4, config.sample_rate // 20
    kinds = train[::clip + silence][:len(train) // (clip + silence)]
    speech_code = audio.mu_law_encode(0.5)
    assert set(kinds.tolist()) == {int(speech_code), int(audio.mu_law_encode(-0.5))}
    positions = np.flatnonzero(kinds == speech_code)
    assert positions.max() > np.flatnonzero(kinds != speech_code).min(), kinds  # interleaved
