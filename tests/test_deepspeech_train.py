"""Deep Speech 2 training end to end on a few synthesised utterances: the loss falls, two runs
with the same seed give the same curve, and a run resumed from its checkpoint continues exactly
as an uninterrupted one."""

import jax
import numpy as np
import pytest
from flax import nnx

from models.deepspeech import configs, data
from models.deepspeech import train as training

CONFIG = configs.get_config(
    "tiny", train_utterances=48, test_utterances=8, conv_channels=(4,), conv_kernels=((5, 11),),
    rnn_layers=1, rnn_hidden=16, dense=16, batch_size=16, num_devices=2, optimizer="adam",
    learning_rate=1e-2, frame_multiple=320, beam_utterances=2, epochs=3)


def test_loss_falls_runs_are_deterministic_and_resume_exactly(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    uninterrupted = training.train_and_evaluate(CONFIG, tmp_path / "a", cache, progress=False)
    losses = [epoch["train_loss"] for epoch in uninterrupted]
    assert losses[-1] < 0.8 * losses[0], losses
    assert (tmp_path / "a" / "learning_curve.png").stat().st_size > 0

    interrupted = CONFIG.replace(epochs=1)
    first = training.train_and_evaluate(interrupted, tmp_path / "b", cache, progress=False)
    assert first[0]["steps"] == 3
    # The same config on other data (a rule that leaves out 16 more utterances for CTC): epochs of
    # 2 steps, where the schedule of the checkpoint's decays every 3, are refused.
    alignable = data.Dataset.alignable

    def sixteen_more_left_out(dataset, strides):
        kept, left_out = alignable(dataset, strides)
        return data.Dataset(*(values[16:] for values in (
            kept.features, kept.labels, kept.transcripts, kept.voices))), left_out + 16

    with monkeypatch.context() as patch:
        patch.setattr(data.Dataset, "alignable", sixteen_more_left_out)
        with pytest.raises(ValueError, match="epochs took 3 steps, but this run's take 2 "
                                             r"\(32 training utterances after 16 left out"):
            training.train_and_evaluate(CONFIG, tmp_path / "b", cache, progress=False)
    resumed = training.train_and_evaluate(CONFIG, tmp_path / "b", cache, progress=False)
    # A transcript longer than max_label_length is refused before the first step.
    with pytest.raises(ValueError, match=r"max_label_length 4 is below the \d+ labels of "
                                         r"training utterance \d+"):
        training.train_and_evaluate(CONFIG.replace(max_label_length=4), tmp_path / "c", cache,
                                    progress=False)
    assert not (tmp_path / "c" / "checkpoints").exists() or not any(
        (tmp_path / "c" / "checkpoints").iterdir())
    assert len(first) == 1 and len(resumed) == 3
    # Restored, not trained again: a rerun of the first epoch would give the same losses, but
    # not the same wall-clock time, which the restored history keeps.
    assert resumed[0] == first[0], (resumed[0], first[0])
    for a, b in zip(uninterrupted, resumed):
        # Same seed, same data order, same reductions: identical to the last bit.
        assert a["train_loss"] == b["train_loss"] and a["cer"] == b["cer"], (a, b)


def test_checkpoint_round_trip(tmp_path):
    model = training.create_model(CONFIG, seed=1)
    _, params, batch_stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    rng = np.random.default_rng(0)
    noise = lambda tree: jax.tree.map(
        lambda x: x + rng.standard_normal(x.shape).astype(x.dtype), tree)
    params, moved_stats = noise(params), noise(batch_stats)
    optimizer = training.create_optimizer(CONFIG, steps_per_epoch=3)
    # One update, so that Adam's moments and step count are not their initial values.
    _, opt_state = optimizer.update(noise(jax.tree.map(np.zeros_like, params)),
                                    optimizer.init(params), params)
    state = {"params": params, "batch_stats": moved_stats, "opt_state": opt_state}
    history = [{"epoch": 1, "cer": 0.5}]
    manager = training.checkpoint_manager(tmp_path)
    training.save_checkpoint(manager, 4, state, history)
    template = {"params": nnx.state(training.create_model(CONFIG, seed=2), nnx.Param)}
    template |= {"batch_stats": batch_stats, "opt_state": optimizer.init(template["params"])}
    for saved, fresh in zip(jax.tree.leaves(state), jax.tree.leaves(template)):
        assert saved.size == 0 or not np.array_equal(saved, fresh), "the template differs"
    epoch, restored, restored_history = training.restore_checkpoint(
        training.checkpoint_manager(tmp_path), template)
    assert epoch == 4 and restored_history == history
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(got, want)


def test_evaluation_splits_batches_over_the_parameters_devices_and_compares_beam_with_greedy():
    """With the parameters replicated on 2 devices, an evaluation batch is split between them
    (every device evaluated all of it before) and gives the log probabilities of the parameters
    on one device; the utterances that beam search decodes are also decoded greedily
    (beam_greedy_cer/wer), so that the two are compared on the same utterances."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from models.deepspeech import data, decoding

    config = CONFIG.replace(batch_size=4, beam_utterances=5)
    graphdef, params, batch_stats = nnx.split(training.create_model(config, seed=3), nnx.Param,
                                              nnx.BatchStat)
    rng = np.random.default_rng(5)
    words = ["on", "off", "light", "door", "two"]
    transcripts = [" ".join(rng.choice(words, 2)) for _ in range(7)]
    dataset = data.Dataset(
        [rng.standard_normal((n, data.feature_size(config.sample_rate))).astype(np.float32)
         for n in rng.permutation([300, 350, 400, 450, 500, 550, 600])],
        [data.text_to_labels(t) for t in transcripts], transcripts, ["v"] * 7)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    replicated = jax.device_put((params, batch_stats), NamedSharding(mesh, P()))
    assert training._batch_sharding(replicated[0], 4) == NamedSharding(mesh, P(("data",)))
    assert training._batch_sharding(params, 4) is None  # on one device: left there
    references, hypotheses = [], []  # in evaluation order: shortest first
    for batch in data.eval_batches(dataset, 4, config.frame_multiple, config.max_label_length):
        one = training.predict_log_probs(graphdef, params, batch_stats, batch.features,
                                         batch.feature_mask)
        split = training.predict_log_probs(graphdef, *replicated, batch.features,
                                           batch.feature_mask)
        np.testing.assert_allclose(split[0], one[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(split[1], one[1])
        real = [i for i, t in enumerate(batch.transcripts) if t]
        hypotheses += decoding.greedy_decode(split[0][real], split[1][real])
        references += [batch.transcripts[i] for i in real]
    greedy_all, greedy_first = decoding.ErrorRates(), decoding.ErrorRates()
    greedy_all.update(references, hypotheses)
    greedy_first.update(references[:5], hypotheses[:5])
    seen = frozenset(references[::2])  # transcripts "heard in training": every other one
    unseen = [k for k, reference in enumerate(references) if reference not in seen]
    greedy_unseen = decoding.ErrorRates()
    greedy_unseen.update([references[k] for k in unseen], [hypotheses[k] for k in unseen])
    metrics = training.evaluate(graphdef, *replicated, dataset, config, beam=True, seen=seen)
    assert (metrics["cer"], metrics["wer"]) == (greedy_all.cer, greedy_all.wer)
    assert 0 < metrics["unseen_utterances"] == len(unseen) < len(references)
    assert (metrics["cer_unseen"], metrics["wer_unseen"]) == (greedy_unseen.cer, greedy_unseen.wer)
    assert (metrics["beam_greedy_cer"], metrics["beam_greedy_wer"]) == (greedy_first.cer,
                                                                        greedy_first.wer)
    assert 0 <= metrics["beam_cer"] and 0 <= metrics["beam_wer"]
    # With nothing to beam-decode, the beam metrics are missing, not perfect scores (they were 0).
    unbeamed = training.evaluate(graphdef, *replicated, dataset,
                                 config.replace(beam_utterances=0), beam=True, seen=seen)
    assert [unbeamed[key] for key in ("beam_cer", "beam_wer", "beam_greedy_cer",
                                      "beam_greedy_wer")] == [None] * 4
    assert (unbeamed["cer"], unbeamed["wer"]) == (greedy_all.cer, greedy_all.wer)
