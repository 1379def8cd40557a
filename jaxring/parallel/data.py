"""Data parallelism on jaxring: fused gradient buckets, parameter broadcast, cross-replica
batch-norm statistics, and a distributed optax optimizer.

Each jaxring collective call has a fixed cost, so reducing a model's gradients leaf by leaf pays
it once per parameter tensor. As Horovod's tensor fusion does, small leaves are packed into a few
flat buckets of at most `bucket_bytes` each and every bucket is reduced with one
`jaxring.all_reduce`. Packing and unpacking copy each packed leaf twice, which costs more than a
call for a large leaf, so leaves of `fuse_below_bytes` or more are reduced on their own.

Every function takes `axis_name`: whatever jaxring's collectives accept (a mesh axis name inside
``jax.shard_map``, or a ``jaxring.mpi.Communicator``), so the same training step runs in one process over N
devices or over N processes.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core

import jaxring
from jaxring._src import common

if TYPE_CHECKING:
    import optax  # only `distributed` needs it, so jaxring does not depend on it

DEFAULT_BUCKET_BYTES = 64 << 20  # Horovod's default fusion threshold (HOROVOD_FUSION_THRESHOLD)
# Leaves of at least this many bytes are not packed. Two copies of 256 KiB (packing and unpacking)
# cost about what one collective costs inside a program on CPU devices (10-50 us); in
# benchmarks/training.py one all-reduce per leaf beat packing all 17 leaves by 7-26%.
DEFAULT_FUSE_BELOW_BYTES = 256 << 10


# ---- fusion ------------------------------------------------------------------------------------


class FusionPlan(NamedTuple):
    """How leaves of one pytree structure are packed into flat buckets, one list per dtype, and
    which leaves travel on their own."""

    treedef: object
    shapes: tuple
    dtypes: tuple
    groups: tuple  # ((dtype, leaf indices, bucket sizes in elements), ...)
    alone: tuple = ()  # indices of the leaves reduced on their own, unpacked
    empty: tuple = ()  # indices of the leaves with no elements: nothing to move


def _check_sizes(bucket_bytes: int, fuse_below_bytes: int | None) -> None:
    """A float or a bool passed here failed later in numpy's split ("'float' object cannot be
    interpreted as an integer"), or was taken as 1 byte."""
    for name, value, none in (("bucket_bytes", bucket_bytes, ""),
                              ("fuse_below_bytes", fuse_below_bytes, " or None")):
        if value is None and none:
            continue
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int{none}, got {value!r}")


def _varying(leaf) -> frozenset:
    """The mesh axes a leaf varies over inside jax.shard_map (none outside a trace)."""
    return common.varying_axes(leaf.aval) if isinstance(leaf, core.Tracer) else frozenset()


