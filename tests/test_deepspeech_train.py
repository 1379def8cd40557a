"""Deep Speech 2 training end to end on a few synthesised utterances: the loss falls, two runs
with the same seed give the same curve, and a run resumed from its checkpoint continues exactly
as an uninterrupted one."""

import jax
import numpy as np
from flax import nnx

from models.deepspeech import configs
from models.deepspeech import train as training

CONFIG = configs.get_config(
    "tiny", train_utterances=48, test_utterances=8, conv_channels=(4,), conv_kernels=((5, 11),),
    rnn_layers=1, rnn_hidden=16, dense=16, batch_size=16, num_devices=2, optimizer="adam",
    learning_rate=1e-2, frame_multiple=320, beam_utterances=2, epochs=3)


def test_loss_falls_runs_are_deterministic_and_resume_exactly(tmp_path):
    cache = tmp_path / "cache"
    uninterrupted = training.train_and_evaluate(CONFIG, tmp_path / "a", cache, progress=False)
    losses = [epoch["train_loss"] for epoch in uninterrupted]
    assert losses[-1] < 0.8 * losses[0], losses
    assert (tmp_path / "a" / "learning_curve.png").stat().st_size > 0

    interrupted = CONFIG.replace(epochs=1)
    first = training.train_and_evaluate(interrupted, tmp_path / "b", cache, progress=False)
    resumed = training.train_and_evaluate(CONFIG, tmp_path / "b", cache, progress=False)
    assert len(first) == 1 and len(resumed) == 3
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
