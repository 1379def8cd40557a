"""ppermute: the twin of lax.ppermute, over jaxring's low-latency point-to-point path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src import core
from jax.interpreters import ad, batching

from jaxring._src import common

# ---- primitive ---------------------------------------------------------------------------------

ppermute_p = core.Primitive("jaxring_ppermute")

# ---- public function ---------------------------------------------------------------------------


def ppermute(x, axis_name, perm):
    """Sends `x` from each device to another along `axis_name`, as ``lax.ppermute``.

    `perm` is a sequence of (source, destination) index pairs; no source or destination may
    repeat. A device that is no pair's destination receives zeros. `x` may be a pytree. Messages
    up to ``jaxring.config`` ``p2p_eager_bytes`` are delivered eagerly (the sender does not wait
    for the receiver unless 8 of its messages already wait there); larger ones are copied once,
    straight from the sender's buffer. Its
    transpose is the inverse permutation, so ``jax.grad`` flows back through pipelines. Over a
    tuple of mesh axes, indices run as the installed jax's ``lax.ppermute`` numbers them: in the
    mesh's order of those axes before jax 0.11, in the tuple's from 0.11, which refuses a tuple
    out of the mesh's order unless jax's option ``jax_raise_on_ppermute_sort_diff`` is off; so
    do ``send`` and ``recv``.
    """

    perm = common.read_once(perm)

    def permute_leaf(leaf):
        leaf = jnp.asarray(leaf)
        common.check_dtype("ppermute", leaf)
        comm = common.point_to_point_communicator("ppermute", axis_name)
        pairs = common.check_perm("ppermute", perm, comm.size, comm.name)
        return _bind(leaf, comm, pairs)

    return jax.tree.map(permute_leaf, x)


def _bind(x, comm: common.AxisCommunicator, perm, op_id: int | None = None):
    return common.bind_collective(ppermute_p, x, comm, op_id, perm=perm)


# ---- abstract evaluation -----------------------------------------------------------------------


def _abstract_eval(rank, group, x, *, comm, perm, op_id):
    return x, {common.collective_effect}


# ---- lowering ----------------------------------------------------------------------------------


def _lowering(ctx, rank, group, x, *, comm, perm, op_id):
    return common.lower_collective("jaxring_ppermute", ctx, rank, group, x, comm=comm,
                                   op_id=op_id, perm=common.perm_attribute(perm))


# ---- batching ----------------------------------------------------------------------------------


def _batching(args, dims, *, comm, perm, op_id):
    rank, group, x = args
    common.check_unbatched(comm, dims[0], dims[1])
    # The permutation moves whole per-device blocks: the batch dimension rides along.
    return ppermute_p.bind(rank, group, x, comm=comm, perm=perm,
                           op_id=common.next_op_id(comm, op_id, "batch")), dims[2]


# ---- JVP and transpose -------------------------------------------------------------------------


def _jvp(primals, tangents, *, comm, perm, op_id):
    rank, group, x = primals
    out = ppermute_p.bind(rank, group, x, comm=comm, perm=perm, op_id=op_id)
    if type(tangents[2]) is ad.Zero:
        return out, ad.Zero.from_primal_value(out)
    return out, _bind(tangents[2], comm, perm, common.next_op_id(comm, op_id, "jvp"))


def _transpose(cotangent, rank, group, x, *, comm, perm, op_id):
    if type(cotangent) is ad.Zero:
        return None, None, ad.Zero(x.aval)
    inverse = tuple((d, s) for s, d in perm)
    return None, None, _bind(cotangent, comm, inverse,
                             common.next_op_id(comm, op_id, "transpose"))


# ---- registration ------------------------------------------------------------------------------

ppermute_p.def_effectful_abstract_eval(_abstract_eval)
common.register_lowering_rule(ppermute_p, _lowering)
batching.primitive_batchers[ppermute_p] = _batching
ad.primitive_jvps[ppermute_p] = _jvp
ad.primitive_transposes[ppermute_p] = _transpose