def fusion_plan(tree, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                fuse_below_bytes: int | None = DEFAULT_FUSE_BELOW_BYTES) -> FusionPlan:
    """Leaves of the same dtype, varying over the same mesh axes, under `fuse_below_bytes`
    (None: every leaf) are concatenated in tree order and the result cut into buckets of at most
    `bucket_bytes` (a leaf may straddle two buckets); larger leaves go alone, and leaves with no
    elements nowhere (unfuse makes them anew). Only shapes, dtypes and the trace's types are
    used, so every rank makes the same plan. (A leaf packed with leaves that vary over more axes
    would come back varying over those too, unlike the leaf reduced on its own.)"""
    _check_sizes(bucket_bytes, fuse_below_bytes)
    leaves, treedef = jax.tree.flatten(tree)
    shapes = tuple(tuple(np.shape(leaf)) for leaf in leaves)
    dtypes = tuple(jnp.result_type(leaf) for leaf in leaves)
    kinds = tuple((dtype, _varying(leaf)) for dtype, leaf in zip(dtypes, leaves))
    alone = tuple(i for i in range(len(leaves)) if fuse_below_bytes is not None
                  and math.prod(shapes[i]) * np.dtype(dtypes[i]).itemsize >= fuse_below_bytes)
    # Nothing to move: no elements, or float0 (the gradients of integer inputs under
    # jax.grad(allow_int=True), whose itemsize 0 divided bucket_bytes by zero).
    empty = tuple(i for i in range(len(leaves))
                  if math.prod(shapes[i]) == 0 or dtypes[i] == jax.dtypes.float0)
    packed = sorted(set(range(len(leaves))) - set(alone) - set(empty))
    groups = []
    for kind in dict.fromkeys(kinds[i] for i in packed):  # first-appearance order, on every rank
        dtype = kind[0]
        indices = tuple(i for i in packed if kinds[i] == kind)
        total = sum(math.prod(shapes[i]) for i in indices)
        per_bucket = max(1, bucket_bytes // np.dtype(dtype).itemsize)
        groups.append((dtype, indices, tuple(min(per_bucket, total - start)
                                             for start in range(0, total, per_bucket))))
    return FusionPlan(treedef, shapes, dtypes, tuple(groups), alone, empty)


def fuse(tree, plan: FusionPlan) -> list:
    """The flat buckets of `tree`, dtype group after dtype group (the leaves that go alone are
    not in them)."""
    leaves = jax.tree.leaves(tree)
    buckets = []
    for dtype, indices, sizes in plan.groups:
        flat = jnp.concatenate([jnp.ravel(leaves[i]).astype(dtype) for i in indices])
        buckets.extend(jnp.split(flat, np.cumsum(sizes)[:-1]))
    return buckets


def unfuse(buckets, plan: FusionPlan, alone=(), empty=None):
    """The inverse of `fuse`: a pytree of the original structure, shapes and dtypes, with the
    leaves that went alone (`alone`, in plan.alone's order) put back in their places and the
    empty ones made anew (or taken from `empty`, in plan.empty's order)."""
    if len(alone) != len(plan.alone) or len(buckets) != sum(len(s) for _, _, s in plan.groups):
        raise ValueError(f"unfuse: the plan has {sum(len(s) for _, _, s in plan.groups)} buckets "
                         f"and {len(plan.alone)} leaves alone, got {len(buckets)} and "
                         f"{len(alone)}")
    leaves = [None] * len(plan.shapes)
    for i, leaf in zip(plan.alone, alone):
        leaves[i] = leaf
    for k, i in enumerate(plan.empty):
        leaves[i] = _made_anew(plan.shapes[i], plan.dtypes[i]) if empty is None else empty[k]
    position = 0
    for _, indices, sizes in plan.groups:
        flat = jnp.concatenate(buckets[position:position + len(sizes)])
        position += len(sizes)
        offsets = np.cumsum([math.prod(plan.shapes[i]) for i in indices])[:-1]
        for i, piece in zip(indices, jnp.split(flat, offsets)):
            leaves[i] = piece.reshape(plan.shapes[i])
    return jax.tree.unflatten(plan.treedef, leaves)


def _apply_fused(name, collective, tree, bucket_bytes, fuse_below_bytes, axis_name):
    _check_sizes(bucket_bytes, fuse_below_bytes)
    if not jax.tree.leaves(tree):
        return tree
    # float0 leaves hold no values, and no collective takes them: they come back as they are.
    # Empty ones go to the collective on their own, which moves nothing on a mesh axis and gives
    # them its result's type (an integer mean's float, the varying axes left).
    def own(leaf):
        return leaf if jnp.result_type(leaf) == jax.dtypes.float0 else collective(leaf)

    if common.communicator(name, axis_name).size == 1:
        return jax.tree.map(own, tree)  # one replica: nothing moves, so nothing to fuse
    plan = fusion_plan(tree, bucket_bytes, fuse_below_bytes)
    leaves = jax.tree.leaves(tree)
    alone = [collective(leaves[i]) for i in plan.alone]
    empty = [own(leaves[i]) for i in plan.empty]
    return unfuse([collective(bucket) for bucket in fuse(tree, plan)], plan, alone, empty)


def _made_anew(shape, dtype):
    """A leaf with no values: zeros, or float0's (which jnp.zeros does not make)."""
    return np.zeros(shape, dtype) if dtype == jax.dtypes.float0 else jnp.zeros(shape, dtype)


# ---- collectives on whole models -----------------------------------------------------------------


def all_reduce_gradients(grads, axis_name, op: str = "mean",
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                         fuse_below_bytes: int | None = DEFAULT_FUSE_BELOW_BYTES):
    """Reduces a pytree of gradients over `axis_name`: leaves under `fuse_below_bytes` in fused
    buckets (one `jaxring.all_reduce` per bucket instead of one per leaf), larger leaves on their
    own. Equal to ``jaxring.all_reduce(grads, axis_name, op)`` (whose `op` defaults to "sum";
    this one's to "mean", Horovod's), which refuses a sum or mean of a
    leaf that varies over some of the axes but not all (packed into a bucket with others, it
    would pass unseen), but for one refusal more: inside ``jax.shard_map`` the gradients must
    be each replica's own, so run it with ``check_vma=False``, under which JAX leaves the
    gradients of replicated parameters per replica. With vma checking JAX reduces them itself,
    and a sum or mean of a leaf that comes back invariant over the axes (of more than one
    device) is refused."""
    common.check_op("all_reduce_gradients", op)
    _check_sizes(bucket_bytes, fuse_below_bytes)
    leaves = jax.tree.leaves(grads)
    if leaves:
        comm = common.communicator("all_reduce_gradients", axis_name)
        for leaf in leaves:
            _refuse_reduced_by_jax(leaf, comm, op)
            common.refuse_partly_varying("all_reduce_gradients", leaf, comm, op)
    return _apply_fused("all_reduce_gradients", lambda b: jaxring.all_reduce(b, axis_name, op),
                        grads, bucket_bytes, fuse_below_bytes, axis_name)


def _refuse_reduced_by_jax(leaf, comm, op: str) -> None:
    """Under shard_map's vma checking (check_vma=True, its default) a parameter replicated over
    the mesh axes is cast to varying where it meets the batch, and that cast's transpose sums its
    gradient over the axes: the gradient comes back invariant, already reduced over the replicas
    by JAX itself (lax.psum), so a sum or mean of it moves nothing, and a "mean" of that sum
    gave replicas N times the global gradient (a review's repro, N-fold SGD updates; lax.pmean
    gives the same). Over one device there is nothing to reduce, and max and min of equal
    copies are those copies, as lax.pmax has them."""
    if (op in ("sum", "mean") and comm.axes and comm.size > 1 and common.vma_checking()
            and isinstance(leaf, core.Tracer) and not _varying(leaf) & set(comm.axes)):
        raise ValueError(
            f"jaxring.all_reduce_gradients: a gradient leaf ({core.typeof(leaf).str_short()}) "
            f"is invariant over {comm.axes!r}: under jax.shard_map's check_vma=True (its "
            f"default), JAX has already reduced the gradients of parameters replicated over "
            f"those axes in the backward pass, with lax.psum, so there is nothing left for "
            f"jaxring to reduce (a {op} of a sum over the replicas would be wrong by their "
            f"number unless the loss itself was a mean over them). Run the shard_map with "
            f"check_vma=False, so that each replica's own gradients reach jaxring, or make the "
            f"parameters varying before differentiating (jax.lax.pcast(p, {comm.axes!r}, "
            f"to='varying'))")


def broadcast_parameters(params, axis_name, root: int = 0,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                         fuse_below_bytes: int | None = DEFAULT_FUSE_BELOW_BYTES):
    """Every replica gets replica `root`'s copy of `params` (Horovod's broadcast_parameters), so
    replicas start identical however they were initialised."""
    return _apply_fused("broadcast_parameters", lambda b: jaxring.broadcast(b, axis_name, root),
                        params, bucket_bytes, fuse_below_bytes, axis_name)


def masked_moments(x, mask, axis_name=None, use_fast_variance: bool = True):
    """Mean and (biased) variance over every axis of `x` but the last, counting only elements
    where `mask` (broadcastable to `x`) is 1, over all replicas of `axis_name` (None: this
    device only), as one device holding the global batch would compute them. A mask shaped like
    `x` masks each feature on its own. 16-bit inputs are summed in float32 (counts past 256 are
    not exact in bfloat16); the statistics come back in the dtype of `x`.

    `use_fast_variance` (as flax's BatchNorm has it, and with its default): sums, sums of
    squares and counts travel in one all-reduce, and the variance is E[x^2] - E[x]^2, which
    loses precision to cancellation where the mean is large against the spread (in float32,
    inputs 10000 + N(0, 1) gave variances from 0 to 30). False: the global mean first, then the
    squared deviations from it, in a second all-reduce (two passes, as numpy's var)."""
    if x.ndim == 0 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"masked_moments takes a floating-point x with a feature axis (its "
                        f"last), got {x.dtype}{list(x.shape)}")
    acc = jnp.promote_types(x.dtype, jnp.float32)
    mask = jnp.broadcast_to(mask, x.shape).astype(acc)
    # Masked-out elements are left out, not multiplied by 0: a NaN or an infinity there made
    # every statistic NaN.
    xs = jnp.where(mask > 0, x.astype(acc), 0)
    axes = tuple(range(x.ndim - 1))

    def total(parts):  # per-feature sums over this device's elements, then over the replicas
        sums = jnp.concatenate([jnp.sum(part, axes) for part in parts])
        sums = sums if axis_name is None else jaxring.all_reduce(sums, axis_name, "sum")
        return jnp.split(sums, len(parts))

    if use_fast_variance:
        sums, squares, count = total([xs * mask, xs * xs * mask, mask])
        count = jnp.maximum(count, 1.0)
        mean = sums / count
        var = jnp.maximum(squares / count - mean * mean, 0.0)
    else:
        sums, count = total([xs * mask, mask])
        count = jnp.maximum(count, 1.0)
        mean = sums / count
        (squares,) = total([jnp.square(xs - mean) * mask])
        var = squares / count
    return mean.astype(x.dtype), var.astype(x.dtype)


