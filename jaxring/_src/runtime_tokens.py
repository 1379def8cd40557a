"""Cheaper hand-over of the ordered effect's token between programs.

jaxring's collectives carry an ordered effect, so JAX passes a token from each program to the
next. The token's data dependency alone does not keep programs apart on CPU devices: PJRT CPU
gives each device of a program a thread from one pool and holds it for the program's whole run,
also while that device waits for its inputs. Programs dispatched back to back without blocking
then take threads in no fixed order, and the devices of program k that still need a thread can
wait behind program k+1's, which wait for program k: a deadlock (XLA's own `psum` deadlocks so;
jaxring's timeout would turn it into an error). What keeps JAX's hand-over safe is that its
`device_put` of the token waits until the previous program has finished. This module keeps that
wait explicitly: a jaxring program is dispatched once the previous one's token is ready, so one
jaxring program runs on the devices at a time, as with JAX's own code.

What it saves is the rest. JAX (0.10/0.11) rebuilds the token's sharding on every dispatch:
`get_token_input` builds a `Mesh` and `NamedSharding` and `device_put`s the token onto them, and
`_handle_token_bufs` builds them again to reassemble the returned per-device tokens. At 8 CPU
devices that is about half a millisecond per call, more than the collective. This module keeps the
sharding per device list and reuses the returned token array as the next input when it already
sits on the right devices, which is what `device_put` would conclude after its checks. The token
buffers that flow from program to program are exactly JAX's.

A program whose only effect is jaxring's also runs through `_fast_call` instead of JAX's
`ExecuteReplicated.__call__`, which does the same with less: it builds the returned token array in
C++ with the program's outputs (one result handler, as JAX builds every other output) instead of
as one Python array per device reassembled afterwards, and asks for no per-device runtime tokens
(`execute_sharded(with_tokens=True)`): those serve `jax.effects_barrier`, which waits for the
token array as well, since the program defines it. Against JAX's code in one process, a lone
all-reduce of 256 B took 30-47 us less on 2 devices (of 230-283 us) and 57-80 us less on 8 (of
343-397 us).

Before it gets there, a jitted call of such a program goes through JAX's Python path, because a
program with an ordered effect cannot take JAX's C++ fast path (that path passes no token). For
every call, that path resolves the arguments' shardings and layouts against the traced program,
looks up the lowering and the compiled executable in JAX's caches and shards the program's
constants, then runs it. `_remembered_runs` keeps what it found for each traced program and
placement of the arguments (their shardings, commitment and layouts), so a repeated call runs the
same executable at once, skipping the program's in_handler too where it passed such a call's
arguments through unchanged. Against JAX's path in one process (in turns), a lone 4-byte
all-reduce took 255-313 us instead of 371-457 us on 2 devices, and 504-560 us instead of
677-740 us on 8.

Only jaxring's own effect takes this path; every other effect is handled by JAX's code. If JAX's
internals differ from what this expects, nothing is patched and dispatch stays JAX's (correct,
slower). `JAXRING_FAST_TOKENS=0` turns the patch off.
"""

from __future__ import annotations

import functools
import inspect
import os
import weakref

import jax
import numpy as np
from jax._src import array, config, core, dispatch, tree_util
from jax._src import util as jax_util
from jax._src import pjit as jax_pjit
from jax._src.interpreters import pxla
from jax._src.lib import xla_client as xc
from jax.sharding import Mesh, NamedSharding, PartitionSpec

_installed = False


@functools.lru_cache(maxsize=256)
def _token_layout(devices: tuple) -> tuple[NamedSharding, core.ShapedArray]:
    """The sharding JAX gives an ordered-effect token over `devices`, and its aval."""
    sharding = NamedSharding(Mesh(np.asarray(devices, dtype=object), "x"), PartitionSpec("x"))
    aval = core.update_aval_with_sharding(core.ShapedArray((0,), np.bool_), sharding)
    return sharding, aval


