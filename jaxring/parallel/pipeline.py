"""Layer-sharded pipelines: contiguous groups of layers live on the devices of one mesh axis, and
activations travel from stage to stage with ``jaxring.ppermute`` (the low-latency path).

Inside ``jax.shard_map`` over the pipeline axis (n devices = n stages):

- :func:`stack_stages` turns a list of per-layer parameter pytrees into leaves of shape
  ``[n, layers_per_stage, ...]``; shard the leading axis with ``P(axis)`` and each device holds
  its own group of layers.
- :func:`scan_layers` makes a stage function out of a one-layer function.
- :func:`pipeline_step` runs one tick: every stage applies its layers to the activation it holds
  and hands the result to the next stage (``ring=True``: the last stage hands back to the
  first, for autoregressive loops whose output is the next step's input). Call it from
  ``lax.scan``; interleaving n independent streams (stream k enters at tick k) keeps every
  stage busy.
- :func:`pipeline_apply` runs a whole batch of microbatches through the pipeline (GPipe's
  schedule) and returns every output on every device. It is differentiable: the transpose of a
  ppermute is the inverse ppermute, so ``jax.grad`` runs the pipeline backwards.

Every stage hands on an activation of the same shape and dtype (a pytree is fine).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxring
from jaxring._src import common

PyTree = Any


def stack_stages(layers: Sequence[PyTree], num_stages: int) -> PyTree:
    """Stacks per-layer parameters into leaves of shape ``[num_stages, len(layers) // num_stages,
    ...]``: contiguous groups of layers, one group per stage, in order."""
    if num_stages < 1 or not layers or len(layers) % num_stages:
        raise ValueError(
            f"jaxring.parallel.pipeline: {len(layers)} layers cannot be split evenly over "
            f"{num_stages} stages; use a layer count divisible by the number of devices (at "
            "least one layer per stage)"
        )
    per_stage = len(layers) // num_stages
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *layers)
    return jax.tree.map(lambda leaf: leaf.reshape((num_stages, per_stage) + leaf.shape[1:]),
                        stacked)


def scan_layers(layer_fn: Callable[[PyTree, PyTree], PyTree]) -> Callable[[PyTree, PyTree], PyTree]:
    """``layer_fn(layer_params, x) -> x`` for one layer, applied to each layer of a stacked group
    in order: the stage function of a pipeline of identical layers."""

    def stage_fn(group_params, x):
        return lax.scan(lambda h, params: (layer_fn(params, h), None), x, group_params)[0]

    return stage_fn


def local_stage(stage_params: PyTree) -> PyTree:
    """This device's group of layers, from the ``[1, ...]`` block shard_map hands it."""

    def unblock(leaf):
        if leaf.shape[:1] != (1,):
            raise ValueError(
                "jaxring.parallel.pipeline: stage parameters must be sharded over the pipeline "
                f"axis with one stage per device (a leading block of 1), got shape {leaf.shape}"
            )
        return leaf[0]

    return jax.tree.map(unblock, stage_params)


def _hand_off(axis_name, n: int, ring: bool):
    """The axes to ppermute over and the pairs (stage s, stage s + 1), the stages numbered as
    lax.axis_index(axis_name) and shard_map's P(axis_name) number them: in a tuple's order. Over
    a tuple of mesh axes the hand-off goes over the same axes in the mesh's order, the pairs
    renumbered to match, since jax numbers that order alike in every version (before 0.11,
    lax.ppermute numbered any tuple's devices in the mesh's order; from 0.11 in the tuple's,
    refusing an order other than the mesh's by default)."""
    pairs = [(s, s + 1) for s in range(n - 1)] + ([(n - 1, 0)] if ring else [])
    order = common._mesh_axes()
    if not isinstance(axis_name, (tuple, list)) or not set(axis_name) <= set(order):
        return axis_name, pairs  # one axis, a process communicator, or an error to name
    shape = jax.sharding.get_abstract_mesh().shape
    axes = tuple(sorted(axis_name, key=order.index))

    def renumber(stage):
        coordinates = dict(zip(axis_name, np.unravel_index(stage, [shape[a] for a in axis_name])))
        return int(np.ravel_multi_index([coordinates[a] for a in axes], [shape[a] for a in axes]))

    return axes, [(renumber(a), renumber(b)) for a, b in pairs]


