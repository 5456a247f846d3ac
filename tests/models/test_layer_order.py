"""The backward in layer order (`ls_jax.optim.gradient_sync.backward_in_layer_order`): traced inside it, a layer
stack's backward finishes each layer's parameter gradients before the layer below starts, with the same values."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from test_models_transformer import loss_fn, reversal_batch, tiny_config

from ls_jax.layers import LayerConfig, TransformerEncoder
from ls_jax.models import Transformer
from ls_jax.optim import GradientSync
from ls_jax.optim.gradient_sync import backward_in_layer_order, layer_order_requested

LAYERS = 3


def encoder_and_loss():
    cfg = LayerConfig.preset("transformer-base", dtype=jnp.float32, hidden_size=32, intermediate_size=64, nhead=4)
    encoder = TransformerEncoder(cfg, LAYERS)
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    mask = jnp.ones((2, 8), bool).at[1, 5:].set(False)
    params = encoder.init(jax.random.key(1), x, mask)["params"]

    def loss(params):
        y = encoder.apply({"params": params}, x, mask, deterministic=False, rngs={"dropout": jax.random.key(2)})
        return jnp.sum(y**2)

    return loss, params


def gradients(loss, params, ordered):
    if not ordered:
        return jax.jit(jax.grad(loss))(params)
    with backward_in_layer_order():
        return jax.jit(jax.grad(loss))(params)


def assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_encoder_gradients_are_the_same_in_layer_order():
    loss, params = encoder_and_loss()
    assert_same(gradients(loss, params, True), gradients(loss, params, False))


@pytest.mark.parametrize("remat", ["none", "layer"])
def test_the_translation_model_gradients_are_the_same_in_layer_order(remat):
    model = Transformer(tiny_config(remat=remat, hidden_dropout_ratio=0.1, attn_prob_dropout_ratio=0.1))
    src, tgt_in, labels = reversal_batch()
    params = model.init(jax.random.key(0), src, tgt_in)["params"]
    loss = lambda p: loss_fn(model, p, src, tgt_in, labels, jax.random.key(3))  # noqa: E731
    assert_same(gradients(loss, params, True), gradients(loss, params, False))


def backward_products(loss, params, ordered):
    """The matrix products of the backward as (layer, id, ids of the products it waits for through the data flow)."""
    if ordered:
        with backward_in_layer_order():
            closed = jax.make_jaxpr(jax.grad(loss))(params)
    else:
        closed = jax.make_jaxpr(jax.grad(loss))(params)
    found: list[tuple[int | None, bool, frozenset]] = []
    _walk(closed.jaxpr, {}, found)
    return [(layer, own, waits) for own, (layer, backward, waits) in enumerate(found) if backward]


def _walk(jaxpr, waits_for, found):
    """Follows the data flow through ``jaxpr`` (into calls whose inputs and outputs map one to one), recording each
    product's layer (from its name scope), whether it is in the backward, and the products it waits for."""
    for eqn in jaxpr.eqns:
        before = frozenset().union(*(waits_for.get(v, frozenset()) for v in eqn.invars if not hasattr(v, "val")))
        bodies = [getattr(value, "jaxpr", value) for value in eqn.params.values()]
        bodies = [
            b
            for b in bodies
            if hasattr(b, "eqns") and len(b.invars) == len(eqn.invars) and len(b.outvars) == len(eqn.outvars)
        ]
        if len(bodies) == 1:
            inner = {
                body_in: waits_for.get(outer, frozenset())
                for outer, body_in in zip(eqn.invars, bodies[0].invars)
                if not hasattr(outer, "val")
            }
            _walk(bodies[0], inner, found)
            for outer, body_out in zip(eqn.outvars, bodies[0].outvars):
                waits_for[outer] = frozenset() if hasattr(body_out, "val") else inner.get(body_out, frozenset())
            continue
        if eqn.primitive.name == "dot_general":
            scope = str(eqn.source_info.name_stack)
            layers = re.findall(r"layer_(\d+)", scope)
            found.append((int(layers[-1]) if layers else None, "transpose(" in scope, before))
            before = before | {len(found) - 1}
        for out in eqn.outvars:
            waits_for[out] = before


def _ids(products, layer):
    """The ids of ``layer``'s backward products."""
    return frozenset(own for lay, own, _ in products if lay == layer)


def test_each_layer_waits_for_the_parameter_gradients_of_the_layer_above():
    loss, params = encoder_and_loss()
    ordered = backward_products(loss, params, True)
    free = backward_products(loss, params, False)
    assert len(ordered) == len(free) == 12 * LAYERS  # per layer 6 products, each with 2 in the backward
    for upper in range(LAYERS - 1, 0, -1):
        top = _ids(ordered, upper)
        below = [waits for layer, _, waits in ordered if layer == upper - 1]
        assert all(top <= waits for waits in below)
        # Left free, the layer below starts as soon as its input's gradient exists: no product of it waits for the
        # weight gradients above (which only the update reads).
        top = _ids(free, upper)
        below = [waits for layer, _, waits in free if layer == upper - 1]
        assert not any(top <= waits for waits in below)


def test_gradient_sync_traces_the_loss_in_layer_order():
    seen = []

    def loss(params, batch):
        seen.append(layer_order_requested())
        return jnp.sum(params["w"] * batch), {}

    mesh = Mesh(np.asarray(jax.devices()[:1]), ("data",))
    run = jax.shard_map(
        lambda p, b: GradientSync("data").grad(loss, p, b)[0], mesh=mesh, in_specs=(P(), P("data")), out_specs=P()
    )
    jax.jit(run)({"w": jnp.ones(3)}, jnp.ones((1, 3)))
    assert seen[-1] is True and layer_order_requested() is False
