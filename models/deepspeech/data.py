"""Offline speech data for Deep Speech 2: utterances synthesised with espeak-ng, with transcripts.

Everything comes from the espeak-ng library and voices inside the `espeakng-loader` wheel
(`models.espeak`); nothing is downloaded. A voice is an accent (espeak language, e.g.
``en-gb-scotland``) with a variant (``+f3``, ``+Alex``, ...); the test split uses variants that
training never hears, so its error rate measures generalisation to new speakers. Generation is
deterministic for a seed and cached on disk as log spectrograms.

Batching follows the paper (section 3.1, SortaGrad): the first epoch goes through utterances from
short to long, later epochs shuffle batches of similar length.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

from models import cache, espeak

# ---- characters --------------------------------------------------------------------------------

BLANK = 0  # the CTC blank is class 0, as optax.ctc_loss expects by default
ALPHABET = "_ abcdefghijklmnopqrstuvwxyz'"  # index 0 ("_") is the blank and never printed
NUM_CLASSES = len(ALPHABET)
_CHAR_TO_INDEX = {c: i for i, c in enumerate(ALPHABET) if i != BLANK}


def text_to_labels(text: str) -> np.ndarray:
    return np.array([_CHAR_TO_INDEX[c] for c in text], np.int32)


def labels_to_text(labels) -> str:
    return "".join(ALPHABET[int(i)] for i in labels if int(i) != BLANK)


# ---- transcripts -------------------------------------------------------------------------------

DIGITS = "zero one two three four five six seven eight nine".split()
WORDS = (
    "yes no up down left right on off stop go start open close play pause call "
    "red green blue black white yellow orange purple brown pink "
    "cat dog bird fish horse cow house tree car boat train plane door window "
    "water fire light music phone table chair book paper coffee "
    "morning evening night today tomorrow weather time home"
).split()
NAMES = "anna ben carl dora emma frank grace henry".split()
SUBJECTS = ["i", "you", "we", "they", "she", "he"] + NAMES
VERBS = "see like want need have open close find call bring".split()
ARTICLES = ["the", "a", "my", "your", "this", "that"]
COMMANDS = ["turn on the", "turn off the", "open the", "close the", "find the", "play the"]


def random_transcript(rng: np.random.Generator) -> str:
    """A digit string, a few command words, or a short sentence, in equal shares."""
    kind = rng.integers(3)
    if kind == 0:
        return " ".join(rng.choice(DIGITS, size=rng.integers(3, 8)))
    if kind == 1:
        return " ".join(rng.choice(WORDS, size=rng.integers(1, 4)))
    if rng.random() < 0.3:
        return f"{rng.choice(COMMANDS)} {rng.choice(WORDS)}"
    subject, verb = rng.choice(SUBJECTS), rng.choice(VERBS)
    if subject in NAMES + ["she", "he"]:
        verb = "has" if verb == "have" else verb + "s"
    obj = f"{rng.choice(ARTICLES)} {rng.choice(WORDS)}"
    if rng.random() < 0.3:
        obj += f" at {rng.choice(DIGITS)}"
    return f"{subject} {verb} {obj}"


# ---- speech synthesis --------------------------------------------------------------------------

ACCENTS = ("en-us", "en", "en-gb-scotland", "en-gb-x-rp", "en-029", "en-us-nyc",
           "en-gb-x-gbclan", "en-gb-x-gbcwmd")
TRAIN_VARIANTS = ("m1", "m2", "m3", "m4", "m5", "m6", "f1", "f2", "f3", "f5", "Alex", "Annie",
                  "adam", "anika", "benjamin", "david", "ed", "edward", "iven", "michel",
                  "norbert", "paul", "quincy", "rob", "robert", "shelby", "steph", "travis")
TEST_VARIANTS = ("m7", "f4", "max", "linda")  # never heard in training


# ---- features ----------------------------------------------------------------------------------


def log_spectrogram(audio: np.ndarray, sample_rate: int, window_ms: float = 20,
                    hop_ms: float = 10) -> np.ndarray:
    """(frames, frequency bins) log power spectrogram, normalised per utterance (paper, 3.1:
    20 ms windows every 10 ms). Per-utterance normalisation removes the loudness of the voice."""
    window = int(sample_rate * window_ms / 1000)
    hop = int(sample_rate * hop_ms / 1000)
    audio = np.pad(audio.astype(np.float32), (0, max(0, window - len(audio))))
    frames = np.lib.stride_tricks.sliding_window_view(audio, window)[::hop]
    power = np.abs(np.fft.rfft(frames * np.hanning(window).astype(np.float32), axis=-1)) ** 2
    features = np.log(power + 1e-6)
    return ((features - features.mean()) / (features.std() + 1e-5)).astype(np.float32)


def feature_size(sample_rate: int, window_ms: float = 20) -> int:
    return int(sample_rate * window_ms / 1000) // 2 + 1


@dataclasses.dataclass(frozen=True)
class Utterance:
    transcript: str
    voice: str
    rate: int
    pitch: int
    pitch_range: int
    snr_db: float


def random_utterance(rng: np.random.Generator, variants) -> Utterance:
    """What to say and how: a random accent and variant, speaking rate, pitch and noise level."""
    return Utterance(
        transcript=random_transcript(rng),
        voice=f"{rng.choice(ACCENTS)}+{rng.choice(variants)}",
        rate=int(rng.integers(130, 211)),  # words per minute
        pitch=int(rng.integers(25, 76)),  # espeak's 0..100 scale
        pitch_range=int(rng.integers(20, 81)),
        snr_db=float(rng.uniform(10, 35)),
    )


def speech_request(utterance: Utterance, rng: np.random.Generator) -> espeak.Request:
    """What espeak-ng is asked to say, with a seed for the voice's random numbers."""
    return espeak.Request(utterance.transcript, utterance.voice, utterance.rate, utterance.pitch,
                          utterance.pitch_range, seed=int(rng.integers(2**31)))


