"""Token + position embedding (``ls_jax.ops.embed``), with tied output logits."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from ls_jax import ops
from ls_jax.layers import fp8
from ls_jax.layers.common import CacheIndex, dropout_args
from ls_jax.layers.config import LayerConfig


def sinusoidal_positions(num_positions: int, hidden_size: int) -> jax.Array:
    """Fixed position table (P, H), f32: sines in the first half of the features, cosines in the second.

    inv_freq[i] = 10000 ** (-i / (H/2 - 1)),   i < H/2
    table[p]    = [sin(p * inv_freq), cos(p * inv_freq)]    (a zero column pads an odd H)
    """
    half = hidden_size // 2
    inv_freq = jnp.exp(jnp.arange(half, dtype=jnp.float32) * (-math.log(10000.0) / max(half - 1, 1)))
    angles = jnp.arange(num_positions, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    table = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=1)
    return jnp.pad(table, ((0, 0), (0, hidden_size - 2 * half)))


class TransformerEmbedding(nn.Module):
    """``dropout(scale * table[tokens] + positions)``, zero at padding tokens; logits via ``attend``.

    Attributes:
      config: layer configuration (hidden size, max_seq_len, padding_idx, dropout, dtype).
      vocab_size: rows V of the token table (V, H), f32.
      learned_positions: a learned (max_seq_len, H) table instead of ``sinusoidal_positions``.
      scale_embedding: multiply token embeddings by sqrt(H) (the original Transformer's convention).
      dropout_rate: embedding dropout; None uses ``config.hidden_dropout_ratio``.
      embedding_init: initializer of the token (and learned position) tables; default N(0, 1/H).
    """

    config: LayerConfig
    vocab_size: int
    learned_positions: bool = False
    scale_embedding: bool = True
    dropout_rate: float | None = None
    embedding_init: nn.initializers.Initializer = nn.initializers.variance_scaling(1.0, "fan_out", "normal")

    def setup(self):
        cfg = self.config
        self.embedding = self.param("embedding", self.embedding_init, (self.vocab_size, cfg.hidden_size), jnp.float32)
        if self.learned_positions:
            self.position_embedding = self.param(
                "position_embedding", self.embedding_init, (cfg.max_seq_len, cfg.hidden_size), jnp.float32
            )
        self.cache_index = CacheIndex()
        if cfg.fp8:
            self.logits_fp8 = fp8.Fp8Dot()

    def __call__(self, tokens: jax.Array, *, decode: bool = False, deterministic: bool = True) -> jax.Array:
        """Embeds (B, L) integer tokens into (B, L, H) of ``config.dtype``.

        With ``decode``, positions continue from the previous decode call (KV-cache decoding).
        """
        cfg = self.config
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape (batch, length), got {tokens.shape}")
        if tokens.shape[1] > cfg.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len {cfg.max_seq_len}")
        positions = None
        if decode:
            start = self.cache_index(tokens.shape[1])
            if start is not None:
                positions = jnp.broadcast_to(start + jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        rate = cfg.hidden_dropout_ratio if self.dropout_rate is None else self.dropout_rate
        rate, seed = dropout_args(self, rate, deterministic)
        return ops.embed(
            tokens,
            self.embedding,
            self._position_table(),
            scale=math.sqrt(cfg.hidden_size) if self.scale_embedding else 1.0,
            padding_id=cfg.padding_idx,
            positions=positions,
            dropout_rate=rate,
            seed=seed,
            dtype=cfg.dtype,
        )

    def _position_table(self) -> jax.Array:
        if self.learned_positions:
            return self.position_embedding
        return sinusoidal_positions(self.config.max_seq_len, self.config.hidden_size)

    def attend(self, hidden: jax.Array) -> jax.Array:
        """Output logits tied to the token table: ``hidden @ table.T``, (..., H) -> (..., V) in ``config.dtype``."""
        cfg = self.config
        if not cfg.fp8:
            return ops.dense(hidden, self.embedding, transposed_kernel=True, dtype=cfg.dtype)
        rows = hidden.reshape(-1, cfg.hidden_size).astype(cfg.dtype)
        logits = self.logits_fp8(rows, self.embedding, contract=1)
        return logits.reshape(*hidden.shape[:-1], self.vocab_size)
