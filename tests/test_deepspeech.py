"""Deep Speech 2: data, shapes, masking, CTC against a brute-force reference, decoding, metrics."""

import itertools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.deepspeech import configs, data, decoding
from models.deepspeech import train as training
from models.deepspeech.model import (BidirectionalGRU, DeepSpeech2, SequenceBatchNorm,
                                     clipped_relu, conv_padding, ctc_loss_per_utterance,
                                     same_padding)

TINY_MODEL = dict(conv_channels=(4,), conv_kernels=((5, 7),), conv_strides=((2, 2),),
                  rnn_layers=2, rnn_hidden=12, dense=16)


@nnx.jit(static_argnames="train")
def apply(model, features, mask, train):
    return model(features, mask, train=train)


def tiny_model(seed=0, feature_size=17, num_classes=data.NUM_CLASSES):
    return DeepSpeech2(feature_size=feature_size, num_classes=num_classes, rngs=nnx.Rngs(seed),
                       **TINY_MODEL)


# ---- data --------------------------------------------------------------------------------------


def test_labels_round_trip():
    text = "turn on the light's"
    assert data.labels_to_text(data.text_to_labels(text)) == text
    assert data.BLANK not in data.text_to_labels(text)


def test_generation_is_deterministic_and_voices_are_held_out(tmp_path):
    first = data.load("train", 6, seed=3, sample_rate=8000, cache_dir=tmp_path)
    again = data.generate(6, data.TRAIN_VARIANTS, seed=3 * 2, sample_rate=8000)
    cached = data.load("train", 6, seed=3, sample_rate=8000, cache_dir=tmp_path)
    for a, b, c in zip(first.features, again.features, cached.features):
        np.testing.assert_array_equal(a, b.astype(np.float16).astype(np.float32))  # as cached
        np.testing.assert_array_equal(a, c)
    assert first.transcripts == again.transcripts == cached.transcripts
    test = data.load("test", 6, seed=3, sample_rate=8000, cache_dir=None)
    train_variants = {v.split("+")[1] for v in first.voices}
    test_variants = {v.split("+")[1] for v in test.voices}
    assert train_variants <= set(data.TRAIN_VARIANTS)
    assert test_variants <= set(data.TEST_VARIANTS)
    assert not set(data.TRAIN_VARIANTS) & set(data.TEST_VARIANTS)
    # CTC needs an output frame per label plus one between each pair of repeated labels; the
    # convolutions keep ceil(frames / time stride) of the input frames.
    stride = int(np.prod([s[0] for s in configs.get_config("tiny").conv_strides]))
    for features, labels in zip(first.features, first.labels):
        assert features.shape[1] == data.feature_size(8000)
        repeats = int(np.sum(labels[1:] == labels[:-1]))
        assert -(-len(features) // stride) >= len(labels) + repeats, (len(features), labels)


def random_dataset(rng, count=10, feature_dim=5):
    lengths = rng.integers(3, 40, size=count)
    return data.Dataset(
        [rng.standard_normal((n, feature_dim)).astype(np.float32) for n in lengths],
        [rng.integers(1, data.NUM_CLASSES, size=rng.integers(1, 6)).astype(np.int32)
         for _ in lengths],
        [f"utt{i}" for i in range(count)], ["v"] * count)


def test_sentences_conjugate_the_third_person():
    """A sentence's verb agrees with its subject: "she has", "anna calls", "we have" (the grammar
    once said "he haves")."""
    third_person = {"has" if verb == "have" else verb + "s" for verb in data.VERBS}
    rng = np.random.default_rng(0)
    sentences = [t.split() for t in (data.random_transcript(rng) for _ in range(3000))]
    sentences = [words for words in sentences if words[0] in data.SUBJECTS]
    assert len(sentences) > 500
    for subject, verb, *_ in sentences:
        if subject in {"he", "she", *data.NAMES}:
            assert verb in third_person, (subject, verb)
        else:
            assert verb in data.VERBS, (subject, verb)


def test_a_transcript_longer_than_max_label_length_is_an_error_not_cut():
    """The labels were cut to max_label_length while the audio was kept whole, so CTC would
    have learned a wrong transcript."""
    dataset = random_dataset(np.random.default_rng(4), count=3)
    longest = max(len(labels) for labels in dataset.labels)
    batch = data.make_batch(dataset, [0, 1, 2], 4, 8, max_label_length=longest)
    assert batch.label_mask.sum() == sum(len(labels) for labels in dataset.labels)
    with pytest.raises(ValueError, match=rf"has {longest} labels, more than max_label_length"):
        data.make_batch(dataset, [0, 1, 2], 4, 8, max_label_length=longest - 1)


def test_training_refuses_a_transcript_too_long_before_its_first_step_and_evaluation_takes_it():
    """A max_label_length below the longest training transcript failed only in the batch that
    held it, late in the first epoch (SortaGrad runs short to long); evaluation, which decodes
    without labels, refused test transcripts as long."""
    dataset = random_dataset(np.random.default_rng(5), count=11)
    longest = max(range(len(dataset)), key=lambda i: len(dataset.labels[i]))
    n = len(dataset.labels[longest])
    assert training._check_label_lengths(dataset, n) is None
    with pytest.raises(ValueError, match=rf"max_label_length {n - 1} is below the {n} labels of "
                                         rf"training utterance {longest} \('utt{longest}'\): "
                                         rf"raise it to at least {n}"):
        training._check_label_lengths(dataset, n - 1)
    rows = 0
    for batch in data.eval_batches(dataset, 4, 8):
        widest = max(len(dataset.labels[int(t[3:])]) for t in batch.transcripts if t)
        assert batch.labels.shape == (4, widest)
        for row, name in enumerate(batch.transcripts):
            if name:
                labels = dataset.labels[int(name[3:])]
                np.testing.assert_array_equal(batch.labels[row, :len(labels)], labels)
                assert batch.label_mask[row].sum() == len(labels)
                rows += 1
    assert rows == len(dataset)


def test_two_writers_of_one_cache_both_finish_and_a_stopped_one_leaves_no_cache(tmp_path,
                                                                                  monkeypatch):
    """Every writer of a data cache wrote one temporary name, so of two runs making the same
    cache at once, the one that renamed second found nothing to rename (FileNotFoundError, 4
    times in 4 in a review); WaveNet's wrote the cache's own name, so a run stopped mid-write
    left a partial file that every later run took for the cache."""
    from models import cache

    path = tmp_path / "speech.npz"
    first, second = (random_dataset(np.random.default_rng(seed), count=5) for seed in (1, 2))
    savez = np.savez

    def another_run_finishes_meanwhile(file, **arrays):
        savez(file, **arrays)
        monkeypatch.setattr(np, "savez", savez)
        data.write_dataset(second, path)  # the other run writes and renames before this one

    monkeypatch.setattr(np, "savez", another_run_finishes_meanwhile)
    data.write_dataset(first, path)
    stored = data.read_dataset(path)  # the last rename's: this run's
    assert stored.transcripts == first.transcripts and all(
        np.array_equal(a, b) for a, b in zip(stored.labels, first.labels))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["speech.npz"]
    assert path.stat().st_mode & 0o777 == 0o644

    def stopped(file, **arrays):
        file.write(b"PK partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", stopped)
    with pytest.raises(KeyboardInterrupt):
        cache.save_npz(tmp_path / "wavenet.npz", x=np.zeros(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["speech.npz"]


def test_batches_sortagrad_then_shuffled_with_masks():
    rng = np.random.default_rng(0)
    dataset = random_dataset(rng, count=23)
    first = list(data.train_batches(dataset, 4, epoch=0, seed=0, frame_multiple=8,
                                    max_label_length=6))
    assert len(first) == 23 // 4
    widths = [batch.features.shape[1] for batch in first]
    assert widths == sorted(widths)  # SortaGrad: short to long in the first epoch
    later = [b.transcripts for b in data.train_batches(dataset, 4, 1, 0, 8, 6)]
    assert later == [b.transcripts for b in data.train_batches(dataset, 4, 1, 0, 8, 6)]
    later_widths = [len(dataset.features[int(t[0][3:])]) for t in later]
    assert later_widths != sorted(later_widths)  # shuffled
    for batch in first + list(data.eval_batches(dataset, 4, 8, 6)):
        assert batch.features.shape[1] % 8 == 0
        for row, name in enumerate(batch.transcripts):
            if not name:  # padding row of the last eval batch
                assert batch.feature_mask[row].sum() == 0
                continue
            index = int(name[3:])
            n, m = len(dataset.features[index]), len(dataset.labels[index])
            np.testing.assert_array_equal(batch.features[row, :n], dataset.features[index])
            assert batch.feature_mask[row].sum() == n and batch.feature_mask[row, :n].all()
            assert not batch.features[row, n:].any()
            np.testing.assert_array_equal(batch.labels[row, :m], dataset.labels[index])
            assert batch.label_mask[row].sum() == m
    for count in (21, 22, 23, 24):  # every remainder of a batch of 4
        some = data.Dataset(*(values[:count] for values in (
            dataset.features, dataset.labels, dataset.transcripts, dataset.voices)))
        seen = sorted(t for b in data.eval_batches(some, 4, 8, 6) for t in b.transcripts if t)
        assert seen == sorted(some.transcripts), count


def test_every_utterance_is_trained_on_within_a_few_epochs():
    """Each epoch leaves out len % batch_size utterances, different ones each epoch (cutting the
    length order into batches once left out the longest ones every epoch), and still cuts
    batches of similar length: within an epoch, no two batches' length ranges overlap."""
    dataset = random_dataset(np.random.default_rng(0), count=23)
    lengths = [len(f) for f in dataset.features]
    seen, left_out = set(), set()
    for epoch in range(5):
        names = [list(b.transcripts)
                 for b in data.train_batches(dataset, 4, epoch, 0, 8, 6)]
        flat = [t for batch in names for t in batch]
        assert len(names) == 23 // 4 and all(len(batch) == 4 for batch in names)
        assert len(set(flat)) == len(flat) and "" not in flat
        ranges = sorted((min(lengths[int(t[3:])] for t in batch),
                         max(lengths[int(t[3:])] for t in batch)) for batch in names)
        assert all(high <= low for (_, high), (low, _) in zip(ranges, ranges[1:]))
        seen |= set(flat)
        left_out.add(frozenset(set(dataset.transcripts) - set(flat)))
    assert seen == set(dataset.transcripts)
    assert len(left_out) == 5


# ---- model -------------------------------------------------------------------------------------


def test_shapes_and_output_mask():
    model = tiny_model()
    rng = np.random.default_rng(1)
    features = jnp.asarray(rng.standard_normal((3, 21, 17)), jnp.float32)
    mask = jnp.asarray(np.arange(21)[None, :] < np.array([[21], [10], [1]]), jnp.float32)
    for train in (True, False):
        logits, out_mask = apply(model, features, mask, train)
        assert logits.shape == (3, 11, data.NUM_CLASSES) and logits.dtype == jnp.float32
        np.testing.assert_array_equal(out_mask.sum(1), [11, 5, 1])  # ceil(n / 2)


# Two convolutions strided in time, one with an even kernel: the padding compounds.
TWO_CONVS = dict(TINY_MODEL, conv_channels=(3, 4), conv_kernels=((5, 7), (4, 3)),
                 conv_strides=((2, 2), (2, 1)))


@pytest.mark.parametrize("layers", [TINY_MODEL, TWO_CONVS], ids=["one-conv", "two-convs"])
def test_padding_does_not_change_real_frames(layers):
    """Appending padded frames (any values, any number, to an odd or even length) to an
    utterance changes neither its logits nor the batch-norm statistics, on every real frame;
    this covers the strided convolutions, whose real frames "SAME" padding aligned by the
    padded length's parity, and the backward GRU, which meets the padding first."""
    rng = np.random.default_rng(2)
    stride = math.prod(stride for stride, _ in layers["conv_strides"])
    for length, padded_lengths in ((14, (24,)), (13, (24, 25, 32))):
        features = rng.standard_normal((2, length, 17)).astype(np.float32)
        mask = np.ones((2, length), np.float32)
        real = -(-length // stride)
        for train in (True, False):
            model = DeepSpeech2(feature_size=17, num_classes=data.NUM_CLASSES,
                                rngs=nnx.Rngs(0), **layers)
            short, short_mask = apply(model, jnp.asarray(features), jnp.asarray(mask), train)
            assert short.shape[1] == real and np.asarray(short_mask).all()
            for padded_length in padded_lengths:
                extra = padded_length - length
                padded = np.concatenate([features, 100 * rng.standard_normal((2, extra, 17))], 1)
                padded_mask = np.concatenate([mask, np.zeros((2, extra))], 1)
                model = DeepSpeech2(feature_size=17, num_classes=data.NUM_CLASSES,
                                    rngs=nnx.Rngs(0), **layers)
                long, out_mask = apply(model, jnp.asarray(padded, jnp.float32),
                                       jnp.asarray(padded_mask, jnp.float32), train)
                assert long.shape[1] == -(-padded_length // stride)
                np.testing.assert_allclose(long[:, :real], short, rtol=1e-4, atol=1e-5,
                                           err_msg=f"{length} frames padded to {padded_length}")
                np.testing.assert_array_equal(
                    np.asarray(out_mask), np.tile(np.arange(long.shape[1]) < real, (2, 1)))


def test_conv_padding_is_same_on_lengths_the_stride_divides():
    """On what training feeds (time padded to `frame_multiple`), the fixed padding is XLA's
    "SAME", so checkpoints trained before it keep their alignment; on every length it gives
    "SAME"'s ceil(T / stride) outputs."""
    rng = np.random.default_rng(5)
    for name in ("tiny", "small", "paper"):
        config = configs.get_config(name)
        frequency = data.feature_size(config.sample_rate)
        for kernel, stride in zip(config.conv_kernels, config.conv_strides):
            weights = jnp.asarray(rng.standard_normal(tuple(kernel) + (1, 2)), jnp.float32)
            padding = conv_padding(frequency, kernel, stride)
            for frames in (32, 34, 33, 35):
                x = jnp.asarray(rng.standard_normal((1, frames, frequency, 1)), jnp.float32)
                same, fixed = (jax.lax.conv_general_dilated(
                    x, weights, stride, pad, dimension_numbers=("NHWC", "HWIO", "NHWC"))
                    for pad in ("SAME", padding))
                assert fixed.shape == same.shape
                if frames % stride[0] == 0:
                    np.testing.assert_array_equal(fixed, same)
            frequency = -(-frequency // stride[1])


def ctc_brute_force(log_probs, labels):
    """-log P(labels | frames) by summing every frame path that collapses to `labels` (merge
    repeats, drop blanks): the definition of CTC, in float64."""
    num_frames, num_classes = log_probs.shape
    total = 0.0
    for path in itertools.product(range(num_classes), repeat=num_frames):
        collapsed = [c for i, c in enumerate(path) if c != 0 and (i == 0 or c != path[i - 1])]
        if collapsed == list(labels):
            total += math.exp(sum(log_probs[t, c] for t, c in enumerate(path)))
    return -math.log(total)


def test_ctc_loss_matches_brute_force_sum_over_alignments():
    rng = np.random.default_rng(3)
    num_classes, frames = 4, 6
    cases = [(6, [1, 2]), (6, [1, 1]), (4, [3]), (5, [2, 3, 2]), (6, [1, 2, 1, 1])]
    logits = rng.standard_normal((len(cases), frames, num_classes)).astype(np.float32)
    logit_mask = np.array([[t < n for t in range(frames)] for n, _ in cases], np.float32)
    labels = np.zeros((len(cases), 4), np.int32)
    label_mask = np.zeros((len(cases), 4), np.float32)
    for i, (_, label) in enumerate(cases):
        labels[i, :len(label)] = label
        label_mask[i, :len(label)] = 1
    losses = ctc_loss_per_utterance(jnp.asarray(logits), jnp.asarray(logit_mask),
                                    jnp.asarray(labels), jnp.asarray(label_mask))
    log_probs = jax.nn.log_softmax(logits.astype(np.float64))
    expected = [ctc_brute_force(np.asarray(log_probs[i, :n]), label)
                for i, (n, label) in enumerate(cases)]
    np.testing.assert_allclose(np.asarray(losses), expected, rtol=1e-5)


# ---- decoding and metrics ----------------------------------------------------------------------


def test_greedy_decode_merges_repeats_drops_blanks_and_padding():
    a, b = data.text_to_labels("ab")
    path = [a, a, 0, a, b, b, 0, b]
    log_probs = np.log(np.full((1, len(path) + 2, data.NUM_CLASSES), 1e-3))
    for t, c in enumerate(path + [a, a]):
        log_probs[0, t, c] = 0
    mask = np.array([[1] * len(path) + [0, 0]], np.float32)
    assert decoding.greedy_decode(log_probs, mask) == ["aabb"]


def test_beam_search_finds_the_most_probable_labelling():
    """Prefix beam search with a wide beam returns the labelling whose summed path probability
    (brute force) is largest, which can differ from the best single path."""
    rng = np.random.default_rng(4)
    for _ in range(5):
        log_probs = np.asarray(jax.nn.log_softmax(2 * rng.standard_normal((5, 3))), np.float64)
        probabilities = {}
        for path in itertools.product(range(3), repeat=5):
            collapsed = tuple(c for i, c in enumerate(path)
                              if c != 0 and (i == 0 or c != path[i - 1]))
            probabilities[collapsed] = probabilities.get(collapsed, 0) + math.exp(
                sum(log_probs[t, c] for t, c in enumerate(path)))
        best = max(probabilities, key=probabilities.get)
        assert decoding.beam_decode_one(log_probs, beam_width=64) == data.labels_to_text(best)


def test_a_narrow_beam_keeps_as_many_prefixes_as_its_width():
    """Two frames, each 0.6 blank and 0.4 "a": the best single path is blank blank (0.36), but
    "a" has 0.64 over three paths. A beam of 1 keeps only "" after the first frame and returns
    it; a beam of 2 keeps both prefixes, and both classes of every frame, and finds "a"."""
    a = data.ALPHABET.index("a")
    frame = np.full(data.NUM_CLASSES, 1e-9)
    frame[data.BLANK], frame[a] = 0.6, 0.4
    log_probs = np.log(np.stack([frame, frame]))
    assert decoding.beam_decode_one(log_probs, beam_width=1) == ""
    assert decoding.beam_decode_one(log_probs, beam_width=2) == "a"


def test_error_rates():
    rates = decoding.ErrorRates()
    rates.update(["one two three", "go"], ["one too three", ""])
    assert rates.chars == 15 and rates.char_edits == 1 + 2
    assert rates.words == 4 and rates.word_edits == 1 + 1
    assert math.isclose(rates.cer, 3 / 15) and math.isclose(rates.wer, 2 / 4)
    assert decoding.edit_distance("kitten", "sitting") == 3


def expected_parameters(config) -> int:
    """Deep Speech 2's parameter count from its configuration, as the README's table gives it:
    convolutions without bias, each batch-normalised (scale and bias); per bidirectional GRU layer
    one input projection for 3 gates x 2 directions, batch-normalised, and per direction
    recurrent weights and biases for 3 gates; a dense layer and the output layer, with biases."""
    frequency, channels, count = data.feature_size(config.sample_rate), 1, 0
    for out, (kt, kf), (_, sf) in zip(config.conv_channels, config.conv_kernels,
                                      config.conv_strides):
        count += kt * kf * channels * out + 2 * out
        frequency, channels = -(-frequency // sf), out
    inputs, hidden = frequency * channels, config.rnn_hidden
    for _ in range(config.rnn_layers):
        count += inputs * 6 * hidden + 2 * 6 * hidden + 2 * (hidden * 3 * hidden + 3 * hidden)
        inputs = hidden
    return count + (inputs + 1) * config.dense + (config.dense + 1) * data.NUM_CLASSES


def test_configs_from_tiny_to_paper():
    counts = {}
    for name in ("tiny", "small", "paper"):
        config = configs.get_config(name)
        model = jax.eval_shape(lambda c=config: nnx.state(
            training.create_model(c, 0), nnx.Param))
        counts[name] = sum(math.prod(x.shape) for x in jax.tree.leaves(model))
        assert counts[name] == expected_parameters(config), name
    # The README's table: 0.83 M, 6.4 M and 267 M.
    assert (round(counts["tiny"] / 1e6, 2), round(counts["small"] / 1e6, 1),
            round(counts["paper"] / 1e6)) == (0.83, 6.4, 267)
    assert configs.get_config("tiny", rnn_layers="3", conv_kernels="[[3, 5]]").rnn_layers == 3
    # From Python, lists become tuples as on the command line: a config is a cache key.
    from_python = configs.get_config("tiny", conv_channels=[4], conv_kernels=[[3, 5]],
                                     conv_strides=[(2, 2)])
    from_text = configs.get_config("tiny", conv_channels="[4]", conv_kernels="[[3, 5]]",
                                   conv_strides="[[2, 2]]")
    assert from_python == from_text and hash(from_python) == hash(from_text)
    assert from_python.conv_kernels == ((3, 5),)
    with pytest.raises(ValueError, match="unknown config key"):
        configs.get_config("tiny", nonsense=1)
    assert training.check_trainable(configs.get_config("tiny")) is None
    # The ends of the optimiser's ranges that are in them: plain SGD steps, no annealing.
    assert training.check_trainable(configs.get_config(
        "tiny", optimizer="nesterov", momentum=0.0, learning_rate_decay_per_epoch=1.0,
        seed=0, data_seed=0)) is None
    # Lists from Python are taken as the command line's, and refused alike.
    assert configs.Config(conv_kernels=[[3, 5]]).conv_kernels == ((3, 5),)


@pytest.mark.parametrize("key, value, message", [
    ("epochs", "abc", "'epochs' takes an int"), ("epochs", "", "'epochs' takes an int"),
    ("sortagrad", "maybe", "'sortagrad' takes true or false"),
    ("conv_channels", "16", "'conv_channels' takes a JSON list"),
    ("learning_rate", "fast", "'learning_rate' takes a number"),
    ("train_utterances", "0", "'train_utterances' must be at least 1"),
    ("num_devices", "0", "'num_devices' must be at least 1"),
    ("conv_channels", "[16, 32]", r"must be as long as each other, got conv_channels=\[16, 32\], "
                                  r"conv_kernels=\[\[11, 21\]\], conv_strides=\[\[2, 2\]\]"),
    ("conv_channels", "[0]", r"conv_channels must be positive ints, got \[0\]"),
    ("conv_kernels", "[[11.5, 21]]", r"conv_kernels must be \[time, frequency\] pairs of positive"),
    ("conv_kernels", "[[11, 21, 3]]", r"conv_kernels must be \[time, frequency\] pairs"),
    ("conv_strides", "[[0, 2]]", r"conv_strides must be \[time, frequency\] pairs of positive"),
    ("optimizer", "sgd", r"optimizer must be one of \('nesterov', 'adam'\), got 'sgd'"),
    ("beam_utterances", "-1", "beam_utterances must be at least 0"),
    ("train_utterances", "8", r"train_utterances \(8\) is below batch_size \(32\)"),
    ("train_utterances", "31", r"train_utterances \(31\) is below batch_size \(32\)"),
    ("bucket_bytes", "1", r"bucket_bytes 1 cuts the gradients into 28593 buckets, each a "
                          r"collective call of its own; more than 4096"),
    ("grad_clip_norm", "-1", r"grad_clip_norm must be above 0, got -1.0"),
    ("grad_clip_norm", "0", r"grad_clip_norm must be above 0, got 0.0"),
    ("learning_rate", "0", r"learning_rate must be above 0, got 0.0"),
    ("learning_rate", "-0.001", r"learning_rate must be above 0, got -0.001"),
    ("learning_rate", "nan", r"learning_rate must be above 0, got nan"),
    ("learning_rate_decay_per_epoch", "0", r"learning_rate_decay_per_epoch must be in \(0, 1\]"),
    ("learning_rate_decay_per_epoch", "1.2",
     r"learning_rate_decay_per_epoch must be in \(0, 1\]: the factor .* got 1.2"),
    ("momentum", "1", r"momentum must be in \[0, 1\), got 1.0"),
    ("momentum", "-0.5", r"momentum must be in \[0, 1\), got -0.5"),
    ("seed", "-1", r"seed must be at least 0, got -1"),
    ("data_seed", "-1", r"data_seed must be at least 0, got -1")])
def test_a_bad_override_names_its_key(key, value, message):
    """--set values that failed deep in parsing, data loading or training (int()'s message, a
    JSON decode error, a modulo by zero) without naming the key, or (a bare 16 for a tuple
    field) were taken and broke the model later. Conv settings of different lengths built as
    many convolutions as the shortest, while config.json recorded the others; too few training
    utterances for one batch trained nothing and wrote NaN losses; 1-byte buckets took minutes to
    compile; an unknown optimizer was refused only after the data was synthesised. optax took a
    negative clip norm (it flipped every gradient, so training climbed the loss), zero rates,
    a decay above 1 (the rate grew each epoch) and momentum of 1; a negative seed failed only
    after the data was made."""
    with pytest.raises(ValueError, match=message):  # as `train` checks a config, first of all
        training.check_trainable(configs.get_config("tiny", **{key: value}))


def test_resuming_with_another_model_is_refused_and_leaves_the_run_alone(tmp_path):
    """A checkpoint of one model resumed with a config of another: the restore failed in orbax
    after config.json had been overwritten, so every later command on the directory (transcribe,
    a resume with the old settings) failed too. It is refused before anything is written."""
    config = configs.get_config("tiny", train_utterances=4, test_utterances=2, batch_size=4)
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(config.to_json())
    training.save_checkpoint(training.checkpoint_manager(tmp_path), 0, {"w": np.zeros(2)}, [])
    before = (tmp_path / "config.json").read_text()
    with pytest.raises(ValueError, match=r"another model \(rnn_hidden: 128 there, 64 here\)"):
        training.train(config.replace(rnn_hidden=64, epochs=5), tmp_path)
    # Epochs of another number of steps: the learning rate's schedule, which counts steps, would
    # decay it mid-epoch (a review resumed at half the batch size).
    with pytest.raises(ValueError, match=r"epochs of another number of steps \(batch_size: 4 "
                                         r"there, 2 here\)"):
        training.train(config.replace(batch_size=2, epochs=5), tmp_path)
    assert (tmp_path / "config.json").read_text() == before


def test_transcribing_a_wav_without_samples_says_so(tmp_path):
    """An empty WAV failed inside numpy ("zero-size array to reduction operation maximum")."""
    import scipy.io.wavfile

    from models.deepspeech import main

    (tmp_path / "config.json").write_text(configs.get_config("tiny").to_json())
    wav = tmp_path / "empty.wav"
    scipy.io.wavfile.write(wav, 16000, np.zeros(0, np.int16))
    with pytest.raises(SystemExit, match="empty.wav holds no samples"):
        main.main(["transcribe", "--workdir", str(tmp_path), str(wav)])
    # A config.json that describes no model (conv fields of different lengths) is named.
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"conv_channels": [16, 32]}))
    with pytest.raises(SystemExit, match=r"config.json describes no model this version builds: "
                                         r"conv_channels, conv_kernels and conv_strides"):
        main.main(["transcribe", "--workdir", str(tmp_path), str(wav)])


def test_an_8_bit_wav_reads_as_the_same_signal_as_a_16_bit_one(tmp_path):
    """scipy reads 8-bit PCM as unsigned samples centred on 128; transcribe took them as they
    came, so the model saw a signal with a large offset (features off by 9.5 at most, in
    normalised units, in a review)."""
    import scipy.io.wavfile

    from models.deepspeech import main

    t = np.arange(4000) / 8000
    signal = 0.8 * np.sin(2 * np.pi * 440 * t) * np.hanning(len(t))
    scipy.io.wavfile.write(tmp_path / "16.wav", 8000, np.round(signal * 32767).astype(np.int16))
    scipy.io.wavfile.write(tmp_path / "8.wav", 8000, np.round(signal * 127 + 128).astype(np.uint8))
    wide, narrow = (main.read_wav(tmp_path / name, 8000) for name in ("16.wav", "8.wav"))
    assert np.abs(wide).max() == pytest.approx(1.0)
    np.testing.assert_allclose(narrow, wide, atol=2 / 127)  # 8 bits' rounding, after the peak


def test_training_leaves_out_utterances_too_short_for_ctc_at_their_strides():
    """An utterance with fewer frames after the strided convolutions than CTC needs for its
    labels (one per label, a blank between repeats) has no alignment, and optax gave it a loss of
    about 1e5, not infinity, which swamped its batch's mean without an error (a review's time
    stride of 4). `train` leaves out what Dataset.alignable leaves out; the frames are counted
    as the model's own mask counts them."""
    rng = np.random.default_rng(8)
    frames = rng.integers(1, 40, 200)
    labels = [rng.integers(1, 4, rng.integers(1, 12)).astype(np.int32) for _ in frames]
    dataset = data.Dataset([np.zeros((f, 3), np.float32) for f in frames], labels,
                           [str(i) for i in range(len(frames))], ["v"] * len(frames))
    strides = ((4, 1), (2, 1))
    model = DeepSpeech2(feature_size=3, num_classes=4, conv_channels=(1, 1),
                        conv_kernels=((3, 1), (3, 1)), conv_strides=strides, rnn_layers=1,
                        rnn_hidden=2, dense=2, rngs=nnx.Rngs(0))
    left = [int(model.output_mask(np.ones((1, f), np.float32)).sum()) for f in frames]
    needed = [len(l) + sum(a == b for a, b in zip(l, l[1:])) for l in labels]
    kept, dropped = dataset.alignable([time for time, _ in strides])
    assert kept.transcripts == [str(i) for i in range(len(frames)) if left[i] >= needed[i]]
    assert 0 < dropped == sum(n > f for f, n in zip(left, needed)) < len(frames)
    # What they would have cost: optax's floor for an impossible alignment, a feasible one less.
    width, length = max(left), max(map(len, labels))
    logits = jnp.asarray(rng.standard_normal((len(frames), width, 4)), jnp.float32)
    logit_mask = (np.arange(width) < np.array(left)[:, None]).astype(np.float32)
    label_array = np.zeros((len(frames), length), np.int32)
    for row, l in enumerate(labels):
        label_array[row, :len(l)] = l
    label_mask = (np.arange(length) < np.array(list(map(len, labels)))[:, None]).astype(np.float32)
    losses = np.asarray(ctc_loss_per_utterance(logits, logit_mask, label_array, label_mask))
    feasible = np.array(left) >= np.array(needed)
    assert losses[~feasible].min() > 1e4 > losses[feasible].max()


# ---- the model's arithmetic (a mutation review of models/deepspeech/model.py) ---------------


def perturbed(module, seed):
    """`module` with every parameter and statistic moved off its initial value (zero biases, unit
    variances), which hid terms that vanish at initialisation; variances stay positive."""
    graphdef, params, stats = nnx.split(module, nnx.Param, nnx.BatchStat)
    rng = np.random.default_rng(seed)
    params = jax.tree.map(
        lambda x: x + 0.3 * rng.standard_normal(x.shape).astype(np.float32), params)
    stats = jax.tree.map(
        lambda x: x + 0.3 * np.abs(rng.standard_normal(x.shape)).astype(np.float32), stats)
    return nnx.merge(graphdef, params, stats)


def sigmoid(v):
    return 1 / (1 + np.exp(-v))


def gru_reference(gru, x, mask):
    """BidirectionalGRU in float64 numpy, frame by frame, from the paper's equations (DS2 section
    3.1, GRU of Cho et al.): z = s(W_z x + U_z h + b_z), r = s(W_r x + U_r h + b_r),
    n = tanh(W_n x + r (U_n h + b_n)), h' = (1 - z) h + z n, the input projection W x normalised
    by the running statistics (train=False); the backward direction runs over each utterance's
    real frames from its last; outputs of both directions summed, zero on padded frames."""
    hidden = gru.hidden
    f64 = lambda v: np.asarray(v, np.float64)
    p = f64(x) @ f64(gru.input_projection.kernel[...])
    norm = gru.norm
    p = ((p - f64(norm.mean[...])) / np.sqrt(f64(norm.var[...]) + norm.epsilon)
         * f64(norm.scale[...]) + f64(norm.bias[...]))
    recurrent, bias = f64(gru.recurrent[...]), f64(gru.recurrent_bias[...])
    batch, time, _ = x.shape
    out = np.zeros((batch, time, hidden))
    for b in range(batch):
        real = int(mask[b].sum())
        for d, frames in ((0, range(real)), (1, range(real - 1, -1, -1))):
            h = np.zeros(hidden)
            for t in frames:
                xz, xr, xn = np.split(p[b, t, d * 3 * hidden:(d + 1) * 3 * hidden], 3)
                hz, hr, hn = np.split(h @ recurrent[d] + bias[d], 3)
                z, r = sigmoid(xz + hz), sigmoid(xr + hr)
                n = np.tanh(xn + r * hn)
                h = (1 - z) * h + z * n
                out[b, t] += h
    return out


# Kills ds05 (reset gate dropped), ds06 (update gate swapped), ds07 (the backward direction fed
# the forward direction's projection) and ds03 (padding let into the recurrence): every element
# against a float64 reference, on utterances of different lengths.
def test_bidirectional_gru_against_a_float64_reference():
    gru = perturbed(BidirectionalGRU(5, 4, rngs=nnx.Rngs(0)), seed=1)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 7, 5)).astype(np.float32)
    mask = (np.arange(7)[None, :] < np.array([[7], [4], [1]])).astype(np.float32)
    x = x * mask[..., None] + 50 * (1 - mask[..., None])  # padding of any value
    y = nnx.jit(lambda m, v, k: m(v, k, train=False))(gru, jnp.asarray(x), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(y), gru_reference(gru, x, mask), rtol=1e-5, atol=1e-5)


# Kills ds03 through the whole model: the padding test, with parameters off their initial values
# (a fresh model's zero biases kept a recurrence fed zeros at zero, mask or no mask).
@pytest.mark.parametrize("layers", [TINY_MODEL, TWO_CONVS], ids=["one-conv", "two-convs"])
@pytest.mark.parametrize("train", [False, True])
def test_padding_does_not_change_real_frames_of_trained_weights(layers, train):
    rng = np.random.default_rng(3)
    length, padded_length = 13, 24
    features = rng.standard_normal((2, length, 17)).astype(np.float32)
    padded = np.concatenate([features, 100 * rng.standard_normal((2, padded_length - length, 17))],
                            1).astype(np.float32)
    mask = np.concatenate([np.ones((2, length)), np.zeros((2, padded_length - length))], 1)

    def run(f, m):
        model = perturbed(DeepSpeech2(feature_size=17, num_classes=data.NUM_CLASSES,
                                      rngs=nnx.Rngs(0), **layers), seed=4)
        return apply(model, jnp.asarray(f), jnp.asarray(m, jnp.float32), train)

    short, _ = run(features, mask[:, :length])
    long, _ = run(padded, mask)
    np.testing.assert_allclose(long[:, :short.shape[1]], short, rtol=1e-4, atol=1e-5)


# Kills ds08 (the halves of "SAME" padding swapped): against XLA's own, odd totals included.
def test_same_padding_is_xlas():
    for size in range(1, 40):
        for kernel in range(1, 12):
            for stride in range(1, 5):
                assert same_padding(size, kernel, stride) == tuple(jax.lax.padtype_to_pads(
                    (size,), (kernel,), (stride,), "SAME")[0]), (size, kernel, stride)


# Kills ds10 (the ReLU's clip at 20 dropped).
def test_clipped_relu_clips_at_20():
    x = jnp.asarray([-3.0, 0.0, 7.5, 20.0, 20.5, 1e6])
    np.testing.assert_array_equal(np.asarray(clipped_relu(x)), [0.0, 0.0, 7.5, 20.0, 20.0, 20.0])


# Kills ds13 (the running variance updated with the batch mean): the running statistics after
# one training call, and the output, against float64 masked moments.
def test_sequence_batch_norm_running_statistics():
    norm = SequenceBatchNorm(3)
    rng = np.random.default_rng(5)
    x = (3 + 2 * rng.standard_normal((2, 5, 3))).astype(np.float32)
    mask = (np.arange(5)[None, :] < np.array([[5], [2]])).astype(np.float32)
    y = norm(jnp.asarray(x), jnp.asarray(mask), train=True)
    real = np.asarray(x, np.float64)[mask > 0]
    mean, var = real.mean(0), real.var(0)
    np.testing.assert_allclose(np.asarray(norm.mean[...]), 0.01 * mean, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(norm.var[...]), 0.99 + 0.01 * var, rtol=1e-5)
    expected = (x - mean) / np.sqrt(var + 1e-5) * mask[..., None]
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-4, atol=1e-5)
