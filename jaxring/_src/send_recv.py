"""send and recv: the two halves of a permutation as separate calls (the twins of lax.psend and
lax.precv), so that a pipeline stage can send, compute, and receive later."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core
from jax.interpreters import ad, batching

from jaxring._src import common

# ---- primitives --------------------------------------------------------------------------------

send_p = core.Primitive("jaxring_send")
send_p.multiple_results = True
recv_p = core.Primitive("jaxring_recv")

# ---- public functions --------------------------------------------------------------------------


def send(x, axis_name, perm) -> None:
    """Sends `x` from each source device of `perm` to its destination along `axis_name`.

    `perm` holds (source, destination) pairs, as in ``ppermute``; devices that are no pair's
    source send nothing. A send never waits for its receiver: the message is copied into the
    destination's mailbox. The matching ``recv`` (same `perm`, shape and dtype) receives it;
    sends and receives between two devices are matched in program order. Neither differentiable
    nor batchable: use ``ppermute``, whose transpose is the inverse permutation, in code you take
    gradients of or vmap.
    """

    def send_leaf(leaf):
        leaf = jnp.asarray(leaf)
        common.check_dtype("send", leaf)
        comm = common.point_to_point_communicator("send", axis_name)
        pairs = common.check_perm("send", perm, comm.size, comm.name)
        common.bind_collective(send_p, leaf, comm, perm=pairs)

    jax.tree.map(send_leaf, x)


def recv(like, axis_name, perm):
    """Receives, on each destination device of `perm`, what the matching ``send`` sent.

    `like` gives the shape and dtype (an array or ``jax.ShapeDtypeStruct``; a pytree of them).
    Devices that are no pair's destination get zeros, as ``lax.ppermute``.
    """

    def recv_leaf(leaf):
        dtype = leaf.dtype if hasattr(leaf, "dtype") else jnp.result_type(leaf)  # Python scalars
        # As send's jnp.asarray does: float64 and int64 become 32-bit unless x64 is on.
        aval = core.ShapedArray(np.shape(leaf), jax.dtypes.canonicalize_dtype(dtype))
        common.check_dtype("recv", aval)
        comm = common.point_to_point_communicator("recv", axis_name)
        pairs = common.check_perm("recv", perm, comm.size, comm.name)
        rank, group = comm.rank_and_group()
        return recv_p.bind(rank, group, aval=aval, comm=comm, perm=pairs,
                           op_id=common.next_op_id(comm), like_varying=_varying_of(leaf))

    return jax.tree.map(recv_leaf, like)


def _varying_of(like):
    """The mesh axes a traced `like` varies over (its vma), or None where `like` carries no such
    type (a ShapeDtypeStruct, a NumPy array, a Python scalar)."""
    if isinstance(like, core.Tracer) and common.vma_checking():
        return common.varying_axes(like.aval)
    return None


# ---- abstract evaluation -----------------------------------------------------------------------


def _send_abstract_eval(rank, group, x, *, comm, perm, op_id):
    return [], {common.collective_effect}


def _recv_abstract_eval(rank, group, *, aval, comm, perm, op_id, like_varying):
    # What arrives differs from device to device along the communicator's axes (like ppermute's
    # result). Over the other mesh axes it varies as what was sent, which a traced `like` tells,
    # as ppermute's result is typed as its input; otherwise as the group does. The device context
    # comes from the rank operand.
    out = rank.update(shape=aval.shape, dtype=aval.dtype, weak_type=False)
    if common.vma_checking():
        if like_varying is None:
            like_varying = common.varying_axes(rank) | common.varying_axes(group)
        out = common.with_varying_axes(out, frozenset(comm.axes) | like_varying)
    return out, {common.collective_effect}


# ---- lowering ----------------------------------------------------------------------------------


def _send_lowering(ctx, rank, group, x, *, comm, perm, op_id):
    return common.lower_collective("jaxring_send", ctx, rank, group, x, comm=comm, op_id=op_id,
                                   perm=common.perm_attribute(perm))


def _recv_lowering(ctx, rank, group, *, aval, comm, perm, op_id, like_varying):
    return common.lower_collective("jaxring_recv", ctx, rank, group, comm=comm, op_id=op_id,
                                   perm=common.perm_attribute(perm))


# ---- batching ----------------------------------------------------------------------------------


def _send_batching(args, dims, *, comm, perm, op_id):
    # recv has no batched operand (only rank and group), so under vmap it would expect one
    # example while send sent the batch.
    raise NotImplementedError(
        "jaxring.send and jaxring.recv do not work under vmap (the matching recv cannot see the "
        "batch); send and receive the whole batch outside vmap, or use jaxring.ppermute, which "
        "does")


def _recv_batching(args, dims, *, comm, **params):
    # recv has no data operand: vmap batches it only when its rank or group is batched, by a vmap
    # axis named like a mesh axis, which check_unbatched refuses.
    common.check_unbatched(comm, *dims)
    raise AssertionError("check_unbatched refuses a batched rank or group")


# ---- differentiation ---------------------------------------------------------------------------


def _send_jvp(primals, tangents, *, comm, perm, op_id):
    if type(tangents[2]) is not ad.Zero:
        raise NotImplementedError(
            "jaxring.send is not differentiable (the gradient would have to travel back from the "
            "matching recv, a separate call); use jaxring.ppermute in differentiated code"
        )
    return send_p.bind(*primals, comm=comm, perm=perm, op_id=op_id), []


# ---- registration ------------------------------------------------------------------------------

send_p.def_effectful_abstract_eval(_send_abstract_eval)
recv_p.def_effectful_abstract_eval(_recv_abstract_eval)
common.register_lowering_rule(send_p, _send_lowering)
common.register_lowering_rule(recv_p, _recv_lowering)
batching.primitive_batchers[send_p] = _send_batching
batching.primitive_batchers[recv_p] = _recv_batching
ad.primitive_jvps[send_p] = _send_jvp
