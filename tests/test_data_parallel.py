"""jaxring.parallel.data: fused buckets against per-leaf lax reductions, parameter broadcast,
cross-replica batch-norm moments, the distributed optimizer, and one data-parallel Deep Speech 2
step against one single-device step on the same global batch."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxring
from jaxring.parallel import data as data_parallel
from models.deepspeech import configs
from models.deepspeech import train as training
from tests.helpers import assert_close, every_device, mesh, random_array, shard


def random_tree(rng, n):
    """Per-device gradients (leading axis n) of mixed dtypes and awkward sizes."""
    shapes = {"w": (5, 3), "b": (7,), "scalar": (), "empty": (0, 4), "big": (1001,)}
    tree = {name: random_array(rng, (n,) + shape, np.float32) for name, shape in shapes.items()}
    tree["f64"] = [random_array(rng, (n, 3, 3), np.float64), random_array(rng, (n, 2), np.float64)]
    tree["count"] = random_array(rng, (n, 4), np.int32)
    tree["half"] = {"f16": random_array(rng, (n, 6), np.float16),
                    "bf16": random_array(rng, (n, 3, 5), jnp.bfloat16)}
    return tree


@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("bucket_bytes", [400, 1 << 20])
@pytest.mark.parametrize("fuse_below_bytes", [None, 60])  # 60: "w", "big" and "f64"[0] go alone
def test_fused_buckets_equal_per_leaf_psum(n, bucket_bytes, fuse_below_bytes):
    rng = np.random.default_rng(n * 1000 + bucket_bytes)
    tree = random_tree(rng, n)
    m = mesh(n)

    def both(local):
        local = jax.tree.map(lambda x: x[0], local)
        fused = data_parallel.all_reduce_gradients(local, "i", "sum", bucket_bytes,
                                                   fuse_below_bytes)
        # An empty leaf's reference is made anew, not from the argument: jaxlib 0.11.2 crashes
        # compiling any use of a zero-size argument of a shard_map body (README, "Versions").
        reference = jax.tree.map(lambda x: lax.psum(x, "i") if x.size else jnp.zeros_like(x),
                                 local)
        return jax.tree.map(lambda x: x[None], (fused, reference))

    fused, reference = jax.device_get(jax.jit(jax.shard_map(
        both, mesh=m, in_specs=P("i"), out_specs=P("i")))(shard(tree, m)))
    for got, want, leaf in zip(jax.tree.leaves(fused), jax.tree.leaves(reference),
                               jax.tree.leaves(tree)):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape
        expected = np.broadcast_to(np.asarray(leaf, np.float64).sum(0), leaf.shape[1:])
        for replica in range(n):
            assert_close(got[replica], expected, leaf.dtype, count=n)
        # lax.psum sums 16-bit types in 16 bits, each step rounded: `n` roundings apart.
        assert_close(got, np.asarray(want, np.float64), leaf.dtype, count=2 * n,
                     exact_reference=False)


def test_a_dtype_with_only_empty_leaves_comes_back():
    """Leaves with no elements go in no bucket and come back as empty arrays of their shape and
    dtype, also where they are the only leaves of their dtype (such a dtype's group used to
    vanish from the plan, and its leaves came back as None)."""
    n = 3
    rng = np.random.default_rng(11)
    tree = {"w": random_array(rng, (n, 5), np.float32), "e32": np.zeros((n, 0, 4), np.float32),
            "e64": np.zeros((n, 2, 0), np.float64)}
    m = mesh(n)
    f = jax.jit(jax.shard_map(
        lambda t: jax.tree.map(lambda x: x[None], data_parallel.all_reduce_gradients(
            jax.tree.map(lambda x: x[0], t), "i", "sum", bucket_bytes=8)),
        mesh=m, in_specs=P("i"), out_specs=P("i")))
    got = jax.device_get(f(shard(tree, m)))
    for name, leaf in tree.items():
        assert got[name].dtype == leaf.dtype and got[name].shape == leaf.shape, name
    expected = np.asarray(tree["w"], np.float64).sum(0)
    for replica in range(n):
        assert_close(got["w"][replica], expected, np.float32, count=n)


def test_the_helpers_work_without_optax():
    """optax is not a dependency of jaxring: only `distributed` needs it, and says so."""
    code = ("import sys; sys.modules['optax'] = None\n"
            "import numpy as np\n"
            "from jaxring.parallel import data\n"
            "tree = {'a': np.arange(5.0), 'b': np.ones(3, np.float32)}\n"
            "plan = data.fusion_plan(tree)\n"
            "back = data.unfuse(data.fuse(tree, plan), plan, [])\n"
            "assert all((back[k] == tree[k]).all() for k in tree)\n"
            "try:\n"
            "    data.distributed(None, 'i')\n"
            "except ImportError as e:\n"
            "    print(e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert result.returncode == 0, result.stderr
    assert "distributed wraps an optax optimizer: install optax" in result.stdout, result.stdout


def count_all_reduces(fn, *args):
    jaxpr = str(jax.make_jaxpr(fn)(*args))
    return jaxpr.count("jaxring_all_reduce")


def test_one_all_reduce_per_bucket():
    """The point of fusion: the number of collective calls is the number of buckets, plus one
    for each leaf too large to pack (fuse_below_bytes)."""
    # Distinct values in every leaf, so that a leaf unpacked from another's place shows.
    tree = {"a": jnp.arange(300, dtype=jnp.float32), "b": -jnp.arange(100, dtype=jnp.float32).reshape(50, 2),
            "c": jnp.arange(10, dtype=jnp.float64) + 0.5}
    m = mesh(2)
    # (bucket_bytes, fuse_below_bytes, buckets, leaves alone); a, b, c hold 1200, 400, 80 bytes
    cases = [(1 << 20, None, 2, 0), (400, None, 4 + 1, 0), (40, None, 40 + 2, 0),
             (1 << 20, 1000, 2, 1), (1 << 20, 400, 1, 2), (40, 400, 2, 2), (1 << 20, 80, 0, 3)]
    leaves = jax.tree.leaves(tree)
    for bucket_bytes, fuse_below, buckets, alone in cases:
        plan = data_parallel.fusion_plan(tree, bucket_bytes, fuse_below)
        assert sum(len(sizes) for _, _, sizes in plan.groups) == buckets
        assert len(plan.alone) == alone
        f = jax.shard_map(
            lambda t, bb=bucket_bytes, fb=fuse_below: data_parallel.all_reduce_gradients(
                t, "i", "sum", bb, fb),
            mesh=m, in_specs=P(), out_specs=P(), check_vma=False)
        assert count_all_reduces(f, tree) == buckets + alone
        restored = data_parallel.unfuse(data_parallel.fuse(tree, plan), plan,
                                        [leaves[i] for i in plan.alone])
        for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(tree)):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)


def test_a_leaf_varying_over_only_some_axes_is_refused_as_all_reduce_refuses_it():
    """Summing over ("a", "b") a leaf that varies over "a" only: jaxring.all_reduce (like
    lax.psum) refuses it, as it is unclear whether its copies along "b" count once or once each.
    Packed into a bucket with a leaf that varies over both, the bucket varies over both, and
    all_reduce_gradients summed both copies; now it refuses the leaf, naming it the same way. A
    leaf alone (over fuse_below_bytes) was refused before too; max takes either."""
    m = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices()[:4])
    x = np.random.default_rng(11).standard_normal((4, 8)).astype(np.float32)
    with jax.set_mesh(m):
        xs = jax.device_put(x, jax.NamedSharding(m, P(("a", "b"))))

        def step(op, fuse_below):
            def body(v):
                partly = lax.psum(v, "b")  # varies over "a" only
                return data_parallel.all_reduce_gradients({"partly": partly, "both": v},
                                                          ("a", "b"), op,
                                                          fuse_below_bytes=fuse_below)
            return jax.jit(jax.shard_map(body, mesh=m, in_specs=P(("a", "b")), out_specs=P()))

        for fuse_below in (None, 4):
            for op in ("sum", "mean"):
                with pytest.raises(ValueError, match=r"all_reduce_gradients: the input varies "
                                                     r"over \('a',\) but not over \('b',\)"):
                    step(op, fuse_below)(xs)
        got = step("max", None)(xs)
    pairs = x.reshape(2, 2, 8).sum(1)  # "partly" on the devices of a = 0 and a = 1
    np.testing.assert_array_equal(np.asarray(got["partly"]), pairs.max(0, keepdims=True))
    np.testing.assert_array_equal(np.asarray(got["both"]), x.max(0, keepdims=True))
    # An empty tree has nothing to refuse or reduce, even outside a shard_map.
    assert data_parallel.all_reduce_gradients({}, ("a", "b")) == {}


def test_fused_buckets_give_each_leaf_the_type_it_would_get_alone():
    """Over a (data, model) mesh, reduced over "data": a leaf varying over both axes and one
    varying over "data" only, each with an empty slice of itself, all packed. A bucket varies over
    every axis one of its leaves does, so the "data"-only leaf came back varying over "model"
    (refused by out_specs=P() below), and empty leaves, made anew, came back invariant. Every
    leaf must get the varying type its own jaxring.all_reduce gives, and its values."""
    import jaxring
    from jax._src import core
    from jaxring._src import common

    m = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
    types = {}

    def body(w, b):
        grads = {"w": w, "b": b, "w_empty": w[:0], "b_empty": b[:0]}
        fused = data_parallel.all_reduce_gradients(grads, "data", "sum", fuse_below_bytes=None)
        alone = {k: jaxring.all_reduce(v, "data", "sum") for k, v in grads.items()}
        for name, tree in (("fused", fused), ("alone", alone)):
            types[name] = {k: common.varying_axes(core.typeof(v)) for k, v in tree.items()}
        return fused["w"], fused["b"]

    rng = np.random.default_rng(13)
    w, b = rng.standard_normal(8).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    f = jax.jit(jax.shard_map(body, mesh=m, in_specs=(P(("data", "model")), P("data")),
                              out_specs=(P("model"), P())))
    got_w, got_b = f(shard(w, m, P(("data", "model"))), shard(b, m, P("data")))
    assert types["fused"] == types["alone"], types
    assert types["alone"]["w"] == types["alone"]["w_empty"] == {"model"}, types
    assert types["alone"]["b"] == types["alone"]["b_empty"] == set(), types
    np.testing.assert_array_equal(np.asarray(got_w), w.reshape(2, 2, 2).sum(0).reshape(4))
    np.testing.assert_array_equal(every_device(got_b), np.tile(b.reshape(2, 2).sum(0), (4, 1)))


def test_bucket_sizes_are_checked_and_errors_name_the_function_called():
    """The sizes were checked only where buckets were planned: not on an axis of one device or
    for an empty tree; and an unknown axis was blamed on "jaxring.fusion"."""
    one = mesh(1)
    for helper in (data_parallel.all_reduce_gradients, data_parallel.broadcast_parameters):
        with pytest.raises(ValueError, match="bucket_bytes must be a positive int, got -1"):
            jax.jit(jax.shard_map(lambda v: helper(v, "i", bucket_bytes=-1), mesh=one,
                                  in_specs=P("i"), out_specs=P("i")))(shard(np.ones(2), one))
        with pytest.raises(ValueError, match="fuse_below_bytes must be a positive int or None, "
                                             "got 0"):
            helper({}, "i", fuse_below_bytes=0)
        # A float failed in numpy's split ("'float' object cannot be interpreted as an
        # integer"), and True was taken as 1 byte.
        for bad in (1e6, 16.5, True):
            with pytest.raises(ValueError, match=rf"bucket_bytes must be a positive int, got "
                                                 rf"{bad!r}"):
                helper({"w": np.ones(3, np.float32)}, "i", bucket_bytes=bad)
            with pytest.raises(ValueError, match=rf"fuse_below_bytes must be a positive int or "
                                                 rf"None, got {bad!r}"):
                helper({"w": np.ones(3, np.float32)}, "i", fuse_below_bytes=bad)
    # An unknown op named all_reduce_gradients only where it reached jaxring.all_reduce, and
    # distributed() took it until its first update.
    with pytest.raises(ValueError, match=r"jaxring.all_reduce_gradients: unsupported op 'avg'"):
        data_parallel.all_reduce_gradients({}, "i", op="avg")
    with pytest.raises(ValueError, match=r"jaxring.distributed: unsupported op 'avg'"):
        data_parallel.distributed(optax.sgd(0.1), "i", op="avg")
    with pytest.raises(ValueError, match=r"bucket_bytes must be a positive int, got 0"):
        data_parallel.distributed(optax.sgd(0.1), "i", bucket_bytes=0)
        with pytest.raises(NameError, match=f"jaxring.{helper.__name__}: unbound axis name"):
            jax.jit(jax.shard_map(lambda v: helper(v, "nope"), mesh=one, in_specs=P("i"),
                                  out_specs=P("i")))(shard(np.ones(2), one))


def test_broadcast_parameters_from_root():
    n, root = 4, 2
    rng = np.random.default_rng(7)
    tree = random_tree(rng, n)
    m = mesh(n)
    f = jax.jit(jax.shard_map(
        lambda t: jax.tree.map(lambda x: x[None], data_parallel.broadcast_parameters(
            jax.tree.map(lambda x: x[0], t), "i", root, bucket_bytes=64)),
        mesh=m, in_specs=P("i"), out_specs=P("i")))
    for got, leaf in zip(jax.tree.leaves(jax.device_get(f(shard(tree, m)))),
                         jax.tree.leaves(tree)):
        for replica in range(n):
            np.testing.assert_array_equal(got[replica], leaf[root])


def test_masked_moments_across_replicas_equal_global_batch():
    n = 4
    rng = np.random.default_rng(8)
    x = rng.standard_normal((n * 3, 5, 6)).astype(np.float32) * 3 + 1
    mask = (rng.random((n * 3, 5, 1)) < 0.6).astype(np.float32)
    m = mesh(n)
    replicas = jax.tree.map(every_device, jax.jit(jax.shard_map(
        lambda x, mask: data_parallel.masked_moments(x, mask, "i"), mesh=m,
        in_specs=(P("i"), P("i")), out_specs=P()))(shard(x, m), shard(mask, m)))
    selected = np.asarray(x, np.float64).reshape(-1, 6)[mask.reshape(-1) > 0]
    local = data_parallel.masked_moments(jnp.asarray(x), jnp.asarray(mask))
    for moments in zip(*replicas):  # each device's (mean, var)
        np.testing.assert_allclose(moments[0], selected.mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(moments[1], selected.var(0), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(local[0], moments[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(local[1], moments[1], rtol=1e-4, atol=1e-6)


def test_masked_moments_per_feature_masks_and_16_bit_inputs():
    """A mask shaped like x masks each feature on its own; bfloat16 inputs are summed in float32,
    so counts past 256 stay exact and the statistics are those of the float64 reference."""
    n = 2
    rng = np.random.default_rng(10)
    x = (rng.standard_normal((n * 40, 16, 3)) + 2).astype(jnp.bfloat16)
    mask = (rng.random(x.shape) < 0.7).astype(np.float32)
    m = mesh(n)
    means, variances = jax.tree.map(every_device, jax.jit(jax.shard_map(
        lambda x, mask: data_parallel.masked_moments(x, mask, "i"), mesh=m,
        in_specs=(P("i"), P("i")), out_specs=P()))(shard(x, m), shard(mask, m)))
    assert means.dtype == variances.dtype == jnp.bfloat16
    x64 = np.asarray(x, np.float64).reshape(-1, 3)
    keep = mask.reshape(-1, 3) > 0
    for mean, var in zip(means, variances):  # each device's
        for f in range(3):  # about 900 selected elements per feature, a different count each
            selected = x64[keep[:, f], f]
            np.testing.assert_allclose(float(mean[f]), selected.mean(), rtol=1e-2)
            np.testing.assert_allclose(float(var[f]), selected.var(), rtol=2e-2)


@pytest.mark.parametrize("n", [1, 3, 5])
def test_masked_moments_of_a_large_mean_keep_the_variance_without_the_fast_variance(n):
    """Inputs 10000 + N(0, 1) in float32: the fast variance from summed squares (E[x^2] -
    E[x]^2) loses it to cancellation (a review's repro: 0 to 30 where the truth is about 1);
    two passes, deviations from the global mean, match the float64 reference."""
    rng = np.random.default_rng(n + 20)
    x = (rng.standard_normal((n * 7, 9, 4)) + 10000).astype(np.float32)
    mask = (rng.random((n * 7, 9, 1)) < 0.8).astype(np.float32)
    mask[:7] = 0 if n > 1 else mask[:7]  # the first replica holds no element at all
    m = mesh(n)
    replicas = jax.tree.map(every_device, jax.jit(jax.shard_map(
        lambda x, mask: data_parallel.masked_moments(x, mask, "i", use_fast_variance=False),
        mesh=m, in_specs=(P("i"), P("i")), out_specs=P()))(shard(x, m), shard(mask, m)))
    selected = np.asarray(x, np.float64).reshape(-1, 4)[mask.reshape(-1) > 0]
    for mean, var in zip(*replicas):
        np.testing.assert_allclose(mean, selected.mean(0), rtol=1e-6)  # float32: 1 ulp 6e-8
        np.testing.assert_allclose(var, selected.var(0), rtol=2e-3)
    # The gradient through both passes equals one device's on the global batch.
    weights = rng.standard_normal((2, 4)).astype(np.float32)

    def loss(x, mask, axis_name):
        mean, var = data_parallel.masked_moments(x - 10000, mask, axis_name,
                                                 use_fast_variance=False)
        return jnp.sum(mean * weights[0] + var * weights[1])

    sharded = jax.jit(jax.shard_map(jax.grad(lambda x, mask: loss(x, mask, "i")), mesh=m,
                                    in_specs=(P("i"), P("i")), out_specs=P("i")))
    np.testing.assert_allclose(np.asarray(sharded(shard(x, m), shard(mask, m))),
                               np.asarray(jax.grad(loss)(x, mask, None)), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("use_fast_variance", [True, False])
def test_masked_moments_of_a_feature_masked_everywhere_or_constant(use_fast_variance):
    """A feature that every replica masks out gets mean and variance 0, not 0 / 0; a constant
    one gets variance 0, never below (the fast variance, E[x^2] - E[x]^2, rounds below 0 there,
    and a normalisation's rsqrt would make that NaN); the others match the float64 reference."""
    n = 4
    rng = np.random.default_rng(30)
    x = rng.standard_normal((n * 6, 5, 3)).astype(np.float32) * 2 + 1
    x[..., 0] = 0.1
    mask = (rng.random(x.shape) < 0.7).astype(np.float32)
    mask[..., 1] = 0
    m = mesh(n)
    replicas = jax.tree.map(every_device, jax.jit(jax.shard_map(
        lambda x, mask: data_parallel.masked_moments(x, mask, "i", use_fast_variance), mesh=m,
        in_specs=(P("i"), P("i")), out_specs=P()))(shard(x, m), shard(mask, m)))
    selected = np.asarray(x, np.float64)[..., 2][mask[..., 2] > 0]
    for mean, var in zip(*replicas):  # each device's
        np.testing.assert_allclose(mean[0], 0.1, rtol=1e-6)
        assert 0 <= var[0] < 1e-9, var[0]
        assert mean[1] == 0 and var[1] == 0, (mean[1], var[1])
        np.testing.assert_allclose(mean[2], selected.mean(), rtol=1e-5)
        np.testing.assert_allclose(var[2], selected.var(), rtol=1e-4)


def test_masked_moments_leave_out_what_is_masked_even_nan_and_inf():
    """Masked-out elements were multiplied by 0, so a NaN or an infinity there (padding that
    was never written, say) made every statistic NaN."""
    n = 2
    rng = np.random.default_rng(31)
    x = rng.standard_normal((n * 4, 3, 2)).astype(np.float32)
    mask = (rng.random(x.shape) < 0.6).astype(np.float32)
    x[mask == 0] = rng.choice([np.nan, np.inf, -np.inf], int((mask == 0).sum()))
    m = mesh(n)
    for fast in (True, False):
        mean, var = jax.tree.map(every_device, jax.jit(jax.shard_map(
            lambda x, mask, fast=fast: data_parallel.masked_moments(x, mask, "i", fast), mesh=m,
            in_specs=(P("i"), P("i")), out_specs=P()))(shard(x, m), shard(mask, m)))
        for feature in range(2):
            selected = np.asarray(x, np.float64)[..., feature][mask[..., feature] > 0]
            for replica in range(n):
                np.testing.assert_allclose(mean[replica][feature], selected.mean(), rtol=1e-5)
                np.testing.assert_allclose(var[replica][feature], selected.var(), rtol=1e-4)


@pytest.mark.parametrize("n", [1, 3])
def test_float0_and_empty_integer_gradients(n):
    """The gradients of integer parameters under jax.grad(allow_int=True) are float0, whose
    itemsize 0 divided bucket_bytes by zero (ZeroDivisionError); they come back as they are. An
    empty int32 leaf's mean came back int32 on several devices and float32 on one, where
    jaxring.all_reduce (and lax.pmean) gives float32 on any number."""
    m = mesh(n)
    x = np.random.default_rng(12).standard_normal((n, 3)).astype(np.float32)
    types = []

    def body(v):
        params = {"w": jnp.ones(3, jnp.float32), "steps": jnp.int32(7)}
        grads = jax.grad(lambda p: jnp.sum(p["w"] * v[0]), allow_int=True)(params)
        grads["empty"] = jnp.zeros((0, 2), jnp.int32)
        reduced = data_parallel.all_reduce_gradients(grads, "i", "mean", bucket_bytes=8)
        alone = jaxring.all_reduce(grads["empty"], "i", "mean")
        types.append({k: (leaf.shape, leaf.dtype) for k, leaf in reduced.items()})
        types.append({"empty": (alone.shape, alone.dtype)})
        return reduced["w"][None]

    got = np.asarray(jax.jit(jax.shard_map(body, mesh=m, in_specs=P("i"), out_specs=P("i"),
                                           check_vma=False))(shard(x, m)))
    for replica in range(n):
        assert_close(got[replica], np.asarray(x, np.float64).mean(0), np.float32, count=n)
    reduced, alone = types
    assert reduced["steps"] == ((), jax.dtypes.float0)
    assert reduced["empty"] == alone["empty"] == ((0, 2), jnp.float32)
    # The plan's own inverse refuses the pieces of another plan.
    plan = data_parallel.fusion_plan({"a": np.ones(100), "b": np.arange(3.0)},
                                     fuse_below_bytes=64)
    with pytest.raises(ValueError, match=r"unfuse: the plan has 1 buckets and 1 leaves alone, "
                                         r"got 1 and 0"):
        data_parallel.unfuse(data_parallel.fuse({"a": np.ones(100), "b": np.arange(3.0)}, plan),
                             plan)


def test_masked_moments_refuse_an_x_without_a_floating_feature_axis():
    for x in (jnp.float32(1.0), jnp.ones((3, 2), jnp.int32)):
        with pytest.raises(TypeError, match="floating-point x with a feature axis"):
            data_parallel.masked_moments(x, 1.0)


@pytest.mark.parametrize("make_optimizer", [
    lambda: optax.sgd(0.1),
    lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1, 0.9, nesterov=True)),
    lambda: optax.adam(1e-2)], ids=["sgd", "nesterov+clip", "adam"])
