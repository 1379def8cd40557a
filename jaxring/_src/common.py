"""What every jaxring collective shares: the dtype and op tables, the ordered effect, the
communicator of a mesh axis, the lowering to an FFI custom call, and the vma (varying manual axes)
bookkeeping that shard_map's type checker needs.

The per-collective modules (all_reduce.py, reduce_scatter.py, ...) all have the same sections:
primitive, public function, abstract eval, lowering, batching, JVP/transpose, registration.
"""

from __future__ import annotations

import atexit
import collections.abc
import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import itertools
import math
import operator
import os
import sys
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import config as jax_config
from jax._src import core, dispatch, effects
from jax._src.interpreters import mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lib import version as jaxlib_version

from jaxring._src import native, runtime_tokens

# ---- tables (one place for each fact) ----------------------------------------------------------

SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(d) for d in (jnp.float32, jnp.float64, jnp.float16, jnp.bfloat16, jnp.int32, jnp.int64)
)
# The native library's codes (xla_ffi/common/types.h) by name: ops, collectives and dtypes.
_CODES = native.extension.codes()
REDUCE_OPS: dict[str, int] = dict(_CODES["reduce_op"])
COLLECTIVE_CODES: dict[str, int] = dict(_CODES["collective"])
DTYPE_CODES: dict[np.dtype, int] = {np.dtype(jnp.dtype(name)): code
                                    for name, code in _CODES["dtype"].items()}


def check_dtype(name: str, x) -> None:
    dtype = x.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) or np.dtype(dtype) not in SUPPORTED_DTYPES:
        allowed = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"jaxring.{name}: unsupported dtype {dtype}; allowed: {allowed}")


def check_tiled(name: str, tiled) -> None:
    if not isinstance(tiled, (bool, np.bool_)):
        raise TypeError(f"jaxring.{name}: tiled must be True or False, got {tiled!r}")


def check_op(name: str, op: str) -> None:
    if not isinstance(op, str) or op not in REDUCE_OPS:
        raise ValueError(
            f"jaxring.{name}: unsupported op {op!r}; allowed: {', '.join(map(repr, REDUCE_OPS))}"
        )


# ---- the ordered effect --------------------------------------------------------------------------


class CollectiveEffect(effects.Effect):
    """Communication happens in program order on every device: XLA threads a token through every
    jaxring call, so two collectives can never be reordered (or run concurrently) on one device
    and be matched with the wrong peers."""

    def __str__(self):
        return "jaxring.Collective"


collective_effect = CollectiveEffect()
for _effect_set in (
    effects.ordered_effects,
    effects.shardable_ordered_effects,  # allowed in computations over several devices
    effects.lowerable_effects,
    effects.control_flow_allowed_effects,
    effects.custom_derivatives_allowed_effects,
    effects.remat_allowed_effects,
):
    _effect_set.add_type(CollectiveEffect)
runtime_tokens.install(CollectiveEffect)
runtime_tokens.guard_compiled_calls()

def reset_after_error() -> None:
    """Lets later programs run after a jaxring collective raised (a timeout or a mismatch).

    JAX threads the ordered effect's token from one program to the next, so a program that
    failed hands its error to every later program that uses jaxring. Call this once the error
    has been caught and handled to start a fresh token chain.

    It first waits until every device has finished the last jaxring program dispatched (and so
    every earlier one), failed or not: the error of one device reaches Python while others may
    still be on their way to a call, or waiting in one for up to ``timeout_seconds``, and a
    message one of them posted after the point-to-point mailboxes were emptied would reach the
    next program as that program's own. Call it where no other thread runs jaxring programs:
    it empties every program's mailboxes.
    """
    wait_for_dispatched_programs()
    _drop_tokens()
    native.extension.reset_point_to_point()
    # The calls that a device gave up on before its peers came are kept for late peers to find;
    # those peers have finished by now without coming.
    native.extension.forget_given_up_meetings()


def _drop_tokens() -> None:
    """Ends the token chain: the next jaxring program starts a fresh one."""
    dispatch.runtime_tokens.current_tokens.pop(collective_effect, None)
    dispatch.runtime_tokens.output_runtime_tokens.clear()


