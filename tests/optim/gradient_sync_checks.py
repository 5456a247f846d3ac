"""Checks of ls_jax.optim.GradientSync on 4 CPU devices (run by test_gradient_sync.py in its own interpreter).

A 4-layer MLP with a tied embedding and an unused leaf: the summed gradient over 2 and 4 devices, for every bucket
size, with earlier micro-batches carried, with ZeRO-1's rows and in bf16 against one device's gradient of the whole
batch; the order the backward completes the leaves in; and that the collectives sit inside the backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ls_jax.optim import GradientSync, adamw, shard_optimizer
from ls_jax.optim import _shard_layout as layout_lib
from ls_jax.optim.gradient_sync import backward_order, plan_buckets

AXIS = "data"
LAYERS = 4
WIDTH = 12


def make_params():
    rng = np.random.default_rng(0)
    params = {f"layer_{i}": {"w": 0.4 * rng.standard_normal((WIDTH, WIDTH), np.float32)} for i in range(LAYERS)}
    for i in range(LAYERS):
        params[f"layer_{i}"]["b"] = np.full((WIDTH,), 0.01 * i, np.float32)
    params["embed"] = 0.3 * rng.standard_normal((7, WIDTH), np.float32)  # used first and, tied, last
    params["unused"] = np.ones((3,), np.float32)
    return params


def loss(params, batch):
    """(summed squared error of the tied read-out, {"rows": rows}) for batch (tokens (B,) int, targets (B, 7))."""
    tokens, targets = batch
    hidden = params["embed"][tokens]
    for i in range(LAYERS):
        hidden = jnp.tanh(hidden @ params[f"layer_{i}"]["w"] + params[f"layer_{i}"]["b"])
    logits = hidden @ params["embed"].T
    return jnp.sum((logits - targets) ** 2), {"rows": jnp.float32(tokens.shape[0])}


def make_batch(rows=16, seed=1):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 7, (rows,)).astype(np.int32), rng.standard_normal((rows, 7)).astype(np.float32)


def whole_batch_grad(params, batch):
    return jax.grad(lambda p: loss(p, batch)[0])(params)


def synced_grad(sync, params, batch, devices, carried_batch=None):
    """``sync.grad`` inside shard_map over the first ``devices`` devices; ``carried_batch`` gives each device a
    carried gradient (of its rows of that batch)."""
    mesh = Mesh(np.asarray(jax.devices()[:devices]), (AXIS,))
    out_spec = P(AXIS) if sync.sharded is not None else P()

    def per_device(params, batch, carried_batch):
        carried = None
        if carried_batch is not None:
            local = jax.lax.pcast(params, AXIS, to="varying")
            carried = jax.grad(lambda p: loss(p, carried_batch)[0])(local)
        grads, aux = sync.grad(loss, params, batch, carried=carried)
        if sync.sharded is not None:
            grads = jax.tree.map(lambda row: row[None], grads)
        return grads, jax.lax.psum(aux, AXIS)

    run = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)), out_specs=(out_spec, P()))
    return jax.jit(run)(params, batch, carried_batch)


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-5):
    for path, a, e in zip(
        jax.tree_util.tree_flatten_with_path(expected)[0], jax.tree.leaves(actual), jax.tree.leaves(expected)
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol, err_msg=str(path[0]))


def test_runs_on_four_devices():
    assert jax.device_count() == 4


def test_the_backward_completes_the_last_layer_first_and_the_tied_embedding_last():
    params = make_params()
    names = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    order = [names[i] for i in backward_order(lambda p, b: loss(p, b)[0], params, make_batch())]
    layers = [f"['layer_{i}']['{leaf}']" for i in reversed(range(LAYERS)) for leaf in ("b", "w")]
    assert order == [*layers, "['embed']", "['unused']"]


def test_buckets_take_consecutive_leaves_up_to_the_budget():
    assert plan_buckets([4, 4, 4, 10, 1], [4, 3, 2, 1, 0], 8) == [[4], [3], [2, 1], [0]]
    assert plan_buckets([4, 4, 4], [2, 1, 0], 10**9) == [[2, 1, 0]]


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("bucket_bytes", [1, 600, 10**9])
def test_the_sum_over_devices_is_the_whole_batch_gradient(devices, bucket_bytes):
    params, batch = make_params(), make_batch()
    grads, aux = synced_grad(GradientSync(AXIS, bucket_bytes), params, batch, devices)
    assert_trees_close(grads, whole_batch_grad(params, batch))
    assert float(aux["rows"]) == 16
    assert not np.any(np.asarray(grads["unused"]))


def test_carried_gradients_join_the_sum():
    params, batch, earlier = make_params(), make_batch(), make_batch(seed=2)
    grads, _ = synced_grad(GradientSync(AXIS, 600), params, batch, 4, carried_batch=earlier)
    expected = jax.tree.map(jnp.add, whole_batch_grad(params, batch), whole_batch_grad(params, earlier))
    assert_trees_close(grads, expected)


def test_zero1_gets_this_devices_rows_of_the_sum():
    params, batch = make_params(), make_batch()
    sharded = shard_optimizer(adamw(1e-3), AXIS, num_shards=4, average_gradients=False)
    rows, _ = synced_grad(GradientSync(AXIS, 600, sharded=sharded), params, batch, 4)
    expected = jax.tree.map(lambda g: layout_lib.rows(g, 4), whole_batch_grad(params, batch))
    assert_trees_close(rows, expected)


def test_bf16_communication_is_bf16_close_and_not_exact():
    params, batch = make_params(), make_batch()
    f32, _ = synced_grad(GradientSync(AXIS, 600), params, batch, 4)
    bf16, _ = synced_grad(GradientSync(AXIS, 600, comm_dtype=jnp.bfloat16), params, batch, 4)
    assert_trees_close(bf16, f32, rtol=2e-2, atol=2e-2 * max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(f32)))
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(bf16), jax.tree.leaves(f32)))
    assert jax.tree.leaves(bf16)[0].dtype == jnp.float32


def collective_dtypes(params, comm_dtype):
    """The dtypes of the all-reduces of the differentiated per-device program."""
    sync = GradientSync(AXIS, 600, comm_dtype=comm_dtype)
    mesh = Mesh(np.asarray(jax.devices()), (AXIS,))
    run = jax.shard_map(lambda p, b: sync.grad(loss, p, b)[0], mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P())
    (shard_map_eqn,) = jax.make_jaxpr(run)(params, make_batch()).jaxpr.eqns
    return {str(e.invars[0].aval.dtype) for e in shard_map_eqn.params["jaxpr"].eqns if "psum" in e.primitive.name}


def test_gradients_travel_in_the_params_dtype_unless_told():
    params = make_params()
    bf16_params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    assert collective_dtypes(params, None) == {"float32"}
    assert collective_dtypes(bf16_params, None) == {"bfloat16"}
    assert collective_dtypes(params, jnp.bfloat16) == {"bfloat16"}
    assert collective_dtypes(bf16_params, jnp.float32) == {"float32"}


def products_before_each_collective(bucket_bytes):
    """For each all-reduce of the differentiated per-device program, in order, how many of its matrix products it
    waits for (depends on through the data flow), and how many products the program has."""
    params, batch = make_params(), make_batch()
    sync = GradientSync(AXIS, bucket_bytes)
    mesh = Mesh(np.asarray(jax.devices()), (AXIS,))
    run = jax.shard_map(lambda p, b: sync.grad(loss, p, b)[0], mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P())
    (shard_map_eqn,) = jax.make_jaxpr(run)(params, batch).jaxpr.eqns
    waits_for: dict = {}
    products, collectives = 0, []
    for eqn in shard_map_eqn.params["jaxpr"].eqns:
        before = frozenset().union(*(waits_for.get(v, frozenset()) for v in eqn.invars if not hasattr(v, "val")))
        if eqn.primitive.name == "dot_general":
            before |= {products}
            products += 1
        if "psum" in eqn.primitive.name:
            collectives.append(len(before))
        for out in eqn.outvars:
            waits_for[out] = before
    return collectives, products


def test_each_buckets_collective_waits_only_for_its_layers_backward():
    collectives, products = products_before_each_collective(600)  # a bucket per leaf but the embedding's
    assert len(collectives) == 2 * LAYERS + 1
    # Of the 15 products (5 forward, 2 of the read-out's backward, 2 per layer's), the top layer's bias waits for 6
    # (the forward and the read-out's product back into the layer), each leaf below for one more, the embedding's
    # for all but the 4 weight gradients: none waits for the whole backward.
    assert products == 15 and sorted(collectives) == [6, 7, 7, 8, 8, 9, 9, 10, 11]
    collectives, products = products_before_each_collective(10**9)  # one bucket: after the whole backward
    assert collectives == [products]


def test_the_order_is_traced_once_for_every_batch_shape():
    traced = []

    def counted_loss(params, batch):
        traced.append(batch[0].shape[0])
        return loss(params, batch)

    sync, params = GradientSync(AXIS, 600), make_params()
    mesh = Mesh(np.asarray(jax.devices()), (AXIS,))
    run = jax.jit(
        jax.shard_map(lambda p, b: sync.grad(counted_loss, p, b)[0], mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P())
    )
    run(params, make_batch(16))
    run(params, make_batch(32))
    assert traced == [4, 4, 8]  # per device: the order and the gradient at 16 rows, the gradient alone at 32


def test_a_sync_over_another_axis_than_its_optimizer_is_refused():
    sharded = shard_optimizer(adamw(1e-3), "model", num_shards=4)
    with pytest.raises(ValueError, match="splits over axis 'model'"):
        GradientSync(AXIS, sharded=sharded)
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        GradientSync(AXIS, 0)
