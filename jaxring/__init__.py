"""jaxring: jit-compatible ring collectives for JAX, as XLA FFI custom calls.

Every collective takes a mesh axis name (inside ``jax.shard_map`` or ``jax.pmap``), or a
``jaxring.mpi.Communicator`` for processes launched by ``mpiexec``, and follows the semantics of
its ``jax.lax`` twin where one exists.
"""

from jaxring import config
from jaxring._src.all_gather import all_gather
from jaxring._src.all_reduce import all_reduce
from jaxring._src.barrier import barrier
from jaxring._src.broadcast import broadcast
from jaxring._src.common import REDUCE_OPS, SUPPORTED_DTYPES, reset_after_error
from jaxring._src.ppermute import ppermute
from jaxring._src.reduce_scatter import reduce_scatter
from jaxring._src.send_recv import recv, send

__version__ = "0.1.0"

__all__ = [
    "REDUCE_OPS",
    "SUPPORTED_DTYPES",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "config",
    "ppermute",
    "recv",
    "reduce_scatter",
    "reset_after_error",
    "send",
]