def pipeline_step(stage_fn, stage_params: PyTree, carry: PyTree, axis_name, *,
                  ring: bool = False) -> tuple[PyTree, PyTree]:
    """One tick of the pipeline on every stage at once.

    Returns ``(output, next_carry)``: `output` is what this stage computed from `carry` (the
    pipeline's result on the last stage), `next_carry` what it received from the stage before.
    The first stage receives zeros unless ``ring=True``.
    """
    n = common.communicator("pipeline", axis_name).size
    output = stage_fn(local_stage(stage_params), carry)
    return output, jaxring.ppermute(output, *_hand_off(axis_name, n, ring))


def pipeline_apply(stage_fn, stage_params: PyTree, microbatches: PyTree, axis_name) -> PyTree:
    """Runs microbatches (leaves ``[M, ...]``) through every stage in order (GPipe's schedule:
    M + n - 1 ticks) and returns the last stage's outputs ``[M, ...]`` on every device.

    Equal to applying the stages one after another on one device; ``jax.grad`` through it equals
    the unsharded gradient. (Over a process communicator each rank differentiates its own copy,
    as with every collective across processes, so the objective is the sum of the ranks'
    losses: ranks that each compute the whole loss from the output divide it by n, or let one
    rank's count.) A stage runs `stage_fn` only at the M ticks that bring it a
    microbatch (under ``lax.cond``): at the others it would run on zeros or on what the idle
    stages before it made of them, and a function that is not finite there (a normalisation
    without an epsilon, a log) would put NaN into the gradient, multiplied by zero as it is.
    """
    comm = common.communicator("pipeline", axis_name)
    n = comm.size
    stage = comm.rank_and_group()[0]  # a mesh axis index, or a process communicator's rank
    count = _microbatch_count(microbatches)
    if count == 0:
        return jax.tree.map(jnp.asarray, microbatches)

    def tick(carry, t):
        fresh = jax.tree.map(lambda mb: mb[jnp.minimum(t, count - 1)], microbatches)
        x = jax.tree.map(lambda f, c: jnp.where(stage == 0, f, c), fresh, carry)
        busy = (t >= stage) & (t < stage + count)  # microbatch t - stage is here
        def guarded(params, x):
            return lax.cond(busy, stage_fn, lambda _, x: x, params, x)

        output, carry = pipeline_step(guarded, stage_params, x, axis_name)
        return carry, output

    empty = jax.tree.map(lambda mb: common.make_varying(jnp.zeros_like(mb[0]), comm.axes),
                         microbatches)
    _, outputs = lax.scan(tick, empty, jnp.arange(count + n - 1))
    finished = jax.tree.map(lambda o: o[n - 1:], outputs)  # microbatch m leaves at tick m + n - 1
    return jaxring.broadcast(finished, axis_name, root=n - 1)


def _microbatch_count(microbatches: PyTree) -> int:
    """M, the leading size every leaf of `microbatches` shares; an error naming the leaves that
    differ (indexing them alike would clamp the shorter ones' indices and pair microbatches
    wrongly, without an error)."""
    leaves, _ = jax.tree.flatten_with_path(microbatches)
    if not leaves:
        raise ValueError("jaxring.parallel.pipeline: pipeline_apply got no microbatches (an empty "
                         "pytree); pass arrays with a leading microbatch axis")
    sizes = {}
    for path, leaf in leaves:
        shape = np.shape(leaf)
        if not shape:
            raise ValueError(
                f"jaxring.parallel.pipeline: microbatch leaf {jax.tree_util.keystr(path)!r} is a "
                "scalar; every leaf needs a leading microbatch axis [M, ...]")
        sizes.setdefault(shape[0], []).append(jax.tree_util.keystr(path) or "microbatches")
    if len(sizes) > 1:
        found = "; ".join(f"{m} in {', '.join(names)}" for m, names in sorted(sizes.items()))
        raise ValueError("jaxring.parallel.pipeline: microbatch leaves differ in their leading "
                         f"(microbatch) size: {found}")
    return next(iter(sizes))