@pytest.mark.parametrize("op", ["mean", "sum"])
def test_distributed_optimizer_sees_the_global_gradient(make_optimizer, op):
    """Two updates through the wrapper on per-replica gradients equal two updates of the plain
    optimizer on the replicas' mean (or sum, as `op` asks), and every replica gets the same
    result. Plain SGD's update is proportional to the gradient, so it tells the mean from the
    sum; clipping (these gradients' norm is above 0.5) and Adam remove the gradient's scale."""
    n = 4
    rng = np.random.default_rng(9)
    params = {"w": rng.standard_normal((3, 4)).astype(np.float32),
              "b": rng.standard_normal((4,)).astype(np.float32)}
    grads = [{k: rng.standard_normal((n,) + v.shape).astype(np.float32) for k, v in params.items()}
             for _ in range(2)]
    optimizer = make_optimizer()
    distributed = data_parallel.distributed(optimizer, "i", op, bucket_bytes=40)
    m = mesh(n)

    def local(params, grads_0, grads_1):
        state = distributed.init(params)
        for g in (grads_0, grads_1):
            updates, state = distributed.update(jax.tree.map(lambda x: x[0], g), state, params)
            params = optax.apply_updates(params, updates)
        return jax.tree.map(lambda x: x[None], params)

    got = jax.device_get(jax.jit(jax.shard_map(
        local, mesh=m, in_specs=(P(), P("i"), P("i")), out_specs=P("i"), check_vma=False))(
        params, shard(grads[0], m), shard(grads[1], m)))
    expected, state = params, optimizer.init(params)
    for g in grads:
        updates, state = optimizer.update(jax.tree.map(lambda x: getattr(x, op)(0), g), state,
                                          expected)
        expected = optax.apply_updates(expected, updates)
    for name in params:
        for replica in range(n):
            np.testing.assert_allclose(got[name][replica], expected[name], rtol=1e-5, atol=1e-6)


