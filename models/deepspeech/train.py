"""Deep Speech 2 training, data-parallel over jaxring: `train_and_evaluate(config, workdir)`.

Every replica holds the full model and a slice of the global batch; batch-norm statistics are
summed across replicas in the forward pass, and gradients are averaged in fused buckets by the
jaxring.parallel.data distributed optimizer. Parameters are broadcast from replica 0 before the
first step. The replicas are either

* the devices of this process (`InProcess`): the step runs inside ``jax.shard_map`` over a 1-D
  mesh "data" (``--set num_devices=N``); or
* the processes of an ``mpiexec -n N`` job with N > 1 (`Processes`), one JAX device each: the same
  step runs in plain ``jax.jit`` with the communicator ``jaxring.mpi.world()`` as its axis, and
  each rank takes its slice of the global batch. Rank 0 writes the data cache, evaluates, shows
  progress and writes checkpoints; the others wait for it in a barrier that sleeps.
"""

from __future__ import annotations

import functools
import json
import os
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

import jaxring
from jaxring.parallel import data as data_parallel
from models.deepspeech import data, decoding
from models.deepspeech.configs import OPTIMIZERS, Config
from models.deepspeech.model import DeepSpeech2, ctc_loss_per_utterance

AXIS = "data"


def create_model(config: Config, seed: int) -> DeepSpeech2:
    return DeepSpeech2(
        feature_size=data.feature_size(config.sample_rate), num_classes=data.NUM_CLASSES,
        conv_channels=config.conv_channels, conv_kernels=config.conv_kernels,
        conv_strides=config.conv_strides, rnn_layers=config.rnn_layers,
        rnn_hidden=config.rnn_hidden, dense=config.dense, rngs=nnx.Rngs(seed))


# Gradient buckets (each a collective call of its own) past which a training program is refused:
# 1-byte buckets cut tiny's gradients into 28,593 calls, and the program took minutes to compile.
MAX_GRADIENT_CALLS = 4096


def check_trainable(config: Config) -> None:
    """Refuses, before any data is made, settings that would train nothing or fail only after
    minutes of data synthesis: an unknown optimizer, fewer training utterances than one batch
    (it trained nothing and wrote NaN losses), a negative beam_utterances, optimiser settings
    that train wrongly (`_check_optimisation`), or buckets so small that the gradients'
    collective calls could not be compiled in reasonable time."""
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {config.optimizer!r}")
    _check_optimisation(config)
    if config.beam_utterances < 0:
        raise ValueError(f"beam_utterances must be at least 0 (0: no beam search), got "
                         f"{config.beam_utterances}")
    if config.train_utterances < config.batch_size:
        raise ValueError(f"train_utterances ({config.train_utterances}) is below batch_size "
                         f"({config.batch_size}): an epoch takes only whole batches, so it would "
                         "train nothing")
    params = nnx.state(nnx.eval_shape(lambda: create_model(config, config.seed)), nnx.Param)
    plan = data_parallel.fusion_plan(params, config.bucket_bytes)
    calls = sum(len(sizes) for _, _, sizes in plan.groups) + len(plan.alone)
    if calls > MAX_GRADIENT_CALLS:
        raise ValueError(f"bucket_bytes {config.bucket_bytes} cuts the gradients into {calls} "
                         f"buckets, each a collective call of its own; more than "
                         f"{MAX_GRADIENT_CALLS} make a program that takes minutes to compile")


def _check_label_lengths(train_set: data.Dataset, max_label_length: int) -> None:
    """Refuses, before the first step, a training transcript longer than max_label_length: the
    batch that held it failed, and SortaGrad puts the longest last in the first epoch."""
    longest = max(range(len(train_set)), key=lambda i: len(train_set.labels[i]), default=None)
    if longest is not None and len(train_set.labels[longest]) > max_label_length:
        raise ValueError(f"max_label_length {max_label_length} is below the "
                         f"{len(train_set.labels[longest])} labels of training utterance "
                         f"{longest} ({train_set.transcripts[longest]!r}): raise it to at least "
                         f"{len(train_set.labels[longest])}")


