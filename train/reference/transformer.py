"""A plain Flax linen Transformer, written the way a JAX user would: the baseline ls_jax is measured against.

No ls_jax code: ``nn.Embed``, ``nn.MultiHeadDotProductAttention``, ``nn.LayerNorm``, ``nn.Dense``,
``nn.Dropout`` and optax's cross entropy, all compiled by XLA. The architecture matches
``ls_jax.models.Transformer`` (pre-LN encoder-decoder, sinusoidal positions, one embedding shared by source,
target and the tied output projection), so the two do the same FLOPs per step.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclasses.dataclass(frozen=True)
class ReferenceConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_encoder_layers: int
    num_decoder_layers: int
    dropout_rate: float = 0.1
    max_len: int = 1024
    dtype: jnp.dtype = jnp.bfloat16


def sinusoidal_positions(max_len: int, hidden: int) -> np.ndarray:
    """(max_len, hidden) table: sin on the first half of the features, cos on the second (tensor2tensor layout)."""
    half = hidden // 2
    inv_freq = np.exp(-np.log(10000.0) * np.arange(half) / max(half - 1, 1))
    angles = np.arange(max_len)[:, None] * inv_freq[None, :]
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=1).astype(np.float32)


class FeedForward(nn.Module):
    config: ReferenceConfig

    @nn.compact
    def __call__(self, x, deterministic):
        cfg = self.config
        h = nn.Dense(cfg.intermediate_size, dtype=cfg.dtype)(x)
        h = nn.Dropout(cfg.dropout_rate)(nn.relu(h), deterministic=deterministic)
        h = nn.Dense(cfg.hidden_size, dtype=cfg.dtype)(h)
        return nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)


def _attention(cfg: ReferenceConfig) -> nn.MultiHeadDotProductAttention:
    # Flax's default attention dropout shares one mask across batch and heads: less random-number work than
    # ls_jax's per-element dropout (the fairseq / LightSeq semantics), which favours this baseline.
    return nn.MultiHeadDotProductAttention(num_heads=cfg.num_heads, dtype=cfg.dtype, dropout_rate=cfg.dropout_rate)


class EncoderLayer(nn.Module):
    config: ReferenceConfig

    @nn.compact
    def __call__(self, x, mask, deterministic):
        cfg = self.config
        h = nn.LayerNorm(dtype=cfg.dtype)(x)
        h = _attention(cfg)(h, h, mask=mask, deterministic=deterministic)
        x = x + nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
        return x + FeedForward(cfg)(nn.LayerNorm(dtype=cfg.dtype)(x), deterministic)


class DecoderLayer(nn.Module):
    config: ReferenceConfig

    @nn.compact
    def __call__(self, y, encoded, self_mask, cross_mask, deterministic):
        cfg = self.config
        h = nn.LayerNorm(dtype=cfg.dtype)(y)
        h = _attention(cfg)(h, h, mask=self_mask, deterministic=deterministic)
        y = y + nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
        h = nn.LayerNorm(dtype=cfg.dtype)(y)
        h = _attention(cfg)(h, encoded, mask=cross_mask, deterministic=deterministic)
        y = y + nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
        return y + FeedForward(cfg)(nn.LayerNorm(dtype=cfg.dtype)(y), deterministic)


class ReferenceTransformer(nn.Module):
    """Pre-LN encoder-decoder; ``__call__(src (B,S), tgt_in (B,T)) -> logits (B,T,V)``; token 0 is padding."""

    config: ReferenceConfig

    @nn.compact
    def __call__(self, src, tgt_in, deterministic: bool = True):
        cfg = self.config
        embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype,
                         embedding_init=nn.initializers.normal(cfg.hidden_size**-0.5))
        positions = jnp.asarray(sinusoidal_positions(cfg.max_len, cfg.hidden_size))

        def embed_tokens(tokens):
            x = embed(tokens) * jnp.sqrt(cfg.hidden_size) + positions[None, : tokens.shape[1]]
            return nn.Dropout(cfg.dropout_rate)(x.astype(cfg.dtype), deterministic=deterministic)

        src_valid = src > 0
        tgt_valid = tgt_in > 0
        # The scopes name the stages of a step in traces (train.bench.tracing.kernel_trace.stage).
        with jax.named_scope("encoder"):
            enc_mask = nn.make_attention_mask(src_valid, src_valid)
            x = embed_tokens(src)
            for _ in range(cfg.num_encoder_layers):
                x = EncoderLayer(cfg)(x, enc_mask, deterministic)
            encoded = nn.LayerNorm(dtype=cfg.dtype)(x)

        with jax.named_scope("decoder"):
            self_mask = nn.combine_masks(nn.make_attention_mask(tgt_valid, tgt_valid), nn.make_causal_mask(tgt_in))
            cross_mask = nn.make_attention_mask(tgt_valid, src_valid)
            y = embed_tokens(tgt_in)
            for _ in range(cfg.num_decoder_layers):
                y = DecoderLayer(cfg)(y, encoded, self_mask, cross_mask, deterministic)
            y = nn.LayerNorm(dtype=cfg.dtype)(y)
        with jax.named_scope("output_projection"):
            return embed.attend(y.astype(cfg.dtype))


def label_smoothed_loss(logits: jax.Array, labels: jax.Array, epsilon: float) -> tuple[jax.Array, jax.Array]:
    """Sum of label-smoothed cross entropy over non-pad labels (fairseq's target distribution) and their count."""
    vocab = logits.shape[-1]
    off = epsilon / (vocab - 1)
    targets = jax.nn.one_hot(labels, vocab) * (1.0 - epsilon - off) + off
    loss = optax.softmax_cross_entropy(logits.astype(jnp.float32), targets)
    weights = (labels > 0).astype(jnp.float32)
    return jnp.sum(loss * weights), jnp.sum(weights)
