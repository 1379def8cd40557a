"""Deep Speech 2 training, data-parallel over jaxring: `train_and_evaluate(config, workdir)`.

One training step runs inside ``jax.shard_map`` over a 1-D mesh ("data"). Every replica holds the
full model and a slice of the global batch; batch-norm statistics are summed across replicas in
the forward pass, and gradients are summed in fused buckets by the jaxring.parallel.data
distributed optimizer. Parameters are broadcast from replica 0 before the first step.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

import jaxring
from jaxring.parallel import data as data_parallel
from models.deepspeech import data, decoding
from models.deepspeech.configs import Config
from models.deepspeech.model import DeepSpeech2, ctc_loss_per_utterance

AXIS = "data"


def create_model(config: Config, seed: int) -> DeepSpeech2:
    return DeepSpeech2(
        feature_size=data.feature_size(config.sample_rate), num_classes=data.NUM_CLASSES,
        conv_channels=config.conv_channels, conv_kernels=config.conv_kernels,
        conv_strides=config.conv_strides, rnn_layers=config.rnn_layers,
        rnn_hidden=config.rnn_hidden, dense=config.dense, rngs=nnx.Rngs(seed))


def create_optimizer(config: Config, steps_per_epoch: int) -> optax.GradientTransformation:
    """The paper's optimiser (section 3.1): Nesterov momentum on gradients clipped by global
    norm, the learning rate annealed by a constant factor each epoch; Adam as an option."""
    schedule = optax.exponential_decay(config.learning_rate, max(steps_per_epoch, 1),
                                       config.learning_rate_decay_per_epoch, staircase=True)
    if config.optimizer == "nesterov":
        inner = optax.sgd(schedule, momentum=config.momentum, nesterov=True)
    elif config.optimizer == "adam":
        inner = optax.adam(schedule)
    else:
        raise ValueError(f"optimizer must be 'nesterov' or 'adam', got {config.optimizer!r}")
    return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), inner)


def loss_and_batch_stats(params, batch_stats, graphdef, batch, axis_name):
    """Mean CTC loss over this replica's utterances, and the updated batch-norm statistics."""
    model = nnx.merge(graphdef, params, batch_stats, copy=True)
    logits, logit_mask = model(batch["features"], batch["feature_mask"], train=True,
                               axis_name=axis_name)
    losses = ctc_loss_per_utterance(logits, logit_mask, batch["labels"], batch["label_mask"])
    return losses.mean(), nnx.state(model, nnx.BatchStat)


def make_train_step(graphdef, optimizer: optax.GradientTransformation, mesh, gradient_sync=None):
    """A jitted step (params, batch_stats, opt_state, batch) -> (same, loss), data-parallel over
    the mesh axis "data". `optimizer` must reduce gradients itself (data_parallel.distributed)
    unless `gradient_sync` does it, e.g. ``lambda g: lax.pmean(g, "data")`` (the benchmark's
    rival) or ``lambda g: g`` (to time a step without synchronisation)."""

    def local_step(params, batch_stats, opt_state, batch):
        # shard_map with check_vma=False: the gradient of a replicated parameter stays per replica
        # (no implicit psum is inserted); the distributed optimizer then sums it with jaxring.
        (loss, batch_stats), grads = jax.value_and_grad(loss_and_batch_stats, has_aux=True)(
            params, batch_stats, graphdef, batch, AXIS)
        if gradient_sync is not None:
            grads = gradient_sync(grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, batch_stats, opt_state, jaxring.all_reduce(loss, AXIS, "mean")

    sharded = jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(), P(), P(AXIS)),
                            out_specs=(P(), P(), P(), P()), check_vma=False)
    return jax.jit(sharded, donate_argnums=(0, 1, 2))


