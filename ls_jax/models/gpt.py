"""GPT-2 (Radford et al., 2019) language model, the Hugging Face architecture on ``ls_jax.layers``."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ls_jax.layers import LayerConfig, TransformerEmbedding, TransformerEncoder
from ls_jax.layers.config import replace_checked
from ls_jax.models.tokens import check_tokens

_PRESETS: dict[str, dict[str, Any]] = {
    # A small model for the synthetic corpus and CPU runs; no dropout: its training data never repeats.
    "gpt2-tiny": dict(
        layer=LayerConfig.preset(
            "gpt2-small",
            hidden_size=128,
            intermediate_size=512,
            nhead=4,
            max_seq_len=256,
            attn_prob_dropout_ratio=0.0,
            hidden_dropout_ratio=0.0,
        ),
        num_layers=2,
    ),
    "gpt2-small": dict(layer=LayerConfig.preset("gpt2-small"), num_layers=12),
    "gpt2-medium": dict(
        layer=LayerConfig.preset("gpt2-small", hidden_size=1024, intermediate_size=4096, nhead=16), num_layers=24
    ),
    "gpt2-large": dict(
        layer=LayerConfig.preset("gpt2-small", hidden_size=1280, intermediate_size=5120, nhead=20), num_layers=36
    ),
}
PRESETS: tuple[str, ...] = tuple(_PRESETS)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """GPT-2 hyper-parameters.

    Attributes:
      layer: block configuration (pre-LN, tanh GELU); ``max_seq_len`` is the number of learned positions.
        ``layer.padding_idx`` must be None: GPT-2 embeds every id.
      vocab_size: BPE vocabulary size.
      num_layers: number of blocks.
      embedding_dropout: dropout on the summed embeddings; None uses ``layer.hidden_dropout_ratio``.
    """

    layer: LayerConfig = LayerConfig.preset("gpt2-small")
    vocab_size: int = 50257
    num_layers: int = 12
    embedding_dropout: float | None = None

    def __post_init__(self):
        for name in ("vocab_size", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.embedding_dropout is not None and not 0.0 <= self.embedding_dropout < 1.0:
            raise ValueError(f"embedding_dropout must be in [0, 1), got {self.embedding_dropout}")
        if self.layer.padding_idx is not None:
            raise ValueError(
                f"layer.padding_idx must be None for GPT-2 (it embeds every id), got {self.layer.padding_idx}"
            )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """One of `PRESETS` ("gpt2-tiny", "gpt2-small", "gpt2-medium", "gpt2-large"); ``overrides`` replace
        GPTConfig fields."""
        if name not in _PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; valid presets are {', '.join(PRESETS)}")
        return replace_checked(cls(**_PRESETS[name]), overrides)


class GPTLMHeadModel(nn.Module):
    """Token + learned position embeddings, causal pre-LN blocks, final LayerNorm, logits tied to the token table.

    Matches Hugging Face ``GPT2LMHeadModel``; weights convert with ``ls_jax.models.hf``. Incremental decoding
    with the KV cache::

        _, state = model.apply(variables, batch, max_len, method="init_cache", mutable=["cache"])
        logits, state = model.apply({**variables, **state}, tokens, method="decode", mutable=["cache"])
    """

    config: GPTConfig

    def setup(self):
        cfg = self.config
        self.embedding = TransformerEmbedding(
            cfg.layer,
            cfg.vocab_size,
            learned_positions=True,
            scale_embedding=False,
            dropout_rate=cfg.embedding_dropout,
            embedding_init=nn.initializers.normal(stddev=0.02),
        )
        self.decoder = TransformerEncoder(cfg.layer, cfg.num_layers, causal=True)

    @property
    def max_positions(self) -> int:
        """The most positions a row (or a decoding cache) holds: ``layer.max_seq_len``."""
        return self.config.layer.max_seq_len

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        *,
        lengths: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """input_ids (B, T) int; attention_mask (B, T), nonzero for real tokens (any mask, e.g. left padding), or
        lengths (B,) int, the number of real tokens of each row when padding comes after them (cuDNN's attention
        takes them without a bias tensor); at most one of the two -> logits (B, T, V)."""
        check_tokens("input_ids", input_ids)
        key_mask = None
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask has shape {attention_mask.shape} but input_ids has {input_ids.shape}")
            key_mask = attention_mask != 0
        x = self.embedding(input_ids, deterministic=deterministic)
        return self.embedding.attend(self.decoder(x, key_mask, key_lengths=lengths, deterministic=deterministic))

    def init_cache(self, batch_size: int, max_len: int) -> None:
        """Creates the "cache" collection for ``max_len`` positions of ``batch_size`` rows (run with
        mutable=["cache"]): every layer's keys/values (B, max_len, heads, d) and the position counters at 0."""
        if not 1 <= max_len <= self.config.layer.max_seq_len:
            raise ValueError(f"max_len must be in [1, max_seq_len={self.config.layer.max_seq_len}], got {max_len}")
        self._decode_hidden(jnp.zeros((batch_size, max_len), jnp.int32), deterministic=True)

    def decode(self, input_ids: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """The next L positions: input_ids (B, L) -> logits (B, L, V); each attends to every earlier cached
        position and to itself, and the cache grows by L. The caller keeps the total within ``init_cache``'s
        ``max_len``."""
        check_tokens("input_ids", input_ids)
        return self.embedding.attend(self._decode_hidden(input_ids, deterministic=deterministic))

    def _decode_hidden(self, input_ids: jax.Array, *, deterministic: bool) -> jax.Array:
        x = self.embedding(input_ids, decode=True, deterministic=deterministic)
        return self.decoder(x, decode=True, deterministic=deterministic)