def _token_array(aval, sharding, bufs):
    """The per-device token buffers as one array: ArrayImpl directly (7 µs at 8 devices), or, if
    this JAX's constructor differs, the public `make_array_from_single_device_arrays` (34 µs)."""
    global _token_array
    try:
        return array.ArrayImpl(aval, sharding, bufs, committed=True, _skip_checks=True)
    except TypeError:
        _token_array = lambda aval, sharding, bufs: jax.make_array_from_single_device_arrays(  # noqa: E731
            (0,), sharding, bufs)
        return _token_array(aval, sharding, bufs)


@functools.lru_cache(maxsize=256)
def _token_handler(devices: tuple):
    """A C++ result handler that makes a program's per-device output tokens one array on
    `_token_layout(devices)`, as JAX's handlers make its other outputs."""
    sharding, aval = _token_layout(devices)
    try:
        return xc.array_result_handler(aval, sharding, committed=True, _skip_checks=True)
    except TypeError:  # jaxlib 0.11 has no _skip_checks (and no checks to skip)
        return xc.array_result_handler(aval, sharding, committed=True)


# What _fast_call and _remembered_runs read of an ExecuteReplicated (the same in jax 0.10 and 0.11).
_EXECUTE_SLOTS = {"xla_executable", "in_handler", "out_handler", "ordered_effects",
                  "has_unordered_effects", "has_host_callbacks", "_local_devices", "kept_var_idx",
                  "mut", "pgle_profiler"}


def _expected_call() -> bool:
    return (_EXECUTE_SLOTS <= set(getattr(pxla.ExecuteReplicated, "__slots__", ()))
            and hasattr(xc, "array_result_handler")
            and hasattr(dispatch, "needs_check_special")
            and hasattr(pxla, "MeshExecutable") and hasattr(core, "trace_state_clean")
            and all(hasattr(config, flag) for flag in (
                "no_execution", "debug_key_reuse", "enable_pgle", "distributed_debug")))


def _expected_signatures() -> bool:
    try:
        get = inspect.signature(dispatch.RuntimeTokenSet.get_token_input).parameters
        handle = inspect.signature(pxla.ExecuteReplicated._handle_token_bufs).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return (list(get) == ["self", "eff", "devices"]
            and list(handle) == ["self", "token_bufs", "sharded_token"]
            and hasattr(dispatch.runtime_tokens, "current_tokens")
            and hasattr(dispatch.runtime_tokens, "output_runtime_tokens"))


def _expected_run() -> bool:
    """Whether pjit._run_python_pjit is what _remembered_runs stands in for."""
    try:
        run = inspect.signature(jax_pjit._run_python_pjit).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return (list(run) == ["p", "args_flat", "fun", "args", "kwargs"]
            and hasattr(jax_pjit, "_pjit_call_impl_python") and hasattr(jax_pjit, "jit_evict_fn"))


_compiled_calls_guarded = False


def guard_compiled_calls() -> bool:
    """Keeps ahead-of-time compiled programs with an ordered effect off JAX's C++ fast path.

    `jax.jit(f).lower(x).compile()` returns a Compiled whose calls JAX moves, from the second on,
    to a C++ path that passes no token. `MeshExecutable.create_cpp_call` (jax 0.10 and 0.11)
    refuses that path to programs with unordered effects or host callbacks, but not to programs
    with ordered effects, whose executables take the token as their first argument: the second
    call of a compiled jaxring program ran with one argument too few and crashed the process
    (jaxring's effect is the only ordered one without a host callback, so only its programs met
    this). Such programs now keep JAX's Python path, which passes the token as a jitted call
    does. Applied whatever `JAXRING_FAST_TOKENS` says, since it is about correctness. Returns
    whether it applied (False where this JAX has no such method to guard)."""
    global _compiled_calls_guarded
    if _compiled_calls_guarded:
        return True
    jax_create = getattr(pxla.MeshExecutable, "create_cpp_call", None)
    if jax_create is None:
        return False

    @functools.wraps(jax_create)
    def create_cpp_call(self, *args, **kwargs):
        if getattr(getattr(self, "unsafe_call", None), "ordered_effects", None):
            return None
        return jax_create(self, *args, **kwargs)

    pxla.MeshExecutable.create_cpp_call = create_cpp_call
    _compiled_calls_guarded = True
    return True


