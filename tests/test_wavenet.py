"""WaveNet: mu-law, causality, every sampler against the naive one, the fused C++ step, and a
short training run whose loss falls."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
# Channel counts that are not multiples of 8: the kernel's portable path.
ODD = dataclasses.replace(TINY, residual_channels=6, skip_channels=10, output_channels=12,
                          num_layers=3)


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
    if config.num_layers % devices:
        devices = 2 if devices != 2 else 1
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


@pytest.mark.parametrize("portable,chunk_steps", [(False, 8), (True, NUM_SAMPLES)],
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
    ("conditioned", None, 3, 8), ("conditioned", jnp.float16, 2, NUM_SAMPLES), ("odd", None, 2, 8),
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
    """Each stage a fused loop over its layers; chunks of 8 steps, so tokens cross the chunk
    boundary from the last stage to the first."""
    config, batch, weights, key, speaker, local, naive = case
    sharded = pipeline_sampler.sample_layer_sharded_fused(
        weights, config, key, NUM_SAMPLES, batch, mesh(devices, "stage"), "stage", speaker,
        local, return_logits=True, chunk_steps=8)
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


def test_training_loss_falls_and_resumes(tmp_path):
    from models.wavenet import train

    config = get_config("tiny")
    first = train.train_and_evaluate(config, tmp_path)
    resumed = train.train_and_evaluate(dataclasses.replace(config, num_epochs=3), tmp_path)
    assert [h["epoch"] for h in resumed] == [1, 2, 3]
    assert resumed[:2] == first
    steps = [loss for h in resumed for loss in h["step_losses"]]
    assert np.mean(steps[-5:]) < np.mean(steps[:5]) - 0.05
    assert resumed[-1]["test_nll"] < resumed[0]["test_nll"]
    assert (tmp_path / "learning_curve.png").stat().st_size > 0