def make_broadcast(mesh, bucket_bytes: int):
    """Replica 0's parameters to every replica (the start of Horovod-style training)."""
    sharded = jax.shard_map(
        lambda tree: data_parallel.broadcast_parameters(tree, AXIS, 0, bucket_bytes),
        mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    return jax.jit(sharded)


@functools.partial(jax.jit, static_argnums=0)
def _log_probs(graphdef, params, batch_stats, features, feature_mask):
    model = nnx.merge(graphdef, params, batch_stats)
    logits, mask = model(features, feature_mask, train=False)
    return jax.nn.log_softmax(logits), mask


def predict_log_probs(graphdef, params, batch_stats, features, feature_mask):
    """Per-frame log probabilities (batch, frames, classes) and the frame mask, on one device."""
    log_probs, mask = _log_probs(graphdef, params, batch_stats, jnp.asarray(features),
                                 jnp.asarray(feature_mask))
    return np.asarray(log_probs), np.asarray(mask)


def evaluate(graphdef, params, batch_stats, dataset, config: Config, beam: bool = False):
    """Greedy (and, with `beam`, prefix-beam on the first `beam_utterances`) CER and WER."""
    greedy, beam_rates = decoding.ErrorRates(), decoding.ErrorRates()
    beam_left = config.beam_utterances if beam else 0
    for batch in data.eval_batches(dataset, config.batch_size, config.frame_multiple,
                                   config.max_label_length):
        log_probs, mask = predict_log_probs(graphdef, params, batch_stats, batch.features,
                                            batch.feature_mask)
        real = [i for i, t in enumerate(batch.transcripts) if t]
        references = [batch.transcripts[i] for i in real]
        hypotheses = decoding.greedy_decode(log_probs[real], mask[real])
        greedy.update(references, hypotheses)
        if beam_left > 0:
            take = real[:beam_left]
            beam_rates.update([batch.transcripts[i] for i in take],
                              decoding.beam_decode(log_probs[take], mask[take], config.beam_width))
            beam_left -= len(take)
    metrics = {"cer": greedy.cer, "wer": greedy.wer}
    if beam:
        metrics |= {"beam_cer": beam_rates.cer, "beam_wer": beam_rates.wer}
    return metrics


def checkpoint_manager(workdir: Path) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        (workdir / "checkpoints").absolute(),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))


def save_checkpoint(manager, epoch: int, state: dict, history: list):
    manager.save(epoch, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), history=ocp.args.JsonSave(history)))
    manager.wait_until_finished()


def restore_checkpoint(manager, template: dict):
    """(epoch, state, history) of the latest checkpoint, or None when there is none."""
    epoch = manager.latest_step()
    if epoch is None:
        return None
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    restored = manager.restore(epoch, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), history=ocp.args.JsonRestore()))
    return epoch, restored["state"], restored["history"]


def shard_batch(batch: data.Batch, sharding) -> dict:
    return {name: jax.device_put(getattr(batch, name), sharding)
            for name in ("features", "feature_mask", "labels", "label_mask")}


@functools.cache
def _training_functions(config: Config, steps_per_epoch: int, devices: tuple):
    """The model's structure and initial state, the optimizer, and the jitted step and broadcast:
    cached, so that training again in this process (a resumed run, a test) does not recompile.
    `config` comes with epochs=0: the number of epochs changes none of these."""
    mesh = jax.sharding.Mesh(np.array(devices), (AXIS,))
    graphdef, params, batch_stats = nnx.split(create_model(config, config.seed), nnx.Param,
                                              nnx.BatchStat)
    optimizer = data_parallel.distributed(create_optimizer(config, steps_per_epoch), AXIS,
                                          bucket_bytes=config.bucket_bytes)
    return (graphdef, params, batch_stats, optimizer, make_train_step(graphdef, optimizer, mesh),
            make_broadcast(mesh, config.bucket_bytes))