def _check_optimisation(config: Config) -> None:
    """Settings optax takes without a word but trains wrongly with: a negative clip norm flips
    every gradient (training climbs the loss), a zero one or a zero rate never updates, a decay
    above 1 (1.2 for the paper's "annealed by 1.2") grows the rate every epoch, momentum of 1 or
    more diverges. A negative seed failed only after the data was made."""
    for key, bad, rule in (
            ("learning_rate", not config.learning_rate > 0, "above 0"),
            ("grad_clip_norm", not config.grad_clip_norm > 0, "above 0"),
            ("learning_rate_decay_per_epoch", not 0 < config.learning_rate_decay_per_epoch <= 1,
             "in (0, 1]: the factor the rate is multiplied by each epoch (1/1.2 anneals it "
             "by 1.2)"),
            ("momentum", not 0 <= config.momentum < 1, "in [0, 1)"),
            ("seed", config.seed < 0, "at least 0"),
            ("data_seed", config.data_seed < 0, "at least 0")):
        if bad:
            raise ValueError(f"{key} must be {rule}, got {getattr(config, key)}")


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
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {config.optimizer!r}")
    return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), inner)


def loss_and_batch_stats(params, batch_stats, graphdef, batch, axis_name):
    """Mean CTC loss over this replica's utterances, and the updated batch-norm statistics."""
    model = nnx.merge(graphdef, params, batch_stats, copy=True)
    logits, logit_mask = model(batch["features"], batch["feature_mask"], train=True,
                               axis_name=axis_name)
    losses = ctc_loss_per_utterance(logits, logit_mask, batch["labels"], batch["label_mask"])
    return losses.mean(), nnx.state(model, nnx.BatchStat)


# ---- where the replicas live ----------------------------------------------------------------
#
# Both kinds answer the same questions: the axis that collectives take, how many replicas there
# are, whether this process is the main one, how to place a batch and a replicated state, how to
# compile a per-replica function, and a barrier.


class InProcess:
    """Replicas on the devices of one mesh axis "data" of this process; functions run inside
    ``jax.shard_map`` with check_vma=False: the gradient of a replicated parameter stays per
    replica (no implicit psum is inserted), so the distributed optimizer averages it with
    jaxring."""

    is_main = True

    def __init__(self, mesh: Mesh):
        self.mesh, self.axis, self.size = mesh, AXIS, mesh.size
        self._batch_sharding = NamedSharding(mesh, P(AXIS))
        self._replicated = NamedSharding(mesh, P())

    def place_batch(self, batch: data.Batch) -> dict:
        return {name: jax.device_put(array, self._batch_sharding)
                for name, array in _batch_arrays(batch).items()}

    def place_state(self, tree):
        return jax.device_put(tree, self._replicated)

    def compile(self, fn, num_args: int, batched=(), donate_argnums=()):
        """`fn` on every replica, jitted: arguments at `batched` are split over the replicas along
        their first axis, the others and every output are replicated."""
        in_specs = tuple(P(AXIS) if i in batched else P() for i in range(num_args))
        return jax.jit(jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=P(),
                                     check_vma=False), donate_argnums=donate_argnums)

    def barrier(self):
        pass


class Processes:
    """One replica per process of a jaxring.mpi communicator, on this process's first device.
    Each process differentiates its own copy of the parameters, and the transpose of all_reduce
    sums cotangents: the convention of `InProcess`, so the same step serves both."""

    def __init__(self, comm):
        self.comm, self.axis, self.size = comm, comm, comm.size
        self.is_main = comm.rank == 0
        self.device = jax.local_devices()[0]

    def place_batch(self, batch: data.Batch) -> dict:
        """This rank's contiguous rows of the global batch (the rows replica `rank` of `InProcess`
        gets), so N processes and N devices train on the same split."""
        rows = batch.features.shape[0] // self.size
        mine = slice(self.comm.rank * rows, (self.comm.rank + 1) * rows)
        return {name: jax.device_put(array[mine], self.device)
                for name, array in _batch_arrays(batch).items()}

    def place_state(self, tree):
        return jax.device_put(tree, self.device)

    def compile(self, fn, num_args: int, batched=(), donate_argnums=()):
        del num_args, batched  # each process already holds only its own rows
        return jax.jit(fn, donate_argnums=donate_argnums)

    def barrier(self, max_sleep: float = 0.05):
        """Every rank waits here for every other. MPI's blocking barrier polls at full speed,
        which would take a core from rank 0 while it writes the data cache or evaluates; this
        one tests a non-blocking barrier and sleeps in between, and never times out."""
        request, sleep = self.comm.mpi_comm.Ibarrier(), 1e-4
        while not request.Test():
            time.sleep(sleep)
            sleep = min(2 * sleep, max_sleep)


