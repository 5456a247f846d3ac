"""Multi-head attention sublayer: LayerNorm, QKV projection, fused attention, output bias + dropout + residual."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from ls_jax import ops
from ls_jax.layers.common import CacheIndex, DeferredResidual, dense, dropout_args, pre_norm, sublayer_output
from ls_jax.layers.config import LayerConfig


class MultiHeadAttention(nn.Module):
    """One attention sublayer with its LayerNorm and residual, LightSeq-style.

        pre-LN:  y = x + dropout(attention(LN(x)) @ W_o + b_o)
        post-LN: y = LN(x + dropout(attention(x) @ W_o + b_o))
        attention(h) = softmax(q k^T / sqrt(d) + mask) v   per head, dropout on the probabilities

    Self-attention computes Q, K and V with one (H -> 3, heads, d) GEMM. Cross-attention projects Q from ``x``
    and takes K and V precomputed as ``key_value`` (B, K, 2, heads, d), so a decoder can project all its layers'
    K/V in one GEMM. The Q (or QKV) projection's bias ("query_bias", "qkv_bias") is added inside the fused
    attention. Shapes: x (B, Q, H) -> y (B, Q, H). Pre-LN, x may be a ``DeferredResidual`` (the previous
    sublayer's output, formed by this one's LayerNorm), and ``defer_residual=True`` returns y as one.

    Attributes:
      config: layer configuration.
      self_attention: True for self-attention, False for cross-attention.
      causal: mask keys after each query (decoder self-attention).
    """

    config: LayerConfig
    self_attention: bool = True
    causal: bool = False

    @nn.compact
    def __call__(
        self,
        x: jax.Array | DeferredResidual,
        key_value: jax.Array | None = None,
        key_mask: jax.Array | None = None,
        *,
        key_lengths: jax.Array | None = None,
        decode: bool = False,
        deterministic: bool = True,
        defer_residual: bool = False,
    ) -> jax.Array | DeferredResidual:
        """Args:
        x: (B, Q, H) query stream (and, for self-attention, keys and values).
        key_value: cross-attention only: (B, K, 2, heads, head_dim) keys [:, :, 0] and values [:, :, 1].
        key_mask: optional (B, K) boolean, True for keys that may be attended (False at padding): any mask.
        key_lengths: optional (B,) integer, the number of visible keys of each row when they are a prefix (right
          padding; ``ls_jax.ops.attention_lengths``): the same as the mask ``arange(K) < key_lengths[:, None]``,
          which cuDNN's attention takes without a bias tensor. At most one of ``key_mask`` and ``key_lengths``.
        decode: self-attention only: append this step's keys/values to the "cache" collection and attend
          over everything cached so far (incremental decoding, one or more tokens per call).
        deterministic: disable dropout.
        defer_residual: pre-LN only: return ``DeferredResidual`` for the next LayerNorm to form.
        """
        cfg = self.config
        if self.self_attention == (key_value is not None):
            raise ValueError("key_value is required for cross-attention and not accepted for self-attention")
        if decode and not (self.self_attention and self.causal):
            raise ValueError("decode (KV cache) applies only to causal self-attention")
        if decode and (key_mask is not None or key_lengths is not None):
            raise ValueError("key_mask and key_lengths are not supported with decode: cached keys are never padding")
        h, x = pre_norm(cfg, x)
        rate, seed = dropout_args(self, cfg.attn_prob_dropout_ratio, deterministic)
        if not self.self_attention:
            query = dense(cfg, (cfg.nhead, cfg.head_dim), use_bias=False, name="query")(h)
            query_bias = self.param("query_bias", nn.initializers.zeros, query.shape[2:], jnp.float32)
            context = ops.cross_attention(
                query, key_value, key_mask, key_lengths=key_lengths, bias=query_bias, dropout_rate=rate, seed=seed
            )
        else:
            qkv = dense(cfg, (3, cfg.nhead, cfg.head_dim), use_bias=False, name="qkv")(h)
            qkv_bias = self.param("qkv_bias", nn.initializers.zeros, qkv.shape[2:], jnp.float32)
            if decode:
                context = self._attend_cached(qkv + qkv_bias.astype(qkv.dtype), rate, seed)
            else:
                context = ops.self_attention(
                    qkv, key_mask, lengths=key_lengths, bias=qkv_bias, causal=self.causal, dropout_rate=rate, seed=seed
                )
        out = dense(cfg, cfg.hidden_size, input_axes=2, use_bias=False, name="out")(context)
        out_bias = self.param("out_bias", nn.initializers.zeros, (cfg.hidden_size,), jnp.float32)
        return sublayer_output(cfg, self, out, out_bias, x, deterministic=deterministic, defer_residual=defer_residual)

    def _attend_cached(self, qkv: jax.Array, rate: float, seed: jax.Array | None) -> jax.Array:
        """Causal self-attention of this call's (B, L, 3, heads, d) qkv over the KV cache extended with it."""
        key, value, visible = self._extend_cache(qkv[:, :, 1], qkv[:, :, 2])
        return ops.attention_unfused(
            qkv[:, :, 0], key, value, visible, causal=visible is None, dropout_rate=rate, seed=seed
        )

    def _extend_cache(self, key: jax.Array, value: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """Writes (B, L, heads, d) keys/values at the cache index and returns the whole cache (B, C, heads, d)
        with the (1, 1, L, C) mask of cached keys each new query may see (itself and earlier positions).

        The call that creates the cache (C = L, zeros) attends causally over its own keys and returns mask None.
        """
        start = CacheIndex(name="cache_index")(key.shape[1])
        if start is None:
            self.put_variable("cache", "key", jnp.zeros_like(key))
            self.put_variable("cache", "value", jnp.zeros_like(value))
            return key, value, None
        cached_key = jax.lax.dynamic_update_slice(self.get_variable("cache", "key"), key, (0, start, 0, 0))
        cached_value = jax.lax.dynamic_update_slice(self.get_variable("cache", "value"), value, (0, start, 0, 0))
        self.put_variable("cache", "key", cached_key)
        self.put_variable("cache", "value", cached_value)
        query_positions = start + jnp.arange(key.shape[1])
        visible = jnp.arange(cached_key.shape[1])[None, :] <= query_positions[:, None]
        return cached_key, cached_value, visible[None, None]
