"""barrier: no device of the axis continues until every device has reached it."""

from __future__ import annotations

from jax._src import core
from jax.interpreters import batching

from jaxring._src import common

# ---- primitive ---------------------------------------------------------------------------------

barrier_p = core.Primitive("jaxring_barrier")
barrier_p.multiple_results = True

# ---- public function ---------------------------------------------------------------------------


def barrier(axis_name) -> None:
    """Blocks each device of `axis_name` until all of them have arrived.

    Ordered with every other jaxring call on the device, so it also separates the collectives
    before it from those after it. A device that never arrives is named in a timeout error.
    """
    _bind(axis_name, None)


# Above the ids of call sites (common.next_op_id), so that it never meets one.
FREE_OP_ID = common.PROCESS_OP_ID_BIT << 1
common.name_call_site(FREE_OP_ID, "jaxring.mpi.Communicator.free")


def barrier_to_free(communicator) -> None:
    """The barrier of jaxring.mpi.Communicator.free: its op id is fixed, not that of the line
    that called free(), so that ranks may free a communicator from different lines (a `with`
    block on one, an error path on another)."""
    _bind(communicator, FREE_OP_ID)


def _bind(axis_name, op_id: int | None) -> None:
    comm = common.communicator("barrier", axis_name)
    rank, group = comm.rank_and_group()
    barrier_p.bind(rank, group, comm=comm,
                   op_id=common.next_op_id(comm) if op_id is None else op_id)


# ---- abstract evaluation -----------------------------------------------------------------------


def _abstract_eval(rank, group, *, comm, op_id):
    return [], {common.collective_effect}


# ---- lowering ----------------------------------------------------------------------------------


def _lowering(ctx, rank, group, *, comm, op_id):
    return common.lower_collective("jaxring_barrier", ctx, rank, group, comm=comm, op_id=op_id)


# ---- batching ----------------------------------------------------------------------------------


def _batching(args, dims, *, comm, op_id):
    # A barrier has no data operand: vmap batches it only when its rank or group is batched, by a
    # vmap axis named like a mesh axis, which check_unbatched refuses (a batched rank would make
    # the custom call take one example's index for the device's).
    common.check_unbatched(comm, *dims)
    rank, group = args
    return barrier_p.bind(rank, group, comm=comm, op_id=op_id), []


# ---- registration ------------------------------------------------------------------------------

barrier_p.def_effectful_abstract_eval(_abstract_eval)
common.register_lowering_rule(barrier_p, _lowering)
batching.primitive_batchers[barrier_p] = _batching