def _batch_arrays(batch: data.Batch) -> dict:
    return {name: getattr(batch, name)
            for name in ("features", "feature_mask", "labels", "label_mask")}


@functools.cache
def in_process(devices: tuple) -> InProcess:
    return InProcess(Mesh(np.array(devices), (AXIS,)))


@functools.cache
def processes(comm) -> Processes:
    return Processes(comm)


# Set by MPI launchers (MPICH/Intel MPI/Slurm PMI, PMIx, Open MPI, MVAPICH) in every rank.
MPI_LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
                          "MV2_COMM_WORLD_SIZE")


@functools.cache
def launched_processes() -> int:
    """The number of processes in this MPI job; 1 when not launched by an MPI launcher. mpi4py
    (which starts MPI) is imported only when a launcher's variable is set."""
    if not any(name in os.environ for name in MPI_LAUNCHER_VARIABLES):
        return 1
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


def replicas_for(config: Config) -> InProcess | Processes:
    """The processes of the MPI job when there are several (`config.num_devices` is then
    ignored), else `config.num_devices` devices of this process."""
    if launched_processes() > 1:
        import jaxring.mpi

        return processes(jaxring.mpi.world())
    devices = jax.devices()[:config.num_devices]
    if len(devices) < config.num_devices:
        platform = jax.default_backend()
        more = ("set XLA_FLAGS=--xla_force_host_platform_device_count=N" if platform == "cpu"
                else f"set num_devices={len(devices)} (--set num_devices={len(devices)}), or "
                     "train on CPU devices: JAX_PLATFORMS=cpu XLA_FLAGS="
                     f"--xla_force_host_platform_device_count={config.num_devices}")
        raise ValueError(f"num_devices={config.num_devices} but only {len(devices)} {platform} "
                         f"devices; {more}")
    return in_process(tuple(devices))


def _as_replicas(replicas) -> InProcess | Processes:
    return InProcess(replicas) if isinstance(replicas, Mesh) else replicas


# ---- the step --------------------------------------------------------------------------------


