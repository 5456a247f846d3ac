"""Fused Transformer operators: one public function per op, each a ``jax.custom_vjp`` whose forward and
backward run CUDA kernels (ffi_kernels) on NVIDIA GPUs and plain XLA elsewhere (``dense``, the layers' GEMM,
is XLA everywhere). See ``ls_jax.backend``. ``attention_unfused`` is the one composition among them: two einsums
around ``attn_softmax``, for attention over a KV cache. ``fp8_quantize``, a step inside FP8 products' forward and
backward, has no gradient."""

from ls_jax.ops.attention import attention_unfused, cross_attention, self_attention
from ls_jax.ops.bias import ACTIVATIONS, Activation, bias_act_dropout, bias_dropout_residual
from ls_jax.ops.cross_entropy import label_smoothed_cross_entropy
from ls_jax.ops.dense import dense
from ls_jax.ops.dropout import dropout
from ls_jax.ops.embedding import embed
from ls_jax.ops.layer_norm import layer_norm
from ls_jax.ops.quantize import fp8_quantize
from ls_jax.ops.random import dropout_seed
from ls_jax.ops.softmax import attn_softmax

__all__ = [
    "ACTIVATIONS",
    "Activation",
    "attention_unfused",
    "attn_softmax",
    "bias_act_dropout",
    "bias_dropout_residual",
    "cross_attention",
    "dense",
    "dropout",
    "dropout_seed",
    "embed",
    "fp8_quantize",
    "label_smoothed_cross_entropy",
    "layer_norm",
    "self_attention",
]
