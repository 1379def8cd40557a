"""all_reduce: the twin of lax.psum / pmean / pmax / pmin."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core
from jax.interpreters import ad, batching

from jaxring._src import common
from jaxring._src.all_gather import all_gather
from jaxring._src.reduce_scatter import reduce_scatter

# ---- primitive ---------------------------------------------------------------------------------

all_reduce_p = core.Primitive("jaxring_all_reduce")

# ---- public function ---------------------------------------------------------------------------


def all_reduce(x, axis_name, op: str = "sum", *, in_place: bool | None = None):
    """Reduces `x` over the devices of `axis_name`; every device gets the same result.

    Drop-in for ``lax.psum`` (op="sum"), ``lax.pmean`` ("mean"), ``lax.pmax`` ("max") and
    ``lax.pmin`` ("min") inside ``jax.shard_map`` or ``jax.pmap``. `x` may be a pytree.
    float16/bfloat16 accumulate in float32 and are rounded once. Results are bit-identical from
    run to run and on every device. Integer "mean" divides like ``lax.pmean`` (true division).

    `in_place`: write the result over x's buffer (on CPU). Results never change: where x is still
    needed afterwards, XLA copies it first. By default (None) values computed in the program and
    loop carries are reduced in place and the program's arguments into a fresh output
    (``common.in_place_pays``); True suits a donated argument.
    """
    common.check_op("all_reduce", op)

    def reduce_leaf(leaf):
        leaf = jnp.asarray(leaf)
        common.check_dtype("all_reduce", leaf)
        comm = common.communicator("all_reduce", axis_name)
        common.refuse_partly_varying("all_reduce", leaf, comm, op)
        if op == "mean" and jnp.issubdtype(leaf.dtype, jnp.integer):
            return all_reduce(leaf, axis_name, "sum", in_place=in_place) / comm.size  # as pmean
        if comm.size == 1:
            # Nothing to exchange: every op is the identity. lax.psum, which XLA elides, makes
            # the value invariant over the axes as every all-reduce does, and has a derivative
            # (lax.pmax and lax.pmin have none).
            return lax.psum(leaf, comm.axes) if comm.axes else leaf
        # A hierarchical jaxring.mpi communicator: large all-reduces go through its levels.
        levels = getattr(axis_name, "levels", None)
        nbytes = leaf.size * leaf.dtype.itemsize
        if levels is not None and nbytes > axis_name.levels_threshold_bytes:
            return _hierarchical(leaf, axis_name, op, common.next_op_id(comm))
        return _bind(leaf, comm, op, in_place)

    return jax.tree.map(reduce_leaf, x)


def _bind(x, comm: common.AxisCommunicator, op: str, in_place: bool | None = None,
          op_id: int | None = None):
    in_place = common.in_place_pays(x) if in_place is None else bool(in_place)
    return common.bind_collective(all_reduce_p, x, comm, op_id, op=op, in_place=in_place)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _hierarchical(x, communicator, op: str, op_id: int):
    """All-reduce over processes on several nodes, as Horovod's and NCCL's hierarchical
    all-reduce: reduce-scatter within each node (shared memory), all-reduce each shard between
    the nodes' ranks of the same local rank (MPI), all-gather within each node. Only 1/L of the
    data crosses the network from each of a node's L ranks. 16-bit floats travel as float32, so
    they are still rounded once; every rank ends with the same bits. The levels' calls take
    their op ids from `op_id`, the user's call's."""
    node, across = communicator.levels
    accumulate = jnp.float32 if x.dtype in (jnp.float16, jnp.bfloat16) else x.dtype
    flat = x.reshape(-1).astype(accumulate)
    flat = jnp.pad(flat, (0, -flat.size % node.size))  # padding is reduced only with padding
    with common.op_ids_derived_from(op_id, "levels"):
        shard = all_reduce(reduce_scatter(flat, node, op), across, op)
        out = all_gather(shard, node)
    return out[:x.size].reshape(x.shape).astype(x.dtype)


@_hierarchical.defjvp
def _hierarchical_jvp(communicator, op, op_id, primals, tangents):
    """all_reduce_p's JVP (_jvp below), through the levels: reduce_scatter_p has none for max and
    min, whose gradient is not a reduce-scatter's."""
    (x,), (tangent,) = primals, tangents
    out = _hierarchical(x, communicator, op, op_id)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return out, np.zeros(out.shape, jax.dtypes.float0)
    def tangent_id(role):
        return common.next_op_id(communicator.axis_communicator(), op_id, role)
    if op in ("sum", "mean"):
        return out, _hierarchical(tangent, communicator, op, tangent_id("jvp"))
    return out, _winners_tangent(
        x, out, tangent, lambda v, role: _hierarchical(v, communicator, "sum", tangent_id(role)))