def test_gradients_jax_already_reduced_under_vma_checking_are_refused():
    """Under shard_map's default check_vma=True the gradient of a replicated parameter comes
    back summed over the replicas by JAX itself; a "mean" of it then gave N times the global
    gradient, and SGD N-fold steps (a review's repro). It is refused, naming check_vma=False;
    parameters cast to varying before differentiating keep their gradients per replica, and then
    give the global batch's gradient, as check_vma=False does."""
    n = 4
    rng = np.random.default_rng(12)
    w = rng.standard_normal(3).astype(np.float32)
    x = rng.standard_normal((4 * n, 3)).astype(np.float32)
    m = mesh(n)

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    def grads(w, x, cast=False):
        if cast:
            w = lax.pcast(w, ("i",), to="varying")
        return data_parallel.all_reduce_gradients(jax.grad(loss)(w, x), "i")

    def run(f, **options):
        return np.asarray(jax.jit(jax.shard_map(f, mesh=m, in_specs=(P(), P("i")),
                                                out_specs=P(), **options))(w, shard(x, m)))

    with pytest.raises(ValueError, match=r"invariant over \('i',\).*check_vma=False"):
        run(grads)
    # Over one device JAX's sum changed nothing, and max or min of equal copies is refused by
    # neither lax.pmax nor jaxring.
    one = jax.jit(jax.shard_map(grads, mesh=mesh(1), in_specs=(P(), P("i")), out_specs=P()))
    np.testing.assert_allclose(np.asarray(one(w, shard(x, mesh(1)))),
                               np.asarray(jax.grad(loss)(w, x)), rtol=1e-6)
    maxed = jax.jit(jax.shard_map(
        lambda w, x: data_parallel.all_reduce_gradients(jax.grad(loss)(w, x), "i", "max"),
        mesh=m, in_specs=(P(), P("i")), out_specs=P()))(w, shard(x, m))
    np.testing.assert_allclose(np.asarray(maxed), np.asarray(run(grads, check_vma=False)) * n,
                               rtol=1e-5)
    xs, ws = x.astype(np.float64), w.astype(np.float64)
    expected = (2 * np.tanh(xs @ ws) * (1 - np.tanh(xs @ ws) ** 2)) @ xs / len(xs)
    for got in (run(grads, check_vma=False), run(lambda w, x: grads(w, x, cast=True))):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


