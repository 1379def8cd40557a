"""Process communicators: jaxring's collectives across processes launched by ``mpiexec``, one
JAX device per process, as Horovod and mpi4jax users run them.

    comm = jaxring.mpi.world()
    y = jax.jit(lambda x: jaxring.all_reduce(x, comm))(x)     # any collective, in place of an axis

Three transports carry the data:

* ``"shm"``: ranks on one node meet in a shared-memory segment (``xla_ffi/transports/shm``);
  every byte is staged once and read once per reader, with no MPI double copy.
* ``"mpi"``: non-blocking MPI point-to-point on a private duplicate of the communicator
  (``xla_ffi/transports/mpi``): recursive doubling for small all-reduces, a sliced, pipelined
  ring for large ones. It needs jaxring's MPI extension, built against the same MPI that mpi4py
  uses (checked here, with a clear error if they differ).
* ``"hierarchical"``: ranks on several nodes, each with the same number of ranks. Large
  all-reduces run as a reduce-scatter within each node (shared memory), an all-reduce of each
  shard between nodes (MPI), and an all-gather within each node; everything else goes over MPI.
  Asked for on one node it becomes ``"shm"``, over nodes of unequal sizes ``"mpi"`` (the
  communicator's ``transport`` tells which).

``"auto"`` (the default, or ``JAXRING_MPI_TRANSPORT``) takes shared memory when every rank is on
one node, hierarchical when nodes hold equal numbers of ranks, and MPI otherwise.
``ppermute``/``send``/``recv`` always go over MPI. ``JAXRING_MPI_RANKS_PER_NODE`` (or
`ranks_per_node`) = k pretends that nodes hold k consecutive ranks each, so that one machine runs
the paths between nodes (a split keeps its parent's pretend nodes).

Processes with a GPU also get a GPU transport (`gpu_transport`, or ``JAXRING_GPU_TRANSPORT``):
``"ipc"`` (GPU memory mapped between the processes of one node), ``"staged"`` (pipelined pinned
staging through the transport above) or ``"host"``; ``"auto"`` is ipc on one node (up to 16
ranks) and staged across nodes. See jaxring/_src/gpu.py.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import secrets
import sys
import time
import weakref

from jaxring import config
from jaxring._src import common, gpu, native

# Staging slot per rank. Measured at 2 and 4 ranks, bound to cores or not (README, "Across
# processes"): 1 MiB slots beat 4 MiB ones from 4 MiB messages up (a step's slots stay in cache),
# in a loop (4 MiB: 593 against 793 us) and alone (16 MiB: 3.7 against 5.0 ms), and tie below.
DEFAULT_SLOT_BYTES = 1 << 20
TRANSPORTS = ("auto", "shm", "mpi", "hierarchical")


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as error:  # pragma: no cover - mpi4py is a dependency of the mpi extra
        raise ImportError("jaxring.mpi needs mpi4py: pip install 'jaxring[mpi]'") from error
    return MPI


@functools.cache
def _mpi_extension():
    """jaxring's MPI transport module and None, or None and why it cannot be used."""
    MPI = _mpi()  # loads the MPI library first, so the extension binds to that very library
    runtime = MPI.Get_library_version().strip(" \n\x00").splitlines()[0]  # Open MPI's ends in NUL
    rebuild = ("rebuild jaxring against the MPI that mpi4py uses: MPICC=<its mpicc> pip install "
               "--no-build-isolation --no-deps -e . (README, \"Across processes\")")
    try:
        from jaxring import _jaxring_mpi
    except ImportError as error:
        if "No module named" in str(error):
            return None, "jaxring was built without its MPI transport (no mpicc at build time)"
        return None, (f"build-time and run-time MPI differ: jaxring's MPI transport cannot be "
                      f"loaded next to mpi4py's MPI ({runtime}): {error}; {rebuild}")
    try:
        native.check_same_build("jaxring's MPI transport", native.build_id(_jaxring_mpi))
    except RuntimeError as error:
        return None, str(error)
    linked = _jaxring_mpi.library_version().strip(" \n\x00").splitlines()[0]
    if linked != runtime:
        return None, (f"build-time and run-time MPI differ: jaxring's MPI transport was built "
                      f"with {_jaxring_mpi.built_with()} and runs {linked}, but mpi4py runs "
                      f"{runtime}; {rebuild}")
    _jaxring_mpi.set_call_site_source(native.extension.call_site_address())
    return _jaxring_mpi, None