# ---- optimizer ---------------------------------------------------------------------------------


def distributed(optimizer: optax.GradientTransformation, axis_name, op: str = "mean",
                bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                fuse_below_bytes: int | None = DEFAULT_FUSE_BELOW_BYTES
                ) -> optax.GradientTransformation:
    """Wraps any optax optimizer so that its updates see gradients reduced over all replicas,
    in fused buckets (leaves of `fuse_below_bytes` or more on their own): Horovod's
    DistributedOptimizer, made functional.

    Call `update` inside the data-parallel region (e.g. ``jax.shard_map`` with
    ``check_vma=False``, see `all_reduce_gradients`) with each replica's local gradients; the
    reduction happens before the inner optimizer, so clipping by global
    norm, momentum and Adam's moments all see the global gradient, and every replica computes
    the same update.
    """

    try:
        import optax
    except ImportError as error:
        raise ImportError("jaxring.parallel.data.distributed wraps an optax optimizer: install "
                          "optax (pip install optax, or jaxring[models])") from error
    common.check_op("distributed", op)
    _check_sizes(bucket_bytes, fuse_below_bytes)
    inner = optax.with_extra_args_support(optimizer)

    def update(updates, state, params=None, **extra_args):
        updates = all_reduce_gradients(updates, axis_name, op, bucket_bytes, fuse_below_bytes)
        return inner.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(inner.init, update)
