"""Encoder-decoder Transformer for translation (Vaswani et al., 2017; LightSeq2's WMT model)."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ls_jax.layers import Dense, LayerConfig, TransformerDecoder, TransformerEmbedding, TransformerEncoder
from ls_jax.models.tokens import BOS_ID, NUM_SPECIAL_TOKENS, PAD_ID, check_tokens, prefix_lengths
from ls_jax.ops.attention_lengths import lengths_mask

_TINY_LAYER = LayerConfig.preset("transformer-base", hidden_size=128, intermediate_size=256, nhead=4, max_seq_len=64)
_PRESETS: dict[str, dict[str, Any]] = {
    "transformer-tiny": dict(layer=_TINY_LAYER, num_encoder_layers=2, num_decoder_layers=2),
    "transformer-base": dict(layer=LayerConfig.preset("transformer-base"), num_encoder_layers=6, num_decoder_layers=6),
    "transformer-big": dict(layer=LayerConfig.preset("transformer-big"), num_encoder_layers=6, num_decoder_layers=6),
    "transformer-big-12e12d": dict(
        layer=LayerConfig.preset("transformer-big"), num_encoder_layers=12, num_decoder_layers=12
    ),
    "transformer-big-24e24d": dict(
        layer=LayerConfig.preset("transformer-big"), num_encoder_layers=24, num_decoder_layers=24
    ),
}
PRESETS: tuple[str, ...] = tuple(_PRESETS)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Encoder-decoder Transformer hyper-parameters.

    Attributes:
      layer: every layer's configuration; ``layer.padding_idx`` must be ``PAD_ID``.
      vocab_size: V, including the special tokens PAD, BOS, EOS, UNK (ids 0-3).
      num_encoder_layers, num_decoder_layers: stack depths.
      share_embeddings: one token table for source and target (a joint vocabulary).
      tie_output: logits = h @ target_table.T instead of a separate output projection.
      learned_positions: learned position table instead of sinusoids.
      scale_embedding: multiply token embeddings by sqrt(H).
    """

    layer: LayerConfig
    vocab_size: int
    num_encoder_layers: int
    num_decoder_layers: int
    share_embeddings: bool = True
    tie_output: bool = True
    learned_positions: bool = False
    scale_embedding: bool = True

    def __post_init__(self):
        if self.vocab_size < NUM_SPECIAL_TOKENS:
            raise ValueError(f"vocab_size must cover the {NUM_SPECIAL_TOKENS} special tokens, got {self.vocab_size}")
        for name in ("num_encoder_layers", "num_decoder_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.layer.padding_idx != PAD_ID:
            raise ValueError(
                f"layer.padding_idx must be PAD_ID={PAD_ID} (the token convention), got {self.layer.padding_idx}"
            )

    @classmethod
    def preset(cls, name: str, vocab_size: int, **overrides: Any) -> TransformerConfig:
        """A named configuration (``PRESETS``); ``overrides`` may set fields of this class or of ``LayerConfig``."""
        if name not in _PRESETS:
            raise ValueError(f"unknown Transformer preset {name!r}; valid presets are {', '.join(PRESETS)}")
        own_fields = {field.name for field in dataclasses.fields(cls)} - {"layer", "vocab_size"}
        layer_fields = {field.name for field in dataclasses.fields(LayerConfig)}
        unknown = sorted(set(overrides) - own_fields - layer_fields)
        if unknown:
            raise ValueError(
                f"unknown overrides {unknown}; valid are TransformerConfig fields {sorted(own_fields)} "
                f"and LayerConfig fields {sorted(layer_fields)}"
            )
        fields = {**_PRESETS[name], **{key: overrides[key] for key in own_fields & set(overrides)}}
        layer_overrides = {key: overrides[key] for key in layer_fields & set(overrides)}
        return cls(layer=dataclasses.replace(fields.pop("layer"), **layer_overrides), vocab_size=vocab_size, **fields)


class Transformer(nn.Module):
    """Encoder-decoder Transformer: ``logits = model(src_tokens, tgt_in_tokens)``.

    Teacher forcing feeds ``[BOS] + target`` and scores against ``target + [EOS]``; padding (``PAD_ID``) is zero in
    the embeddings, and the source keys from a row's first ``PAD_ID`` on are masked (source padding is a suffix, as
    every batch of the data pipeline has it): the attention takes the source lengths (``tokens.prefix_lengths``),
    which cuDNN's attention runs without a bias tensor. Incremental decoding::

        encoded, src_mask = model.apply(variables, src, method="encode")
        _, state = model.apply(variables, encoded, src_mask, max_len, method="init_cache", mutable=["cache"])
        logits, state = model.apply({**variables, **state}, tokens, method="decode", mutable=["cache"])

    ``ls_jax.models.decoding`` does this for greedy and beam search.
    """

    config: TransformerConfig

    def setup(self):
        cfg = self.config
        self.source_embedding = self._embedding()
        if not cfg.share_embeddings:
            self.target_embedding = self._embedding()
        self.encoder = TransformerEncoder(cfg.layer, cfg.num_encoder_layers)
        self.decoder = TransformerDecoder(cfg.layer, cfg.num_decoder_layers)
        if not cfg.tie_output:
            self.output_projection = Dense(cfg.vocab_size, use_bias=False, dtype=cfg.layer.dtype)

    @property
    def max_target_len(self) -> int:
        """The most target positions decoding may fill: ``layer.max_seq_len``."""
        return self.config.layer.max_seq_len

    def _embedding(self) -> TransformerEmbedding:
        cfg = self.config
        return TransformerEmbedding(
            cfg.layer,
            cfg.vocab_size,
            learned_positions=cfg.learned_positions,
            scale_embedding=cfg.scale_embedding,
        )

    def _target_embedding(self) -> TransformerEmbedding:
        return self.source_embedding if self.config.share_embeddings else self.target_embedding

    def __call__(self, src_tokens: jax.Array, tgt_in_tokens: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """src_tokens (B, S), tgt_in_tokens (B, T) integer -> logits (B, T, V) in the compute dtype."""
        check_tokens("tgt_in_tokens", tgt_in_tokens)
        encoded, src_lengths = self._encode(src_tokens, deterministic=deterministic)
        hidden = self._decoder_hidden(
            tgt_in_tokens, encoded, None, src_lengths=src_lengths, decode=False, deterministic=deterministic
        )
        return self._logits(hidden)

    def encode(self, src_tokens: jax.Array, *, deterministic: bool = True) -> tuple[jax.Array, jax.Array]:
        """src_tokens (B, S) integer -> (encoded (B, S, H), src_mask (B, S) boolean, False from a row's first PAD
        on)."""
        encoded, src_lengths = self._encode(src_tokens, deterministic=deterministic)
        return encoded, lengths_mask(src_lengths, src_tokens.shape[1])

    def _encode(self, src_tokens: jax.Array, *, deterministic: bool) -> tuple[jax.Array, jax.Array]:
        """src_tokens (B, S) integer -> (encoded (B, S, H), src_lengths int32 (B,))."""
        check_tokens("src_tokens", src_tokens)
        src_lengths = prefix_lengths(src_tokens)
        embedded = self.source_embedding(src_tokens, deterministic=deterministic)
        return self.encoder(embedded, key_lengths=src_lengths, deterministic=deterministic), src_lengths

    def init_cache(self, encoded: jax.Array, src_mask: jax.Array, max_len: int) -> None:
        """Creates the "cache" collection for decoding up to ``max_len`` target tokens (run with mutable=["cache"]).

        The cache holds every decoder layer's self-attention keys/values (B, max_len, heads, d), the position
        counters, and the cross-attention keys/values projected once from ``encoded`` (B, S, H).
        """
        start = jnp.full((encoded.shape[0], max_len), BOS_ID, jnp.int32)
        self._decoder_hidden(start, encoded, src_mask, decode=True, deterministic=True)

    def decode(self, tgt_tokens: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """One incremental step: tgt_tokens (B, L), the next L target inputs -> logits (B, L, V); extends the cache."""
        check_tokens("tgt_tokens", tgt_tokens)
        return self._logits(self._decoder_hidden(tgt_tokens, None, None, decode=True, deterministic=deterministic))

    def _decoder_hidden(
        self, tgt_tokens, encoded, src_mask, *, src_lengths=None, decode: bool, deterministic: bool
    ) -> jax.Array:
        # The scope puts a shared embedding's target lookup in the decoder's stage of a step's trace.
        with jax.named_scope("decoder"):
            embedded = self._target_embedding()(tgt_tokens, decode=decode, deterministic=deterministic)
        return self.decoder(
            embedded, encoded, src_mask, src_lengths=src_lengths, decode=decode, deterministic=deterministic
        )

    def _logits(self, hidden: jax.Array) -> jax.Array:
        with jax.named_scope("output_projection"):
            if self.config.tie_output:
                return self._target_embedding().attend(hidden)
            return self.output_projection(hidden)