def _check_slot_bytes(slot_bytes, size: int) -> None:
    """A slot holds one step of every collective: for reduce_scatter one element of the widest
    dtype (8 bytes) per rank, so that each step moves at least one element per rank. Rank r's
    slot starts r x slot_bytes into the segment, so a multiple of 64 starts every slot on a cache
    line, aligned for every dtype (the reductions read elements in place)."""
    value = common.as_index(slot_bytes)
    if value is None or value < 8 * size or value % 64:
        raise ValueError(f"jaxring.mpi: slot_bytes must be an int of at least 8 x {size} ranks = "
                         f"{8 * size} bytes and a multiple of 64 (every rank's slot starts on a "
                         f"cache line), got {slot_bytes!r}")
    # The segment holds 2 x (size + 1) slots; a size past 2**62 bytes would wrap in the native
    # library's arithmetic and map a few bytes (a crash on the first call, where it was let by).
    if 2 * (size + 1) * value > 1 << 62:
        raise ValueError(f"jaxring.mpi: slot_bytes must be at most 2**62 / (2 x {size + 1}) = "
                         f"{(1 << 62) // (2 * (size + 1))} bytes, got {slot_bytes!r}")


def _done_within(requests: list, seconds: float) -> bool:
    """Whether the MPI `requests` complete within `seconds`, polled (mpi4py's waits have no
    timeout)."""
    deadline = time.monotonic() + seconds
    pause = 1e-5
    while not _mpi().Request.Testall(requests):
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)
    return True


# The requests (and their buffers) of meetings that timed out: MPI forbids freeing a pending
# collective's request, and a late rank's meeting completes them.
_abandoned_requests: list = []


def _meet(mpi_comm, what: str, kind: str | None = None, error: str | None = None) -> None:
    """Waits, up to jaxring.config's timeout, for every rank of `mpi_comm` to come to `what` (one
    of its collectives, in which mpi4py would wait for a missing rank for ever): a barrier, then
    the maximum of a flag saying whether a rank gave up on it. A rank that times out sets its
    flag and raises; a rank that comes after it finds the flag set, so it raises too instead of
    going on to a collective that nobody else calls: at once while the ranks that gave up still
    make MPI progress (are in MPI calls), else when its own timeout passes. Either way every
    rank has made the same two collectives, so the communicator's collectives stay in step.
    Ranks through the barrier give the flag twice the timeout: one that gave up on it alone,
    while the others found it clear, would leave them waiting in the set-up's next collective.

    The same reduction tells whether every rank came for the same `kind` of set-up (default:
    `what`; ranks making different ones would go on to different MPI collectives and wait in
    them for ever) and whether a rank's arguments were refused (`error`, this rank's reason):
    every rank then raises."""
    import numpy as np

    seconds = config.get().timeout_seconds
    where = f"an MPI communicator of {mpi_comm.Get_size()} processes"
    barrier = mpi_comm.Ibarrier()
    came = _done_within([barrier], seconds)
    digest = int.from_bytes(hashlib.blake2b((kind or what).encode(), digest_size=7).digest(),
                            "little")
    # Maxima of: gave up; the kind's digest and its negation (their maximum and minimum); the
    # highest rank (plus one) whose arguments were refused.
    mine = np.array([0 if came else 1, digest, -digest,
                     mpi_comm.Get_rank() + 1 if error else 0], np.int64)
    agreed = np.zeros_like(mine)
    agree = mpi_comm.Iallreduce(mine, agreed, op=_mpi().MAX)
    if came and _done_within([agree], 2 * seconds):
        gave_up, highest, negated_lowest, refused = (int(v) for v in agreed)
        if gave_up:
            raise RuntimeError(
                f"jaxring.mpi: rank {mpi_comm.Get_rank()} came to {what} on {where} after "
                "another rank had given up waiting for it (JAXRING_TIMEOUT_SECONDS sets how "
                "long ranks wait)")
        if highest != -negated_lowest:
            raise RuntimeError(
                f"jaxring.mpi: the ranks of {where} came to different set-ups at once (rank "
                f"{mpi_comm.Get_rank()} to {what}): every rank must make the same jaxring.mpi "
                "calls on it (Communicator, split, world) in the same order")
        if refused:
            raise ValueError(error or f"jaxring.mpi: rank {refused - 1}'s arguments to {what} "
                                      "were refused (its error says why)")
        return
    _abandoned_requests.append(([barrier, agree], (mine, agreed)))
    raise TimeoutError(
        f"jaxring.mpi: rank {mpi_comm.Get_rank()} timed out after {seconds:g} s waiting for the "
        f"other ranks of {where} to {what}: "
        "every rank must, in the same order as its other collectives on that communicator "
        "(JAXRING_TIMEOUT_SECONDS sets the timeout); a rank that comes later raises too, at "
        "once while this one still makes MPI calls")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _agreed(mpi_comm, resolve):
    """`resolve()`, the options of a Communicator, on every rank; they must agree. A rank whose
    options are bad, or differ from the others', would leave its peers waiting for ever in MPI
    collectives of the set-up that it never reaches (mpi4py's have no timeout), so every rank
    raises instead, naming each rank's problem."""
    try:
        mine, error = resolve(), None
    except (TypeError, ValueError) as e:
        mine, error = None, str(e)
    # Beyond the options, every rank must run the same build (headers and shared-memory layouts
    # may differ between builds) and load jaxring's MPI transport or not (its set-up is
    # collective): both are checked before any other collective of the set-up, which starts when
    # every rank has come (or times out).
    _meet(mpi_comm, "create a jaxring.mpi.Communicator on it")
    everyone = mpi_comm.allgather((mine, error, native.build_id(), _mpi_extension()[1]))
    for index, what in ((2, "run the same build of jaxring"),
                        (3, "be able to use jaxring's MPI transport, or none")):
        found = {}
        for rank, theirs in enumerate(everyone):
            found.setdefault(theirs[index], []).append(rank)
        if len(found) > 1:
            raise RuntimeError(f"jaxring.mpi: every rank must {what}, but " + "; ".join(
                f"{_ranks(ranks)}: " + (f"build {value}" if index == 2 else value or "usable")
                for value, ranks in found.items()))
    errors = [f"rank {rank}: {e}" for rank, (_, e, _, _) in enumerate(everyone) if e]
    if errors:
        raise ValueError("; ".join(errors))
    for rank, (theirs, _, _, _) in enumerate(everyone):
        if theirs != everyone[0][0]:
            raise ValueError(
                f"jaxring.mpi: every rank must ask for the same communicator, but rank 0 asked "
                f"for (transport, slot_bytes, ranks_per_node, GPU options, direct header "
                f"exchange) {everyone[0][0]} and "
                f"rank {rank} for {theirs}: pass the same arguments, JAXRING_ variables and "
                "jaxring.config to every rank")
    return mine


