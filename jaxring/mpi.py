"""Process communicators: jaxring's collectives across processes launched by ``mpiexec``, one
JAX device per process, as Horovod and mpi4jax users run them.

    comm = jaxring.mpi.world()
    y = jax.jit(lambda x: jaxring.all_reduce(x, comm))(x)     # any collective, in place of an axis

MPI (through mpi4py) is used to set communicators up: it tells ranks apart, finds which share a
node, and exchanges the name of a shared-memory segment. The data then moves through that
segment (``xla_ffi/transports/shm``), not through MPI, so no MPI library is linked into jaxring
and build-time and run-time MPI cannot disagree. Ranks on different nodes are not supported yet
and are refused with a clear error.
"""

from __future__ import annotations

import atexit
import functools
import secrets
import weakref

from jaxring._src import common, native

DEFAULT_SLOT_BYTES = 4 << 20  # measured with benchmarks/allreduce_mpi.py: fewer steps pay


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as error:  # pragma: no cover - mpi4py is a dependency of the mpi extra
        raise ImportError("jaxring.mpi needs mpi4py: pip install 'jaxring[mpi]'") from error
    return MPI


class Communicator:
    """The processes of an mpi4py communicator. Pass it wherever a collective takes an axis name.

    Every rank must create it (it is collective, like MPI_Comm_dup) and then make the same
    jaxring calls on it in the same order. `slot_bytes` is the staging area per rank; messages
    larger than it move in chunks.
    """

    def __init__(self, mpi_comm, *, label: str = "", slot_bytes: int = DEFAULT_SLOT_BYTES):
        MPI = _mpi()
        self.mpi_comm = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.name = f"MPI communicator {label or hex(id(mpi_comm))} ({self.size} processes)"
        node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        on_one_node = mpi_comm.allreduce(node.Get_size() == self.size, op=MPI.LAND)
        node.Free()
        if not on_one_node:
            raise NotImplementedError(
                f"jaxring.mpi: the {self.size} ranks of {self.name} are spread over several "
                "nodes; jaxring's transport between nodes (MPI point-to-point) is not built yet. "
                "Run every rank on one node for now.")
        self.key = mpi_comm.bcast(secrets.randbits(63) if self.rank == 0 else None, root=0)
        path = f"/jaxring-{self.key:016x}"
        # Rank 0 creates the segment, then the others map it; errors are shared so that no rank
        # is left waiting for one that failed.
        for creating in (True, False):
            error = None
            if (self.rank == 0) == creating:
                try:
                    native.extension.shm_attach(self.key, path, creating, self.rank, self.size,
                                                slot_bytes, self.name)
                except RuntimeError as e:
                    error = f"rank {self.rank}: {e}"
            errors = [e for e in mpi_comm.allgather(error) if e]
            if errors:
                if self.rank == 0:
                    native.extension.shm_unlink(path)
                native.extension.shm_detach(self.key)
                raise RuntimeError("jaxring.mpi: cannot set up " + self.name + ": " +
                                   "; ".join(errors))
        if self.rank == 0:
            native.extension.shm_unlink(path)  # every rank has it mapped; nothing to clean up
        weakref.finalize(self, native.extension.shm_detach, self.key)
        _wait_for_pending_work_at_exit()

    def split(self, color: int, key: int = 0) -> "Communicator":
        """Ranks with the same `color` form a new communicator, ordered by `key` (MPI_Comm_split)."""
        return Communicator(self.mpi_comm.Split(color, key), label=f"split(color={color})")

    def axis_communicator(self) -> common.AxisCommunicator:
        return common.AxisCommunicator(axes=(), size=self.size, key=self.key, name=self.name,
                                       process_rank=self.rank)

    def __repr__(self) -> str:
        return f"<jaxring.mpi.Communicator {self.name}, rank {self.rank}>"


@functools.cache
def world() -> Communicator:
    """Every process of the job (a duplicate of MPI_COMM_WORLD)."""
    return Communicator(_mpi().COMM_WORLD.Dup(), label="world")


@functools.cache
def _wait_for_pending_work_at_exit() -> None:
    """A process that dispatched a collective and exits at once must still take part in it, or
    its peers would wait for it in vain (mpi4jax#22). JAX dispatches asynchronously, so wait for
    every pending computation before the interpreter shuts down."""
    import jax

    atexit.register(jax.effects_barrier)
