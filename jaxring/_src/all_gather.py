"""all_gather: the twin of lax.all_gather(..., tiled=True); the second half of the ring."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src import core
from jax.interpreters import ad, batching

from jaxring._src import common

# ---- primitive ---------------------------------------------------------------------------------

# Gathers along the leading dimension; the public function moves `axis` there.
all_gather_p = core.Primitive("jaxring_all_gather")

# ---- public function ---------------------------------------------------------------------------


def all_gather(x, axis_name, axis: int = 0, tiled: bool = True):
    """Concatenates the `x` of every device of `axis_name` along `axis`, in device order.

    Drop-in for ``lax.all_gather(x, axis_name, axis=axis, tiled=tiled)``, whose default is
    ``tiled=False``: this one's is ``tiled=True``, the ring's natural result. Untiled, the
    inputs are stacked along a new dimension `axis` of one entry per device. Tiled, scalars are
    gathered into a vector of one element per device (``lax`` refuses them).
    """
    common.check_tiled("all_gather", tiled)

    def gather_leaf(leaf):
        leaf = jnp.asarray(leaf)
        common.check_dtype("all_gather", leaf)
        comm = common.communicator("all_gather", axis_name)
        given = leaf.ndim
        if tiled and given == 0:
            leaf = leaf[None]
        index = common.as_index(axis)
        rank = leaf.ndim + (not tiled)  # of the input the ring concatenates
        if index is None or not -rank <= index < rank:
            how = ", untiled" if not tiled else ", tiled (a vector of one)" if given == 0 else ""
            raise ValueError(f"jaxring.all_gather: axis must be an int in [{-rank}, {rank}) for "
                             f"an input of rank {given}{how}, got {axis!r}")
        dim = index % rank
        if not tiled:
            leaf = jnp.expand_dims(leaf, dim)
        out = _bind(jnp.moveaxis(leaf, dim, 0), comm)
        return jnp.moveaxis(out, 0, dim)

    return jax.tree.map(gather_leaf, x)


def _bind(x, comm: common.AxisCommunicator, op_id: int | None = None):
    return common.bind_collective(all_gather_p, x, comm, op_id)


# ---- abstract evaluation -----------------------------------------------------------------------


def _abstract_eval(rank, group, x, *, comm, op_id):
    shape = (x.shape[0] * comm.size, *x.shape[1:])
    return x.update(shape=shape), {common.collective_effect}


# ---- lowering ----------------------------------------------------------------------------------


def _lowering(ctx, rank, group, x, *, comm, op_id):
    return common.lower_collective("jaxring_all_gather", ctx, rank, group, x, comm=comm,
                                   op_id=op_id)


# ---- batching ----------------------------------------------------------------------------------


def _batching(args, dims, *, comm, op_id):
    rank, group, x = args
    common.check_unbatched(comm, dims[0], dims[1])
    x = common.move_batch_axis(x, dims[2], 1)
    return all_gather_p.bind(rank, group, x, comm=comm,
                             op_id=common.next_op_id(comm, op_id, "batch")), 1


# ---- JVP and transpose -------------------------------------------------------------------------


def _jvp(primals, tangents, *, comm, op_id):
    rank, group, x = primals
    out = all_gather_p.bind(rank, group, x, comm=comm, op_id=op_id)
    if type(tangents[2]) is ad.Zero:
        return out, ad.Zero.from_primal_value(out)
    return out, _bind(tangents[2], comm, common.next_op_id(comm, op_id, "jvp"))


def _transpose(cotangent, rank, group, x, *, comm, op_id):
    from jaxring._src import reduce_scatter  # the other half of the ring

    if type(cotangent) is ad.Zero:
        return None, None, ad.Zero(x.aval)
    return None, None, reduce_scatter._bind(cotangent, comm, "sum",
                                            common.next_op_id(comm, op_id, "transpose"))


# ---- registration ------------------------------------------------------------------------------

all_gather_p.def_effectful_abstract_eval(_abstract_eval)
common.register_lowering_rule(all_gather_p, _lowering)
batching.primitive_batchers[all_gather_p] = _batching
ad.primitive_jvps[all_gather_p] = _jvp
ad.primitive_transposes[all_gather_p] = _transpose
