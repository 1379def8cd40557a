"""jaxring.parallel.pipeline: layer-sharded models equal their unsharded selves, forward and
backward, for GPipe-style microbatches and for interleaved autoregressive streams in a ring."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from helpers import every_device, mesh, shard
from jaxring.parallel import pipeline

LAYERS, WIDTH = 8, 6


def make_layers(rng, dtype):
    return [{"w": (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(dtype),
             "b": rng.standard_normal(WIDTH).astype(dtype)} for _ in range(LAYERS)]


def layer(params, h):
    return jnp.tanh(h @ params["w"] + params["b"])


def unsharded(layers, x):
    for params in layers:
        x = layer(params, x)
    return x


def sharded_apply(m, check_vma=True):
    body = lambda p, x: pipeline.pipeline_apply(pipeline.scan_layers(layer), p, x, "i")  # noqa
    return jax.jit(jax.shard_map(body, mesh=m, in_specs=(P("i"), P()), out_specs=P(),
                                 check_vma=check_vma))


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pipeline_apply_equals_unsharded_model(n, dtype):
    rng = np.random.default_rng(n)
    layers = make_layers(rng, dtype)
    microbatches = rng.standard_normal((5, 3, WIDTH)).astype(dtype)
    m = mesh(n)
    got = sharded_apply(m)(shard(pipeline.stack_stages(layers, n), m), microbatches)
    expected = unsharded(layers, microbatches.astype(np.float64))
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    for copy in every_device(got):
        np.testing.assert_allclose(copy, expected, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("axes", [("a", "b"), ("b", "a")])
def test_a_pipeline_over_a_tuple_of_axes_in_either_order_equals_unsharded(axes):
    """8 stages over a 2 x 4 mesh. Stages are numbered in the tuple's order (lax.axis_index's,
    and P(axes)'s placement of the layers), while jax 0.10's ppermute numbered a tuple's
    devices in the mesh's order: over ("b", "a") the activations went to the wrong stages."""
    rng = np.random.default_rng(11)
    layers = make_layers(rng, np.float64)
    microbatches = rng.standard_normal((5, 3, WIDTH))
    m = jax.make_mesh((2, 4), ("a", "b"), devices=jax.devices()[:8])
    body = lambda p, x: pipeline.pipeline_apply(pipeline.scan_layers(layer), p, x, axes)  # noqa
    apply = jax.jit(jax.shard_map(body, mesh=m, in_specs=(P(axes), P()), out_specs=P()))
    with jax.set_mesh(m):
        stages = jax.device_put(pipeline.stack_stages(layers, 8), jax.NamedSharding(m, P(axes)))
        got = apply(stages, microbatches)
    for copy in every_device(got):
        np.testing.assert_allclose(copy, unsharded(layers, microbatches), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("check_vma", [True, False])
def test_gradient_through_a_4_stage_pipeline_equals_unsharded(check_vma):
    n = 4
    rng = np.random.default_rng(7)
    layers = make_layers(rng, np.float64)
    microbatches = rng.standard_normal((6, 2, WIDTH))
    targets = rng.standard_normal((6, 2, WIDTH))
    m = mesh(n)
    apply = sharded_apply(m, check_vma)

    def sharded_loss(stacked, x):
        return jnp.sum((apply(stacked, x) - targets) ** 2)

    with jax.set_mesh(m):
        grads = jax.jit(jax.grad(sharded_loss, argnums=(0, 1)))(
            shard(pipeline.stack_stages(layers, n), m), microbatches)
    expected = jax.grad(lambda ls, x: jnp.sum((unsharded(ls, x) - targets) ** 2),
                        argnums=(0, 1))(layers, microbatches)
    for got, want in zip(jax.tree.leaves(grads[0]),
                         jax.tree.leaves(pipeline.stack_stages(expected[0], n))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(grads[1]), np.asarray(expected[1]), rtol=1e-10,
                               atol=1e-12)


def test_gradient_through_a_pipeline_of_layers_not_finite_at_zero_equals_unsharded():
    """Layers that normalise their input without an epsilon are not finite at zero, which the
    model never sees but the idle ticks of GPipe's schedule did (a stage ran on the zeros that
    start the pipeline before its first microbatch came): multiplied by a zero cotangent, the NaN
    went into every gradient. Stages now run only at the ticks that bring them a microbatch."""
    n = 4
    rng = np.random.default_rng(12)
    layers = make_layers(rng, np.float64)
    microbatches = rng.standard_normal((5, 2, WIDTH))
    targets = rng.standard_normal((5, 2, WIDTH))

    def normalised(params, h):
        return (h / jnp.linalg.norm(h, axis=-1, keepdims=True)) @ params["w"] + params["b"]

    m = mesh(n)
    apply = jax.jit(jax.shard_map(
        lambda p, x: pipeline.pipeline_apply(pipeline.scan_layers(normalised), p, x, "i"),
        mesh=m, in_specs=(P("i"), P()), out_specs=P()))

    def unsharded_loss(ls, x):
        for params in ls:
            x = normalised(params, x)
        return jnp.sum((x - targets) ** 2)

    with jax.set_mesh(m):
        grads = jax.jit(jax.grad(lambda s, x: jnp.sum((apply(s, x) - targets) ** 2),
                                 argnums=(0, 1)))(shard(pipeline.stack_stages(layers, n), m),
                                                  microbatches)
    expected = jax.grad(unsharded_loss, argnums=(0, 1))(layers, microbatches)
    for got, want in zip(jax.tree.leaves(grads[0]),
                         jax.tree.leaves(pipeline.stack_stages(expected[0], n))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(grads[1]), np.asarray(expected[1]), rtol=1e-10,
                               atol=1e-12)


@pytest.mark.parametrize("ring", [False, True])
def test_one_pipeline_step_hands_each_output_to_the_next_stage(ring):
    """Stage k multiplies by k + 1: every stage's output goes to the next stage, and the first
    stage receives zeros, or with ring=True the last stage's output."""
    n = 4
    m = mesh(n)
    scales = np.arange(1.0, n + 1).reshape(n, 1)  # one stage's parameters per device
    x = np.random.default_rng(3).standard_normal((n, 3))

    def body(scale, v):
        return pipeline.pipeline_step(lambda s, c: s * c, scale, v, "i", ring=ring)

    f = jax.jit(jax.shard_map(body, mesh=m, in_specs=(P("i"), P("i")),
                              out_specs=(P("i"), P("i"))))
    output, carry = f(shard(scales, m), shard(x, m))
    expected = scales * x
    np.testing.assert_array_equal(np.asarray(output), expected)
    np.testing.assert_array_equal(np.asarray(carry), np.concatenate(
        [expected[-1:] if ring else np.zeros((1, 3)), expected[:-1]]))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_interleaved_streams_in_a_ring(n):
    """n autoregressive streams share an n-stage ring: stream k enters stage 0 at tick k, and what
    leaves the last stage is that stream's next input. Every stage is busy at every tick after
    the first n, and each stream evolves exactly as x <- model(x) on one device."""
    passes = 3
    rng = np.random.default_rng(n)
    layers = make_layers(rng, np.float64)
    streams = rng.standard_normal((n, 2, WIDTH))  # one initial value per stream
    stage_fn = pipeline.scan_layers(layer)

    def body(stacked, initial):
        stage = lax.axis_index("i")

        def tick(carry, t):
            # The first n ticks inject fresh streams; later, stage 0 continues what came round.
            x = jnp.where((stage == 0) & (t < n), initial[jnp.minimum(t, n - 1)], carry)
            output, carry = pipeline.pipeline_step(stage_fn, stacked, x, "i", ring=True)
            return carry, output

        empty = lax.pcast(jnp.zeros_like(initial[0]), "i", to="varying")
        _, outputs = lax.scan(tick, empty, jnp.arange(passes * n + n - 1))
        return outputs[None]

    m = mesh(n)
    f = jax.jit(jax.shard_map(body, mesh=m, in_specs=(P("i"), P()), out_specs=P("i")))
    outputs = np.asarray(f(shard(pipeline.stack_stages(layers, n), m), streams))
    last_stage = outputs[n - 1]  # [ticks, ...]: stream k completes pass p at tick k + p*n + n - 1
    for k in range(n):
        x = streams[k]
        for p in range(passes):
            x = unsharded(layers, x)
            np.testing.assert_allclose(last_stage[k + p * n + n - 1], x, rtol=1e-12)


def test_bad_layouts_are_refused():
    layers = make_layers(np.random.default_rng(0), np.float32)
    with pytest.raises(ValueError, match="8 layers cannot be split evenly over 3 stages"):
        pipeline.stack_stages(layers, 3)
    with pytest.raises(ValueError, match="0 layers cannot be split evenly over 2 stages"):
        pipeline.stack_stages([], 2)
    m = mesh(2)
    stacked = pipeline.stack_stages(layers, 2)
    unsharded_params = jax.shard_map(
        lambda p, x: pipeline.pipeline_apply(pipeline.scan_layers(layer), p, x, "i"), mesh=m,
        in_specs=(P(), P()), out_specs=P())
    with pytest.raises(ValueError, match="one stage per device"):
        jax.jit(unsharded_params)(stacked, np.ones((2, 1, WIDTH), np.float32))


def test_microbatches_that_do_not_share_a_leading_size_are_refused_and_none_give_none():
    """Leaves of different leading sizes were indexed alike, the shorter ones' indices clamped:
    microbatches paired wrongly, without an error. Scalars and an empty tree have no microbatch
    axis; zero microbatches pass through, as they would through the unsharded model."""
    layers = make_layers(np.random.default_rng(0), np.float64)
    m = mesh(2)
    stacked = shard(pipeline.stack_stages(layers, 2), m)
    pair_layer = lambda p, h: {"x": layer(p, h["x"]), "y": h["y"]}  # noqa: E731

    def run(microbatches, stage_fn=pipeline.scan_layers(pair_layer)):
        return jax.jit(jax.shard_map(
            lambda p, x: pipeline.pipeline_apply(stage_fn, p, x, "i"),
            mesh=m, in_specs=(P("i"), P()), out_specs=P()))(stacked, microbatches)

    with pytest.raises(ValueError, match=r"leading \(microbatch\) size: 3 in \['y'\]; "
                                         r"4 in \['x'\]"):
        run({"x": np.ones((4, 1, WIDTH)), "y": np.ones((3, 1, WIDTH))})
    with pytest.raises(ValueError, match=r"microbatch leaf \"\['y'\]\" is a scalar"):
        run({"x": np.ones((4, 1, WIDTH)), "y": np.float64(1.0)})
    with pytest.raises(ValueError, match="got no microbatches"):
        run({})
    none = run(np.ones((0, 1, WIDTH)), pipeline.scan_layers(layer))
    assert none.shape == (0, 1, WIDTH)