class Communicator:
    """The processes of an mpi4py communicator. Pass it wherever a collective takes an axis name.

    Every rank must create it (it is collective, like MPI_Comm_dup) and then make the same
    jaxring calls on it in the same order. `transport` is ``"auto"``, ``"shm"``, ``"mpi"`` or
    ``"hierarchical"`` (see the module docstring); `slot_bytes` is the shared-memory staging area
    per rank, and messages larger than it move in chunks; `ranks_per_node` pretends a node layout
    (for tests and benchmarks on one machine). `gpu_transport` is ``"auto"``, ``"ipc"``,
    ``"staged"`` or ``"host"`` (processes with GPUs only); `gpu_workspace_bytes` (cuda-ipc, per
    rank and parity) and `gpu_staging_bytes` (staged, per pinned chunk) bound one step.

    A hierarchical communicator's all-reduces of more than `levels_threshold_bytes` per rank go
    through its `levels`: jaxring.config's mpi_ring_threshold_bytes when it was made, on which its
    ranks must agree.

    `free()` (or a ``with`` block) releases it, collectively, like MPI_Comm_free.
    """

    def __init__(self, mpi_comm, *, label: str = "", transport: str | None = None,
                 slot_bytes: int = DEFAULT_SLOT_BYTES, ranks_per_node: int | None = None,
                 gpu_transport: str | None = None, gpu_workspace_bytes: int | None = None,
                 gpu_staging_bytes: int | None = None, _pretend_node: int | None = None):
        MPI = _mpi()
        self._freed = False
        self._owned = []  # MPI communicators this one made, which free() frees

        def resolve():
            options = gpu.GpuOptions.resolve(gpu_transport, gpu_workspace_bytes,
                                             gpu_staging_bytes)
            chosen = transport or os.environ.get("JAXRING_MPI_TRANSPORT", "auto")
            _check_slot_bytes(slot_bytes, mpi_comm.Get_size())
            if chosen not in TRANSPORTS:
                raise ValueError(f"jaxring.mpi: transport must be one of {TRANSPORTS}, "
                                 f"got {chosen!r}")
            pretend = _ranks_per_node(ranks_per_node)
            # The MPI transport's header exchange, which ranks must share: differing, they would
            # mistake each other's messages (config.py).
            direct_headers = mpi_comm.Get_size() <= config.get().mpi_direct_header_ranks
            return chosen, int(slot_bytes), pretend, options, direct_headers

        transport, slot_bytes, ranks_per_node, gpu_options, direct_headers = _agreed(
            mpi_comm, resolve)
        self.mpi_comm = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        # The same on every rank (shared memory's name and the native calls' key), and so is
        # the name, which every rank's errors give.
        self.key = mpi_comm.bcast(
            secrets.randbits(62) | common.PROCESS_KEY_BIT if self.rank == 0 else None, root=0)
        label = label or f"{self.key & 0xFFFFFF:06x}"
        self.name = f"MPI communicator {label} ({self.size} processes)"
        self.levels = None  # (this node's communicator, the one across nodes) when hierarchical
        self.slot_bytes = slot_bytes
        self._requested = (transport, ranks_per_node)
        # This rank's pretend node (ranks_per_node > 0): a split's ranks keep their parent's.
        self._pretend_node = None
        if ranks_per_node:
            self._pretend_node = (self.rank // ranks_per_node if _pretend_node is None
                                  else _pretend_node)
        self._gpu_requested = gpu_options
        self._finalizer = None
        node = _node_communicator(mpi_comm, self._pretend_node)
        self._owned.append(node)  # until the node level takes it over, or the set-up ends
        levels = []  # the levels made so far
        try:
            self._set_up(node, levels, label, transport, slot_bytes, ranks_per_node,
                         gpu_options, direct_headers)
        except BaseException:
            # Whatever the set-up made is released on this rank, wherever it failed: the levels
            # made so far, its native state and the MPI communicators it made.
            self.levels = tuple(levels) or None
            self._release()
            raise

    def _set_up(self, node, levels: list, label: str, transport: str, slot_bytes: int,
                ranks_per_node: int, gpu_options, direct_headers: bool) -> None:
        """__init__'s collective part, once the ranks agree on the options."""
        mpi_comm = self.mpi_comm
        MPI = _mpi()
        node_sizes = mpi_comm.allgather(node.Get_size())
        on_one_node = node_sizes[0] == self.size
        extension, self.point_to_point_unavailable = _mpi_extension()
        if transport == "auto":
            transport = "shm" if on_one_node else "hierarchical"
        if transport == "hierarchical" and (on_one_node or len(set(node_sizes)) > 1):
            transport = "shm" if on_one_node else "mpi"  # uneven nodes: one flat MPI ring
        # A hierarchical communicator's all-reduces larger than this many bytes per rank go
        # through its levels, as decided at trace time. Ranks deciding differently would wait for
        # each other on different communicators until the timeout, so it is fixed now, agreed.
        self.levels_threshold_bytes = None
        thresholds = {}
        if transport == "hierarchical":
            everyone = mpi_comm.allgather(config.get().mpi_ring_threshold_bytes)
            self.levels_threshold_bytes = everyone[0]
            for rank, threshold in enumerate(everyone):
                thresholds.setdefault(threshold, []).append(rank)
        # Each problem below is the same on every rank.
        if len(thresholds) > 1:
            raise ValueError(
                f"jaxring.mpi: every rank of the hierarchical {self.name} must have the same "
                "jaxring.config mpi_ring_threshold_bytes, above which its all-reduces go through "
                "its levels, but " + "; ".join(f"{_ranks(ranks)} {threshold}"
                                               for threshold, ranks in thresholds.items()))
        if transport == "shm" and not on_one_node:
            raise ValueError(f"jaxring.mpi: the ranks of {self.name} are on several nodes; "
                             "the shared-memory transport needs them on one (use "
                             "transport='mpi')")
        if transport != "shm" and extension is None:
            raise RuntimeError(f"jaxring.mpi: {self.name} needs the MPI transport"
                               f"{'' if on_one_node else ' (its ranks are on several nodes)'}"
                               f", but {self.point_to_point_unavailable}")
        self.transport = transport
        # Run when the object is collected, or at exit: this rank then closes it alone.
        self._finalizer = weakref.finalize(self, _detach, self.key, alone=True)
        if extension is not None:
            try:
                transport_capsule = extension.create(MPI._addressof(mpi_comm), self.name,
                                                     direct_headers)
            except RuntimeError as error:  # e.g. MPI initialised without MPI_THREAD_MULTIPLE
                if transport != "shm":
                    raise
                self.point_to_point_unavailable = str(error)
            else:
                native.extension.process_register(self.key, transport_capsule)
        if transport == "shm":
            self._attach_shared_memory(slot_bytes)
        self._owned.remove(node)
        if transport == "hierarchical":
            gpu_levels = dict(gpu_transport=gpu_options.transport,
                              gpu_workspace_bytes=gpu_options.workspace_bytes,
                              gpu_staging_bytes=gpu_options.staging_bytes)
            # Each level on every rank before the next: a rank whose node level failed (say, its
            # node's /dev/shm is full) must not leave the other nodes' ranks waiting for it in
            # the set-up of the level across nodes. Each level owns its MPI communicator (freed
            # if the level fails), and places its ranks on nodes as this communicator did, not
            # from JAXRING_MPI_RANKS_PER_NODE, which the caller may have overridden.
            def level(comm, make):
                levels.append(common.set_up_on_every_rank(
                    mpi_comm, lambda: _owning(comm, make), self.rank, self.name,
                    Communicator._release))

            level(node, lambda comm: Communicator(
                comm, label=f"{label} node", transport="shm", slot_bytes=slot_bytes,
                ranks_per_node=comm.Get_size() if ranks_per_node else 0, **gpu_levels))
            level(mpi_comm.Split(node.Get_rank(), key=self.rank), lambda comm: Communicator(
                comm, label=f"{label} across nodes", transport="mpi",
                ranks_per_node=1 if ranks_per_node else 0, **gpu_levels))
            self.levels = tuple(levels)
            # A failed call on any of the three makes this rank leave the other two, so that its
            # peers there (on other nodes too) fail at once instead of after a timeout.
            native.extension.link_failures([self.key] + [level.key for level in self.levels])
        else:
            node.Free()
        # The transport GPU calls take ("none" in processes without GPUs), and whether MPI takes
        # device pointers (with how that was found out).
        self.gpu_transport, self.cuda_aware_mpi, self.cuda_aware_mpi_source = gpu.attach(
            mpi_comm, self.key, self.rank, self.size, self.name, gpu_options, on_one_node,
            extension)
        if self.gpu_transport in ("ipc", "staged"):
            _meet_at_exit(mpi_comm)
        _wait_for_pending_work_at_exit()

    def _attach_shared_memory(self, slot_bytes: int) -> None:
        path = f"/jaxring-{self.key:016x}"
        # Rank 0 creates the segment, then the others map it; errors are shared so that no rank
        # is left waiting for one that failed.
        def attach(creating):
            if (self.rank == 0) == creating:
                native.extension.shm_attach(self.key, path, creating, self.rank, self.size,
                                            slot_bytes, self.name)

        try:
            for creating in (True, False):
                common.set_up_on_every_rank(self.mpi_comm, lambda: attach(creating), self.rank,
                                            self.name)
        except RuntimeError:
            if self.rank == 0:
                native.extension.shm_unlink(path)
            raise
        if self.rank == 0:
            native.extension.shm_unlink(path)  # every rank has it mapped; nothing to clean up

    def split(self, color: int, key: int = 0) -> "Communicator | None":
        """Ranks with the same `color` form a new communicator, ordered by `key` (MPI_Comm_split),
        asking for what this one asked for (transport, slot_bytes, ranks_per_node, GPU
        options); its ranks keep the pretend nodes they had here, which need not be k
        consecutive ranks of the split nor equal in size. Its MPI communicator is its own:
        free() frees it. A rank whose color is ``MPI.UNDEFINED`` joins none and gets None, as
        MPI gives it MPI_COMM_NULL."""
        self._check_not_freed()
        transport, ranks_per_node = self._requested
        options = self._gpu_requested
        color, key, problem = _split_arguments(color, key)
        _meet(self.mpi_comm, f"split {self.name}", kind="split", error=problem)
        split = self.mpi_comm.Split(color, key)
        if split == _mpi().COMM_NULL:
            return None
        return _owning(split, lambda comm: Communicator(
            comm, label=f"split(color={color})", transport=transport,
            slot_bytes=self.slot_bytes, ranks_per_node=ranks_per_node,
            _pretend_node=self._pretend_node,
            gpu_transport=options.transport,
            gpu_workspace_bytes=options.workspace_bytes, gpu_staging_bytes=options.staging_bytes))

    def free(self) -> None:
        """Releases this communicator: its shared memory, its MPI transport, the levels of a
        hierarchical one, and the MPI communicators it made (by `split`, by `world`, for its
        levels; one passed in stays the caller's to free). Collective, like MPI_Comm_free: every
        rank calls it after its last call on the communicator, and it waits (up to the timeout,
        naming the ranks that never came, or past `mpi_direct_header_ranks` ranks the one this
        rank heard nothing from, as every collective's timeout does) for all of them, so that no
        peer still reads this rank's memory. Later calls on it fail, saying so; a second free()
        does nothing. Where the barrier fails (a communicator that failed refuses it, as every
        later call), this rank's part is released all the same and the barrier's error raised.
        A GPU transport's device memory is not yet returned (README, "GPUs")."""
        if self._freed:
            return
        if not self._finalizer.alive:  # released at interpreter exit
            self._release()
            return
        import jax

        from jaxring._src.barrier import barrier_to_free

        try:
            jax.jit(lambda: barrier_to_free(self))()
            jax.effects_barrier()  # this process's programs on it (the barrier last) are done
        finally:
            # Released even where the barrier failed, so that a communicator that failed (which
            # refuses every later call, this barrier too) can still be freed: its peers keep
            # their own mappings of the shared memory, and a broken MPI transport leaves its MPI
            # communicator allocated for messages still on their way.
            self._release()

    def _release(self) -> None:
        """free() once every rank is there (which covers the levels' ranks too)."""
        self._freed = True
        try:
            # None where the set-up failed before native state; detach() gives None once run.
            if self._finalizer is not None and self._finalizer.detach() is not None:
                _detach(self.key)  # with every rank
            for level in self.levels or ():
                level._release()
        finally:
            if not _mpi().Is_finalized():
                for comm in self._owned:
                    comm.Free()
            self._owned.clear()
            if world.cache_info().currsize and world() is self:
                world.cache_clear()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if error is None:
            self.free()
            return
        # The block failed, perhaps on this rank alone, whose peers may be in another call: the
        # block's error is the one to report, with free()'s beside it.
        try:
            self.free()
        except Exception as failure:  # noqa: BLE001 - reported with the block's error
            error.add_note(f"and free() of {self.name} then failed: {failure}")

    def _check_not_freed(self) -> None:
        if self._freed:
            raise ValueError(f"jaxring.mpi: {self.name} was freed")

    def axis_communicator(self) -> common.AxisCommunicator:
        self._check_not_freed()
        return common.AxisCommunicator(axes=(), size=self.size, key=self.key, name=self.name,
                                       process_rank=self.rank, owner=self)

    def __repr__(self) -> str:
        gpu_part = "" if self.gpu_transport == "none" else f", GPU {self.gpu_transport}"
        return (f"<jaxring.mpi.Communicator {self.name}, rank {self.rank}, "
                f"{self.transport}{gpu_part}>")


