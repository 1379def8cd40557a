"""reduce_scatter: the twin of lax.psum_scatter(..., tiled=True); the first half of the ring."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core
from jax.interpreters import ad, batching

from jaxring._src import common

# ---- primitive ---------------------------------------------------------------------------------

# Scatters along the leading dimension; the public function moves `scatter_dimension` there.
reduce_scatter_p = core.Primitive("jaxring_reduce_scatter")

# ---- public function ---------------------------------------------------------------------------


def reduce_scatter(x, axis_name, op: str = "sum", scatter_dimension: int = 0,
                   tiled: bool = True):
    """Reduces `x` over the devices of `axis_name` and leaves block i of the result on device i.

    Drop-in for ``lax.psum_scatter(x, axis_name, scatter_dimension=d, tiled=tiled)``, whose
    default is ``tiled=False``: this one's is ``tiled=True``. Tiled, dimension `d` of `x` must
    be divisible by the number of devices and shrinks by that factor; untiled, it must equal the
    number of devices and is removed. `op` is one of "sum", "mean", "max", "min".
    """
    common.check_op("reduce_scatter", op)
    common.check_tiled("reduce_scatter", tiled)

    def scatter_leaf(leaf):
        leaf = jnp.asarray(leaf)
        common.check_dtype("reduce_scatter", leaf)
        comm = common.communicator("reduce_scatter", axis_name)
        common.refuse_partly_varying("reduce_scatter", leaf, comm, op)
        if leaf.ndim == 0:
            raise ValueError("jaxring.reduce_scatter: needs an array of rank >= 1, got a scalar")
        dim = _canonical_dimension(scatter_dimension, leaf.ndim)
        if not tiled and leaf.shape[dim] != comm.size:
            raise ValueError(
                f"jaxring.reduce_scatter: untiled, dimension {dim} of shape {leaf.shape} must "
                f"equal the {comm.size} devices of {comm.name}")
        if leaf.shape[dim] % comm.size:
            raise ValueError(
                f"jaxring.reduce_scatter: dimension {dim} of shape {leaf.shape} must be divisible "
                f"by the {comm.size} devices of {comm.name}"
            )
        if op == "mean" and jnp.issubdtype(leaf.dtype, jnp.integer):
            return reduce_scatter(leaf, axis_name, "sum", dim, tiled) / comm.size
        out = jnp.moveaxis(_bind(jnp.moveaxis(leaf, dim, 0), comm, op), 0, dim)
        return out if tiled else jnp.squeeze(out, dim)

    return jax.tree.map(scatter_leaf, x)


def _canonical_dimension(dim: int, ndim: int) -> int:
    index = common.as_index(dim)
    if index is None or not -ndim <= index < ndim:
        raise ValueError(f"jaxring.reduce_scatter: scatter_dimension must be an int in [{-ndim}, "
                         f"{ndim}) for an input of rank {ndim}, got {dim!r}")
    return index % ndim


def _bind(x, comm: common.AxisCommunicator, op: str, op_id: int | None = None):
    return common.bind_collective(reduce_scatter_p, x, comm, op_id, op=op)


# ---- abstract evaluation -----------------------------------------------------------------------


def _abstract_eval(rank, group, x, *, comm, op, op_id):
    shape = (x.shape[0] // comm.size, *x.shape[1:])
    return x.update(shape=shape), {common.collective_effect}


# ---- lowering ----------------------------------------------------------------------------------


def _lowering(ctx, rank, group, x, *, comm, op, op_id):
    return common.lower_collective(
        "jaxring_reduce_scatter", ctx, rank, group, x, comm=comm, op_id=op_id,
        op=common.REDUCE_OPS[op],
    )


# ---- batching ----------------------------------------------------------------------------------


def _batching(args, dims, *, comm, op, op_id):
    rank, group, x = args
    common.check_unbatched(comm, dims[0], dims[1])
    # The leading dimension is the scattered one, so the batch dimension goes second.
    x = common.move_batch_axis(x, dims[2], 1)
    return reduce_scatter_p.bind(rank, group, x, comm=comm, op=op,
                                 op_id=common.next_op_id(comm, op_id, "batch")), 1


# ---- JVP and transpose -------------------------------------------------------------------------


def _jvp(primals, tangents, *, comm, op, op_id):
    rank, group, x = primals
    out = reduce_scatter_p.bind(rank, group, x, comm=comm, op=op, op_id=op_id)
    tangent = tangents[2]
    if type(tangent) is ad.Zero:
        return out, ad.Zero.from_primal_value(out)
    if op not in ("sum", "mean"):
        raise NotImplementedError(f"jaxring.reduce_scatter: no derivative for op={op!r}")
    return out, _bind(tangent, comm, op, common.next_op_id(comm, op_id, "jvp"))


def _transpose(cotangent, rank, group, x, *, comm, op, op_id):
    from jaxring._src import all_gather  # the other half of the ring

    if type(cotangent) is ad.Zero:
        return None, None, ad.Zero(x.aval)
    ct = all_gather._bind(cotangent, comm, common.next_op_id(comm, op_id, "transpose"))
    if op == "mean":
        ct = ct / np.asarray(comm.size, ct.dtype)
    return None, None, ct


# ---- registration ------------------------------------------------------------------------------

reduce_scatter_p.def_effectful_abstract_eval(_abstract_eval)
common.register_lowering_rule(reduce_scatter_p, _lowering)
batching.primitive_batchers[reduce_scatter_p] = _batching
ad.primitive_jvps[reduce_scatter_p] = _jvp
ad.primitive_transposes[reduce_scatter_p] = _transpose
