"""Training loop (Flax NNX + optax + orbax), laid out like Flax's examples:
`train_and_evaluate(config, workdir)` trains, evaluates the held-out NLL every epoch, saves a
checkpoint each `checkpoint_every_epochs` (resuming from the newest one it finds), and draws the
learning curve."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

from models.wavenet import input_pipeline, model
from models.wavenet.configs.default import Config, ModelConfig


def nll(logits, targets):
    """Mean negative log-likelihood in nats per sample."""
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets).mean()


def crop_nll(net: model.WaveNet, crops, context: int):
    """The NLL of each crop's last targets: the first `context` inputs (a receptive field less
    one) only give the rest their past. So every counted target sees a whole receptive field of
    real audio in every layer, as every sample after the first receptive field does in sampling;
    without the margin, a target near a crop's start would see zeros where the audio was."""
    return nll(net(crops[:, :-1])[:, context:], crops[:, context + 1:])


@functools.partial(nnx.jit, static_argnames="context")
def train_step(net: model.WaveNet, optimizer: nnx.Optimizer, crops, context: int):
    loss, grads = nnx.value_and_grad(crop_nll)(net, crops, context)
    optimizer.update(net, grads)
    return loss


eval_step = nnx.jit(crop_nll, static_argnames="context")


def held_out_nll(net: model.WaveNet, crops, batch_size: int, context: int) -> float:
    """crop_nll over all `crops`, evaluated `batch_size` crops at a time: the mean over every
    counted target, so a last batch with fewer crops weighs by its size."""
    batches = [crops[i: i + batch_size] for i in range(0, len(crops), batch_size)]
    return sum(float(eval_step(net, b, context)) * len(b) for b in batches) / len(crops)


def save_config(config: Config, workdir) -> None:
    (Path(workdir) / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=1))


def stored_config(workdir) -> Config | None:
    """The configuration a training run in `workdir` was started with, if one was. Fields this
    version does not know are dropped; fields it added take their defaults."""
    path = Path(workdir) / "config.json"
    if not path.exists():
        return None

    def known(cls, fields: dict) -> dict:
        return {f.name: fields[f.name] for f in dataclasses.fields(cls) if f.name in fields}

    fields = known(Config, json.loads(path.read_text()))
    return Config(**{**fields, "model": ModelConfig(**known(ModelConfig, fields["model"]))})


def create_model(config: Config):
    net = model.WaveNet(config.model, rngs=nnx.Rngs(config.seed))
    optimizer = nnx.Optimizer(net, optax.adam(config.learning_rate), wrt=nnx.Param)
    return net, optimizer


def training_state(net, optimizer) -> nnx.State:
    """What a checkpoint holds: the weights and the optimizer's moments and step count."""
    return nnx.State({"model": nnx.state(net), "optimizer": nnx.state(optimizer)})


def checkpoint_manager(workdir, read_only: bool = False) -> ocp.CheckpointManager:
    """Keeps the last two epochs; `read_only` (sampling) creates and deletes nothing, so that a
    mistyped work directory is not made."""
    options = (ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
               if read_only else ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
    return ocp.CheckpointManager(Path(workdir).resolve() / "checkpoints", options=options)


def restore(manager: ocp.CheckpointManager, net, optimizer) -> int:
    """Loads the newest checkpoint into `net` and `optimizer`; returns the epochs it had done."""
    epoch = manager.latest_step()
    if epoch is None:
        return 0
    state = training_state(net, optimizer)
    pure = nnx.to_pure_dict(state)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, pure)
    restored = manager.restore(epoch, args=ocp.args.StandardRestore(abstract))
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(net, state["model"])
    nnx.update(optimizer, state["optimizer"])
    return epoch


def load_weights(workdir, config: Config) -> dict:
    """The newest checkpoint's weights as the samplers' plain dictionary."""
    net, optimizer = create_model(config)
    with checkpoint_manager(workdir, read_only=True) as manager:
        restored = restore(manager, net, optimizer)
    if restored == 0:
        raise FileNotFoundError(f"no checkpoint under {Path(workdir) / 'checkpoints'}")
    return net.weights()


