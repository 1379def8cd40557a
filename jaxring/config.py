"""jaxring's configuration: one object, written through to the native library.

Environment variables (JAXRING_TIMEOUT_SECONDS, JAXRING_RING_THRESHOLD_BYTES, JAXRING_ALGORITHM,
JAXRING_PIPELINE_SLICE_BYTES, JAXRING_SPIN_ITERATIONS, JAXRING_P2P_EAGER_BYTES,
JAXRING_MPI_RING_THRESHOLD_BYTES, JAXRING_MPI_DIRECT_HEADER_RANKS, JAXRING_HUGE_PAGE_BYTES,
JAXRING_SHM_STORES, JAXRING_COPY_INPUT_BYTES, JAXRING_HAND_OFF_AFTER_SECONDS,
JAXRING_CPU_KERNELS, JAXRING_SCRATCH_POOL_BYTES) override the defaults at import time; ``update``
and ``override`` change them at run time. Values are read when a collective runs
(mpi_direct_header_ranks when a jaxring.mpi communicator is created); ``update`` and ``override``
first wait for the programs already dispatched to finish, so each program runs under the
configuration in force when it was dispatched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import os
import threading

from jaxring._src import native


@dataclasses.dataclass(frozen=True)
class Config:
    # Every wait gives up after this long, naming the devices that never arrived (over MPI past
    # mpi_direct_header_ranks ranks, the rank this one heard nothing from); float("inf") waits
    # for ever.
    timeout_seconds: float = 300.0
    # Devices of one process: "auto" uses the direct (one-shot) algorithm up to this many bytes
    # per device and the pipelined ring above it (ranks sharing a node's memory, jaxring.mpi's
    # shm transport, always stage through it and read neither this nor `algorithm`). Measured in benchmarks/allreduce.py: on CPU devices sharing one
    # memory the direct path moves the fewest bytes at every size, so the ring is opt-in there.
    ring_threshold_bytes: int = 1 << 62
    # "auto", "direct" or "ring": forces one algorithm for every call when not "auto" (over
    # MPI, "direct" is recursive doubling).
    algorithm: str = "auto"
    # The ring moves each chunk in slices of about this many bytes (pipelining); over MPI, and in
    # its broadcast chain, slices grow past it where a step would otherwise have over 1024.
    pipeline_slice_bytes: int = 256 * 1024
    # Polls before a waiting device sleeps in the kernel; small because devices share cores.
    spin_iterations: int = 256
    # Point-to-point: ppermute messages up to this many bytes go eagerly through the receiver's
    # mailbox (the sender does not wait); larger ones are read in place from the sender.
    p2p_eager_bytes: int = 64 * 1024
    # Process communicators over MPI (jaxring.mpi): all_reduce by recursive doubling up to this
    # many bytes per rank, the pipelined ring above it; broadcast by a binomial tree of whole
    # messages up to it, a pipelined chain above. A hierarchical communicator also fixes,
    # when it is created (its ranks must agree), which all-reduces go through its node levels:
    # those larger than its value then (Communicator.levels_threshold_bytes).
    mpi_ring_threshold_bytes: int = 64 * 1024
    # The MPI transport's header exchange: direct (one round; timeouts name exactly the absent
    # ranks) up to this many ranks, Bruck's log2 n rounds above. Read when a jaxring.mpi
    # communicator is created, whose ranks must agree on the method it gives.
    mpi_direct_header_ranks: int = 64
    # CPU outputs of at least this many bytes get transparent huge pages (madvise) before their
    # first write; 0 turns it off. Outputs this large are usually fresh mappings, and on a VM each
    # 4 KiB page fault costs about 2.7 us: 64 MiB took 48 ms to fault in, 10 ms as huge pages.
    huge_page_bytes: int = 8 << 20
    # How ranks on one node write into their shared memory: "auto" times plain copies and switches
    # to non-temporal stores while they run slow (the reading core on another die), "plain" or
    # "streaming" force one kind.
    shm_stores: str = "auto"
    # Devices of one process: direct collectives up to this many input bytes per device copy
    # their input into the rendezvous as they arrive, and each device then writes only its own
    # output from the copies and leaves without waiting for its peers to finish reading (one
    # hand-off instead of two); 0 turns it off.
    copy_input_bytes: int = 16 * 1024
    # Devices of one process: how long a call waits for its peers on XLA's thread before it hands
    # the wait and the rest of the call to a jaxring thread, so that XLA's few threads stay free
    # for work a late peer may be queued behind (README, "Failure behaviour"). Peers in step
    # arrive well within it; 0 hands off every call whose peers are not all there after the short
    # spin and yield that every wait begins with.
    hand_off_after_seconds: float = 1e-3
    # The instruction set of the CPU reduction kernels: "auto" (the widest this CPU supports,
    # except SSE2 for dtypes other than float16/bfloat16 where the outputs are large enough to be
    # written with streaming stores), "baseline" (SSE2 on x86-64), "avx2" or "avx512". All write
    # the same bits; the wider ones are faster where the reduction, not memory, is the
    # bottleneck: float16/bfloat16 sums, and sums whose data sits in the cache.
    cpu_kernels: str = "auto"
    # Scratch memory that calls reuse from one to the next instead of allocating and faulting in
    # fresh pages (the ring's partial sums, float32 for 16-bit dtypes; copies of sent messages
    # larger than a mailbox slot): at most this many bytes stay pooled between calls, the largest
    # buffers beyond it are freed; 0 pools none. Lowering it frees the excess at once.
    scratch_pool_bytes: int = 1 << 30


_ENV = {
    "timeout_seconds": ("JAXRING_TIMEOUT_SECONDS", float),
    "ring_threshold_bytes": ("JAXRING_RING_THRESHOLD_BYTES", int),
    "algorithm": ("JAXRING_ALGORITHM", str),
    "pipeline_slice_bytes": ("JAXRING_PIPELINE_SLICE_BYTES", int),
    "spin_iterations": ("JAXRING_SPIN_ITERATIONS", int),
    "p2p_eager_bytes": ("JAXRING_P2P_EAGER_BYTES", int),
    "mpi_ring_threshold_bytes": ("JAXRING_MPI_RING_THRESHOLD_BYTES", int),
    "mpi_direct_header_ranks": ("JAXRING_MPI_DIRECT_HEADER_RANKS", int),
    "huge_page_bytes": ("JAXRING_HUGE_PAGE_BYTES", int),
    "shm_stores": ("JAXRING_SHM_STORES", str),
    "copy_input_bytes": ("JAXRING_COPY_INPUT_BYTES", int),
    "hand_off_after_seconds": ("JAXRING_HAND_OFF_AFTER_SECONDS", float),
    "cpu_kernels": ("JAXRING_CPU_KERNELS", str),
    "scratch_pool_bytes": ("JAXRING_SCRATCH_POOL_BYTES", int),
}


# Per field type, what it accepts (NumPy's scalars too) and how to name it.
_ACCEPTS = {float: (numbers.Real, "a number"), int: (numbers.Integral, "an int"),
            str: (str, "a str")}


# The numeric fields' ranges (_validate).
_POSITIVE = ("timeout_seconds", "pipeline_slice_bytes", "mpi_direct_header_ranks")
_NON_NEGATIVE = ("spin_iterations", "p2p_eager_bytes", "huge_page_bytes", "copy_input_bytes",
                 "ring_threshold_bytes", "mpi_ring_threshold_bytes", "scratch_pool_bytes",
                 "hand_off_after_seconds")


def _takes(kind: type, value) -> bool:
    """Whether a field of `kind` takes `value` (converted to `kind` by _validate)."""
    # A bool is an int to Python but no count of bytes or seconds.
    return not isinstance(value, bool) and isinstance(value, _ACCEPTS[kind][0])


def _validate(config: Config) -> Config:
    """`config` with every field of its Python type, or a TypeError/ValueError naming the field."""
    typed = {}
    for field, (_, kind) in _ENV.items():
        value = getattr(config, field)
        if not _takes(kind, value):
            raise TypeError(f"jaxring.config: {field} must be {_ACCEPTS[kind][1]}, got {value!r}")
        if kind is int and not -2**63 <= value < 2**63:  # the native library's int64_t
            raise ValueError(f"jaxring.config: {field} must be in [-2**63, 2**63), got {value}")
        typed[field] = kind(value)
    config = dataclasses.replace(config, **typed)
    if config.algorithm not in ("auto", "direct", "ring"):
        raise ValueError(
            f"jaxring.config: algorithm must be 'auto', 'direct' or 'ring', got {config.algorithm!r}"
        )
    if config.shm_stores not in ("auto", "plain", "streaming"):
        raise ValueError("jaxring.config: shm_stores must be 'auto', 'plain' or 'streaming', got "
                         f"{config.shm_stores!r}")
    kernels = native.extension.cpu_kernels_supported()
    if config.cpu_kernels not in kernels:
        raise ValueError(f"jaxring.config: cpu_kernels must be one of "
                         f"{', '.join(map(repr, kernels))} on this CPU, "
                         f"got {config.cpu_kernels!r}")
    for field in _POSITIVE + _NON_NEGATIVE:
        value = getattr(config, field)
        positive = field in _POSITIVE
        if not (value > 0 if positive else value >= 0):  # NaN is neither
            raise ValueError(f"jaxring.config: {field} must be {'> 0' if positive else '>= 0'}, "
                             f"got {value}")
    return config


def _from_environment() -> Config:
    values = {}
    for field, (variable, kind) in _ENV.items():
        if variable in os.environ:
            raw = os.environ[variable]
            try:
                values[field] = kind(raw)
            except ValueError:
                raise ValueError(f"jaxring.config: the environment's {variable}={raw!r} is not "
                                 f"{_ACCEPTS[kind][1]}") from None
    return _validate(Config(**values))


_current = _from_environment()
native.extension.set_config(**dataclasses.asdict(_current))


def get() -> Config:
    """The configuration in force."""
    return _current


def _finish_dispatched_programs() -> None:
    """Waits for the programs already dispatched, so that each runs wholly under the
    configuration it was dispatched under. (The devices of one in-process call always share one:
    the configuration in force when the call's first device arrived.)"""
    from jaxring._src import common  # which imports this module

    common.wait_for_dispatched_programs()


# Updates from several threads take turns: each builds on the configuration the previous made.
_updating = threading.RLock()


def update(**changes) -> Config:
    """Changes some fields, e.g. ``jaxring.config.update(timeout_seconds=10)``, once the
    programs already dispatched have finished."""
    with _updating:
        return _update(changes)


def _keeps(field: str, value) -> bool:
    """Whether setting `field` to `value` leaves the configuration as it is: an equal value of a
    type _validate takes for that field (an int for seconds, say; never a bool, nor a float for a
    count, which _validate refuses)."""
    return _takes(_ENV[field][1], value) and value == getattr(_current, field)


def _update(changes: dict) -> Config:
    global _current
    unknown = sorted(set(changes) - set(_ENV))
    if unknown:
        raise TypeError(f"jaxring.config: no field {', '.join(map(repr, unknown))}; the fields are "
                        f"{', '.join(_ENV)}")
    if all(_keeps(field, value) for field, value in changes.items()):
        # Nothing changes (an override of a field to its value, or its restoring): no programs to
        # wait for, nothing to hand on. Such an override cost 40-100 us around each timed call
        # of benchmarks/allreduce.py, in which the devices' threads fell asleep.
        return _current
    new = _validate(dataclasses.replace(_current, **changes))
    _finish_dispatched_programs()
    native.extension.set_config(**dataclasses.asdict(new))
    _current = new
    return _current


@contextlib.contextmanager
def override(**changes):
    """Changes some fields inside a ``with`` block, restoring those fields afterwards (a field
    the block changed with ``update`` keeps its new value)."""
    with _updating:
        before = _current
        update(**changes)
    try:
        yield _current
    finally:
        update(**{field: getattr(before, field) for field in changes})
