"""Hyper-parameters shared by every Transformer layer, with LightSeq's field names."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from ls_jax import ops

COMPUTE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

_TRANSFORMER = dict(
    attn_prob_dropout_ratio=0.1,
    activation_dropout_ratio=0.1,
    hidden_dropout_ratio=0.1,
    pre_layer_norm=True,
    activation_fn="relu",
    max_seq_len=256,
    padding_idx=0,
)
_BERT = dict(
    attn_prob_dropout_ratio=0.1,
    activation_dropout_ratio=0.0,
    hidden_dropout_ratio=0.1,
    pre_layer_norm=False,
    activation_fn="gelu",
    max_seq_len=512,
    padding_idx=None,
    layer_norm_eps=1e-12,
    initializer_range=0.02,
)
_PRESETS: dict[str, dict[str, Any]] = {
    "transformer-base": dict(_TRANSFORMER, hidden_size=512, intermediate_size=2048, nhead=8),
    "transformer-big": dict(_TRANSFORMER, hidden_size=1024, intermediate_size=4096, nhead=16),
    "bert-base": dict(_BERT, hidden_size=768, intermediate_size=3072, nhead=12),
    "bert-large": dict(_BERT, hidden_size=1024, intermediate_size=4096, nhead=16),
    "gpt2-small": dict(
        hidden_size=768,
        intermediate_size=3072,
        nhead=12,
        attn_prob_dropout_ratio=0.1,
        activation_dropout_ratio=0.0,
        hidden_dropout_ratio=0.1,
        pre_layer_norm=True,
        activation_fn="gelu_tanh",
        max_seq_len=1024,
        padding_idx=None,
        initializer_range=0.02,
    ),
}
PRESETS: tuple[str, ...] = tuple(_PRESETS)


def replace_checked(config: Any, overrides: dict[str, Any]) -> Any:
    """``dataclasses.replace`` that names unknown fields in a ValueError instead of a TypeError."""
    fields = {field.name for field in dataclasses.fields(config)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown {type(config).__name__} fields {unknown}; valid fields are {sorted(fields)}")
    return dataclasses.replace(config, **overrides)


REMAT_MODES = ("none", "layer", "gemm-outputs")


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """One Transformer layer's shape, dropout, normalization and precision.

    Attributes:
      hidden_size: model width H.
      intermediate_size: feed-forward width.
      nhead: attention heads; must divide ``hidden_size``.
      max_seq_len: the most positions an embedding or attention cache holds.
      attn_prob_dropout_ratio: dropout on attention probabilities.
      activation_dropout_ratio: dropout after the feed-forward activation.
      hidden_dropout_ratio: dropout on embeddings and on each sublayer's output before the residual add.
      pre_layer_norm: LayerNorm before each sublayer (pre-LN) or after the residual add (post-LN).
      activation_fn: "relu", "gelu" (exact) or "gelu_tanh" (tanh approximation, GPT-2's).
      padding_idx: token id of padding (embeds to zero, masked as an attention key), or None.
      dtype: compute dtype (float32, bfloat16 or float16); parameters are float32.
      layer_norm_eps: added to the LayerNorm variance.
      remat: gradient checkpointing of each layer in training: "none" keeps every activation the backward needs;
        "layer" keeps only each layer's input and recomputes the layer in the backward; "gemm-outputs" keeps the
        matmul outputs and recomputes the rest (LayerNorm, softmax, activations, dropout).
      initializer_range: standard deviation of the normal distribution the matmul kernels are drawn from
        (the ``initializer_range`` of BERT's and GPT-2's configurations, 0.02; Hugging Face's GPT-2 also scales
        its residual projections down with depth, which this does not); None draws them from LeCun's normal,
        variance 1 / fan-in.
      fp8: the Dense GEMMs and the tied logits multiply in FP8 with delayed scaling (`ls_jax.layers.fp8`: e4m3
        forward, e5m2 gradients); their scaling state is the "_overwrite_with_gradient" collection.
    """

    hidden_size: int
    intermediate_size: int
    nhead: int
    max_seq_len: int
    attn_prob_dropout_ratio: float = 0.1
    activation_dropout_ratio: float = 0.1
    hidden_dropout_ratio: float = 0.1
    pre_layer_norm: bool = True
    activation_fn: ops.Activation = "relu"
    padding_idx: int | None = 0
    dtype: Any = jnp.bfloat16
    layer_norm_eps: float = 1e-5
    remat: str = "none"
    initializer_range: float | None = None
    fp8: bool = False

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "nhead", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.hidden_size % self.nhead:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by nhead {self.nhead}; each head needs an equal share"
            )
        if self.activation_fn not in ops.ACTIVATIONS:
            raise ValueError(f"activation_fn must be one of {', '.join(ops.ACTIVATIONS)}, got {self.activation_fn!r}")
        for name in ("attn_prob_dropout_ratio", "activation_dropout_ratio", "hidden_dropout_ratio"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.remat not in REMAT_MODES:
            raise ValueError(f"remat must be one of {', '.join(REMAT_MODES)}, got {self.remat!r}")
        if self.initializer_range is not None and not self.initializer_range > 0:
            raise ValueError(f"initializer_range must be positive or None, got {self.initializer_range}")
        if not self.layer_norm_eps > 0:
            raise ValueError(f"layer_norm_eps must be positive, got {self.layer_norm_eps}")
        dtype = jnp.dtype(self.dtype)
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        object.__setattr__(self, "dtype", dtype)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.nhead

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LayerConfig:
        """A named configuration (``PRESETS``) with fields replaced by ``overrides``."""
        if name not in _PRESETS:
            raise ValueError(f"unknown layer preset {name!r}; valid presets are {', '.join(PRESETS)}")
        return replace_checked(cls(**_PRESETS[name]), overrides)