def _earlier_failure(error: Exception) -> Exception:
    """The error a program raises, before it runs, when an earlier jaxring program failed: JAX
    hands that program's token, and with it its error, to every later one."""
    message = (f"jaxring: an earlier program with jaxring calls failed, so this one was not run; "
               f"call jaxring.reset_after_error() once that failure is handled. Its error: "
               f"{error}")
    try:
        return type(error)(message)
    except Exception:  # noqa: BLE001 - a type that takes no message
        return RuntimeError(message)


def install(effect_type: type) -> bool:
    """Routes tokens of `effect_type` through the cached layouts. Returns whether it did."""
    global _installed
    if _installed:
        return True
    if os.environ.get("JAXRING_FAST_TOKENS", "1") == "0" or not _expected_signatures():
        return False
    jax_get_token_input = dispatch.RuntimeTokenSet.get_token_input
    jax_handle_token_bufs = pxla.ExecuteReplicated._handle_token_bufs

    def get_token_input(self, eff, devices):
        if isinstance(eff, effect_type):
            token = self.current_tokens.get(eff)
            if isinstance(token, core.Token) and token._buf.is_deleted():
                # No program failed; its error would say one had (and JAX's own, that a buffer
                # was deleted).
                raise RuntimeError(
                    "jaxring: the token JAX passes from one jaxring program to the next was "
                    "deleted (it is one of jax.live_arrays(), so deleting every live array "
                    "deletes it); call jaxring.reset_after_error() to start a fresh one")
            if isinstance(token, core.Token):
                # Whatever devices it is on: one program at a time (see the module docstring),
                # and a failed one's error until reset_after_error, which JAX's code below
                # (from jax 0.12) would raise for the next program only.
                try:
                    token.block_until_ready()
                except Exception as error:  # noqa: BLE001 - any earlier program's error, wrapped
                    raise _earlier_failure(error) from error
                if token._buf.sharding is _token_layout(tuple(devices))[0]:
                    return token
        return jax_get_token_input(self, eff, devices)

    def handle_token_bufs(self, token_bufs, sharded_token):
        if not all(isinstance(eff, effect_type) for eff in self.ordered_effects):
            return jax_handle_token_bufs(self, token_bufs, sharded_token)
        tokens = dispatch.runtime_tokens
        for i, device in enumerate(self._local_devices):
            tokens.output_runtime_tokens[device] = sharded_token.get_token(i)
        for eff, bufs in zip(self.ordered_effects, token_bufs):
            devices = tuple(b.sharding._device_assignment[0] for b in bufs)
            sharding, aval = _token_layout(devices)
            tokens.current_tokens[eff] = core.Token(_token_array(aval, sharding, list(bufs)))

    dispatch.RuntimeTokenSet.get_token_input = get_token_input
    pxla.ExecuteReplicated._handle_token_bufs = handle_token_bufs
    if _expected_call():
        pxla.ExecuteReplicated.__call__ = _fast_call(pxla.ExecuteReplicated.__call__, effect_type)
        if _expected_run():
            jax_pjit._run_python_pjit = _remembered_runs(jax_pjit._run_python_pjit, effect_type)
    _installed = True
    return True


