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

Only jaxring's own effect takes this path; every other effect is handled by JAX's code. If JAX's
internals differ from what this expects, nothing is patched and dispatch stays JAX's (correct,
slower). `JAXRING_FAST_TOKENS=0` turns the patch off.
"""

from __future__ import annotations

import functools
import inspect
import os

import jax
import numpy as np
from jax._src import array, config, core, dispatch
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


# What _fast_call reads of an ExecuteReplicated (the same in jax 0.10 and 0.11).
_EXECUTE_SLOTS = {"xla_executable", "in_handler", "out_handler", "ordered_effects",
                  "has_unordered_effects", "has_host_callbacks", "_local_devices", "kept_var_idx",
                  "mut", "pgle_profiler"}


def _expected_call() -> bool:
    return (_EXECUTE_SLOTS <= set(getattr(pxla.ExecuteReplicated, "__slots__", ()))
            and hasattr(xc, "array_result_handler")
            and hasattr(dispatch, "needs_check_special")
            and hasattr(config, "no_execution"))


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
            if (isinstance(token, core.Token)
                    and token._buf.sharding is _token_layout(tuple(devices))[0]):
                token.block_until_ready()  # one program at a time: see the module docstring
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
        effects = self.ordered_effects
        if (not usable or len(effects) != 1 or not isinstance(effects[0], effect_type)
                or self.has_unordered_effects or self.has_host_callbacks
                or self.mut is not None or self.pgle_profiler is not None
                or config.no_execution.value or dispatch.needs_check_special()):
            return jax_call(self, *args)
        try:
            token_handler = _token_handler(tuple(self._local_devices))
        except TypeError:  # neither of the array_result_handler signatures tried
            usable = False
            return jax_call(self, *args)
        input_bufs = self.in_handler([x for i, x in enumerate(args) if i in self.kept_var_idx])
        tokens = dispatch.runtime_tokens
        token = tokens.get_token_input(effects[0], self._local_devices)
        results = self.xla_executable.execute_sharded([token._buf, *input_bufs])
        token_out, *out = results.consume_with_handlers(
            [token_handler, *self.out_handler.handlers])
        tokens.current_tokens[effects[0]] = core.Token(token_out)
        return out

    return call