def make_train_step(graphdef, optimizer: optax.GradientTransformation, replicas,
                    gradient_sync=None):
    """A jitted step (params, batch_stats, opt_state, batch) -> (same, loss), data-parallel over
    `replicas` (`InProcess`, `Processes`, or a mesh with the axis "data"). `optimizer` must reduce
    gradients itself (data_parallel.distributed) unless `gradient_sync` does it, e.g.
    ``lambda g: lax.pmean(g, "data")`` (the benchmark's rival) or ``lambda g: g`` (to time a step
    without synchronisation)."""
    replicas = _as_replicas(replicas)

    def local_step(params, batch_stats, opt_state, batch):
        (loss, batch_stats), grads = jax.value_and_grad(loss_and_batch_stats, has_aux=True)(
            params, batch_stats, graphdef, batch, replicas.axis)
        if gradient_sync is not None:
            grads = gradient_sync(grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, batch_stats, opt_state, jaxring.all_reduce(loss, replicas.axis, "mean")

    return replicas.compile(local_step, 4, batched=(3,), donate_argnums=(0, 1, 2))


def make_broadcast(replicas, bucket_bytes: int):
    """Replica 0's parameters to every replica (the start of Horovod-style training)."""
    replicas = _as_replicas(replicas)
    return replicas.compile(
        lambda tree: data_parallel.broadcast_parameters(tree, replicas.axis, 0, bucket_bytes), 1)


@functools.partial(jax.jit, static_argnums=0)
def _log_probs(graphdef, params, batch_stats, features, feature_mask):
    model = nnx.merge(graphdef, params, batch_stats)
    logits, mask = model(features, feature_mask, train=False)
    return jax.nn.log_softmax(logits), mask


def _batch_sharding(params, batch_size: int) -> NamedSharding | None:
    """Where an evaluation batch goes: split over the mesh the parameters are replicated on,
    so that each device evaluates its share (with the batch on one device, every device of the
    mesh evaluated all of it); None (the default device) for parameters on one device, or a
    batch the mesh does not divide."""
    sharding = getattr(jax.tree.leaves(params)[0], "sharding", None)
    if (isinstance(sharding, NamedSharding) and sharding.mesh.size > 1
            and batch_size % sharding.mesh.size == 0):
        return NamedSharding(sharding.mesh, P(sharding.mesh.axis_names))
    return None


def predict_log_probs(graphdef, params, batch_stats, features, feature_mask):
    """Per-frame log probabilities (batch, frames, classes) and the frame mask, the batch split
    over the devices that hold the parameters."""
    sharding = _batch_sharding(params, len(features))
    features, feature_mask = ((jax.device_put(features, sharding),
                               jax.device_put(feature_mask, sharding)) if sharding is not None
                              else (jnp.asarray(features), jnp.asarray(feature_mask)))
    log_probs, mask = _log_probs(graphdef, params, batch_stats, features, feature_mask)
    return np.asarray(log_probs), np.asarray(mask)


def evaluate(graphdef, params, batch_stats, dataset, config: Config, beam: bool = False,
             seen: frozenset = frozenset()):
    """Greedy CER and WER over `dataset`, and over its utterances whose transcript is not in
    `seen` (the training transcripts: cer_unseen, wer_unseen, unseen_utterances; the test split's
    voices are new, but a short transcript from the small grammar often is not); with `beam`,
    prefix-beam search's on the first `beam_utterances` (the shortest: batches run in order of
    length), and greedy decoding's on the same utterances, to compare the two (beam_greedy_cer,
    beam_greedy_wer)."""
    greedy, unseen, beam_rates, beam_greedy = (decoding.ErrorRates(), decoding.ErrorRates(),
                                               decoding.ErrorRates(), decoding.ErrorRates())
    unseen_utterances = beamed = 0
    beam_left = config.beam_utterances if beam else 0
    for batch in data.eval_batches(dataset, config.batch_size, config.frame_multiple):
        log_probs, mask = predict_log_probs(graphdef, params, batch_stats, batch.features,
                                            batch.feature_mask)
        real = [i for i, t in enumerate(batch.transcripts) if t]
        references = [batch.transcripts[i] for i in real]
        hypotheses = decoding.greedy_decode(log_probs[real], mask[real])
        greedy.update(references, hypotheses)
        new = [k for k, reference in enumerate(references) if reference not in seen]
        unseen.update([references[k] for k in new], [hypotheses[k] for k in new])
        unseen_utterances += len(new)
        if beam_left > 0:
            take = real[:beam_left]
            beam_rates.update([batch.transcripts[i] for i in take],
                              decoding.beam_decode(log_probs[take], mask[take], config.beam_width))
            beam_greedy.update([batch.transcripts[i] for i in take], hypotheses[:len(take)])
            beam_left -= len(take)
            beamed += len(take)
    metrics = {"cer": greedy.cer, "wer": greedy.wer, "unseen_utterances": unseen_utterances,
               "cer_unseen": unseen.cer if unseen_utterances else None,
               "wer_unseen": unseen.wer if unseen_utterances else None}
    if beam:  # None where no utterance was beam-decoded (beam_utterances=0), as cer_unseen
        metrics |= {"beam_cer": beam_rates.cer if beamed else None,
                    "beam_wer": beam_rates.wer if beamed else None,
                    "beam_greedy_cer": beam_greedy.cer if beamed else None,
                    "beam_greedy_wer": beam_greedy.wer if beamed else None}
    return metrics


# Fields a run cannot change when it resumes from a checkpoint: they shape the parameters, the
# optimizer's state or the features.
_SHAPING_FIELDS = ("sample_rate", "conv_channels", "conv_kernels", "conv_strides", "rnn_layers",
                   "rnn_hidden", "dense", "optimizer")


# Fields that set the steps of an epoch, which the learning rate's schedule counts: a run resumed
# with others decays it at other steps than once an epoch.
_SCHEDULE_FIELDS = ("batch_size", "train_utterances")


def _check_resumable(config: Config, workdir: Path) -> None:
    """Refuses to resume the checkpoint in `workdir` with a config that shapes the model or its
    optimizer differently (the restore failed deep in orbax, after config.json had been
    overwritten with the new config, so every later command on the directory failed too), or
    whose epochs have another number of steps (the learning rate decayed mid-epoch)."""
    path = workdir / "config.json"
    if not path.exists():
        return
    stored = json.loads(path.read_text())
    ours = json.loads(config.to_json())
    shaping, schedule = ("; ".join(f"{key}: {stored[key]} there, {ours[key]} here"
                                   for key in fields if key in stored and stored[key] != ours[key])
                         for fields in (_SHAPING_FIELDS, _SCHEDULE_FIELDS))
    if shaping:
        raise ValueError(f"{workdir} holds a checkpoint of another model ({shaping}): resume it "
                         "with its own settings, or train in a fresh work directory")
    if schedule:
        raise ValueError(f"{workdir} holds a checkpoint trained with epochs of another number of "
                         f"steps ({schedule}), which the learning rate's schedule counts to decay "
                         "it once an epoch: resume it with its own settings, or train in a fresh "
                         "work directory")


def _check_steps(history: list[dict], steps_per_epoch: int, workdir: Path, utterances: int,
                 unalignable: int, config: Config) -> None:
    """Refuses to resume a checkpoint whose epochs took another number of steps than this run's
    (the config is the same, but not the utterances it trains on: a data cache made anew, or a
    change in which utterances are left out for CTC), since the learning rate's schedule counts
    steps to decay once an epoch. A history from before epochs recorded their steps is taken
    as it is."""
    stored = history[-1].get("steps", steps_per_epoch) if history else steps_per_epoch
    if stored != steps_per_epoch:
        raise ValueError(
            f"{workdir} holds a checkpoint whose epochs took {stored} steps, but this run's take "
            f"{steps_per_epoch} ({utterances} training utterances after {unalignable} left out "
            f"for CTC, in batches of {config.batch_size}), and the learning rate's "
            "schedule counts steps to decay once an epoch: resume it with the data it was "
            "trained on, or train in a fresh work directory")


def checkpoint_manager(workdir: Path, read_only: bool = False) -> ocp.CheckpointManager:
    """Keeps the last two epochs. `read_only` (the non-main ranks under mpiexec): restores only,
    creates and deletes nothing."""
    options = (ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
               if read_only else ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
    return ocp.CheckpointManager((workdir / "checkpoints").absolute(), options=options)


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


@functools.cache
def _training_functions(config: Config, steps_per_epoch: int, replicas):
    """The model's structure and initial state, the optimizer, and the jitted step and broadcast:
    cached, so that training again in this process (a resumed run, a test) does not recompile.
    `config` comes with epochs=0: the number of epochs changes none of these."""
    graphdef, params, batch_stats = nnx.split(create_model(config, config.seed), nnx.Param,
                                              nnx.BatchStat)
    optimizer = data_parallel.distributed(create_optimizer(config, steps_per_epoch),
                                          replicas.axis, bucket_bytes=config.bucket_bytes)
    return (graphdef, params, batch_stats, optimizer,
            make_train_step(graphdef, optimizer, replicas),
            make_broadcast(replicas, config.bucket_bytes))


def train_and_evaluate(config: Config, workdir: str | Path, cache_dir: str | Path | None = None,
                       progress: bool = True) -> list[dict]:
    """Trains `config` and evaluates on held-out voices after every epoch. Resumes from the
    latest checkpoint in `workdir`. Returns the history: one dict of metrics per epoch (under
    mpiexec, only rank 0's records have the evaluation metrics)."""
    return train(config, workdir, cache_dir, progress)[0]


def train(config: Config, workdir: str | Path, cache_dir: str | Path | None = None,
          progress: bool = True) -> tuple[list[dict], dict]:
    """`train_and_evaluate`, which also returns this process's final state (params,
    batch_stats, opt_state). Under ``mpiexec -n N`` (N > 1) every rank calls it; see
    `replicas_for`. With no `cache_dir`, every rank synthesises the data itself."""
    check_trainable(config)
    replicas = replicas_for(config)
    if config.batch_size % replicas.size:
        raise ValueError(f"batch_size {config.batch_size} is not divisible by the {replicas.size} "
                         "replicas")
    workdir = Path(workdir)
    if replicas.is_main:
        workdir.mkdir(parents=True, exist_ok=True)
        manager = checkpoint_manager(workdir)
        if manager.latest_step() is not None:
            _check_resumable(config, workdir)
        (workdir / "config.json").write_text(config.to_json())
        train_set = data.load("train", config.train_utterances, config.data_seed,
                              config.sample_rate, cache_dir)
        test_set = data.load("test", config.test_utterances, config.data_seed,
                             config.sample_rate, cache_dir)
    replicas.barrier()  # the others read the cache (and checkpoints) that the main one wrote
    if not replicas.is_main:
        manager = checkpoint_manager(workdir, read_only=True)
        train_set = data.load("train", config.train_utterances, config.data_seed,
                              config.sample_rate, cache_dir)

    train_set, unalignable = train_set.alignable([stride[0] for stride in config.conv_strides])
    if unalignable:
        warnings.warn(f"{unalignable} training utterances are left out: conv_strides "
                      f"{list(config.conv_strides)} leave them fewer frames than CTC needs for "
                      "their transcripts")
    _check_label_lengths(train_set, config.max_label_length)
    seen = frozenset(train_set.transcripts)  # evaluation also scores the test's other sentences
    steps_per_epoch = len(train_set) // config.batch_size
    if steps_per_epoch == 0:  # all but a few left out for CTC (check_trainable counted them all)
        raise ValueError(f"the {len(train_set)} training utterances left ({unalignable} left out "
                         f"for CTC) make no whole batch of {config.batch_size}")
    graphdef, params, batch_stats, optimizer, train_step, broadcast = _training_functions(
        config.replace(epochs=0), steps_per_epoch, replicas)
    state = {"params": params, "batch_stats": batch_stats, "opt_state": optimizer.init(params)}
    # Copies: the step donates its inputs, and the cached initial state must survive.
    state = jax.tree.map(jnp.copy, replicas.place_state(state))

    history, first_epoch = [], 0
    restored = restore_checkpoint(manager, state)  # every replica reads the same checkpoint
    if restored is not None:
        last_epoch, state, history = restored
        _check_steps(history, steps_per_epoch, workdir, len(train_set), unalignable, config)
        state = replicas.place_state(state)
        first_epoch = last_epoch + 1
        if replicas.is_main and progress:
            print(f"resumed from the checkpoint of epoch {first_epoch}", flush=True)
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
                   unit="step", disable=not (progress and replicas.is_main), leave=False)
        params, batch_stats, opt_state = state["params"], state["batch_stats"], state["opt_state"]
        for batch in bar:
            params, batch_stats, opt_state, loss = train_step(
                params, batch_stats, opt_state, replicas.place_batch(batch))
            losses.append(loss)
            utterances += config.batch_size
            if len(losses) % 10 == 0 and not bar.disable:
                bar.set_postfix(loss=f"{float(loss):.3f}",
                                utt_per_s=f"{utterances / (time.perf_counter() - start):.0f}")
        state = {"params": params, "batch_stats": batch_stats, "opt_state": opt_state}
        train_loss = float(np.mean([float(x) for x in losses]))
        train_seconds = time.perf_counter() - start
        is_last = epoch == config.epochs - 1
        metrics = (evaluate(graphdef, params, batch_stats, test_set, config, beam=is_last,
                            seen=seen) if replicas.is_main else {})
        if replicas.is_main:
            metrics["eval_seconds"] = time.perf_counter() - start - train_seconds
        elapsed += time.perf_counter() - start
        history.append({"epoch": epoch + 1, "train_loss": train_loss, "steps": len(losses),
                        "utterances_per_second": utterances / train_seconds,
                        "elapsed_seconds": elapsed, **metrics})
        if replicas.is_main:
            print(json.dumps(history[-1]), flush=True)
            save_checkpoint(manager, epoch, state, history)
        # The others sleep while the main one evaluates: a jaxring collective would wait for it
        # too, but gives up after jaxring's timeout, which a long evaluation could outlast.
        replicas.barrier()
    manager.close()
    if replicas.is_main:
        write_learning_curve(history, workdir)
    replicas.barrier()  # every rank leaves together, none spinning in MPI_Finalize meanwhile
    return history, state


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
    if all(h.get("cer_unseen") is not None for h in history):
        error_axes.plot(epochs, [100 * h["cer_unseen"] for h in history], marker="o",
                        linestyle="--", label="CER, sentences unseen in training")
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