def _fast_call(jax_call, effect_type: type):
    """ExecuteReplicated.__call__ for programs whose only effect is `effect_type`: JAX's steps for
    an ordered effect (the token in first, the returned token kept for the next program), without
    the per-device runtime tokens, and with the returned token built by a C++ result handler
    together with the outputs. Every other program, and any with JAX's debugging checks, PGLE
    profiling or mutable state in play, goes through `jax_call`."""

    usable = True

    def call(self, *args):
        nonlocal usable
        if (not usable or not _only_effect(self, effect_type)
                or config.no_execution.value or dispatch.needs_check_special()):
            return jax_call(self, *args)
        try:
            token_handler = _token_handler(tuple(self._local_devices))
        except TypeError:  # neither of the array_result_handler signatures tried
            usable = False
            return jax_call(self, *args)
        input_bufs = self.in_handler([x for i, x in enumerate(args) if i in self.kept_var_idx])
        return _run_with_token(self, token_handler, input_bufs)

    return call


def _run_with_token(call, token_handler, input_bufs):
    """Runs ExecuteReplicated `call`, whose only effect is jaxring's, on `input_bufs` (what its
    in_handler made of the kept arguments): the token in first, the returned token kept for the
    next program."""
    effect = call.ordered_effects[0]
    tokens = dispatch.runtime_tokens
    token = tokens.get_token_input(effect, call._local_devices)
    results = call.xla_executable.execute_sharded([token._buf, *input_bufs])
    token_out, *out = results.consume_with_handlers([token_handler, *call.out_handler.handlers])
    tokens.current_tokens[effect] = core.Token(token_out)
    return out


# How many (traced program, argument placement) pairs _remembered_runs keeps; past that it starts
# afresh. Its entries hold what JAX's own caches hold too (traces and executables, and through
# the traces the arrays a function closes over); they go with the jitted function, as JAX's do,
# and jax.clear_caches() or a jitted function's clear_cache() empties them with JAX's.
_REMEMBERED_RUNS = 256


def _only_effect(call, effect_type: type) -> bool:
    """Whether ExecuteReplicated `call` runs a program whose only effect is `effect_type`, with no
    mutable state or PGLE profiling in play: the programs `_fast_call` runs itself."""
    effects = call.ordered_effects
    return (len(effects) == 1 and isinstance(effects[0], effect_type)
            and not call.has_unordered_effects and not call.has_host_callbacks
            and call.mut is None and call.pgle_profiler is None)


def _run_key(p, args_flat) -> tuple | None:
    """What JAX's path decides a jitted call's executable by, past the traced program `p`: each
    argument's sharding, commitment and layout. None where the call must take JAX's path: an
    argument that is not a plain jax.Array (JAX checks and converts those) or was deleted, inside
    a trace, or with a debugging mode on that JAX's path serves (key reuse, NaN checks, PGLE
    profiling, distributed debug logging, no execution)."""
    if (not core.trace_state_clean() or config.debug_key_reuse.value
            or config.enable_pgle.value or config.distributed_debug.value
            or config.no_execution.value or dispatch.needs_check_special()):
        return None
    key = [id(p)]
    for a in args_flat:
        # A deleted array's layout is not there to read (jaxlib crashes reading it); JAX's path
        # raises its error.
        if type(a) is not array.ArrayImpl or a.is_deleted():
            return None
        try:
            key.append((a.sharding, a._committed, a._pjrt_layout))
        except Exception:  # noqa: BLE001 - no layout to read (a platform without): JAX's path
            return None
    return tuple(key)


class _Remembered:
    """_remembered_runs' entries, registered with JAX's caches (util.cache's interface), so that
    jax.clear_caches() empties them too."""

    def __init__(self):
        self.entries: dict = {}
        # id(function) -> the keys of its entries, dropped when the function is (weakref.finalize)
        self.owners: dict[int, set] = {}

    def own(self, fun, key) -> bool:
        """Makes the entry at `key` go when `fun`, the jitted function, does; False where `fun`
        cannot be referred to weakly, and an entry would keep what it closes over alive."""
        if id(fun) not in self.owners:
            try:
                weakref.finalize(fun, self.forget, id(fun))
            except TypeError:
                return False
            self.owners[id(fun)] = set()
        self.owners[id(fun)].add(key)
        return True

    def forget(self, fun_id: int) -> None:
        for key in self.owners.pop(fun_id, ()):
            self.entries.pop(key, None)

    def cache_clear(self):
        self.entries.clear()
        for keys in list(self.owners.values()):  # another thread's call may add or drop one
            keys.clear()

    def cache_info(self):
        return f"{len(self.entries)} of {_REMEMBERED_RUNS} entries"

    def cache_keys(self):
        return list(self.entries)


