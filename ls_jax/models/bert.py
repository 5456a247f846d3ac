"""BERT (Devlin et al., 2019) for sequence classification, the Hugging Face architecture on ``ls_jax.layers``."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ls_jax import ops
from ls_jax.layers import Dense, LayerConfig, LayerNorm, TransformerEncoder
from ls_jax.layers.common import dropout_args
from ls_jax.layers.config import replace_checked
from ls_jax.models.tokens import check_tokens

_PRESETS: dict[str, dict[str, Any]] = {
    "bert-base": dict(layer=LayerConfig.preset("bert-base"), num_layers=12),
    "bert-large": dict(layer=LayerConfig.preset("bert-large"), num_layers=24),
}
PRESETS: tuple[str, ...] = tuple(_PRESETS)
INITIALIZER = nn.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """BERT hyper-parameters.

    Attributes:
      layer: encoder layer configuration (post-LN, exact GELU, LayerNorm eps 1e-12); ``max_seq_len`` is the
        number of learned positions. ``layer.padding_idx`` must be None: BERT embeds every id and masks
        padding only through ``attention_mask``.
      vocab_size: word-piece vocabulary size.
      num_layers: encoder depth.
      type_vocab_size: number of segment (token type) ids.
      num_labels: classifier outputs.
      classifier_dropout: dropout before the classifier; None uses ``layer.hidden_dropout_ratio``.
    """

    layer: LayerConfig = LayerConfig.preset("bert-base")
    vocab_size: int = 30522
    num_layers: int = 12
    type_vocab_size: int = 2
    num_labels: int = 2
    classifier_dropout: float | None = None

    def __post_init__(self):
        for name in ("vocab_size", "num_layers", "type_vocab_size", "num_labels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.classifier_dropout is not None and not 0.0 <= self.classifier_dropout < 1.0:
            raise ValueError(f"classifier_dropout must be in [0, 1), got {self.classifier_dropout}")
        if self.layer.padding_idx is not None:
            raise ValueError(
                f"layer.padding_idx must be None for BERT (attention_mask masks padding), got {self.layer.padding_idx}"
            )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> BertConfig:
        """ "bert-base" or "bert-large"; ``overrides`` replace BertConfig fields."""
        if name not in _PRESETS:
            raise ValueError(f"unknown BERT preset {name!r}; valid presets are {', '.join(PRESETS)}")
        return replace_checked(cls(**_PRESETS[name]), overrides)


class BertEmbeddings(nn.Module):
    """``dropout(LN(word[ids] + position[0..T-1] + token_type[types]))``: (B, T) ids -> (B, T, H)."""

    config: BertConfig

    @nn.compact
    def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array, *, deterministic: bool) -> jax.Array:
        cfg = self.config
        hidden, dtype = cfg.layer.hidden_size, cfg.layer.dtype
        word = self.param("word_embedding", INITIALIZER, (cfg.vocab_size, hidden), jnp.float32)
        position = self.param("position_embedding", INITIALIZER, (cfg.layer.max_seq_len, hidden), jnp.float32)
        token_type = self.param("token_type_embedding", INITIALIZER, (cfg.type_vocab_size, hidden), jnp.float32)
        summed = ops.embed(input_ids, word, position, dtype=dtype) + ops.embed(token_type_ids, token_type, dtype=dtype)
        normed = LayerNorm(cfg.layer.layer_norm_eps, name="layer_norm")(summed)
        rate, seed = dropout_args(self, cfg.layer.hidden_dropout_ratio, deterministic)
        return ops.dropout(normed, rate=rate, seed=seed)


class BertForSequenceClassification(nn.Module):
    """BERT encoder, tanh pooler on the first ([CLS]) token, dropout, linear classifier.

    Matches Hugging Face ``BertForSequenceClassification`` (absolute positions); weights convert with
    ``ls_jax.models.hf``.
    """

    config: BertConfig

    @nn.compact
    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        token_type_ids: jax.Array | None = None,
        *,
        lengths: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """input_ids (B, T) int; attention_mask (B, T), nonzero for real tokens (any mask); token_type_ids (B, T) int;
        lengths (B,) int, the number of real tokens of each row when they come first and padding after (right
        padding: the same as ``attention_mask = arange(T) < lengths[:, None]``, which cuDNN's attention takes
        without a bias tensor). At most one of ``attention_mask`` and ``lengths``.

        Returns logits (B, num_labels) in the compute dtype.
        """
        cfg = self.config
        check_tokens("input_ids", input_ids)
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        check_tokens("token_type_ids", token_type_ids)
        if token_type_ids.shape != input_ids.shape:
            raise ValueError(f"token_type_ids has shape {token_type_ids.shape} but input_ids has {input_ids.shape}")
        key_mask = None
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask has shape {attention_mask.shape} but input_ids has {input_ids.shape}")
            key_mask = attention_mask != 0
        x = BertEmbeddings(cfg, name="embeddings")(input_ids, token_type_ids, deterministic=deterministic)
        x = TransformerEncoder(cfg.layer, cfg.num_layers, name="encoder")(
            x, key_mask, key_lengths=lengths, deterministic=deterministic
        )
        pooled = jnp.tanh(self._dense(cfg.layer.hidden_size, "pooler")(x[:, 0]))
        rate = cfg.layer.hidden_dropout_ratio if cfg.classifier_dropout is None else cfg.classifier_dropout
        rate, seed = dropout_args(self, rate, deterministic)
        return self._dense(cfg.num_labels, "classifier")(ops.dropout(pooled, rate=rate, seed=seed))

    def _dense(self, features: int, name: str) -> Dense:
        return Dense(features, dtype=self.config.layer.dtype, kernel_init=INITIALIZER, name=name)
