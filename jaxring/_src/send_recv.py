"""send and recv: the two halves of a permutation as separate calls (the twins of lax.psend and
lax.precv), so that a pipeline stage can send, compute, and receive later."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core
from jax._src import shard_map as jax_shard_map
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
    source send nothing. A send does not wait for its receiver: the message is copied into the
    destination's mailbox, which holds 8 messages from each sender; a ninth send before the
    receiver takes one waits for room (and times out naming the receiver). The matching
    ``recv`` (same `perm`, dtype and element count; shapes are not compared) receives it, in the
    same program (so under ``jax.jit``: a ``shard_map`` not under it runs each call as a program
    of its own, and is refused); sends and receives between two devices are matched in program
    order, and apart from ``ppermute``'s messages (a ppermute between a send and its recv over
    the same pairs takes its own). Neither is differentiable, and send refuses vmap (a ``recv``
    under vmap has no batched operand: it receives one message, which every example shares): use
    ``ppermute``, whose transpose is the inverse permutation, in code you take gradients of or
    vmap.
    """

    perm = common.read_once(perm)

    def send_leaf(leaf):
        leaf = jnp.asarray(leaf)
        common.check_dtype("send", leaf)
        comm = common.point_to_point_communicator("send", axis_name)
        _refuse_eager_shard_map("send", comm)
        pairs = common.check_perm("send", perm, comm.size, comm.name)
        common.bind_collective(send_p, leaf, comm, perm=pairs)

    jax.tree.map(send_leaf, x)


def recv(like, axis_name, perm):
    """Receives, on each destination device of `perm`, what the matching ``send`` sent.

    `like` gives the shape and dtype (an array or ``jax.ShapeDtypeStruct``; a pytree of them).
    Devices that are no pair's destination get zeros, as ``lax.ppermute``. A message sent by an
    earlier program, which no recv of its own took, is refused with an error (between the
    devices of one process; across processes only where its dtype or count differs). Inside
    ``shard_map`` the result is typed as varying over every manual mesh axis (recv cannot see
    what was sent): a scan carry it replaces must vary over them too
    (``jax.lax.pcast(x, axes, to="varying")``).
    """

    perm = common.read_once(perm)

    def recv_leaf(leaf):
        if not hasattr(leaf, "dtype") and not isinstance(leaf, (bool, int, float, complex)):
            raise TypeError(f"jaxring.recv: `like` must hold arrays, jax.ShapeDtypeStruct or "
                            f"Python numbers (a pytree of them), got {leaf!r}")
        dtype = leaf.dtype if hasattr(leaf, "dtype") else jnp.result_type(leaf)  # Python scalars
        common.check_dtype("recv", core.ShapedArray((), dtype))
        # As send's jnp.asarray does: float64 and int64 become 32-bit unless x64 is on.
        aval = core.ShapedArray(np.shape(leaf), jax.dtypes.canonicalize_dtype(dtype))
        comm = common.point_to_point_communicator("recv", axis_name)
        _refuse_eager_shard_map("recv", comm)
        pairs = common.check_perm("recv", perm, comm.size, comm.name)
        rank, group = comm.rank_and_group()
        return recv_p.bind(rank, group, aval=aval, comm=comm, perm=pairs,
                           op_id=common.next_op_id(comm), varying=_result_varying(comm))

    return jax.tree.map(recv_leaf, like)


def _refuse_eager_shard_map(name, comm):
    """A ``jax.shard_map`` not under ``jax.jit`` runs each call in its body as a program of its
    own, so a send and its recv could never be in one program: the recv found the message of
    an earlier program, refused it, and left jaxring failed until reset_after_error."""
    eager = getattr(jax_shard_map, "ShardMapTrace", None)  # None: a jax that renamed it
    if comm.process_rank is None and eager is not None and isinstance(core.trace_ctx.trace, eager):
        raise RuntimeError(
            f"jaxring.{name} over {comm.name} is inside a jax.shard_map that is not under "
            f"jax.jit, which runs each call of its body as a program of its own; a send and its "
            f"recv must be in one program: wrap the shard_map (or its body) in jax.jit")


def _result_varying(comm):
    """What recv's result varies over under shard_map's vma checking (None without it): what
    was sent differs between the communicator's devices and may differ along every other manual
    axis, size-1 axes included (an input split over one varies over it), and recv cannot tell."""
    if not common.vma_checking():
        return None
    mesh = jax.sharding.get_abstract_mesh()
    manual = frozenset() if mesh is None or mesh.empty else frozenset(mesh.manual_axes)
    return frozenset(comm.axes) | manual


# ---- abstract evaluation -----------------------------------------------------------------------


def _send_abstract_eval(rank, group, x, *, comm, perm, op_id):
    return [], {common.collective_effect}


def _recv_abstract_eval(rank, group, *, aval, comm, perm, op_id, varying):
    # The device context comes from the rank operand; the varying axes from _result_varying.
    out = rank.update(shape=aval.shape, dtype=aval.dtype, weak_type=False)
    if varying is not None:
        out = common.with_varying_axes(out, varying)
    return out, {common.collective_effect}


# ---- lowering ----------------------------------------------------------------------------------


def _send_lowering(ctx, rank, group, x, *, comm, perm, op_id):
    return common.lower_collective("jaxring_send", ctx, rank, group, x, comm=comm, op_id=op_id,
                                   perm=common.perm_attribute(perm))


def _recv_lowering(ctx, rank, group, *, aval, comm, perm, op_id, varying):
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