def _remembered_runs(jax_run, effect_type: type):
    """pjit._run_python_pjit (what a jitted call runs once JAX's C++ fast path declined it) that
    remembers, for programs whose only effect is `effect_type`, the executable and sharded
    constants JAX's path found for each traced program `p` and placement of the arguments
    (`_run_key`), and runs them directly when the same call comes again. `p` is JAX's own cached
    trace for the function, the arguments' types and the trace context (config and mesh), so a
    call that JAX would trace or compile afresh finds no entry. Every other call, and the first of
    each kind, goes through `jax_run`. A remembered call runs the program as `_fast_call` does;
    where the second call's arguments came out of the program's in_handler unchanged (already
    on the program's devices, shardings and layouts), later ones skip it."""
    remembered = _Remembered()
    if hasattr(jax_util, "register_cache"):
        jax_util.register_cache(remembered, "jaxring's remembered runs")
    runs = remembered.entries
    # A jitted function's clear_cache() empties JAX's cache of traced programs, every function's,
    # so no later call finds an entry here: the entries would only keep their programs alive.
    # (JAX sets its clear_cache on the jitted functions' class as it makes each one.)
    jax_evict = jax_pjit.jit_evict_fn

    def jit_evict_fn(self):
        jax_evict(self)
        remembered.cache_clear()

    jax_pjit.jit_evict_fn = jit_evict_fn
    type(jax.jit(lambda: None)).clear_cache = jit_evict_fn  # the functions made before

    def run(p, args_flat, fun, args, kwargs):
        key = _run_key(p, args_flat)
        hit = runs.get(key) if key is not None else None
        if hit is not None and hit[0] is p:  # an entry holds its p, so no other p has its id
            _, compiled, const_args, token_handler, passes = hit
            call = compiled.unsafe_call
            kept = [x for i, x in enumerate((*const_args, *args_flat)) if i in call.kept_var_idx]
            if passes:  # the arguments are what the program takes, as they were the last time
                input_bufs = kept
            else:
                input_bufs = call.in_handler(kept)
                if passes is None and runs.get(key) is hit:  # not cleared meanwhile
                    # The key fixes what in_handler does with them.
                    runs[key] = (*hit[:4], all(b is a for a, b in zip(input_bufs, kept)))
            out_flat = _run_with_token(call, token_handler, input_bufs)
            return (tree_util.tree_unflatten(p.out_tree, out_flat), out_flat, p.out_tree,
                    args_flat, p.params["jaxpr"], compiled, None, const_args)
        result = jax_run(p, args_flat, fun, args, kwargs)
        compiled = result[5] if len(result) == 8 and result[6] is None else None
        call = getattr(compiled, "unsafe_call", None)
        # Not with constants passed as arguments (jax_use_simplified_jaxpr_constants): JAX's
        # path sends them to the devices on every call, so it sees one changed or deleted since.
        if (key is not None and not result[7] and isinstance(compiled, pxla.MeshExecutable)
                and isinstance(call, pxla.ExecuteReplicated) and _only_effect(call, effect_type)):
            try:
                token_handler = _token_handler(tuple(call._local_devices))
            except TypeError:  # as in _fast_call, which then leaves the program to JAX
                return result
            if len(runs) >= _REMEMBERED_RUNS:
                remembered.cache_clear()
            if remembered.own(fun, key):
                runs[key] = (p, compiled, result[7], token_handler, None)
        return result

    run.remembered, run.jax_run = remembered, jax_run  # for tests and benchmarks/overhead.py
    return run
