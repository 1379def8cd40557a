"""Offline training audio: speech synthesised with espeak-ng (the library and voices ship inside
the `espeakng-loader` wheel) plus synthetic signals, mu-law coded. Nothing is downloaded.

Speech: spoken digit strings and short sentences, several voices, rates and pitches, a little
noise; the test set holds out one voice. Synthetic: sums of harmonics with vibrato and decaying
envelopes, and chirps. Everything is deterministic in `config.seed` and cached as an .npz in the
work directory.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
from pathlib import Path

import numpy as np
from scipy import signal

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

# espeak-ng's C API (speak_lib.h): synchronous output through a callback.
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_POS_CHARACTER = 1
_ESPEAK_CHARS_AUTO = 0
_ESPEAK_RATE, _ESPEAK_PITCH = 1, 3
_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int,
                             ctypes.c_void_p)


class Espeak:
    """espeak-ng loaded once per process (it keeps global state)."""

    @functools.cache
    def __new__(cls):
        import espeakng_loader

        self = super().__new__(cls)
        self.lib = ctypes.CDLL(espeakng_loader.get_library_path())
        data_dir = str(Path(espeakng_loader.get_data_path()).parent).encode()
        self.sample_rate = self.lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, data_dir, 0)
        if self.sample_rate <= 0:
            raise RuntimeError(f"espeak-ng failed to initialise with data in {data_dir!r}")
        self.chunks = []
        self.callback = _CALLBACK(self._collect)  # kept alive as long as the library uses it
        self.lib.espeak_SetSynthCallback(self.callback)
        return self

    def _collect(self, wav, count, events):
        if count > 0:
            self.chunks.append(np.ctypeslib.as_array(wav, shape=(count,)).copy())
        return 0

    def synthesize(self, text: str, voice: str, rate: int, pitch: int) -> np.ndarray:
        """Float audio in [-1, 1] at `self.sample_rate`."""
        if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise ValueError(f"espeak-ng has no voice {voice!r}")
        self.lib.espeak_SetParameter(_ESPEAK_RATE, rate, 0)
        self.lib.espeak_SetParameter(_ESPEAK_PITCH, pitch, 0)
        self.chunks = []
        encoded = text.encode()
        self.lib.espeak_Synth(encoded, len(encoded) + 1, 0, _POS_CHARACTER, 0,
                              _ESPEAK_CHARS_AUTO, None, None)
        self.lib.espeak_Synchronize()
        pcm = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.int16)
        return pcm.astype(np.float32) / 32768.0


def speech(voices, utterances_per_voice: int, sample_rate: int, rng) -> list[np.ndarray]:
    engine = Espeak()
    common = np.gcd(engine.sample_rate, sample_rate)
    clips = []
    for voice in voices:
        for index in range(utterances_per_voice):
            if index % 2:
                text = " ".join(rng.choice(DIGITS, size=rng.integers(3, 7)))
            else:
                text = SENTENCES[rng.integers(len(SENTENCES))]
            clip = engine.synthesize(text, voice, int(rng.integers(130, 220)),
                                     int(rng.integers(25, 75)))
            clip = signal.resample_poly(clip, sample_rate // common, engine.sample_rate // common)
            clip = clip / max(1e-3, np.abs(clip).max()) * rng.uniform(0.5, 0.9)
            clip = clip + rng.normal(0.0, 10 ** rng.uniform(-3.5, -2.5), clip.shape)
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


def load_dataset(config: Config, cache_dir) -> dict[str, np.ndarray]:
    """{"train", "test"}: one long int32 mu-law stream each (clips joined by 50 ms of silence)."""
    settings = dict(rate=config.sample_rate, per_voice=config.utterances_per_voice,
                    synthetic=config.synthetic_seconds, seed=config.seed,
                    levels=config.model.quantization_levels,
                    voices=[TRAIN_VOICES, TEST_VOICES])
    digest = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    path = Path(cache_dir) / f"wavenet-data-{digest}.npz"
    if path.exists():
        with np.load(path) as data:
            return {"train": data["train"], "test": data["test"]}
    rng = np.random.default_rng(config.seed)
    train = speech(TRAIN_VOICES, config.utterances_per_voice, config.sample_rate, rng)
    train += synthetic(config.synthetic_seconds, config.sample_rate, rng)
    test = speech(TEST_VOICES, max(2, config.utterances_per_voice // 2), config.sample_rate, rng)
    test += synthetic(max(1.0, config.synthetic_seconds / 5), config.sample_rate, rng)
    rng.shuffle(train)
    silence = np.zeros(config.sample_rate // 20, np.float32)
    levels = config.model.quantization_levels
    dataset = {
        name: audio.mu_law_encode(np.concatenate([x for clip in clips for x in (clip, silence)]),
                                  levels)
        for name, clips in (("train", train), ("test", test))
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **dataset)
    return dataset


def random_crops(stream: np.ndarray, batch: int, length: int, rng) -> np.ndarray:
    """`[batch, length + 1]` crops: inputs are `[:, :-1]`, targets `[:, 1:]`."""
    starts = rng.integers(0, len(stream) - length - 1, size=batch)
    return np.stack([stream[s: s + length + 1] for s in starts])


def evaluation_crops(stream: np.ndarray, count: int, length: int) -> np.ndarray:
    """Evenly spaced crops, the same every epoch."""
    starts = np.linspace(0, len(stream) - length - 1, count).astype(np.int64)
    return np.stack([stream[s: s + length + 1] for s in starts])
