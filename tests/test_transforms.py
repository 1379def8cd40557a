"""jaxring under JAX's transformations: grad (against the lax twins, and a whole data-parallel
training step), scan, cond, remat, vmap and pmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxring
from helpers import assert_close, every_device, mesh, shard, shmap

N = 4


def _grad_of(f, m, x, out_specs=P()):
    with jax.set_mesh(m):
        return np.asarray(jax.jit(jax.grad(
            lambda v: jnp.sum(jax.shard_map(f, mesh=m, in_specs=P("i"), out_specs=out_specs)(v)
                              ** 2)))(x))


# lax's reductions, differentiable: lax.pmax and lax.pmin have no derivative, so max and min
# take a gathered jnp.max/jnp.min (whose gradient goes to the winner, as jaxring's does).
_LAX_REDUCE = {"sum": lax.psum, "mean": lax.pmean,
               "max": lambda v, axis: jnp.max(lax.all_gather(v, axis), 0),
               "min": lambda v, axis: jnp.min(lax.all_gather(v, axis), 0)}


def _scan_cond_remat(reduce):
    """Rank-dependent values through a scan of remat'ed means and a cond choosing max or min:
    jaxring(v, op) or lax's, as `reduce`."""
    def f(v):
        k = 1.0 + lax.axis_index("i")

        def body(c, _):
            c = jax.checkpoint(lambda c: reduce(jnp.sin(c) * k, "mean"))(c)
            c = lax.cond(jnp.sum(c) > 0, lambda c: reduce(c * k, "max"),
                         lambda c: reduce(c * k, "min"), c)
            return c, None
        return lax.scan(body, v, None, length=3)[0]
    return f


@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("ours,theirs,out_specs", [
    (lambda v: jaxring.all_reduce(jnp.sin(v), "i"), lambda v: lax.psum(jnp.sin(v), "i"), P()),
    (lambda v: jaxring.all_reduce(v * v, "i", "mean"), lambda v: lax.pmean(v * v, "i"), P()),
    (lambda v: jaxring.all_reduce(jnp.sin(v), "i", "min"),
     lambda v: _LAX_REDUCE["min"](jnp.sin(v), "i"), P("i")),
    (lambda v: jaxring.reduce_scatter(v * v, "i"),
     lambda v: lax.psum_scatter(v * v, "i", tiled=True), P("i")),
    (lambda v: jaxring.reduce_scatter(v * v, "i", "mean"),
     lambda v: lax.psum_scatter(v * v, "i", tiled=True) / lax.axis_size("i"), P("i")),
    (lambda v: jaxring.reduce_scatter(v * v, "i", scatter_dimension=1),
     lambda v: lax.psum_scatter(v * v, "i", scatter_dimension=1, tiled=True), P("i")),
    (lambda v: jaxring.all_gather(jnp.cos(v), "i", axis=1),
     lambda v: lax.all_gather(jnp.cos(v), "i", axis=1, tiled=True), P("i")),
    # The root's gradient sums every device's cotangent (lax.pbroadcast has no CPU lowering).
    (lambda v: jaxring.broadcast(jnp.sin(v), "i", root=1) * (1.0 + lax.axis_index("i")),
     lambda v: lax.all_gather(jnp.sin(v), "i")[1] * (1.0 + lax.axis_index("i")), P("i")),
], ids=["psum", "pmean", "pmin", "psum_scatter", "psum_scatter_mean", "psum_scatter_dim1",
        "all_gather", "broadcast"])