@atexit.register  # after JAX's exit handlers (imported first), so it runs before them
def _report_a_failed_program_at_exit() -> None:
    """At exit JAX waits for the last token of each ordered effect, and prints the error of a
    failed one as an ignored exception with its traceback, once for each of its two barriers,
    though the caller has most often caught it long before. A failed jaxring program whose error
    was not cleared (reset_after_error) is told once, in a line, and its token dropped."""
    token = dispatch.runtime_tokens.current_tokens.get(collective_effect)
    try:
        if token._buf.is_deleted():  # deleted with jax.live_arrays(), say: no program failed
            _drop_tokens()
            return
        token._buf.block_until_ready()
        return
    except AttributeError:  # no token, or a JAX whose token differs: JAX reports as it does
        return
    except Exception as error:  # noqa: BLE001 - the failed program's error
        wait_for_dispatched_programs()
        print(f"jaxring: a jaxring program failed, and jaxring.reset_after_error() was not "
              f"called after it: {str(error).splitlines()[0]}", file=sys.stderr)
    _drop_tokens()


def wait_for_dispatched_programs() -> None:
    """Waits until every device has finished the last jaxring program dispatched (and so every
    earlier one), failed or not. Unlike ``jax.effects_barrier`` it keeps JAX's token chain: that
    clears it, and the next jaxring program then builds a fresh token, about 60 us more on 2 CPU
    devices (benchmarks/allreduce.py's timed calls, each inside a config override, took that
    much longer while override waited through jax.effects_barrier)."""
    token = dispatch.runtime_tokens.current_tokens.get(collective_effect)
    if token is None:
        return
    try:
        token._buf.block_until_ready()
        return
    except Exception:  # noqa: BLE001 - a failed device, perhaps before the others finished
        pass
    try:  # each device's part raises its error only once that device has finished
        waits = [shard.data.block_until_ready for shard in token._buf.addressable_shards]
    except Exception:  # noqa: BLE001 - a JAX whose token differs: its barrier, which may end at
        waits = [jax.effects_barrier]  # the first device's error
    for wait in waits:
        try:
            wait()
        except Exception:  # noqa: BLE001 - the error the caller has already caught
            pass


