"""Feed-forward sublayer: LayerNorm, GEMM, fused bias + activation + dropout, GEMM, fused bias + dropout + residual."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from ls_jax import ops
from ls_jax.layers.common import DeferredResidual, dense, dropout_args, pre_norm, sublayer_output
from ls_jax.layers.config import LayerConfig


class FeedForward(nn.Module):
    """Position-wise feed-forward sublayer with its LayerNorm and residual, (B, L, H) -> (B, L, H).

        f(h)    = dropout_act(act(h @ W_1 + b_1)) @ W_2 + b_2
        pre-LN:  y = x + dropout(f(LN(x)))
        post-LN: y = LN(x + dropout(f(x)))

    W_1 (H, intermediate_size), W_2 (intermediate_size, H); the biases are applied by the fused ops. Pre-LN,
    x may be a ``DeferredResidual`` (the previous sublayer's output, formed by this one's LayerNorm), and
    ``defer_residual=True`` returns y as one for the next LayerNorm to form.
    """

    config: LayerConfig

    @nn.compact
    def __call__(
        self, x: jax.Array | DeferredResidual, *, deterministic: bool = True, defer_residual: bool = False
    ) -> jax.Array | DeferredResidual:
        cfg = self.config
        h, x = pre_norm(cfg, x)
        h = dense(cfg, cfg.intermediate_size, use_bias=False, name="fc1")(h)
        fc1_bias = self.param("fc1_bias", nn.initializers.zeros, (cfg.intermediate_size,), jnp.float32)
        rate, seed = dropout_args(self, cfg.activation_dropout_ratio, deterministic)
        h = ops.bias_act_dropout(h, fc1_bias, activation=cfg.activation_fn, dropout_rate=rate, seed=seed)
        h = dense(cfg, cfg.hidden_size, use_bias=False, name="fc2")(h)
        fc2_bias = self.param("fc2_bias", nn.initializers.zeros, (cfg.hidden_size,), jnp.float32)
        return sublayer_output(cfg, self, h, fc2_bias, x, deterministic=deterministic, defer_residual=defer_residual)