def _split_arguments(color, key) -> tuple[int, int, str | None]:
    """split's color and key as MPI takes them (a color >= 0 or MPI.UNDEFINED, a key any C int),
    and why not where they are not. Checked before the split's meeting, which shares the
    verdict: a rank that raised alone would leave the others in MPI_Comm_split for ever."""
    c, k = common.as_index(color), common.as_index(key)
    if (c is None or not (0 <= c < 2**31 or c == _mpi().UNDEFINED)
            or k is None or not -2**31 <= k < 2**31):
        return 0, 0, (f"jaxring.mpi: split takes an int color >= 0 (or MPI.UNDEFINED) and an "
                      f"int key, each a C int, got color {color!r} and key {key!r}")
    return c, k, None


def _ranks_per_node(value: int | None) -> int:
    """`ranks_per_node`, else JAXRING_MPI_RANKS_PER_NODE, else 0 (the real nodes)."""
    if value is None:
        text = os.environ.get("JAXRING_MPI_RANKS_PER_NODE", "0")
        try:
            value = int(text)
        except ValueError:
            raise ValueError("jaxring.mpi: JAXRING_MPI_RANKS_PER_NODE must be a whole number of "
                             f"ranks (0: the real nodes), got {text!r}") from None
    index = common.as_index(value)  # numpy's ints too, as slot_bytes
    if index is None or index < 0:
        raise ValueError("jaxring.mpi: ranks_per_node must be a whole number of ranks (0: the "
                         f"real nodes), got {value!r}")
    return index


