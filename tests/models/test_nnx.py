"""ls_jax.layers under Flax NNX through ``nnx.bridge.ToNNX``."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ls_jax.layers import LayerConfig, TransformerEncoderLayer

CONFIG = LayerConfig(
    hidden_size=32,
    intermediate_size=48,
    nhead=4,
    max_seq_len=16,
    attn_prob_dropout_ratio=0.0,
    activation_dropout_ratio=0.0,
    dtype=jnp.float32,
)


def inputs():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, 32)), jnp.float32)
    key_mask = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    return x, key_mask


def test_encoder_layer_through_the_nnx_bridge_matches_linen():
    x, key_mask = inputs()
    layer = nnx.bridge.ToNNX(TransformerEncoderLayer(CONFIG), rngs=nnx.Rngs(params=0, dropout=1))
    nnx.bridge.lazy_init(layer, x, key_mask)
    params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    expected = jax.jit(TransformerEncoderLayer(CONFIG).apply)({"params": params}, x, key_mask)

    @nnx.jit(static_argnames="deterministic")
    def forward(layer, x, key_mask, deterministic):
        return layer(x, key_mask, deterministic=deterministic)

    np.testing.assert_allclose(forward(layer, x, key_mask, True), expected, rtol=1e-6, atol=1e-6)
    first, second = forward(layer, x, key_mask, False), forward(layer, x, key_mask, False)
    assert np.all(np.isfinite(first)) and not np.allclose(first, second), "dropout draws from the advancing rng stream"

    @nnx.jit
    def loss_and_grads(layer):
        return nnx.value_and_grad(lambda layer: jnp.mean(layer(x, key_mask, deterministic=False) ** 2))(layer)

    loss, grads = loss_and_grads(layer)
    grad_leaves = jax.tree.leaves(nnx.to_pure_dict(grads))
    assert np.isfinite(loss) and len(grad_leaves) == len(jax.tree.leaves(params))
    assert all(np.all(np.isfinite(leaf)) and np.any(leaf != 0) for leaf in grad_leaves)
