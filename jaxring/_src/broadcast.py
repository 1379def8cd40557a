"""broadcast: every device of the axis receives the `x` of device `root`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src import core
from jax.interpreters import ad, batching

from jaxring._src import common

# ---- primitive ---------------------------------------------------------------------------------

broadcast_p = core.Primitive("jaxring_broadcast")

# ---- public function ---------------------------------------------------------------------------


def broadcast(x, axis_name, root: int = 0):
    """Returns, on every device of `axis_name`, the value `x` has on device `root`.

    The result has the shape and dtype of `x`. Gradients flow back to `root` only: its
    cotangent is the sum of every device's cotangent; the others get zeros.
    """

    def broadcast_leaf(leaf):
        leaf = jnp.asarray(leaf)
        common.check_dtype("broadcast", leaf)
        comm = common.communicator("broadcast", axis_name)
        index = common.as_index(root)
        if isinstance(root, core.Tracer):
            raise TypeError(
                f"jaxring.broadcast: root must be a static Python int in [0, {comm.size}), known "
                f"when the program is traced, not a traced value: got {root!r}")
        if index is None or not 0 <= index < comm.size:
            raise ValueError(
                f"jaxring.broadcast: root must be an int in [0, {comm.size}) for {comm.name}, "
                f"got {root!r}"
            )
        return _bind(leaf, comm, index)

    return jax.tree.map(broadcast_leaf, x)


def _bind(x, comm: common.AxisCommunicator, root: int, op_id: int | None = None):
    return common.bind_collective(broadcast_p, x, comm, op_id, root=root)


# ---- abstract evaluation -----------------------------------------------------------------------


def _abstract_eval(rank, group, x, *, comm, root, op_id):
    # Every device ends with the same value: like psum's, the result no longer varies over the
    # communicator's axes (so shard_map can return it with out_specs=P()).
    out = common.with_varying_axes(x, common.varying_axes(x) - frozenset(comm.axes))
    return out, {common.collective_effect}


# ---- lowering ----------------------------------------------------------------------------------


def _lowering(ctx, rank, group, x, *, comm, root, op_id):
    return common.lower_collective("jaxring_broadcast", ctx, rank, group, x, comm=comm,
                                   op_id=op_id, root=root)


# ---- batching ----------------------------------------------------------------------------------


def _batching(args, dims, *, comm, root, op_id):
    rank, group, x = args
    common.check_unbatched(comm, dims[0], dims[1])
    return broadcast_p.bind(rank, group, x, comm=comm, root=root,
                            op_id=common.next_op_id(comm, op_id, "batch")), dims[2]


# ---- JVP and transpose -------------------------------------------------------------------------


def _jvp(primals, tangents, *, comm, root, op_id):
    rank, group, x = primals
    out = broadcast_p.bind(rank, group, x, comm=comm, root=root, op_id=op_id)
    if type(tangents[2]) is ad.Zero:
        return out, ad.Zero.from_primal_value(out)
    return out, _bind(tangents[2], comm, root, common.next_op_id(comm, op_id, "jvp"))


def _transpose(cotangent, rank, group, x, *, comm, root, op_id):
    from jaxring._src import all_reduce

    if type(cotangent) is ad.Zero:
        return None, None, ad.Zero(x.aval)
    if common.reduced_invariant(comm, x.aval):
        # The result is one (invariant) value, so its cotangent is already the total.
        total = common.make_varying(cotangent, comm.axes)
    else:
        total = common.make_varying(all_reduce._bind(
            cotangent, comm, "sum", op_id=common.next_op_id(comm, op_id, "transpose")),
            comm.axes)
    return None, None, jnp.where(rank == root, total, jnp.zeros_like(total))


# ---- registration ------------------------------------------------------------------------------

broadcast_p.def_effectful_abstract_eval(_abstract_eval)
common.register_lowering_rule(broadcast_p, _lowering)
batching.primitive_batchers[broadcast_p] = _batching
ad.primitive_jvps[broadcast_p] = _jvp
ad.primitive_transposes[broadcast_p] = _transpose