def _node_communicator(mpi_comm, pretend_node: int | None):
    """The ranks of `mpi_comm` on this rank's node: its real node, or with `pretend_node` those
    given the same pretend node, to exercise the paths between nodes on one machine."""
    rank = mpi_comm.Get_rank()
    if pretend_node is not None:
        return mpi_comm.Split(pretend_node, key=rank)
    return mpi_comm.Split_type(_mpi().COMM_TYPE_SHARED, key=rank)


def _detach(key: int, alone: bool = False) -> None:
    """Releases this process's native state of communicator `key`. `alone`: without its peers
    (collected, or at exit, with no free()), whose calls on its shared memory then fail at once,
    quoting why, where they waited out their timeout for a rank that was gone."""
    # The MPI transport first: a call finds shared memory before it (cpu/host.cc), so a call made
    # meanwhile runs on the transport its peers use, or on none ("closed"); shared memory first
    # let it fall through to MPI, where it waited for peers that were on shared memory.
    gpu.detach(key)
    native.extension.process_unregister(key)
    (native.extension.shm_leave if alone else native.extension.shm_detach)(key)
    native.extension.unlink_failures(key)


@functools.cache
def world() -> Communicator:
    """Every process of the job (a duplicate of MPI_COMM_WORLD), made once."""
    # Met on COMM_WORLD before its Dup (collective, without a timeout), then on the Dup.
    _meet(_mpi().COMM_WORLD, "make jaxring.mpi.world()")
    return _owning(_mpi().COMM_WORLD.Dup(), lambda comm: Communicator(comm, label="world"))


