"""all_reduce writing its result over its operand (XLA aliasing): where jaxring chooses it, and
that it never changes a result: in place and into a fresh output give the same bits with every
algorithm, when the operand is a loop carry, is still needed afterwards, feeds two calls, or is
the program's own argument (which must survive the call unless donated)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxring
from helpers import assert_close, mesh, random_array, shard, shmap
from test_collectives import VARIANTS


def _aliased(f, *args) -> list[bool]:
    """For each jaxring all-reduce in f's lowered program, in program order: is it in place?"""
    text = f.lower(*args).as_text()
    return ["output_operand_aliases" in line for line in text.splitlines()
            if "custom_call @jaxring_all_reduce" in line]


def test_in_place_is_chosen_for_values_the_program_owns():
    m = mesh(2)
    x = shard(np.ones(8, np.float32), m)
    constant = np.arange(4, dtype=np.float32)
    ar = lambda v, **kw: jaxring.all_reduce(v, "i", **kw)
    carry = lambda step: lambda v: lax.pcast(ar(step(v)), "i", to="varying")
    cases = {
        # The program's argument must survive the call: a fresh output.
        "argument": (lambda v: ar(v), [False]),
        "reshaped argument": (lambda v: ar(v.reshape(2, 2)).reshape(4), [False]),
        "constant": (lambda v: ar(constant) + v, [False]),
        "computed": (lambda v: ar(v * 2), [True]),
        # A broadcast of the argument is a new value, though a view's walk back reaches it.
        "broadcast argument": (lambda v: ar(jnp.broadcast_to(v, (3, 4)))[0], [True]),
        "reshaped computed value": (lambda v: ar((v * 2).reshape(2, 2)).reshape(4), [True]),
        "fori_loop carry": (lambda v: lax.fori_loop(0, 3, lambda _, a: carry(lambda b: b)(a), v),
                            [True]),
        "scan carry and slice": (
            lambda v: lax.scan(lambda c, s: (carry(lambda b: b)(c), ar(s)), v, v.reshape(4, 1))[0],
            [True, True]),
        "while_loop carry": (
            lambda v: lax.while_loop(lambda a: a[0] < 100, carry(lambda b: b), v), [True]),
        "cond operand": (lambda v: lax.cond(v[0] > 0, carry(lambda b: b), lambda b: b, v),
                         [False]),
        "forced in place": (lambda v: ar(v, in_place=True), [True]),
        "forced fresh": (lambda v: ar(v * 2, in_place=False), [False]),
        "computed under grad": (lambda v: jax.grad(lambda b: ar(b * b).sum())(v), [True]),
        "argument under grad": (lambda v: jax.grad(lambda b: (ar(b) * b).sum())(v), [False]),
        "computed under vmap": (lambda v: jax.vmap(ar)((v * 2).reshape(2, 2)).reshape(4), [True]),
        "argument under vmap": (lambda v: jax.vmap(ar)(v.reshape(2, 2)).reshape(4), [False]),
    }
    for name, (body, expected) in cases.items():
        assert _aliased(shmap(body, m), x) == expected, name
    pmapped = jax.pmap(lambda v: jaxring.all_reduce(v, "i") + jaxring.all_reduce(v + 1, "i"),
                       axis_name="i", devices=jax.devices()[:2])
    assert _aliased(pmapped, np.ones((2, 4), np.float32)) == [False, True]