def test_grad_matches_lax(ours, theirs, out_specs, check_vma, n):
    m = mesh(n)
    x = shard(np.random.default_rng(n).standard_normal((n * 2 * n, 3 * n)), m)  # n | each dim

    def grad(f):
        with jax.set_mesh(m):
            g = jax.grad(lambda v: jnp.sum(jax.shard_map(
                f, mesh=m, in_specs=P("i"), out_specs=out_specs, check_vma=check_vma)(v) ** 2))
            return np.asarray(jax.jit(g)(x))

    np.testing.assert_allclose(grad(ours), grad(theirs), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_grad_through_scan_cond_and_remat_matches_lax(n):
    """Remat'ed reductions are recomputed in the backward pass, inside scan and cond. (Without
    check_vma: a reduction's output is invariant and its input not, which scan's carry refuses.)"""
    m = mesh(n)
    x = shard(np.random.default_rng(n).standard_normal((n * 4, 6)), m)

    def grad(reduce):
        f = jax.shard_map(_scan_cond_remat(reduce), mesh=m, in_specs=P("i"), out_specs=P("i"),
                          check_vma=False)
        return np.asarray(jax.jit(jax.grad(lambda v: jnp.sum(f(v) ** 2)))(x))

    ours = grad(lambda v, op: jaxring.all_reduce(v, "i", op))
    np.testing.assert_allclose(ours, grad(lambda v, op: _LAX_REDUCE[op](v, "i")), rtol=1e-12,
                               atol=1e-12)
    assert np.abs(ours).max() > 0


@pytest.mark.parametrize("ours,theirs", [
    (lambda v: jaxring.all_reduce(v, "i"), lambda v: lax.psum(v, "i")),
    (lambda v: jaxring.all_reduce(v, "i", "mean"), lambda v: lax.pmean(v, "i")),
    (lambda v: jaxring.reduce_scatter(v, "i"), lambda v: lax.psum_scatter(v, "i", tiled=True)),
    (lambda v: jaxring.all_gather(v, "i"), lambda v: lax.all_gather(v, "i", tiled=True)),
    (lambda v: jaxring.broadcast(v, "i", root=1), lambda v: lax.all_gather(v, "i")[1]),
], ids=["psum", "pmean", "psum_scatter", "all_gather", "broadcast"])
def test_grad_of_a_replicated_input_matches_lax(ours, theirs):
    """An input replicated over the axis (in_specs P(), so invariant under vma checking): the
    collective sees it as varying, as lax's do, and the gradient agrees with theirs."""
    m = mesh(N)
    x = np.random.default_rng(5).standard_normal((2 * N, 3))

    def grad(f):
        with jax.set_mesh(m):
            g = jax.grad(lambda v: jnp.sum(jax.shard_map(
                lambda v: jnp.sin(f(v)) * (1.0 + lax.axis_index("i")), mesh=m, in_specs=P(),
                out_specs=P("i"))(v) ** 2))
            return np.asarray(jax.jit(g)(x))

    np.testing.assert_allclose(grad(ours), grad(theirs), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op", ["max", "min"])
def test_reduce_scatter_of_max_or_min_has_no_derivative(op):
    x = shard(np.random.default_rng(6).standard_normal((N * N, 3)), mesh(N))
    with pytest.raises(NotImplementedError, match=f"no derivative for op='{op}'"):
        _grad_of(lambda v: jaxring.reduce_scatter(v, "i", op), mesh(N), x, out_specs=P("i"))


def test_grad_of_max_picks_the_winner():
    m = mesh(N)
    x = np.random.default_rng(1).standard_normal((N, 6))
    x[2, 0] = x[1, 0] = 10.0  # a tie: both devices share the gradient
    got = _grad_of(lambda v: jaxring.all_reduce(v, "i", "max"), m, shard(x, m))
    expected = np.asarray(jax.grad(lambda v: jnp.sum(jnp.max(v, axis=0) ** 2))(x))
    np.testing.assert_allclose(got, expected, rtol=1e-12)


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_grad_over_an_axis_of_one_device_is_the_identity(op):
    """Over one device every op returns its input; max and min had no gradient there (they
    took lax.pmax and lax.pmin, which have no derivative), on a (4, 1) mesh as on one device."""
    m = jax.make_mesh((N, 1), ("d", "i"), devices=jax.devices()[:N])
    x = np.random.default_rng(3).standard_normal((N, 5))
    with jax.set_mesh(m):
        f = jax.shard_map(lambda v: jaxring.all_reduce(v, "i", op) * 3.0, mesh=m,
                          in_specs=P("d"), out_specs=P("d"))
        y, g = jax.jit(jax.value_and_grad(lambda v: jnp.sum(jnp.sin(f(v)))))(
            jax.device_put(x, jax.NamedSharding(m, P("d"))))
    np.testing.assert_allclose(y, np.sum(np.sin(3 * x)), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(g), 3 * np.cos(3 * x), rtol=1e-12)


def test_grad_of_broadcast_flows_to_root():
    m = mesh(N)
    x = np.random.default_rng(2).standard_normal((N, 5))
    got = _grad_of(lambda v: jaxring.broadcast(v, "i", root=2) * (1 + lax.axis_index("i")), m,
                   shard(x, m), out_specs=P("i"))
    weights = np.arange(1, N + 1, dtype=np.float64)[:, None]
    expected = np.zeros_like(x)
    expected[2] = np.sum(2 * x[2] * weights**2, axis=0)
    np.testing.assert_allclose(got, expected, rtol=1e-12)


def _mlp_loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_data_parallel_training_step_matches_pmean(n):
    """A whole shard_map SGD step: each device's gradients of its own part of the batch, averaged
    with jaxring vs lax.pmean and vs the float64 gradient of the whole batch. With
    check_vma=False, as models/deepspeech/train.py runs it, the gradients differ between devices
    until reduced; with check_vma JAX would sum them itself first, leaving the reduction nothing
    to do (a reduction that returned its input passed the earlier form of this test)."""
    rng = np.random.default_rng(n)
    params = {"w1": rng.standard_normal((6, 16)), "b1": rng.standard_normal(16),
              "w2": rng.standard_normal((16, 2))}
    batch = (rng.standard_normal((n * 8, 6)), rng.standard_normal((n * 8, 2)))
    m = mesh(n)

    def step(reduce):
        def body(p, b):
            loss, grads = jax.value_and_grad(_mlp_loss)(p, b)
            grads = reduce(grads)
            return jax.tree.map(lambda w, g: w - 0.1 * g, p, grads), reduce(loss)

        return jax.jit(jax.shard_map(body, mesh=m, in_specs=(P(), P("i")), out_specs=(P(), P()),
                                     check_vma=False))

    b = jax.tree.map(lambda v: shard(v, m), batch)
    loss, grads = jax.value_and_grad(_mlp_loss)(params, batch)  # the whole batch, on the host
    expected = (jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), loss)
    unreduced = step(lambda t: t)(params, b)
    assert not np.array_equal(*every_device(unreduced[0]["w1"])[:2]), "nothing left to reduce"
    for reduce in (lambda t: jaxring.all_reduce(t, "i", "mean"), lambda t: lax.pmean(t, "i")):
        got = step(reduce)(params, b)
        for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):  # every device's copy
            np.testing.assert_allclose(every_device(a), np.broadcast_to(e, (n,) + np.shape(e)),
                                       rtol=1e-12, atol=1e-14)