def _winners_tangent(x, out, tangent, total):
    """max/min's tangent: the tangent of the winning element, which ties share equally (as
    jnp.max does); `total(value, role)` sums over the devices, in a call whose op id derives
    from the primal's with `role`, so that the two sums' ids differ."""
    winner = (x == out).astype(tangent.dtype)
    return total(tangent * winner, "jvp") / total(winner, "jvp-ties")


# ---- abstract evaluation -----------------------------------------------------------------------


def _abstract_eval(rank, group, x, *, comm, op, op_id, in_place):
    # Like psum: the result no longer varies over the reduced axes.
    out = common.with_varying_axes(x, common.varying_axes(x) - frozenset(comm.axes))
    return out, {common.collective_effect}


# ---- lowering ----------------------------------------------------------------------------------


def _lowering(ctx, rank, group, x, *, comm, op, op_id, in_place):
    return common.lower_collective("jaxring_all_reduce", ctx, rank, group, x, comm=comm,
                                   op_id=op_id, in_place=in_place, op=common.REDUCE_OPS[op])


# ---- batching ----------------------------------------------------------------------------------


def _batching(args, dims, *, comm, op, op_id, in_place):
    rank, group, x = args
    common.check_unbatched(comm, dims[0], dims[1])
    # Elementwise across devices: the batch dimension just rides along.
    return all_reduce_p.bind(rank, group, x, comm=comm, op=op, in_place=in_place,
                             op_id=common.next_op_id(comm, op_id, "batch")), dims[2]


# ---- JVP and transpose -------------------------------------------------------------------------


def _jvp(primals, tangents, *, comm, op, op_id, in_place):
    rank, group, x = primals
    out = all_reduce_p.bind(rank, group, x, comm=comm, op=op, op_id=op_id, in_place=in_place)
    tangent = tangents[2]
    if type(tangent) is ad.Zero:
        return out, ad.Zero.from_primal_value(out)
    if op in ("sum", "mean"):
        return out, _bind(tangent, comm, op, op_id=common.next_op_id(comm, op_id, "jvp"))
    return out, _winners_tangent(
        x, out, tangent,
        lambda v, role: _bind(v, comm, "sum", op_id=common.next_op_id(comm, op_id, role)))


def _transpose(cotangent, rank, group, x, *, comm, op, op_id, in_place):
    if op not in ("sum", "mean"):
        raise NotImplementedError(f"jaxring.all_reduce: op={op!r} is not linear")
    if type(cotangent) is ad.Zero:
        return None, None, ad.Zero(x.aval)
    if common.reduced_invariant(comm, x.aval):
        # As psum under shard_map's type checker: an invariant cotangent is cast back to varying.
        ct = common.make_varying(cotangent, comm.axes)
    else:
        ct = _bind(cotangent, comm, "sum", op_id=common.next_op_id(comm, op_id, "transpose"))
    if op == "mean":
        ct = ct / np.asarray(comm.size, ct.dtype)
    return None, None, ct


# ---- registration ------------------------------------------------------------------------------

all_reduce_p.def_effectful_abstract_eval(_abstract_eval)
common.register_lowering_rule(all_reduce_p, _lowering)
batching.primitive_batchers[all_reduce_p] = _batching
ad.primitive_jvps[all_reduce_p] = _jvp
ad.primitive_transposes[all_reduce_p] = _transpose