def plot_learning_curve(path, history: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(epochs, [h["train_nll"] for h in history], "o-", label="train")
    axis.plot(epochs, [h["test_nll"] for h in history], "s-", label="held-out voice")
    # (histories from before 2026-12-06 have none, and their test NLL counted synthetic clips)
    axis.plot(epochs, [h.get("test_synthetic_nll", np.nan) for h in history], "^-",
              label="held-out synthetic")
    axis.set_xlabel("epoch")
    axis.set_ylabel("NLL (nats / sample)")
    axis.set_title("WaveNet learning curve")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def train_and_evaluate(config: Config, workdir) -> list[dict]:
    """Trains `config.num_epochs` epochs (continuing from a checkpoint in `workdir` if there is
    one). Returns the per-epoch history, also written to `workdir/metrics.json`."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    manager = checkpoint_manager(workdir)
    stored = stored_config(workdir)
    if (manager.latest_step() is not None and stored is not None
            and (stored.model, stored.sample_rate) != (config.model, config.sample_rate)):
        raise ValueError(f"{workdir} holds a run of another model or sample rate "
                         f"({stored.model}, {stored.sample_rate} Hz); this configuration's is "
                         f"{config.model}, {config.sample_rate} Hz: train in a fresh work "
                         "directory")
    save_config(config, workdir)
    data = input_pipeline.load_dataset(config, workdir / "data")
    context = model.receptive_field(config.model) - 1
    eval_crops = {split: jnp.asarray(input_pipeline.evaluation_crops(
        data[split], config.eval_crops, config.crop_length, context))
        for split in ("test", "test_synthetic")}
    net, optimizer = create_model(config)
    first_epoch = restore(manager, net, optimizer)
    metrics_path = workdir / "metrics.json"
    history = json.loads(metrics_path.read_text())[:first_epoch] if first_epoch else []
    if first_epoch:
        print(f"resumed from the checkpoint of epoch {first_epoch}")
    print(f"receptive field {model.receptive_field(config.model)} samples; "
          f"{len(data['train'])} training samples at {config.sample_rate} Hz")
    for epoch in range(first_epoch + 1, config.num_epochs + 1):
        # One generator per epoch: a resumed run sees the same crops as an uninterrupted one.
        rng = np.random.default_rng([config.seed, epoch])
        losses = []
        bar = tqdm(range(config.steps_per_epoch), desc=f"epoch {epoch}/{config.num_epochs}",
                   leave=False)
        for _ in bar:
            crops = input_pipeline.random_crops(data["train"], config.batch_size,
                                                config.crop_length, rng, context)
            losses.append(float(train_step(net, optimizer, jnp.asarray(crops), context)))
            bar.set_postfix(nll=f"{losses[-1]:.3f}")
        test_nll, synthetic_nll = (held_out_nll(net, eval_crops[split], config.batch_size,
                                                context) for split in eval_crops)
        history.append({"epoch": epoch, "train_nll": float(np.mean(losses)),
                        "test_nll": test_nll, "test_synthetic_nll": synthetic_nll,
                        "step_losses": losses})
        print(f"epoch {epoch}: train NLL {history[-1]['train_nll']:.4f}, held-out voice NLL "
              f"{test_nll:.4f}, held-out synthetic NLL {synthetic_nll:.4f} nats/sample")
        # The history first, whole or not at all: a run stopped before the checkpoint resumes
        # from the previous one and cuts the history back to it, while a checkpoint without its
        # epoch's history would resume with that epoch missing.
        partial = metrics_path.with_suffix(".json.partial")
        partial.write_text(json.dumps(history))
        partial.replace(metrics_path)
        if epoch % config.checkpoint_every_epochs == 0 or epoch == config.num_epochs:
            manager.save(epoch, args=ocp.args.StandardSave(
                nnx.to_pure_dict(training_state(net, optimizer))))
            manager.wait_until_finished()
        plot_learning_curve(workdir / "learning_curve.png", history)
    manager.close()
    return history
