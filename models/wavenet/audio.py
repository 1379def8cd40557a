"""mu-law companding (ITU-T G.711, as used by WaveNet section 2.2), WAV output and spectrogram
plots."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np


def mu_law_encode(audio, levels: int = 256) -> np.ndarray:
    """Maps audio in [-1, 1] to integers in [0, levels): compress with mu = levels - 1, then round
    to the nearest of `levels` evenly spaced values."""
    mu = levels - 1
    audio = np.clip(np.asarray(audio, np.float64), -1.0, 1.0)
    compressed = np.sign(audio) * np.log1p(mu * np.abs(audio)) / np.log1p(mu)
    return np.floor((compressed + 1.0) / 2.0 * mu + 0.5).astype(np.int32)


def mu_law_decode(codes, levels: int = 256) -> np.ndarray:
    """The inverse of `mu_law_encode` on its codes (the centre of each quantisation level)."""
    mu = levels - 1
    compressed = 2.0 * np.asarray(codes, np.float64) / mu - 1.0
    return (np.sign(compressed) * np.expm1(np.abs(compressed) * np.log1p(mu)) / mu).astype(
        np.float32)


def write_wav(path, audio, sample_rate: int) -> Path:
    """16-bit mono PCM."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pcm = (np.clip(np.asarray(audio, np.float64), -1.0, 1.0) * 32767.0).round().astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm.tobytes())
    return path


def read_wav(path) -> tuple[np.ndarray, int]:
    with wave.open(str(path), "rb") as source:
        pcm = np.frombuffer(source.readframes(source.getnframes()), "<i2")
        return pcm.astype(np.float32) / 32767.0, source.getframerate()


def plot_spectrogram(path, audio, sample_rate: int, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure, (wave_axis, spec_axis) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    times = np.arange(len(audio)) / sample_rate
    wave_axis.plot(times, audio, linewidth=0.4)
    wave_axis.set_ylabel("amplitude")
    wave_axis.set_title(title)
    with np.errstate(divide="ignore"):  # exact silence (a sample's start) has no log power
        spec_axis.specgram(audio, NFFT=256 if sample_rate <= 8000 else 512, Fs=sample_rate,
                           noverlap=128 if sample_rate <= 8000 else 384, cmap="magma")
    spec_axis.set_xlabel("seconds")
    spec_axis.set_ylabel("Hz")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
