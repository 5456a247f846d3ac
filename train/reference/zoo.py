"""Plain Flax linen BERT and GPT-2: the baselines ls_jax's BERT and GPT-2 are measured against.

No ls_jax code: ``nn.Embed``, ``nn.DenseGeneral``, ``nn.LayerNorm``, ``nn.Dropout`` and one of two attention
cores, all compiled by XLA:

  "einsum"  ``flax.linen.dot_product_attention``, as Flax's ``MultiHeadDotProductAttention`` and the Hugging Face
            Flax models call it: Q K^T by einsum, a boolean mask, softmax, dropout on the probabilities (one mask
            shared across batch and heads, Flax's default), P V by einsum;
  "cudnn"   ``jax.nn.dot_product_attention(implementation="cudnn")``, cuDNN's fused flash attention: padding as
            per-row key lengths, ``is_causal`` for GPT-2; it has no dropout, so attention dropout must be 0;
  "xla"     the same call with ``implementation="xla"``: the "cudnn" model's masking on any backend (CPU tests).

The architectures match ``ls_jax.models.BertForSequenceClassification`` (post-LN, exact GELU, LayerNorm eps 1e-12,
learned positions, token types, tanh pooler) and ``ls_jax.models.GPTLMHeadModel`` (pre-LN, tanh GELU, final
LayerNorm, logits tied to the token table) with the same parameter count, so each pair does the same FLOPs.
Parameters are float32 and every matmul runs in ``dtype`` (bf16 mixed precision). GPT-2 decodes incrementally
with a key/value cache (``init_cache``, ``decode``), as ls_jax's GPT-2 does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.fp8_ops import Fp8DirectDotGeneralOp

AttentionCore = Literal["einsum", "cudnn", "xla"]
ATTENTION_CORES: tuple[str, ...] = ("einsum", "cudnn", "xla")
INITIALIZER = nn.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True)
class ZooConfig:
    """Shape, dropout and attention core of a plain Flax BERT or GPT-2.

    Attributes:
      vocab_size: token table rows V.
      hidden_size: model width H; ``num_heads`` divides it.
      intermediate_size: feed-forward width.
      num_heads: attention heads.
      num_layers: Transformer layers.
      max_positions: learned position table rows (the longest sequence).
      dropout_rate: dropout on embeddings, sublayer outputs and (BERT) the pooled [CLS] vector.
      attention_dropout_rate: dropout on attention probabilities; only the "einsum" core has it.
      attention: the attention core (module docstring).
      dtype: compute dtype.
      fp8: the layers' Dense GEMMs, attention projections and GPT-2's tied logits through Flax's FP8
        dot_general op.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_layers: int
    max_positions: int
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    attention: AttentionCore = "einsum"
    dtype: Any = jnp.bfloat16
    fp8: bool = False

    @property
    def dot_general_cls(self) -> type | None:
        """What the Dense layers multiply with: Flax's FP8 op with ``fp8``, else XLA's dot."""
        return Fp8DirectDotGeneralOp if self.fp8 else None

    def __post_init__(self):
        if self.attention not in ATTENTION_CORES:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_CORES)}, got {self.attention!r}")
        if self.attention != "einsum" and self.attention_dropout_rate:
            raise ValueError(
                f"attention={self.attention!r} (jax.nn.dot_product_attention) has no dropout: set "
                f"attention_dropout_rate=0, got {self.attention_dropout_rate}"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")


def _dense(cfg: ZooConfig, features: int, name: str, quantized: bool = True) -> nn.Dense:
    """A Dense of the model's dtype and initializer, multiplying as ``cfg`` says (XLA's dot or FP8) when
    ``quantized``."""
    dot_general_cls = cfg.dot_general_cls if quantized else None
    return nn.Dense(features, dtype=cfg.dtype, kernel_init=INITIALIZER, dot_general_cls=dot_general_cls, name=name)


class SelfAttention(nn.Module):
    """Multi-head self-attention with separate Q, K, V projections (as Hugging Face Flax writes it):
    x (B, T, H), lengths (B,) int32 real tokens per row (padding at the end) or None -> (B, T, H)."""

    config: ZooConfig
    causal: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, lengths: jax.Array | None, deterministic: bool, decode: bool = False) -> jax.Array:
        cfg = self.config
        heads = (cfg.num_heads, cfg.hidden_size // cfg.num_heads)
        project = lambda name: nn.DenseGeneral(
            heads, dtype=cfg.dtype, kernel_init=INITIALIZER, dot_general_cls=cfg.dot_general_cls, name=name
        )(x)
        query, key, value = project("query"), project("key"), project("value")
        if decode:
            context = self._cached_attention(query, key, value)
        elif cfg.attention == "einsum":
            context = self._einsum_attention(query, key, value, lengths, deterministic)
        else:
            context = jax.nn.dot_product_attention(
                query,
                key,
                value,
                is_causal=self.causal,
                key_value_seq_lengths=lengths,
                implementation=cfg.attention,
            )
        return nn.DenseGeneral(
            cfg.hidden_size,
            axis=(-2, -1),
            dtype=cfg.dtype,
            kernel_init=INITIALIZER,
            dot_general_cls=cfg.dot_general_cls,
            name="out",
        )(context)

    def _cached_attention(self, query: jax.Array, key: jax.Array, value: jax.Array) -> jax.Array:
        """Causal attention while decoding (the einsum core, no dropout), with the keys and values of every
        position so far in the "cache" collection, as Flax's ``MultiHeadDotProductAttention(decode=True)`` keeps
        them but for L >= 1 new positions per call: query, key, value (B, L, heads, d) -> (B, L, heads, d).

        The first call (from ``init_cache``, L = the length to decode) creates the zero cache of that length and
        caches nothing; each later call writes its L keys and values after the cached ones, and new position i
        attends to every cached position up to itself."""
        cfg = self.config
        initialized = self.has_variable("cache", "cached_key")
        cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
        index = self.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
        if not initialized:
            return self._einsum_attention(query, key, value, None, deterministic=True)
        start, length = index.value, query.shape[1]
        cached_key.value = jax.lax.dynamic_update_slice_in_dim(cached_key.value, key, start, axis=1)
        cached_value.value = jax.lax.dynamic_update_slice_in_dim(cached_value.value, value, start, axis=1)
        index.value = start + length
        query_positions = start + jnp.arange(length)
        key_positions = jnp.arange(cached_key.value.shape[1])
        mask = (key_positions[None, :] <= query_positions[:, None])[None, None]  # (1, 1, L, max_len)
        return nn.dot_product_attention(query, cached_key.value, cached_value.value, mask=mask, dtype=cfg.dtype)

    def _einsum_attention(self, query, key, value, lengths, deterministic: bool) -> jax.Array:
        cfg = self.config
        mask = None
        if lengths is not None:
            positions = jnp.arange(key.shape[1])
            mask = (positions[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
        if self.causal:
            mask = nn.combine_masks(mask, nn.make_causal_mask(jnp.ones(query.shape[:2], jnp.int32)))
        dropout = cfg.attention_dropout_rate > 0 and not deterministic
        dropout_rng = self.make_rng("dropout") if dropout else None
        # The "attention" scope lets `train.bench.tracing.kernel_trace` attribute the mask, softmax and probability
        # dropout kernels as it does those of ls_jax's XLA attention (the two einsums are GEMMs by kernel name).
        with jax.named_scope("attention"):
            return nn.dot_product_attention(
                query,
                key,
                value,
                mask=mask,
                dropout_rng=dropout_rng,
                dropout_rate=cfg.attention_dropout_rate,
                deterministic=not dropout,
                dtype=cfg.dtype,
            )


class FeedForward(nn.Module):
    """Dense(F), GELU (exact, or its tanh approximation for GPT-2), Dense(H): (B, T, H) -> (B, T, H)."""

    config: ZooConfig
    approximate_gelu: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        h = _dense(cfg, cfg.intermediate_size, "fc1")(x)
        h = nn.gelu(h, approximate=self.approximate_gelu)
        return _dense(cfg, cfg.hidden_size, "fc2")(h)


class BertLayer(nn.Module):
    """Post-LN: ``h = LN(x + drop(attn(x)))``, ``LN(h + drop(ffn(h)))``."""

    config: ZooConfig

    @nn.compact
    def __call__(self, x: jax.Array, lengths: jax.Array | None, deterministic: bool) -> jax.Array:
        cfg = self.config
        norm = lambda name: nn.LayerNorm(epsilon=1e-12, dtype=cfg.dtype, name=name)
        drop = lambda h: nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
        attention = SelfAttention(cfg, name="self_attention")
        x = norm("attention_layer_norm")(x + drop(attention(x, lengths, deterministic)))
        return norm("output_layer_norm")(x + drop(FeedForward(cfg, approximate_gelu=False, name="feed_forward")(x)))


class ReferenceBert(nn.Module):
    """BERT for sequence classification: ``(input_ids (B, T), lengths (B,)) -> logits (B, num_labels)``;
    token types are all 0, positions 0..T-1, the tanh pooler reads the first ([CLS]) token."""

    config: ZooConfig
    num_labels: int = 2
    type_vocab_size: int = 2

    @nn.compact
    def __call__(self, input_ids: jax.Array, lengths: jax.Array | None, deterministic: bool = True) -> jax.Array:
        cfg = self.config
        embed = lambda rows, name: nn.Embed(
            rows, cfg.hidden_size, dtype=cfg.dtype, embedding_init=INITIALIZER, name=name
        )
        positions = jnp.arange(input_ids.shape[1])[None, :]
        with jax.named_scope("encoder"):  # the stages of train.bench profile (kernel_trace.stage)
            x = (
                embed(cfg.vocab_size, "word_embedding")(input_ids)
                + embed(cfg.max_positions, "position_embedding")(positions)
                + embed(self.type_vocab_size, "token_type_embedding")(jnp.zeros_like(input_ids))
            )
            x = nn.LayerNorm(epsilon=1e-12, dtype=cfg.dtype, name="embedding_layer_norm")(x)
            x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
            for index in range(cfg.num_layers):
                x = BertLayer(cfg, name=f"layer_{index}")(x, lengths, deterministic)
        with jax.named_scope("output_projection"):
            # One row per sequence: the pooler and classifier stay in the compute dtype, as ls_jax's BERT keeps them.
            pooler = _dense(cfg, cfg.hidden_size, "pooler", quantized=False)
            pooled = nn.Dropout(cfg.dropout_rate)(jnp.tanh(pooler(x[:, 0])), deterministic=deterministic)
            return _dense(cfg, self.num_labels, "classifier", quantized=False)(pooled)


class GPTBlock(nn.Module):
    """Pre-LN causal block: ``x + drop(attn(LN(x)))``, then ``+ drop(ffn(LN(.)))``."""

    config: ZooConfig

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool, decode: bool = False) -> jax.Array:
        cfg = self.config
        norm = lambda name: nn.LayerNorm(epsilon=1e-5, dtype=cfg.dtype, name=name)
        drop = lambda h: nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
        attention = SelfAttention(cfg, causal=True, name="self_attention")
        x = x + drop(attention(norm("attention_layer_norm")(x), None, deterministic, decode))
        return x + drop(FeedForward(cfg, approximate_gelu=True, name="feed_forward")(norm("output_layer_norm")(x)))


class ReferenceGPT(nn.Module):
    """GPT-2 language model: ``input_ids (B, T) -> logits (B, T, V)``, logits tied to the token table.

    Incremental decoding (the interface of ``ls_jax.models.GPTLMHeadModel``): ``init_cache`` makes the "cache"
    collection, then each ``decode`` call feeds the next L >= 1 tokens (a prompt at once, then one at a time)."""

    config: ZooConfig

    @property
    def max_positions(self) -> int:
        """The most positions a row (or a decoding cache) holds."""
        return self.config.max_positions

    @nn.compact
    def __call__(self, input_ids: jax.Array, deterministic: bool = True, decode: bool = False) -> jax.Array:
        cfg = self.config
        tokens = nn.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype, embedding_init=INITIALIZER, name="token_embedding"
        )
        positions = nn.Embed(
            cfg.max_positions, cfg.hidden_size, dtype=cfg.dtype, embedding_init=INITIALIZER, name="position_embedding"
        )
        with jax.named_scope("decoder"):  # the stages of train.bench profile (kernel_trace.stage)
            first = self._next_position(input_ids.shape[1]) if decode else 0
            x = tokens(input_ids) + positions(first + jnp.arange(input_ids.shape[1])[None, :])
            x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
            for index in range(cfg.num_layers):
                x = GPTBlock(cfg, name=f"layer_{index}")(x, deterministic, decode)
            x = nn.LayerNorm(epsilon=1e-5, dtype=cfg.dtype, name="final_layer_norm")(x)
        with jax.named_scope("output_projection"):
            if not cfg.fp8:
                return tokens.attend(x)
            table = tokens.embedding.astype(cfg.dtype)
            return Fp8DirectDotGeneralOp(name="logits_fp8")(x, table, (((x.ndim - 1,), (1,)), ((), ())))

    def _next_position(self, length: int) -> jax.Array:
        """The position of the first of ``length`` tokens being decoded; advances the cached count by ``length``
        (on the call that creates the cache, from ``init_cache``, it stays 0)."""
        initialized = self.has_variable("cache", "position")
        position = self.variable("cache", "position", lambda: jnp.zeros((), jnp.int32))
        first = position.value
        if initialized:
            position.value = first + length
        return first

    def init_cache(self, batch_size: int, max_len: int) -> None:
        """Creates the "cache" collection for ``max_len`` positions of ``batch_size`` rows (run with
        mutable=["cache"]): every layer's keys/values (B, max_len, heads, d) at zero and the position at 0."""
        if not 1 <= max_len <= self.config.max_positions:
            raise ValueError(f"max_len must be in [1, max_positions={self.config.max_positions}], got {max_len}")
        self(jnp.zeros((batch_size, max_len), jnp.int32), decode=True)

    def decode(self, input_ids: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """The next L positions: input_ids (B, L) -> logits (B, L, V); each attends to every earlier cached
        position and to itself, and the cache grows by L."""
        return self(input_ids, deterministic=deterministic, decode=True)