def _owning(mpi_comm, make) -> Communicator:
    """make(mpi_comm), a Communicator that frees `mpi_comm` with itself; `mpi_comm` is freed at
    once if make fails."""
    try:
        communicator = make(mpi_comm)
    except BaseException:
        if mpi_comm != _mpi().COMM_NULL:
            mpi_comm.Free()
        raise
    communicator._owned.append(mpi_comm)
    return communicator


# With a GPU transport, peers' kernels may still read this process's device workspace after its
# own work is done; a barrier at exit keeps the memory alive until every rank's work is.
# Communicators whose ranks meet at exit: together they hold every peer of every GPU transport.
_exit_barrier_comms: list = []


def _meet_at_exit(mpi_comm) -> None:
    """Makes this process wait at exit for the ranks of `mpi_comm` (collective): a GPU transport's
    peers may still read this rank's memory. Nothing is added where a communicator already met
    at exit holds every rank of this one; each rank decides the same, since such a communicator
    was made by all of its ranks, these among them."""
    group = mpi_comm.Get_group()
    try:
        for comm in _exit_barrier_comms:
            other = comm.Get_group()
            covered = _mpi().Group.Difference(group, other).Get_size() == 0
            other.Free()
            if covered:
                return
    finally:
        group.Free()
    _exit_barrier_comms.append(mpi_comm.Dup())


@functools.cache
def _wait_for_pending_work_at_exit() -> None:
    """A process that dispatched a collective and exits at once must still take part in it, or
    its peers would wait for it in vain (mpi4jax#22). JAX dispatches asynchronously, so wait for
    every pending computation before the interpreter shuts down; with a GPU transport, then wait
    (up to the timeout) for every rank to get there too."""
    import jax

    def wait() -> None:
        try:
            jax.effects_barrier()
        except Exception:  # noqa: BLE001 - a failed program, told by common's exit handler
            pass  # its peers must still be met
        if not _exit_barrier_comms:
            return
        requests = [comm.Ibarrier() for comm in _exit_barrier_comms]
        if not _done_within(requests, config.get().timeout_seconds):
            print(f"jaxring: rank {_mpi().COMM_WORLD.Get_rank()} left without the other "
                  "ranks reaching exit; their GPU transport may still read this rank's "
                  "memory", file=sys.stderr)

    atexit.register(wait)