@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int32], ids=str)
def test_in_place_gives_the_bits_of_a_fresh_output(n, variant, dtype):
    """Sizes per device: 1 and 7 (copied into the rendezvous), 5003 (read from the peers'
    buffers) and 100_003 (many pipeline slices a ring step in the small-slice variant). Each
    loop pass scales the sum by a factor that differs per device, so every all-reduce sees
    different inputs on every device and a chunk read after its owner overwrote it would change
    the result."""
    dtype = np.dtype(dtype)
    m = mesh(n)
    rng = np.random.default_rng([n, dtype.num])
    integer = np.issubdtype(dtype, np.integer)

    def program(in_place):  # in_place "lax": the twin, summing 16-bit types in float32 too
        def body(v):
            rank = lax.axis_index("i")
            if integer:
                scale = lambda a: a * (rank + 1).astype(dtype) % 1000
            else:
                scale = lambda a: (a.astype(np.float32) * (1 + rank / 8) / n).astype(dtype)
            if in_place == "lax":
                ar = lambda a: lax.psum(a.astype(np.float32) if dtype.itemsize == 2 else a,
                                        "i").astype(dtype)
            else:
                ar = lambda a: jaxring.all_reduce(a, "i", in_place=in_place)
            looped = lax.fori_loop(0, 3, lambda _, a: scale(ar(a)), v)
            doubled = v * 2
            live = ar(doubled) + doubled  # the operand is still needed after the call
            once, again = ar(v + 1), ar(v + 1)  # one value feeding two calls
            return looped, live, once, again
        return shmap(body, m, out_specs=(P("i"),) * 4)

    for size in (1, 7, 5003, 100_003):
        x = random_array(rng, (n * size,), dtype)
        twin = [np.asarray(r) for r in program("lax")(shard(x, m))]
        with jaxring.config.override(**VARIANTS[variant]):
            fresh = [np.asarray(r) for r in program(False)(shard(x, m))]
            auto = program(None)
            assert _aliased(auto, shard(x, m)) == [True, True, True, True], "in place"
            in_place = [np.asarray(r) for r in auto(shard(x, m))]
        for a, b in zip(in_place, fresh):
            np.testing.assert_array_equal(a, b, err_msg=f"{variant}, {size} per device")
        blocks = x.astype(np.float64).reshape(n, size)
        # Three sums, each scaled and rounded, against the twin's (another summation order).
        assert_close(in_place[0], twin[0].astype(np.float64), dtype, count=4 * n,
                     exact_reference=False)
        # The sum and the addition after it each round (exact_reference=False).
        assert_close(in_place[1], np.tile(blocks.sum(0) * 2, n) + 2 * blocks.reshape(-1), dtype,
                     count=n + 1, exact_reference=False)
        plus_one = (x.astype(dtype) + dtype.type(1)).astype(np.float64).reshape(n, size).sum(0)
        for result in in_place[2:]:
            assert_close(result, np.tile(plus_one, n), dtype, count=n)


@pytest.mark.parametrize("n", [3, 8])
def test_in_place_gives_the_bits_of_a_fresh_output_when_streamed(n):
    """From 16 MiB of outputs in all the direct all-reduce streams its stores: a fresh output a
    64-byte line at a time, one in place in blocks (kernels/reduce_cpu_impl.inc, StreamLines). Both
    must give the same bits, every element checked against float64."""
    count = (16 << 20) // (n * 4) + 13
    m = mesh(n)
    x = random_array(np.random.default_rng(n), (n * count,), np.float32)
    results = {}
    with jaxring.config.override(algorithm="direct"):
        for in_place in (False, True):
            f = shmap(lambda v: jaxring.all_reduce(v * 2, "i", in_place=in_place), m)
            assert _aliased(f, shard(x, m)) == [in_place]
            results[in_place] = np.asarray(f(shard(x, m)))
    np.testing.assert_array_equal(results[True], results[False])
    expected = np.tile((x.astype(np.float64) * 2).reshape(n, count).sum(0), n)
    assert_close(results[True], expected, np.float32, count=n)


@pytest.mark.parametrize("donate", [False, True])
def test_in_place_on_the_program_argument(donate):
    """Forced in place on the program's argument: XLA copies the argument first unless it is
    donated, so the caller's array is intact after the call."""
    n, size = 4, 30_011
    m = mesh(n)
    x = random_array(np.random.default_rng(donate), (n * size,), np.float32)
    f = jax.jit(jax.shard_map(lambda v: jaxring.all_reduce(v, "i", in_place=True), mesh=m,
                              in_specs=P("i"), out_specs=P("i")),
                donate_argnums=(0,) if donate else ())
    argument = shard(x, m)
    result = np.asarray(f(argument))
    assert_close(result, np.tile(x.astype(np.float64).reshape(n, size).sum(0), n), np.float32,
                 count=n)
    if not donate:
        np.testing.assert_array_equal(np.asarray(argument), x)