def train_and_evaluate(config: Config, workdir: str | Path, cache_dir: str | Path | None = None,
                       progress: bool = True) -> list[dict]:
    """Trains `config` and evaluates on held-out voices after every epoch. Resumes from the
    latest checkpoint in `workdir`. Returns the history: one dict of metrics per epoch."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(config.to_json())
    train_set = data.load("train", config.train_utterances, config.data_seed, config.sample_rate,
                          cache_dir)
    test_set = data.load("test", config.test_utterances, config.data_seed, config.sample_rate,
                         cache_dir)

    if config.batch_size % config.num_devices:
        raise ValueError(f"batch_size {config.batch_size} is not divisible by num_devices "
                         f"{config.num_devices}")
    devices = jax.devices()[:config.num_devices]
    if len(devices) < config.num_devices:
        raise ValueError(f"num_devices={config.num_devices} but only {len(devices)} devices; "
                         "set XLA_FLAGS=--xla_force_host_platform_device_count=N")
    mesh = jax.sharding.Mesh(np.array(devices), (AXIS,))
    batch_sharding = NamedSharding(mesh, P(AXIS))
    replicated = NamedSharding(mesh, P())

    steps_per_epoch = len(train_set) // config.batch_size
    graphdef, params, batch_stats, optimizer, train_step, broadcast = _training_functions(
        config.replace(epochs=0), steps_per_epoch, tuple(devices))
    state = {"params": params, "batch_stats": batch_stats, "opt_state": optimizer.init(params)}
    # Copies: the step donates its inputs, and the cached initial state must survive.
    state = jax.tree.map(jnp.copy, jax.device_put(state, replicated))

    manager = checkpoint_manager(workdir)
    history, first_epoch = [], 0
    restored = restore_checkpoint(manager, state)
    if restored is not None:
        last_epoch, state, history = restored
        state = jax.device_put(state, replicated)
        first_epoch = last_epoch + 1
    else:
        state["params"] = broadcast(state["params"])

    elapsed = history[-1]["elapsed_seconds"] if history else 0.0
    for epoch in range(first_epoch, config.epochs):
        start = time.perf_counter()
        losses, utterances = [], 0
        batches = data.train_batches(train_set, config.batch_size, epoch, config.seed,
                                     config.frame_multiple, config.max_label_length,
                                     config.sortagrad)
        bar = tqdm(batches, total=steps_per_epoch, desc=f"epoch {epoch + 1}/{config.epochs}",
                   unit="step", disable=not progress, leave=False)
        params, batch_stats, opt_state = state["params"], state["batch_stats"], state["opt_state"]
        for batch in bar:
            params, batch_stats, opt_state, loss = train_step(
                params, batch_stats, opt_state, shard_batch(batch, batch_sharding))
            losses.append(loss)
            utterances += config.batch_size
            if len(losses) % 10 == 0:
                bar.set_postfix(loss=f"{float(loss):.3f}",
                                utt_per_s=f"{utterances / (time.perf_counter() - start):.0f}")
        state = {"params": params, "batch_stats": batch_stats, "opt_state": opt_state}
        train_seconds = time.perf_counter() - start
        is_last = epoch == config.epochs - 1
        metrics = evaluate(graphdef, params, batch_stats, test_set, config, beam=is_last)
        elapsed += time.perf_counter() - start
        record = {"epoch": epoch + 1, "train_loss": float(np.mean([float(x) for x in losses])),
                  "utterances_per_second": utterances / train_seconds,
                  "elapsed_seconds": elapsed, **metrics}
        history.append(record)
        print(json.dumps(record), flush=True)
        save_checkpoint(manager, epoch, state, history)
    manager.close()
    write_learning_curve(history, workdir)
    return history


def write_learning_curve(history: list[dict], workdir: Path):
    """learning_curve.json and .png in `workdir`: training loss and held-out CER/WER by epoch."""
    (workdir / "learning_curve.json").write_text(json.dumps(history, indent=1))
    if not history:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    figure, (loss_axes, error_axes) = plt.subplots(1, 2, figsize=(10, 4))
    loss_axes.plot(epochs, [h["train_loss"] for h in history], marker="o")
    loss_axes.set(xlabel="epoch", ylabel="CTC loss (train)", yscale="log", title="training loss")
    error_axes.plot(epochs, [100 * h["cer"] for h in history], marker="o", label="CER (greedy)")
    error_axes.plot(epochs, [100 * h["wer"] for h in history], marker="o", label="WER (greedy)")
    error_axes.set(xlabel="epoch", ylabel="%", title="held-out voices")
    error_axes.axhline(10, color="gray", linestyle=":", label="CER goal 10%")
    error_axes.legend()
    figure.suptitle(f"Deep Speech 2: {history[-1]['elapsed_seconds'] / 60:.1f} min, "
                    f"final CER {100 * history[-1]['cer']:.1f}%")
    figure.tight_layout()
    figure.savefig(workdir / "learning_curve.png", dpi=100)
    plt.close(figure)


if __name__ == "__main__":  # python -m models.deepspeech.train [--config tiny] [--workdir DIR] ...
    import sys

    from models.deepspeech.main import main

    main(["train", *sys.argv[1:]])