def test_inside_scan_cond_and_remat():
    """Every reduction sees different values on each device (the carry is scaled by 1 + rank
    first), so that a mean, max or min that returned its input would show; every device's
    results are checked against lax's and a float64 loop's."""
    m = mesh(N)
    host = np.random.default_rng(3).standard_normal((N * 3, 4))

    def program(reduce):  # reduce(x, op), with op one of sum, mean, max, min
        def run(v):
            def body(carry, _):
                k = 1.0 + lax.axis_index("i")
                carry = jax.checkpoint(lambda c: reduce(jnp.sin(c * k), "mean"))(carry)
                carry = lax.cond(jnp.sum(carry) > 0, lambda c: reduce(c * k, "max"),
                                 lambda c: reduce(c * k, "min"), carry)
                return carry, jnp.sum(carry)
            carry, sums = lax.scan(body, reduce(v, "sum"), None, length=5)
            return carry[None], sums[None]
        return jax.tree.map(np.asarray, shmap(run, m)(shard(host, m)))

    lax_ops = {"sum": lax.psum, "mean": lax.pmean, "max": lax.pmax, "min": lax.pmin}
    ours = program(lambda x, op: jaxring.all_reduce(x, "i", op))
    theirs = program(lambda x, op: lax_ops[op](x, "i"))
    k = (1.0 + np.arange(N))[:, None, None]
    carry, sums, branches = host.reshape(N, 3, 4).sum(0), [], set()
    for _ in range(5):
        carry = np.sin(carry * k).mean(0)
        branches.add(carry.sum() > 0)
        carry = (carry * k).max(0) if carry.sum() > 0 else (carry * k).min(0)
        sums.append(carry.sum())
    assert branches == {True, False}, "both branches of the cond are taken"
    for device in range(N):
        for got, want, exact in zip(ours, theirs, (carry, np.array(sums))):
            np.testing.assert_allclose(got[device], want[device], rtol=1e-12)
            np.testing.assert_allclose(got[device], exact, rtol=1e-12)


def test_vmap_inside_shard_map():
    m = mesh(N)
    x = np.random.default_rng(4).standard_normal((N * 3, 5, 6))

    def check(ours, theirs):
        got = shmap(jax.vmap(ours, in_axes=1, out_axes=1), m)(shard(x, m))
        expected = shmap(jax.vmap(theirs, in_axes=1, out_axes=1), m)(shard(x, m))
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-12)

    check(lambda v: jaxring.all_reduce(v, "i"), lambda v: lax.psum(v, "i"))
    check(lambda v: jaxring.reduce_scatter(v[:, :4], "i", scatter_dimension=1),
          lambda v: lax.psum_scatter(v[:, :4], "i", scatter_dimension=1, tiled=True))
    check(lambda v: jaxring.all_gather(v, "i", axis=1),
          lambda v: lax.all_gather(v, "i", axis=1, tiled=True))
    check(lambda v: jaxring.broadcast(v, "i", root=1),
          lambda v: lax.all_gather(v, "i", tiled=False)[1])