# ---- one Deep Speech 2 step: N replicas against one device --------------------------------------


def train_step_result(config, n, batch, seed=0):
    m = jax.make_mesh((n,), (training.AXIS,), devices=jax.devices()[:n])
    graphdef, params, batch_stats = nnx.split(training.create_model(config, seed), nnx.Param,
                                              nnx.BatchStat)
    optimizer = data_parallel.distributed(training.create_optimizer(config, 10), training.AXIS,
                                          bucket_bytes=config.bucket_bytes)
    opt_state = optimizer.init(params)
    step = training.make_train_step(graphdef, optimizer, m)
    batch = {k: shard(v, m, P(training.AXIS)) for k, v in batch.items()}
    for _ in range(2):  # the second step also checks optimizer state and running statistics
        params, batch_stats, opt_state, loss = step(params, batch_stats, opt_state, batch)
    return jax.device_get((params, batch_stats, loss))


def random_batch(rng, batch, frames, feature_dim, label_length):
    lengths = rng.integers(frames // 2, frames + 1, size=batch)
    label_lengths = rng.integers(1, label_length + 1, size=batch)
    return {
        "features": rng.standard_normal((batch, frames, feature_dim)).astype(np.float32),
        "feature_mask": (np.arange(frames) < lengths[:, None]).astype(np.float32),
        "labels": rng.integers(1, 29, size=(batch, label_length)).astype(np.int32),
        "label_mask": (np.arange(label_length) < label_lengths[:, None]).astype(np.float32),
    }


def test_data_parallel_step_equals_single_device_step():
    """The paper's optimiser with a clipping norm that never binds: clipping (the gradient's norm
    here is above 1) would hide a gradient summed over the replicas instead of averaged."""
    config = configs.get_config(
        "tiny", sample_rate=1600, conv_channels=(3,), conv_kernels=((3, 5),),
        rnn_layers=2, rnn_hidden=8, dense=8, optimizer="nesterov", learning_rate=0.05,
        grad_clip_norm=1e9, bucket_bytes=1000)
    rng = np.random.default_rng(10)
    batch = random_batch(rng, 8, 12, 17, 4)
    single = train_step_result(config, 1, batch)
    for n in (4,):
        parallel = train_step_result(config, n, batch)
        np.testing.assert_allclose(parallel[2], single[2], rtol=1e-5)
        for got, want in zip(jax.tree.leaves(parallel[:2]), jax.tree.leaves(single[:2])):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-6)
    # The step must have moved the parameters, or the comparison proves nothing.
    initial = nnx.state(training.create_model(config, 0), nnx.Param)
    moved = [np.abs(a - b).max() for a, b in zip(jax.tree.leaves(single[0]),
                                                jax.tree.leaves(initial))]
    assert min(moved) > 1e-4