def as_index(value) -> int | None:
    """`value` as a Python int if it is an integer (numpy's too), else None: floats and bools are
    not ranks, roots or axes."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def read_once(perm):
    """`perm` as a tuple if it is an iterator (a generator, say), which only one leaf of a pytree
    could read; anything else as it is, for check_perm to judge."""
    return tuple(perm) if isinstance(perm, collections.abc.Iterator) else perm


def check_perm(name: str, perm, size: int, where: str) -> tuple[tuple[int, int], ...]:
    """Validates a permutation given as (source, destination) pairs, as lax.ppermute takes it."""
    try:
        pairs = tuple((as_index(s), as_index(d)) for s, d in perm)
        if any(None in pair for pair in pairs):
            raise TypeError
    except (TypeError, ValueError):
        raise TypeError(
            f"jaxring.{name}: perm must be a sequence of (source, destination) int pairs, "
            f"got {perm!r}"
        ) from None
    for s, d in pairs:
        if not (0 <= s < size and 0 <= d < size):
            raise ValueError(
                f"jaxring.{name}: pair {(s, d)} of perm is outside [0, {size}) for {where}"
            )
    sources = [s for s, _ in pairs]
    dests = [d for _, d in pairs]
    if len(set(sources)) != len(sources) or len(set(dests)) != len(dests):
        raise ValueError(
            f"jaxring.{name}: perm {pairs} repeats a source or a destination; each device sends "
            "at most one message and receives at most one"
        )
    return pairs


def perm_attribute(perm: tuple[tuple[int, int], ...]) -> np.ndarray:
    """The flattened (source, destination) pairs the native handlers decode."""
    return np.asarray(perm, np.int64).reshape(-1)


def set_up_on_every_rank(mpi_comm, step, rank: int, what: str, undo=None):
    """Runs `step()` (a part of setting up `what` that returns a result or raises) on every rank
    of `mpi_comm`; if any rank failed, every rank raises one error naming each failure, so that
    none goes on to wait in the next collective of the set-up for a peer that failed (mpi4py's
    collectives have no timeout). A rank whose own step succeeded first passes its result, which
    nothing will use, to `undo`."""
    try:
        result, error = step(), None
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        result, error = None, f"rank {rank}: {e}"
    errors = [e for e in mpi_comm.allgather(error) if e]
    if errors:
        if error is None and undo is not None:
            undo(result)
        raise RuntimeError(f"jaxring.mpi: cannot set up {what}: " + "; ".join(errors))
    return result


# ---- op ids ------------------------------------------------------------------------------------

_op_ids = itertools.count(1)
# Set in the ids of process calls (24-bit hashes), so that they never equal a mesh call's count
# and each id names one source line.
PROCESS_OP_ID_BIT = 1 << 24
# (base id, role, calls so far) while op_ids_derived_from is in force.
_deriving: contextvars.ContextVar = contextvars.ContextVar("jaxring_deriving", default=None)
_LIBRARY_DIRS = (os.path.dirname(jax.__file__) + os.sep,
                 os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)


def next_op_id(comm: "AxisCommunicator", derived_from: int | None = None, role: str = "") -> int:
    """A static id for one call site, carried in the header peers compare.

    The devices of a mesh share one trace, so a counter serves. Processes trace on their own,
    and may trace different numbers of calls (a rank-dependent branch, a retrace on one rank), so
    for a process communicator the id comes from the calling source line instead: it is the same
    in every process that runs the same code, and differs between call sites. A collective that
    a JVP, transpose or batching rule binds for another takes its id from that one's
    (`derived_from`, with the rule's `role`): those rules run where the program is differentiated
    or batched (the line that calls `jax.grad`'s function, say), which may differ between ranks
    that run the same loss. Either way the id is named after its source line for the native
    errors that print it (name_call_site)."""
    deriving = _deriving.get()
    if derived_from is not None:
        key, site = f"{derived_from}:{role}", _derived_site(derived_from, f"its {role}")
    elif deriving is not None:
        deriving[2] += 1
        key = f"{deriving[0]}:{deriving[1]}:{deriving[2]}"
        site = _derived_site(deriving[0], f"{deriving[1]} call {deriving[2]}")
    else:
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
            frame = frame.f_back
        if frame is None:
            return next(_op_ids) if comm.process_rank is None else 0
        code, file = frame.f_code, os.path.basename(frame.f_code.co_filename)
        key = f"{file}:{code.co_name}:{frame.f_lineno}"
        site = f"{file}:{frame.f_lineno} in {code.co_name}"
    if comm.process_rank is None:
        op_id = next(_op_ids)
    else:
        op_id = PROCESS_OP_ID_BIT | int.from_bytes(
            hashlib.blake2b(key.encode(), digest_size=3).digest(), "little")
    if site is not None:
        name_call_site(op_id, site)
    return op_id


# op id -> the source lines it was traced at (one, unless two lines' hashes collide), which the
# native errors print beside it (xla_ffi/common/types.h, NameCallSite). Each call a retraced mesh
# program makes takes a new id, so this grows by an entry (about 150 bytes with the native copy,
# the names themselves interned) per call traced.
_call_sites: dict[int, list[str]] = {}


def _derived_site(base: int, what: str) -> str | None:
    """The name of a call derived from op id `base`'s: "train.py:42 in loss, its jvp"; None
    where `base` has no name (a test harness's id)."""
    return f"{' or '.join(_call_sites[base])}, {what}" if base in _call_sites else None


def name_call_site(op_id: int, site: str) -> None:
    """Names `op_id` after `site` in the native errors. Two sites whose hashes collide are both
    named, never one in place of the other."""
    sites = _call_sites.setdefault(op_id, [])
    if site not in sites:
        sites.append(sys.intern(site))  # interned: a retraced line keeps one copy of its name
        native.extension.name_call_site(op_id, " or ".join(sites))


# ---- communicators of mesh axes ------------------------------------------------------------------


# Process communicators' keys carry this bit and mesh axes' never do, so that a call whose process
# communicator is gone fails at once (cpu/host.cc, kProcessKeyBit) instead of waiting for peers.
PROCESS_KEY_BIT = 1 << 62


@dataclasses.dataclass(frozen=True)
class AxisCommunicator:
    """The devices along `axes` of the current shard_map/pmap mesh. Devices that differ in the
    other mesh axes form separate groups of this communicator; `key` is the same in every group.

    A process communicator (``jaxring.mpi``) has no axes: its rank is the process's
    (`process_rank`) and `key` names the shared segment the native side has mapped. `owner` (the
    ``jaxring.mpi.Communicator``, left out of equality and hashing) keeps that segment alive for
    as long as a traced program refers to it, e.g. ``all_reduce(x, world().split(0))`` in jit."""

    axes: tuple[Any, ...]
    size: int
    key: int
    name: str
    process_rank: int | None = None
    owner: Any = dataclasses.field(default=None, compare=False, repr=False)
    # Where the other mesh axes split the devices into groups, which group a device is in, for
    # the native side's errors: "{group}" is filled in with the device's group.
    group_label: str = ""

    @property
    def native_name(self) -> str:
        """The name the custom calls carry for their errors."""
        return self.name + self.group_label

    def rank_and_group(self):
        """The (rank, group) int32 operands every jaxring custom call takes."""
        if self.process_rank is not None:
            return jnp.int32(self.process_rank), jnp.int32(0)
        rank = lax.axis_index(self.axes) if self.axes else jnp.int32(0)
        others = _other_mesh_axes(self.axes)
        group = lax.axis_index(others) if others else jnp.int32(0)
        return jnp.asarray(rank, jnp.int32), jnp.asarray(group, jnp.int32)


# jax 0.11 numbers ppermute's devices over a tuple of axes in the tuple's order, and refuses by
# default an order that differs from the mesh's; before it, the group was sorted (None here).
_RAISE_ON_PPERMUTE_SORT_DIFF = getattr(jax_config, "raise_on_ppermute_sort_diff", None)


def _mesh_axes() -> tuple[Any, ...]:
    mesh = jax.sharding.get_abstract_mesh()
    names = tuple(mesh.axis_names) if mesh is not None and not mesh.empty else ()
    return names


def _other_mesh_axes(axes: tuple[Any, ...]) -> tuple[Any, ...]:
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(a for a in _mesh_axes() if a not in axes and mesh.shape[a] > 1)


def communicator(name: str, axis_name) -> AxisCommunicator:
    """Resolves `axis_name`: a mesh axis name or a tuple of them (inside shard_map or pmap), or
    a process communicator from ``jaxring.mpi``."""
    if hasattr(axis_name, "axis_communicator"):
        return axis_name.axis_communicator()
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if len(set(axes)) != len(axes):
        raise ValueError(f"jaxring.{name}: axis names repeat in {axis_name!r}; name each axis once")
    env = core.get_axis_env()
    mesh_axes = _mesh_axes()
    for axis in axes:
        if not env.axis_exists(axis):
            raise NameError(
                f"jaxring.{name}: unbound axis name {axis!r}; call it inside jax.shard_map or "
                f"jax.pmap over that axis (bound axes: {env.axis_names()})"
            )
        if axis not in mesh_axes:
            raise ValueError(
                f"jaxring.{name}: axis {axis!r} is not a device mesh axis (a vmap axis?); "
                "jaxring communicates between devices, use jax.lax collectives for vmap axes"
            )
    mesh = jax.sharding.get_abstract_mesh()
    auto = [a for a in mesh.axis_names if a not in mesh.manual_axes and mesh.shape[a] > 1]
    if auto:
        raise ValueError(
            f"jaxring.{name}: every mesh axis of size > 1 must be manual inside shard_map, but "
            f"{auto} are not: shard_map(..., axis_names=...) without them, or jax.vmap of a "
            "shard_map whose batch is sharded over an Explicit mesh axis, leaves them to the "
            "compiler, and jaxring needs to know which device it runs on. Give shard_map every "
            "mesh axis, or vmap inside the shard_map, or make those axes AxisType.Auto"
        )
    size = math.prod(env.axis_size(a) for a in axes)
    label = ", ".join(repr(a) for a in axes)
    digest = hashlib.blake2b(repr((axes, tuple(mesh.shape.items()))).encode(), digest_size=8)
    key = int.from_bytes(digest.digest(), "little") & (PROCESS_KEY_BIT - 1)
    others = _other_mesh_axes(axes)  # the group index runs over them (rank_and_group)
    group_label = ("" if not others else f" where {others[0]!r} = {{group}}" if len(others) == 1
                   else f" at index {{group}} of mesh axes {', '.join(map(repr, others))}")
    return AxisCommunicator(axes=axes, size=size, key=key, name=f"mesh axis {label}",
                            group_label=group_label)


def point_to_point_communicator(name: str, axis_name) -> AxisCommunicator:
    """`communicator`, for ppermute/send/recv: refuses a process communicator whose MPI
    transport is unavailable (jaxring built without MPI, or against another MPI). Over a tuple
    of mesh axes, devices are numbered as the installed jax's lax.ppermute (and psend/precv)
    numbers them. Before jax 0.11 that is their place in the sorted group, the mesh's order of
    the axes, whatever the tuple's. From 0.11 it is the tuple's order, as lax.axis_index and
    the other collectives have it, and a tuple whose order numbers the devices differently
    from the mesh's is refused while jax's ``jax_raise_on_ppermute_sort_diff`` is on (the
    default), as lax.ppermute refuses it."""
    unavailable = getattr(axis_name, "point_to_point_unavailable", None)
    if unavailable:
        raise NotImplementedError(
            f"jaxring.{name} over {axis_name.name} needs jaxring's MPI transport, but "
            f"{unavailable}")
    if isinstance(axis_name, (tuple, list)):
        order = _mesh_axes()
        # Axes the mesh lacks go last, in their order, for communicator() to name.
        in_mesh_order = tuple(sorted(axis_name, key=lambda a: order.index(a) if a in order
                                     else len(order)))
        if _RAISE_ON_PPERMUTE_SORT_DIFF is None:  # jax before 0.11: the sorted group
            axis_name = in_mesh_order
        elif _RAISE_ON_PPERMUTE_SORT_DIFF.value:
            mesh = jax.sharding.get_abstract_mesh()
            numbering = [a for a in axis_name if a in order and mesh.shape[a] > 1]
            if numbering != [a for a in in_mesh_order if a in numbering]:
                raise RuntimeError(
                    f"jaxring.{name}: the axes {tuple(axis_name)!r} are not in the mesh's order "
                    f"{order!r}, so devices would be numbered otherwise than in the mesh, which "
                    f"lax.ppermute refuses as well; name them in the mesh's order, or allow it "
                    f"with jax.config.update('jax_raise_on_ppermute_sort_diff', False) (then "
                    f"devices are numbered in the tuple's order, as lax.ppermute numbers them)")
    return communicator(name, axis_name)


@contextlib.contextmanager
def op_ids_derived_from(base: int, role: str):
    """Across processes, the calls made inside take ids derived from `base` with `role`, numbered
    in the order they are made, instead of their source lines': for calls that a library
    function makes for one of the user's (a hierarchical all-reduce's levels), whose custom JVP
    may run where the program is differentiated (next_op_id)."""
    token = _deriving.set([base, role, 0])
    try:
        yield
    finally:
        _deriving.reset(token)


def bind_collective(primitive, x, comm: AxisCommunicator, op_id: int | None = None, **params):
    """Binds `primitive` to (rank, group, x) for a fresh call site, or with `op_id` (a rule's,
    next_op_id); x becomes varying over the communicator's axes first, as lax collectives do for
    invariant inputs."""
    rank, group = comm.rank_and_group()
    x = make_varying(x, comm.axes)
    return primitive.bind(rank, group, x, comm=comm,
                          op_id=next_op_id(comm) if op_id is None else op_id, **params)


# ---- writing the result over the operand ---------------------------------------------------------

# Bodies whose inputs live in buffers XLA's loop owns: the carry, or a slice of the scanned array.
_LOOP_BODIES = frozenset({"fori_loop", "while_body", "scan"})
# Operations whose result XLA may make a view of their operand's buffer (same elements).
_VIEWS = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "pcast", "pvary"})


def in_place_pays(x) -> bool:
    """Whether a collective whose result has x's shape should write it over x's buffer.

    Aliasing never changes a result: XLA hands the operand's buffer over when nothing else needs
    x, and copies x first when something does. What it saves depends on where x comes from. A
    value computed in the program (a gradient, a fused bucket) or a loop carry is usually dead
    after the call, and then the result takes its buffer: no fresh output and, inside a loop, no
    copy of the output back into the carry (at 16 MiB that copy costs more than the all-reduce).
    An argument of the program must survive the call unless donated, so XLA would copy it into a
    fresh buffer: slower than the fresh output jaxring writes otherwise (huge pages from
    config.huge_page_bytes). So: in place unless x is (a reshape of) a constant or an input of a
    body other than a loop's (shard_map's, pmap's, jit's, cond's, remat's), which may be the
    program's argument. Read from the trace being built; where it cannot be read, a fresh output."""
    tracer = x
    try:
        while not isinstance(tracer, pe.DynamicJaxprTracer):  # under vmap or grad
            tracer = tracer.val if hasattr(tracer, "val") else tracer.primal
        while (tracer.parent is not None and tracer.parent.primitive.name in _VIEWS
               and tracer.parent.in_tracers[0].aval.size == tracer.aval.size):
            tracer = tracer.parent.in_tracers[0]
        frame = tracer._trace.frame
        var = tracer.val
        if isinstance(var, core.Literal) or var in frame.constvar_to_val:
            return False
        if any(var is v for v in frame.invars):
            return frame.debug_info is not None and frame.debug_info.traced_for in _LOOP_BODIES
        return True
    except (AttributeError, TypeError):  # not a trace this JAX builds as expected
        return False


# ---- varying manual axes (shard_map's check_vma) --------------------------------------------------


def vma_checking() -> bool:
    return bool(jax_config._check_vma.value)


def varying_axes(aval) -> frozenset:
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def with_varying_axes(aval, varying: frozenset):
    if getattr(aval, "mat", None) is not None:
        return aval.update(manual_axis_type=aval.mat.update(varying=frozenset(varying)))
    if hasattr(aval, "vma"):
        return aval.update(vma=frozenset(varying))
    return aval


def reduced_invariant(comm: AxisCommunicator, aval) -> bool:
    """Whether a cotangent arriving for this collective's invariant result is already the total
    (shard_map's vma typing); otherwise it is one device's share, to be summed (pmap and process
    communicators, where every process differentiates its own copy, as mpi4jax does)."""
    return bool(comm.axes) and vma_checking() and set(comm.axes) <= varying_axes(aval)


def refuse_partly_varying(name: str, x, comm: AxisCommunicator, op: str) -> None:
    """A sum over axes where `x` varies over some but not all: lax.psum and lax.psum_scatter
    refuse it, since it is unclear whether the copies along the other axes count once or once
    each; so do jaxring's sums and means (max and min, which copies do not change, take it, as
    lax.pmax does)."""
    if op not in ("sum", "mean") or not comm.axes or not vma_checking():
        return
    varying = varying_axes(core.typeof(x))
    over = [a for a in comm.axes if a in varying]
    if over and len(over) < len(comm.axes):
        raise ValueError(
            f"jaxring.{name}: the input varies over {tuple(over)!r} but not over "
            f"{tuple(a for a in comm.axes if a not in varying)!r}, of the axes {comm.axes!r} "
            f"it would be summed over, which lax.psum refuses as well: sum over the axes it "
            f"varies over, or make it vary over all of them first (jax.lax.pcast(x, axes, "
            f"to='varying'), which counts every copy)")


def make_varying(x, axes: tuple[Any, ...]):
    """Casts `x` to vary over `axes`, as lax collectives do for invariant inputs."""
    if not vma_checking():
        return x
    missing = tuple(a for a in axes if a not in varying_axes(core.typeof(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


# ---- lowering ----------------------------------------------------------------------------------


def lower_collective(target: str, ctx, *operands, comm: AxisCommunicator, op_id: int,
                     in_place: bool = False, **attrs):
    """Lowers to the FFI custom call `target`, threading the ordered effect's token through it.

    Operands are (rank, group, *data); results are (token, *data). `in_place`: the result is
    aliased to the last operand, on CPU, where every transport can write it over its input (GPU
    transports read peers' device buffers and have not been checked in place)."""
    devices = _program_device_count(ctx)
    if comm.process_rank is not None and devices > 1:
        raise ValueError(
            f"{target}: {comm.name} is a process communicator, one device per process, but this "
            f"program runs on {devices} devices of this process. Every one of them would act as "
            "the same rank; run one device per process, or use a mesh axis between the devices "
            "of one process")
    if comm.process_rank is None:
        _refuse_groups_across_processes(target, ctx, comm)
    token = ctx.tokens_in.get(collective_effect)
    if comm.process_rank is None and _moves_nothing(ctx):
        # A zero-size argument of a shard_map or pmap body must stay unused: jaxlib 0.11.2's SPMD
        # partitioner crashes the process compiling any use of one, `v * 2` or a custom call
        # alike (0.10 and 0.12 compile it). Processes keep the call, whose header check names a
        # peer that passed a different shape.
        if target not in _HALVES:
            # Every device of a mesh axis has the same empty shapes, so there is nothing to
            # check or move, and no call is made.
            ctx.set_tokens_out(mlir.TokenSet({collective_effect: token}))
            return [mlir.full_like_aval(ctx, 0, aval) for aval in ctx.avals_out]
        # A send's and its recv's shapes are given apart, so the call is made, on an empty
        # constant: a zero-size recv must still take the message it is paired with, or refuse
        # one that is not empty.
        operands = [*operands[:2], *(mlir.full_like_aval(ctx, 0, aval)
                                     for aval in ctx.avals_in[2:])]
    native.register_targets()
    aliases = {}
    if in_place and tuple(ctx.module_context.platforms) == ("cpu",):
        aliases["operand_output_aliases"] = {len(operands): 1}  # operand 0 is the token
    lowering = jax.ffi.ffi_lowering(target, has_side_effect=True, **aliases)
    sub_ctx = ctx.replace(
        avals_in=[core.abstract_token, *ctx.avals_in],
        avals_out=[core.abstract_token, *ctx.avals_out],
    )
    results = lowering(
        sub_ctx,
        token,
        *operands,
        comm=np.int64(comm.key),
        comm_name=comm.native_name,
        size=np.int64(comm.size),
        op_id=np.int64(op_id),
        **{k: v if isinstance(v, np.ndarray) else np.int64(v) for k, v in attrs.items()},
    )
    ctx.set_tokens_out(mlir.TokenSet({collective_effect: results[0]}))
    return results[1:]


# The targets of a send and a recv: the two halves of one message, each with its own shape.
_HALVES = ("jaxring_send", "jaxring_recv")


def _moves_nothing(ctx) -> bool:
    """Whether a call's data (operands after rank and group, and results) is all empty: a send or
    a recv of zero elements, or a collective on them. A barrier has no data and always meets."""
    data = [*ctx.avals_in[2:], *ctx.avals_out]
    return bool(data) and all(aval.size == 0 for aval in data)


def _program_device_count(ctx) -> int:
    """How many devices run the program being lowered (its mesh under shard_map)."""
    axis_context = ctx.module_context.axis_context
    mesh = getattr(axis_context, "mesh", None)
    if mesh is not None:
        return mesh.size
    return getattr(axis_context, "num_devices", 1)


def _program_mesh(ctx):
    """The concrete mesh of the program being lowered; None where the lowering knows no devices
    (a shard_map nested in another lowers on an AbstractMesh, whose `devices` raises)."""
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    return mesh if isinstance(mesh, jax.sharding.Mesh) else None


def _refuse_groups_across_processes(target: str, ctx, comm: AxisCommunicator) -> None:
    """A mesh axis communicates between the devices of one process (its devices meet in this
    process's memory). Under jax.distributed a mesh may span processes; a collective whose group
    of devices does is refused as it lowers, where its devices would wait for peers that never
    come to this process and time out."""
    mesh = _program_mesh(ctx) if jax.process_count() > 1 else None
    if mesh is None:
        return
    axes = [list(mesh.axis_names).index(a) for a in comm.axes]
    others = [i for i in range(mesh.devices.ndim) if i not in axes]
    processes = np.vectorize(lambda d: d.process_index)(mesh.devices)
    groups = processes.transpose(others + axes).reshape(-1, comm.size)  # a row per group
    if (groups != groups[:, :1]).any():
        raise ValueError(
            f"{target}: {comm.name} spans {max(len(set(row)) for row in groups)} processes "
            "(jax.distributed), but jaxring's mesh-axis collectives run between the devices of "
            "one process. Across processes use a jaxring.mpi communicator (one device per "
            "process under mpiexec), or jax.lax collectives; a mesh axis within each process "
            "works")


def _refuse_nested_shard_maps_jaxlib_cannot_compile() -> None:
    """jaxlib 0.10 aborts the whole process (an XLA check failure in shape.h) compiling a
    shard_map nested in another whose manual axes span more than one device, when the inner one
    makes more than one device manual and carries an ordered effect; an ordered io_callback
    aborts alike, and jaxlib 0.11 compiles both. On jaxlib 0.10 such a shard_map carrying
    jaxring's effect is refused as it lowers, with an error in place of the abort."""
    if jaxlib_version >= (0, 11):
        return
    from jax._src import shard_map as shard_map_module

    primitive = shard_map_module.shard_map_p
    entry = mlir._lowerings[primitive]
    lower = entry.rule

    def refusing(ctx, *args, jaxpr, mesh, newly_manual_axes, **params):
        outer = [a for a in mesh.manual_axes if mesh.shape[a] > 1]
        inner = [a for a in newly_manual_axes if mesh.shape[a] > 1]
        if outer and inner and any(isinstance(e, CollectiveEffect) for e in jaxpr.effects):
            raise NotImplementedError(
                f"jaxring: a collective in a shard_map over mesh axes {inner} nested in one over "
                f"{outer} cannot be compiled by jaxlib {'.'.join(map(str, jaxlib_version))}: XLA "
                "aborts the process compiling any ordered effect there (jaxlib 0.11 compiles "
                "it). Give one shard_map every mesh axis, or use jax and jaxlib 0.11")
        return lower(ctx, *args, jaxpr=jaxpr, mesh=mesh, newly_manual_axes=newly_manual_axes,
                     **params)

    mlir.register_lowering(primitive, refusing, inline=entry.inline)


_refuse_nested_shard_maps_jaxlib_cannot_compile()


def register_lowering_rule(primitive, rule) -> None:
    """Lowers `primitive` by `rule` on CPUs and GPUs; outside jit (a process communicator's
    operands are concrete there) it runs compiled on its own, as lax's primitives do."""
    mlir.register_lowering(primitive, rule, platform="cpu")
    mlir.register_lowering(primitive, _one_process_per_gpu(rule), platform="cuda")
    primitive.def_impl(functools.partial(dispatch.apply_primitive, primitive))


def _one_process_per_gpu(rule):
    """On GPUs jaxring runs one process per GPU (xla_ffi/cuda/handlers.cc stages each call
    through the host transports); the devices of one process are not its communicators."""

    def gpu_rule(ctx, *args, comm: AxisCommunicator, **params):
        if comm.process_rank is None:
            raise NotImplementedError(
                f"jaxring over {comm.name} on GPUs: jaxring runs one process per GPU. Launch "
                "one process per GPU with mpiexec and pass jaxring.mpi.world() (or a split of "
                "it) where the axis name goes; between the GPUs of one process use jax.lax "
                "collectives (NCCL)")
        return rule(ctx, *args, comm=comm, **params)

    return gpu_rule


def move_batch_axis(x, batch_dim, to: int = 0):
    """Batching helper: put vmap's batch dimension at `to`."""
    if batch_dim is None or batch_dim == to:
        return x
    return jnp.moveaxis(x, batch_dim, to)


def check_unbatched(comm: AxisCommunicator, rank_dim, group_dim) -> None:
    """A batching rule's check that the device's rank and group are not batched: they are when a
    vmap axis inside shard_map takes the name of the mesh axis, and then name the vmap's examples,
    not devices."""
    if rank_dim is not None or group_dim is not None:
        # A batched group: the vmap hides one of the other mesh axes, which number the groups.
        hidden = (comm.name if rank_dim is not None else
                  "mesh axis " + " or ".join(map(repr, _other_mesh_axes(comm.axes))))
        raise ValueError(
            f"jaxring: a vmap axis named like {hidden} hides it inside shard_map, and jaxring "
            "would take the vmap's examples for devices; give the vmap axis another name")