def render(utterance: Utterance, speech: np.ndarray, sample_rate: int,
           rng: np.random.Generator) -> np.ndarray:
    """`speech` (`utterance` spoken, at `sample_rate`) with a random leading and trailing silence
    and white noise at the utterance's SNR."""
    lead, trail = rng.integers(0, sample_rate // 10, size=2)
    speech = np.pad(speech, (lead, trail))
    signal_power = np.mean(speech**2) + 1e-12
    noise = rng.standard_normal(len(speech)) * np.sqrt(signal_power / 10 ** (utterance.snr_db / 10))
    return (speech + noise).astype(np.float32)


# ---- datasets ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Dataset:
    """Utterances as log spectrograms with their label sequences."""

    features: list[np.ndarray]  # each (frames, feature_size) float32
    labels: list[np.ndarray]  # each (length,) int32, no blanks
    transcripts: list[str]
    voices: list[str]

    def __len__(self):
        return len(self.features)

    def alignable(self, time_strides) -> tuple[Dataset, int]:
        """The utterances that keep as many frames as CTC needs for their labels (one per label
        and a blank between each pair of repeats) after convolutions with `time_strides` (each
        keeps ceil(frames / stride)), and how many others there were. An utterance with fewer has
        no alignment, and optax's ctc_loss gives it about 1e5 instead of infinity, which swamps a
        batch's mean loss without an error (a review's stride of 4)."""
        def frames_left(frames):
            for stride in time_strides:
                frames = -(-frames // stride)
            return frames

        keep = [i for i, (features, labels) in enumerate(zip(self.features, self.labels))
                if frames_left(len(features)) >= len(labels) + np.sum(labels[1:] == labels[:-1])]
        subset = Dataset(*([values[i] for i in keep] for values in (
            self.features, self.labels, self.transcripts, self.voices)))
        return subset, len(self) - len(keep)


_CACHE_VERSION = 3  # bump when generation changes, so old caches are not reused


def generate(num_utterances: int, variants, seed: int, sample_rate: int,
             description: str = "synthesising", workers: int = 2) -> Dataset:
    """Deterministic for (num_utterances, variants, seed, sample_rate): each utterance draws from
    its own generator seeded by (seed, index), and espeak-ng speaks in fresh processes
    (`models.espeak.speak`, `workers` at a time), so that neither what a process said before nor
    the worker count changes the result."""
    rngs = [np.random.default_rng([seed, index]) for index in range(num_utterances)]
    utterances = [random_utterance(rng, variants) for rng in rngs]
    requests = [speech_request(utterance, rng) for utterance, rng in zip(utterances, rngs)]
    dataset = Dataset([], [], [], [])
    speeches = espeak.speak(requests, sample_rate, workers)
    for utterance, rng, speech in tqdm(zip(utterances, rngs, speeches), total=num_utterances,
                                       desc=description, unit="utt", leave=False):
        dataset.features.append(log_spectrogram(render(utterance, speech, sample_rate, rng),
                                                sample_rate))
        dataset.labels.append(text_to_labels(utterance.transcript))
        dataset.transcripts.append(utterance.transcript)
        dataset.voices.append(utterance.voice)
    return dataset


def write_dataset(dataset: Dataset, path: Path):
    """One .npz: features stored as float16 (half the disk, far below the features' noise)."""
    cache.save_npz(path,
                   features=np.concatenate(dataset.features).astype(np.float16),
                   lengths=np.array([len(f) for f in dataset.features]),
                   labels=np.concatenate(dataset.labels),
                   label_lengths=np.array([len(lab) for lab in dataset.labels]),
                   transcripts=np.array(dataset.transcripts), voices=np.array(dataset.voices))


def read_dataset(path: Path) -> Dataset:
    with np.load(path, allow_pickle=False) as stored:
        lengths, label_lengths = stored["lengths"], stored["label_lengths"]
        features = np.split(stored["features"].astype(np.float32), np.cumsum(lengths)[:-1])
        labels = np.split(stored["labels"], np.cumsum(label_lengths)[:-1])
        return Dataset(features, labels, list(stored["transcripts"]), list(stored["voices"]))


def load(split: str, num_utterances: int, seed: int, sample_rate: int,
         cache_dir: str | Path | None) -> Dataset:
    """The "train" or "test" split (test voices are held out), from the cache when present."""
    variants = {"train": TRAIN_VARIANTS, "test": TEST_VARIANTS}[split]
    split_seed = seed * 2 + (split == "test")
    if cache_dir is None:
        with tempfile.TemporaryDirectory() as folder:
            return load(split, num_utterances, seed, sample_rate, folder)
    key = json.dumps([_CACHE_VERSION, split, num_utterances, split_seed, sample_rate, variants])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"speech-{split}-{num_utterances}-{digest}.npz"
    if not path.exists():
        write_dataset(generate(num_utterances, variants, split_seed, sample_rate,
                               f"synthesising {split}"), path)
    # Always read back what the cache holds, so a cached and a fresh run train identically.
    return read_dataset(path)


# ---- batching ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Batch:
    features: np.ndarray  # (batch, frames, feature_size) float32, zero in padding
    feature_mask: np.ndarray  # (batch, frames) float32: 1 on real frames
    labels: np.ndarray  # (batch, max_label_length) int32, zero in padding
    label_mask: np.ndarray  # (batch, max_label_length) float32: 1 on real labels
    transcripts: list[str]  # "" for padding rows


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def make_batch(dataset: Dataset, indices, batch_size: int, frame_multiple: int,
               max_label_length: int | None) -> Batch:
    """Pads `indices` to `batch_size` rows (extra rows fully masked) and time to a multiple of
    `frame_multiple`, so few distinct shapes reach jit. Labels are padded to `max_label_length`
    (None: to the batch's longest, for decoding, which reads no labels)."""
    frames = round_up(max(len(dataset.features[i]) for i in indices), frame_multiple)
    if max_label_length is None:
        max_label_length = max(len(dataset.labels[i]) for i in indices)
    feature_dim = dataset.features[indices[0]].shape[1]
    batch = Batch(np.zeros((batch_size, frames, feature_dim), np.float32),
                  np.zeros((batch_size, frames), np.float32),
                  np.zeros((batch_size, max_label_length), np.int32),
                  np.zeros((batch_size, max_label_length), np.float32), [""] * batch_size)
    for row, index in enumerate(indices):
        features, labels = dataset.features[index], dataset.labels[index]
        if len(labels) > max_label_length:  # cut, they would teach CTC a wrong transcript
            raise ValueError(f"utterance {index} has {len(labels)} labels, more than "
                             f"max_label_length {max_label_length}: "
                             f"{dataset.transcripts[index]!r}")
        batch.features[row, :len(features)] = features
        batch.feature_mask[row, :len(features)] = 1
        batch.labels[row, :len(labels)] = labels
        batch.label_mask[row, :len(labels)] = 1
        batch.transcripts[row] = dataset.transcripts[index]
    return batch


def train_batches(dataset: Dataset, batch_size: int, epoch: int, seed: int, frame_multiple: int,
                  max_label_length: int, sortagrad: bool = True):
    """Batches of similar length. Epoch 0 runs short to long (SortaGrad, paper 3.1); later epochs
    shuffle the order of the batches. Only full batches, so every replica gets the same size:
    the len % batch_size utterances left out are drawn anew each epoch (cutting the length order
    into batches would always leave out the longest ones, never trained on)."""
    rng = np.random.default_rng([seed, epoch])
    order = np.argsort([len(f) for f in dataset.features], kind="stable")
    order = np.delete(order, rng.choice(len(order), len(order) % batch_size, replace=False))
    groups = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    if not (sortagrad and epoch == 0):
        rng.shuffle(groups)
    for group in groups:
        yield make_batch(dataset, group, batch_size, frame_multiple, max_label_length)


def eval_batches(dataset: Dataset, batch_size: int, frame_multiple: int,
                 max_label_length: int | None = None):
    """Every utterance once, in length order; the last batch is padded with masked rows. Labels
    are padded as `make_batch` pads them: with no `max_label_length`, no transcript is too long
    (evaluation decodes without them)."""
    order = np.argsort([len(f) for f in dataset.features], kind="stable")
    for i in range(0, len(order), batch_size):
        yield make_batch(dataset, order[i:i + batch_size], batch_size, frame_multiple,
                         max_label_length)
