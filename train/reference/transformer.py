"""A plain Flax linen Transformer, written the way a JAX user would: the baseline ls_jax is measured against.

No ls_jax code: ``nn.Embed``, ``nn.MultiHeadDotProductAttention``, ``nn.LayerNorm``, ``nn.Dense`` and
``nn.Dropout``, all compiled by XLA (its criterion is `train.reference.losses`). The architecture matches
``ls_jax.models.Transformer`` (pre-LN encoder-decoder, sinusoidal positions, one embedding shared by source,
target and the tied output projection), so the two do the same FLOPs per step.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.fp8_ops import Fp8DirectDotGeneralOp


@dataclasses.dataclass(frozen=True)
class ReferenceConfig:
    """The Transformer's shape; ``dropout_rate`` drops embeddings, attention probabilities, the feed-forward
    activation and every sublayer's output; ``max_len`` is the position table's rows (the longest sequence)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_encoder_layers: int
    num_decoder_layers: int
    dropout_rate: float = 0.1
    max_len: int = 1024
    dtype: jnp.dtype = jnp.bfloat16
    fp8: bool = False  # every Dense, attention projection and the tied logits through Flax's FP8 dot_general op

    @property
    def dot_general_cls(self) -> type | None:
        """What the Dense layers multiply with: Flax's FP8 op with ``fp8``, else XLA's dot."""
        return Fp8DirectDotGeneralOp if self.fp8 else None


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
        h = nn.Dense(cfg.intermediate_size, dtype=cfg.dtype, dot_general_cls=cfg.dot_general_cls)(x)
        h = nn.Dropout(cfg.dropout_rate)(nn.relu(h), deterministic=deterministic)
        h = nn.Dense(cfg.hidden_size, dtype=cfg.dtype, dot_general_cls=cfg.dot_general_cls)(h)
        return nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)


def _attention(cfg: ReferenceConfig, decode: bool = False) -> nn.MultiHeadDotProductAttention:
    # Flax's default attention dropout shares one mask across batch and heads: less random-number work than
    # ls_jax's per-element dropout (the fairseq / LightSeq semantics), which favours this baseline. With
    # ``decode`` it keeps Flax's own cache of keys and values, one position per call.
    return nn.MultiHeadDotProductAttention(
        num_heads=cfg.num_heads,
        dtype=cfg.dtype,
        dropout_rate=cfg.dropout_rate,
        decode=decode,
        qkv_dot_general_cls=cfg.dot_general_cls,
        out_dot_general_cls=cfg.dot_general_cls,
    )


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
    def __call__(self, y, encoded, self_mask, cross_mask, deterministic, decode: bool = False):
        cfg = self.config
        h = nn.LayerNorm(dtype=cfg.dtype)(y)
        h = _attention(cfg, decode)(h, h, mask=self_mask, deterministic=deterministic)
        y = y + nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
        h = nn.LayerNorm(dtype=cfg.dtype)(y)
        h = _attention(cfg)(h, encoded, mask=cross_mask, deterministic=deterministic)
        y = y + nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
        return y + FeedForward(cfg)(nn.LayerNorm(dtype=cfg.dtype)(y), deterministic)


