"""Offline training audio: speech synthesised with espeak-ng (the library and voices ship inside
the `espeakng-loader` wheel) plus synthetic signals, mu-law coded. Nothing is downloaded.

Speech: spoken digit strings and short sentences, several voices, rates and pitches, a little
noise; the test set holds out one voice. Synthetic: sums of harmonics with vibrato and decaying
envelopes, and chirps. Everything is deterministic in `config.seed`: espeak-ng speaks in fresh,
seeded processes (`models.espeak`), and every choice is drawn before any audio exists, so no
clip's length shifts a later one. Cached as an .npz in the work directory.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from scipy import signal

from models import cache, espeak
from models.wavenet import audio
from models.wavenet.configs.default import Config

TRAIN_VOICES = ("en", "en-us", "en+f2", "en+m3", "en-us+f4", "en+m7", "en-gb-x-rp+f3")
TEST_VOICES = ("en-us+m2",)
SENTENCES = (
    "the quick brown fox jumps over the lazy dog",
    "she sells sea shells by the sea shore",
    "a sample of audio every sixteen thousandth of a second",
    "how much wood would a woodchuck chuck",
    "please call stella and ask her to bring these things",
    "we present a deep neural network that generates raw audio",
)
DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_CACHE_VERSION = 3  # bump when generation changes, so old caches are not reused


def speech(voices, utterances_per_voice: int, sample_rate: int, rng) -> list[np.ndarray]:
    """Digit strings and sentences, each scaled to a random peak, with a little white noise.
    `rng` makes every choice before any audio exists, and each utterance's noise comes from its
    own generator, so the choices do not depend on how long the clips come out."""
    requests, levels = [], []
    for voice in voices:
        for index in range(utterances_per_voice):
            if index % 2:
                text = " ".join(rng.choice(DIGITS, size=rng.integers(3, 7)))
            else:
                text = SENTENCES[rng.integers(len(SENTENCES))]
            requests.append(espeak.Request(text, voice, rate=int(rng.integers(130, 220)),
                                           pitch=int(rng.integers(25, 75)),
                                           seed=int(rng.integers(2**31))))
            levels.append((rng.uniform(0.5, 0.9), 10 ** rng.uniform(-3.5, -2.5),
                           int(rng.integers(2**31))))
    clips = []
    for clip, (peak, noise, noise_seed) in zip(espeak.speak(requests, sample_rate), levels):
        clip = clip / max(1e-3, np.abs(clip).max()) * peak
        clip = clip + np.random.default_rng(noise_seed).normal(0.0, noise, clip.shape)
        clips.append(clip.astype(np.float32))
    return clips


def synthetic(seconds: float, sample_rate: int, rng) -> list[np.ndarray]:
    """Harmonic notes with vibrato and decay, and linear chirps, half a second each."""
    clips = []
    length = sample_rate // 2
    time = np.arange(length) / sample_rate
    for index in range(int(seconds * 2)):
        if index % 3 == 2:
            f0, f1 = rng.uniform(100, sample_rate / 8, size=2)
            clip = signal.chirp(time, f0, time[-1], f1)
        else:
            f0 = rng.uniform(80, 500)
            vibrato = 1 + 0.01 * np.sin(2 * np.pi * rng.uniform(3, 7) * time)
            phase = 2 * np.pi * f0 * np.cumsum(vibrato) / sample_rate
            harmonics = range(1, int(min(8, sample_rate / 2 / f0 / 1.2)) + 1)
            clip = sum(np.sin(k * phase) / k for k in harmonics)
            clip = clip * np.exp(-time * rng.uniform(1, 6))
        clip = clip / np.abs(clip).max() * rng.uniform(0.3, 0.9)
        clips.append(clip.astype(np.float32))
    return clips


SPLITS = ("train", "test", "test_synthetic")


def load_dataset(config: Config, cache_dir) -> dict[str, np.ndarray]:
    """One long int32 mu-law stream (clips joined by 50 ms of silence) per split: "train" (the
    training voices' speech and synthetic clips, shuffled), "test" (speech of the held-out voice
    alone) and "test_synthetic" (held-out synthetic clips, new draws of the training ones'
    kinds)."""
    settings = dict(version=_CACHE_VERSION, rate=config.sample_rate,
                    per_voice=config.utterances_per_voice,
                    synthetic=config.synthetic_seconds, seed=config.seed,
                    levels=config.model.quantization_levels,
                    voices=[TRAIN_VOICES, TEST_VOICES])
    digest = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    path = Path(cache_dir) / f"wavenet-data-{digest}.npz"
    if path.exists():
        with np.load(path) as data:
            return {split: data[split] for split in SPLITS}
    rng = np.random.default_rng(config.seed)
    train = speech(TRAIN_VOICES, config.utterances_per_voice, config.sample_rate, rng)
    train += synthetic(config.synthetic_seconds, config.sample_rate, rng)
    test = speech(TEST_VOICES, max(2, config.utterances_per_voice // 2), config.sample_rate, rng)
    test_synthetic = synthetic(max(1.0, config.synthetic_seconds / 5), config.sample_rate, rng)
    rng.shuffle(train)
    silence = np.zeros(config.sample_rate // 20, np.float32)
    levels = config.model.quantization_levels
    dataset = {
        name: audio.mu_law_encode(np.concatenate([x for clip in clips for x in (clip, silence)]),
                                  levels)
        for name, clips in zip(SPLITS, (train, test, test_synthetic))
    }
    cache.save_npz(path, **dataset)
    return dataset


def random_crops(stream: np.ndarray, batch: int, length: int, rng, context: int = 0) -> np.ndarray:
    """`[batch, context + length + 1]` crops: inputs are `[:, :-1]`, targets `[:, 1:]`, and the
    loss counts the last `length` targets (see train.crop_nll)."""
    span = context + length
    starts = rng.integers(0, len(stream) - span, size=batch)  # the last start included
    return np.stack([stream[s: s + span + 1] for s in starts])


def evaluation_crops(stream: np.ndarray, count: int, length: int, context: int = 0) -> np.ndarray:
    """Evenly spaced crops as random_crops', the same every epoch."""
    span = context + length
    if len(stream) <= span:
        raise ValueError(f"a held-out stream of {len(stream)} samples is too short for a crop of "
                         f"{span + 1} (context {context} + length {length} + 1)")
    starts = np.linspace(0, len(stream) - span - 1, count).astype(np.int64)
    return np.stack([stream[s: s + span + 1] for s in starts])
