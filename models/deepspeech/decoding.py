"""CTC decoding (greedy and prefix beam search) and the error rates CER and WER."""

from __future__ import annotations

import collections
import math

import numpy as np

from models.deepspeech.data import BLANK, labels_to_text


def greedy_decode(log_probs: np.ndarray, mask: np.ndarray) -> list[str]:
    """Best class per frame, repeats merged, blanks dropped (Graves et al. 2006's best path).
    log_probs: (batch, frames, classes); mask: (batch, frames)."""
    best = np.asarray(log_probs).argmax(-1)
    texts = []
    for path, frame_mask in zip(best, np.asarray(mask)):
        path = path[frame_mask > 0]
        keep = np.ones(len(path), bool)
        keep[1:] = path[1:] != path[:-1]
        texts.append(labels_to_text(path[keep]))
    return texts


def _log_add(a: float, b: float) -> float:
    if a == -math.inf:
        return b
    if b == -math.inf:
        return a
    return max(a, b) + math.log1p(math.exp(-abs(a - b)))


def beam_decode_one(log_probs: np.ndarray, beam_width: int = 8) -> str:
    """CTC prefix beam search without a language model (Hannun et al. 2014, "First-pass large
    vocabulary continuous speech recognition using bi-directional recurrent DNNs", algorithm 1).
    Each prefix keeps two scores: ending in blank and ending in its last character, so paths
    that differ only in blanks and repeats are summed, not ranked apart. log_probs: (frames,
    classes) for the real frames only."""
    beams = {(): (0.0, -math.inf)}  # prefix -> (log P ending in blank, log P ending in non-blank)
    for frame in np.asarray(log_probs, np.float64):
        # Only the likeliest classes can extend a beam usefully.
        candidates = np.argsort(frame)[::-1][:beam_width]
        next_beams = collections.defaultdict(lambda: (-math.inf, -math.inf))
        for prefix, (blank_score, char_score) in beams.items():
            total = _log_add(blank_score, char_score)
            for c in candidates:
                p = float(frame[c])
                if c == BLANK:
                    b, nb = next_beams[prefix]
                    next_beams[prefix] = (_log_add(b, total + p), nb)
                    continue
                extended = prefix + (int(c),)
                b, nb = next_beams[extended]
                if prefix and prefix[-1] == c:
                    # A repeat only extends across a blank; without one it merges into prefix.
                    next_beams[extended] = (b, _log_add(nb, blank_score + p))
                    b0, nb0 = next_beams[prefix]
                    next_beams[prefix] = (b0, _log_add(nb0, char_score + p))
                else:
                    next_beams[extended] = (b, _log_add(nb, total + p))
        ranked = sorted(next_beams.items(), key=lambda kv: -_log_add(*kv[1]))
        beams = dict(ranked[:beam_width])
    best = max(beams.items(), key=lambda kv: _log_add(*kv[1]))[0]
    return labels_to_text(best)


def beam_decode(log_probs: np.ndarray, mask: np.ndarray, beam_width: int = 8) -> list[str]:
    return [beam_decode_one(lp[m > 0], beam_width)
            for lp, m in zip(np.asarray(log_probs), np.asarray(mask))]


def edit_distance(reference, hypothesis) -> int:
    """Levenshtein distance between two sequences (characters or words)."""
    previous = list(range(len(hypothesis) + 1))
    for i, r in enumerate(reference, 1):
        current = [i]
        for j, h in enumerate(hypothesis, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (r != h)))
        previous = current
    return previous[-1]


class ErrorRates:
    """Accumulates character and word error rates over a corpus: total edits / total reference
    length, so long utterances weigh more (as corpus-level CER/WER are usually reported)."""

    def __init__(self):
        self.char_edits = self.chars = self.word_edits = self.words = 0

    def update(self, references, hypotheses):
        for reference, hypothesis in zip(references, hypotheses):
            self.char_edits += edit_distance(reference, hypothesis)
            self.chars += len(reference)
            self.word_edits += edit_distance(reference.split(), hypothesis.split())
            self.words += len(reference.split())

    @property
    def cer(self) -> float:
        return self.char_edits / max(self.chars, 1)

    @property
    def wer(self) -> float:
        return self.word_edits / max(self.words, 1)