class ReferenceTransformer(nn.Module):
    """Pre-LN encoder-decoder; ``__call__(src (B,S), tgt_in (B,T)) -> logits (B,T,V)``; token 0 is padding.

    Incremental decoding, the interface of ``ls_jax.models.decoding``, as Flax's WMT example decodes: the
    decoder's self-attention keeps Flax's key/value cache and takes one position per call; the cross-attention
    projects the encoded source again at every step (no cache of its keys and values)::

        encoded, src_mask = model.apply(variables, src, method="encode")
        _, state = model.apply(variables, encoded, src_mask, max_len, method="init_cache", mutable=["cache"])
        logits, state = model.apply({**variables, **state}, tokens (B, 1), method="decode", mutable=["cache"])
    """

    config: ReferenceConfig

    def setup(self):
        cfg = self.config
        self.embed = nn.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=cfg.dtype,
            embedding_init=nn.initializers.normal(cfg.hidden_size**-0.5),
        )
        self.encoder_layers = [EncoderLayer(cfg) for _ in range(cfg.num_encoder_layers)]
        self.encoder_norm = nn.LayerNorm(dtype=cfg.dtype)
        self.decoder_layers = [DecoderLayer(cfg) for _ in range(cfg.num_decoder_layers)]
        self.decoder_norm = nn.LayerNorm(dtype=cfg.dtype)
        self.embedding_dropout = nn.Dropout(cfg.dropout_rate)
        if cfg.fp8:
            self.logits_fp8 = Fp8DirectDotGeneralOp()

    @property
    def max_target_len(self) -> int:
        """The most target positions decoding may fill: the position table's rows."""
        return self.config.max_len

    def __call__(self, src, tgt_in, deterministic: bool = True):
        encoded, src_valid = self.encode(src, deterministic=deterministic)
        tgt_valid = tgt_in > 0
        self_mask = nn.combine_masks(nn.make_attention_mask(tgt_valid, tgt_valid), nn.make_causal_mask(tgt_in))
        cross_mask = nn.make_attention_mask(tgt_valid, src_valid)
        return self._decoder(tgt_in, 0, encoded, self_mask, cross_mask, deterministic, decode=False)

    def _embed_tokens(self, tokens: jax.Array, offset: jax.Array | int, deterministic: bool) -> jax.Array:
        """Token embeddings x sqrt(H) plus the sinusoids of positions offset .. offset + T - 1: (B, T, H)."""
        cfg = self.config
        table = jnp.asarray(sinusoidal_positions(cfg.max_len, cfg.hidden_size))
        positions = jax.lax.dynamic_slice_in_dim(table, offset, tokens.shape[1])
        x = self.embed(tokens) * jnp.sqrt(cfg.hidden_size) + positions[None]
        return self.embedding_dropout(x.astype(cfg.dtype), deterministic=deterministic)

    def encode(self, src: jax.Array, *, deterministic: bool = True) -> tuple[jax.Array, jax.Array]:
        """src (B, S) -> (encoded (B, S, H), src_valid (B, S) boolean, False at padding)."""
        src_valid = src > 0
        # The scopes name the stages of a step in traces (train.bench.tracing.kernel_trace.stage).
        with jax.named_scope("encoder"):
            mask = nn.make_attention_mask(src_valid, src_valid)
            x = self._embed_tokens(src, 0, deterministic)
            for layer in self.encoder_layers:
                x = layer(x, mask, deterministic)
            return self.encoder_norm(x), src_valid

    def _decoder(self, tokens, offset, encoded, self_mask, cross_mask, deterministic: bool, decode: bool):
        """Logits (B, T, V) of target inputs (B, T) at positions offset .. offset + T - 1."""
        with jax.named_scope("decoder"):
            y = self._embed_tokens(tokens, offset, deterministic)
            for layer in self.decoder_layers:
                y = layer(y, encoded, self_mask, cross_mask, deterministic, decode)
            y = self.decoder_norm(y)
        with jax.named_scope("output_projection"):
            y = y.astype(self.config.dtype)
            if not self.config.fp8:
                return self.embed.attend(y)
            table = self.embed.embedding.astype(y.dtype)
            return self.logits_fp8(y, table, (((y.ndim - 1,), (1,)), ((), ())))

    def init_cache(self, encoded: jax.Array, src_valid: jax.Array, max_len: int) -> None:
        """Creates the "cache" collection for decoding up to ``max_len`` target tokens (run with mutable=["cache"]):
        every decoder layer's self-attention keys/values (B, max_len, heads, d) at zero, the encoded source and
        its mask, and the next position, 0."""
        start = jnp.ones((encoded.shape[0], max_len), jnp.int32)
        self_mask = nn.make_causal_mask(start)
        cross_mask = nn.make_attention_mask(start > 0, src_valid)
        self._decoder(start, 0, encoded, self_mask, cross_mask, True, decode=True)
        self.put_variable("cache", "encoded", encoded)
        self.put_variable("cache", "src_mask", src_valid)
        self.put_variable("cache", "position", jnp.zeros((), jnp.int32))

    def decode(self, tokens: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """One step: tokens (B, 1), the next target inputs -> logits (B, 1, V); extends the cache."""
        encoded, src_valid = self.get_variable("cache", "encoded"), self.get_variable("cache", "src_mask")
        position = self.get_variable("cache", "position")
        cross_mask = nn.make_attention_mask(jnp.ones(tokens.shape, bool), src_valid)
        logits = self._decoder(tokens, position, encoded, None, cross_mask, deterministic, decode=True)
        self.put_variable("cache", "position", position + tokens.shape[1])
        return logits
