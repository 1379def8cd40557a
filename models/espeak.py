"""espeak-ng speech for the models' offline datasets, the same from run to run.

The library and voices come from the `espeakng-loader` wheel, driven through ctypes; nothing is
downloaded. Two things make the same request sound different from one run to the next: voices
with flutter, roughness or breath draw random numbers, so every utterance seeds them; and
espeak-ng keeps synthesis state from one utterance to the next (e.g. the phase of its pitch
flutter), so an utterance also depends on what was said before it in the process. `speak`
therefore synthesises each chunk of CHUNK_UTTERANCES requests in a fresh interpreter (`python -m
models.espeak`, which imports neither JAX nor the caller's modules): what comes out depends on the
requests alone, not on what the process did before or on the number of workers.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import scipy.signal

CHUNK_UTTERANCES = 200


@dataclasses.dataclass(frozen=True)
class Request:
    """What to say and how."""

    text: str
    voice: str  # "accent+variant", e.g. "en-gb-scotland+f3"
    rate: int  # words per minute
    pitch: int  # espeak's 0..100 scale
    pitch_range: int = 50  # espeak's 0..100 scale; 50 is its default
    seed: int = 0  # for the voice's random numbers


class Espeak:
    """The espeak-ng library, driven through ctypes.

    espeak-ng keeps global state, so there is one instance per process and a lock around it.
    """

    _instance = None
    _lock = threading.Lock()
    _OUTPUT_SYNCHRONOUS = 2  # espeak_AUDIO_OUTPUT: synthesise into our callback, return when done
    _RATE, _PITCH, _RANGE = 1, 3, 4  # espeak_PARAMETER
    _POS_CHARACTER, _CHARS_UTF8 = 1, 1

    @classmethod
    def get(cls) -> Espeak:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self):
        import espeakng_loader

        self._lib = ctypes.CDLL(espeakng_loader.get_library_path())
        self.sample_rate = self._lib.espeak_Initialize(
            self._OUTPUT_SYNCHRONOUS, 0, espeakng_loader.get_data_path().encode(), 0)
        if self.sample_rate <= 0:
            raise RuntimeError(f"espeak_Initialize failed with {self.sample_rate}")
        self._chunks: list[np.ndarray] = []
        callback_type = ctypes.CFUNCTYPE(
            ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)
        self._callback = callback_type(self._collect)  # kept alive as long as the library uses it
        self._lib.espeak_SetSynthCallback(self._callback)

    def _collect(self, samples, count, events):
        if count > 0:
            self._chunks.append(np.ctypeslib.as_array(samples, (count,)).copy())
        return 0

    def synthesize(self, request: Request) -> np.ndarray:
        """int16 samples at `self.sample_rate`."""
        with self._lock:
            self._lib.espeak_ng_SetRandSeed(ctypes.c_long(request.seed))
            if self._lib.espeak_SetVoiceByName(request.voice.encode()) != 0:
                raise ValueError(f"espeak-ng has no voice {request.voice!r}")
            self._lib.espeak_SetParameter(self._RATE, request.rate, 0)
            self._lib.espeak_SetParameter(self._PITCH, request.pitch, 0)
            self._lib.espeak_SetParameter(self._RANGE, request.pitch_range, 0)
            self._chunks = []
            data = request.text.encode()
            status = self._lib.espeak_Synth(data, len(data) + 1, 0, self._POS_CHARACTER, 0,
                                            self._CHARS_UTF8, None, None)
            self._lib.espeak_Synchronize()
            if status != 0:
                raise RuntimeError(f"espeak_Synth failed with {status} on {request.text!r}")
            return np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)

    def speak(self, request: Request, sample_rate: int) -> np.ndarray:
        """float32 audio in [-1, 1) at `sample_rate`, synthesised in this process (where what
        was said before changes it slightly; datasets use `speak` below)."""
        speech = self.synthesize(request).astype(np.float32) / 32768
        ratio = np.gcd(sample_rate, self.sample_rate)
        return scipy.signal.resample_poly(speech, sample_rate // ratio, self.sample_rate // ratio)


def speak(requests, sample_rate: int, workers: int = 2):
    """Yields `Espeak.speak`'s audio for each request, in order. Each chunk of CHUNK_UTTERANCES
    requests is synthesised by a fresh interpreter, `workers` at a time (see the module's
    docstring): the same requests give the same audio in any run."""
    requests = list(requests)
    root = str(Path(__file__).resolve().parents[1])
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))

    def speak_chunk(start: int, folder: str) -> list[np.ndarray]:
        chunk = Path(folder) / f"chunk-{start}"
        chunk.with_suffix(".json").write_text(json.dumps(
            [dataclasses.asdict(r) for r in requests[start:start + CHUNK_UTTERANCES]]))
        subprocess.run([sys.executable, "-m", "models.espeak", str(chunk.with_suffix(".json")),
                        str(sample_rate), str(chunk.with_suffix(".npz"))],
                       check=True, env=environment, cwd=root)
        with np.load(chunk.with_suffix(".npz")) as stored:
            return np.split(stored["audio"], np.cumsum(stored["lengths"])[:-1])

    with tempfile.TemporaryDirectory() as folder, \
            concurrent.futures.ThreadPoolExecutor(workers) as pool:
        chunks = collections.deque(pool.submit(speak_chunk, start, folder)
                                   for start in range(0, len(requests), CHUNK_UTTERANCES))
        while chunks:  # each chunk's audio is let go once yielded
            yield from chunks.popleft().result()


if __name__ == "__main__":
    # One chunk, in a fresh process (see `speak`): python -m models.espeak IN.json RATE OUT.npz
    chunk_requests = [Request(**r) for r in json.loads(Path(sys.argv[1]).read_text())]
    audio = [Espeak.get().speak(r, int(sys.argv[2])) for r in chunk_requests]
    np.savez(sys.argv[3], audio=np.concatenate(audio) if audio else np.zeros(0, np.float32),
             lengths=np.array([len(a) for a in audio], np.int64))