def test_pmap():
    x = np.random.default_rng(5).standard_normal((8, 7))
    got = jax.pmap(lambda v: jaxring.all_reduce(v, "d"), axis_name="d")(x)
    expected = jax.pmap(lambda v: lax.psum(v, "d"), axis_name="d")(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-12)
    got = jax.pmap(lambda v: jaxring.all_gather(v, "d"), axis_name="d")(x)
    np.testing.assert_array_equal(np.asarray(got), np.tile(x.reshape(-1), (8, 1)))


@pytest.mark.parametrize("axes", [("data", "model"), ("model", "data")])
def test_every_collective_over_a_tuple_of_axes_in_either_order_matches_lax(axes):
    """Over a tuple, devices are numbered in the tuple's order, as lax.axis_index,
    lax.all_gather and psum_scatter number them (broadcast's root likewise)."""
    m = jax.make_mesh((4, 2), ("data", "model"))
    x = np.random.default_rng(8).standard_normal((4 * 16, 2 * 3))
    xs = shard(x, m, P("data", "model"))
    spec = P("data", "model")
    pairs = {
        "all_gather": (lambda v: jaxring.all_gather(v, axes, axis=1),
                       lambda v: lax.all_gather(v, axes, axis=1, tiled=True)),
        "reduce_scatter": (lambda v: jaxring.reduce_scatter(v, axes),
                           lambda v: lax.psum_scatter(v, axes, tiled=True)),
        "broadcast": (lambda v: jaxring.broadcast(v, axes, root=5),
                      lambda v: lax.psum(jnp.where(lax.axis_index(axes) == 5, v, 0), axes)),
    }
    for name, (ours, theirs) in pairs.items():
        got = np.asarray(shmap(ours, m, spec, spec)(xs))
        expected = np.asarray(shmap(theirs, m, spec, spec)(xs))
        assert got.shape == expected.shape, name
        assert_close(got, expected, np.float64, count=8)


def test_two_dimensional_mesh_keeps_groups_apart():
    """Reducing over one mesh axis: the groups along the other axis must never mix."""
    m = jax.make_mesh((4, 2), ("data", "model"))
    x = np.random.default_rng(6).standard_normal((4 * 3, 2 * 5))
    xs = shard(x, m, P("data", "model"))
    for axes in ["data", "model", ("data", "model")]:
        got = shmap(lambda v: jaxring.all_reduce(v, axes), m, P("data", "model"),
                    P("data", "model"))(xs)
        expected = shmap(lambda v: lax.psum(v, axes), m, P("data", "model"),
                         P("data", "model"))(xs)
        assert_close(np.asarray(got), np.asarray(expected), np.float64, count=8)


@pytest.mark.parametrize("shape", [(2, 2), (4, 2), (2, 1), (1, 2)])
def test_a_shard_map_nested_in_another_matches_lax_or_is_refused_where_jaxlib_would_abort(shape):
    """An outer shard_map over "a", an inner one over "b". jaxlib 0.10 aborts the process
    compiling an ordered effect there when both span more than one device, so jaxring refuses
    that case on it. jaxlib 0.11 compiles that case, and where one of them spans a single device
    its partitioner may refuse a side effect there (an ordered io_callback alike), with an error.
    Whatever compiles matches lax."""
    from jax._src.lib import version as jaxlib_version
    m = jax.make_mesh(shape, ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                      devices=jax.devices()[:shape[0] * shape[1]])
    x = np.random.default_rng(9).standard_normal((4 * shape[0], 6 * shape[1]))
    pairs = {
        "all_reduce": (lambda v: jaxring.all_reduce(v, "b"), lambda v: lax.psum(v, "b"), "b"),
        "all_gather": (lambda v: jaxring.all_gather(v, "b", axis=1),
                       lambda v: lax.all_gather(v, "b", axis=1, tiled=True), None),
    }

    def nested(f, out_b):
        inner = lambda v: jax.shard_map(f, in_specs=P(None, "b"), out_specs=P(None, out_b),
                                        axis_names={"b"}, check_vma=False)(v)
        return jax.jit(jax.shard_map(inner, mesh=m, in_specs=P("a"), out_specs=P("a"),
                                     axis_names={"a"}, check_vma=False))

    for name, (ours, theirs, out_b) in pairs.items():
        if jaxlib_version < (0, 11) and min(shape) > 1:
            with pytest.raises(NotImplementedError, match=r"nested in one over \['a'\] cannot "
                                                          r"be compiled by jaxlib 0\.10"):
                nested(ours, out_b)(x)
            continue
        try:
            got = np.asarray(nested(ours, out_b)(x))
        except jax.errors.JaxRuntimeError as e:
            assert jaxlib_version >= (0, 11) and min(shape) == 1, e
            assert "side-effect HLO cannot have a replicated sharding" in str(e), e
            continue
        expected = np.asarray(nested(theirs, out_b)(x))
        assert got.shape == expected.shape, name
        assert_close(got, expected, np.float64, count=shape[1])
