"""Dropout and the two elementwise fusions around Transformer GEMMs.

    dropout(x)                          = x * keep / (1 - p)
    bias_dropout_residual(x, b, r)      = r + (x + b) * keep / (1 - p)
    bias_act_dropout(x, b)              = act(x + b) * keep / (1 - p),   act in relu | gelu | gelu_tanh

Shapes: x, r (..., H); b (H,). ``keep`` comes from the Philox seed (``ls_jax.ops.random``) and is regenerated
in the backward, so only the seed (and for bias_act_dropout x and b) is saved. Backward with m = keep / (1 - p):

    dropout:               dx = dy * m
    bias_dropout_residual: dx = dy * m,  db = sum_rows(dx),  dr = dy
    bias_act_dropout:      dx = dy * m * act'(x + b),  db = sum_rows(dx)

Implementations share:
  dropout_forward(x, seed) -> y;                dropout_backward(dy, seed) -> dx
  bdr_forward(x, bias, residual, seed) -> y;    bdr_backward(dy, seed) -> (dx, dbias)
  bad_forward(x, bias, seed) -> y;              bad_backward(dy, x, bias, seed) -> (dx, dbias)
with dx in the activation dtype and dbias in the bias dtype; seed is None when the rate is 0.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp

from ls_jax.ops import _common
from ls_jax.ops import random

_f32 = jnp.float32
Activation = Literal["relu", "gelu", "gelu_tanh"]
ACTIVATIONS: tuple[Activation, ...] = ("relu", "gelu", "gelu_tanh")
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_TANH_CUBIC = 0.044715


def activate(z: jax.Array, activation: Activation) -> jax.Array:
    """relu, exact (erf) GELU, or tanh-approximated GELU of f32 ``z``."""
    if activation == "relu":
        return jnp.maximum(z, 0.0)
    if activation == "gelu":
        return 0.5 * z * (1.0 + jax.lax.erf(z * (1.0 / math.sqrt(2.0))))
    inner = _SQRT_2_OVER_PI * (z + _GELU_TANH_CUBIC * z * z * z)
    return 0.5 * z * (1.0 + jnp.tanh(inner))


def activation_derivative(z: jax.Array, activation: Activation) -> jax.Array:
    """d act(z) / dz for f32 ``z``."""
    if activation == "relu":
        return (z > 0.0).astype(z.dtype)
    if activation == "gelu":
        cdf = 0.5 * (1.0 + jax.lax.erf(z * (1.0 / math.sqrt(2.0))))
        return cdf + z * jnp.exp(-0.5 * z * z) * (1.0 / math.sqrt(2.0 * math.pi))
    inner = _SQRT_2_OVER_PI * (z + _GELU_TANH_CUBIC * z * z * z)
    t = jnp.tanh(inner)
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_CUBIC * z * z)


def _row_sum(x: jax.Array) -> jax.Array:
    return jnp.sum(x, axis=tuple(range(x.ndim - 1)))


# ---- dropout ----------------------------------------------------------------------------------------------


def _dropout_forward_xla(x, seed, *, rate):
    return (x.astype(_f32) * random.dropout_multiplier(seed, x.shape, rate)).astype(x.dtype)


def _dropout_backward_xla(dy, seed, *, rate):
    return (dy.astype(_f32) * random.dropout_multiplier(seed, dy.shape, rate)).astype(dy.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dropout(x, seed, rate):
    return _dropout_fwd(x, seed, rate)[0]


def _dropout_fwd(x, seed, rate):
    forward_xla = functools.partial(_dropout_forward_xla, rate=rate)
    return _common.dispatch("dropout", forward_xla, None, (x, seed)), seed


def _dropout_bwd(rate, seed, dy):
    backward_xla = functools.partial(_dropout_backward_xla, rate=rate)
    return _common.dispatch("dropout", backward_xla, None, (dy, seed)), None


_dropout.defvjp(_dropout_fwd, _dropout_bwd)


def dropout(x: jax.Array, *, rate: float, seed: jax.Array | None = None) -> jax.Array:
    """Zeroes each element of ``x`` with probability ``rate`` and scales the rest by ``1 / (1 - rate)``.

    Args:
      x: any shape, f32, bf16 or f16.
      rate: in [0, 1); 0 returns ``x`` unchanged.
      seed: uint32[2] dropout seed; required when ``rate > 0``.
    """
    _common.check_activation("x", x)
    _common.check_dropout(rate, seed)
    if rate == 0.0:
        return x
    return _dropout(x, seed, float(rate))


# ---- bias + dropout + residual ----------------------------------------------------------------------------


def _bdr_forward_xla(x, bias, residual, seed, *, rate):
    z = (x.astype(_f32) + bias.astype(_f32)) * random.dropout_multiplier(seed, x.shape, rate)
    return (residual.astype(_f32) + z).astype(x.dtype)


def _bdr_backward_xla(dy, seed, *, rate, bias_dtype):
    dx = dy.astype(_f32) * random.dropout_multiplier(seed, dy.shape, rate)
    return dx.astype(dy.dtype), _row_sum(dx).astype(bias_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _bias_dropout_residual(x, bias, residual, seed, rate, bias_dtype):
    return _bias_dropout_residual_fwd(x, bias, residual, seed, rate, bias_dtype)[0]


def _bias_dropout_residual_fwd(x, bias, residual, seed, rate, bias_dtype):
    forward_xla = functools.partial(_bdr_forward_xla, rate=rate)
    return _common.dispatch("bias_dropout_residual", forward_xla, None, (x, bias, residual, seed)), seed


def _bias_dropout_residual_bwd(rate, bias_dtype, seed, dy):
    backward_xla = functools.partial(_bdr_backward_xla, rate=rate, bias_dtype=bias_dtype)
    dx, dbias = _common.dispatch("bias_dropout_residual", backward_xla, None, (dy, seed))
    return dx, dbias, dy, None


_bias_dropout_residual.defvjp(_bias_dropout_residual_fwd, _bias_dropout_residual_bwd)


def bias_dropout_residual(
    x: jax.Array,
    bias: jax.Array,
    residual: jax.Array,
    *,
    dropout_rate: float = 0.0,
    seed: jax.Array | None = None,
) -> jax.Array:
    """``residual + dropout(x + bias)``: the tail of an attention or feed-forward block.

    Args:
      x: (..., H) output of a GEMM without bias, f32, bf16 or f16.
      bias: (H,), f32 or x's dtype.
      residual: x's shape and dtype.
      dropout_rate, seed: as in ``dropout``.
    """
    _common.check_activation("x", x)
    _common.check_param("bias", bias, (x.shape[-1],), x.dtype)
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {residual.shape} but x has {x.shape}; they must match")
    _common.check_same_dtype("residual", residual, "x", x)
    _common.check_dropout(dropout_rate, seed)
    if dropout_rate == 0.0:
        seed = None
    return _bias_dropout_residual(x, bias, residual, seed, float(dropout_rate), jnp.dtype(bias.dtype))


# ---- bias + activation + dropout --------------------------------------------------------------------------


def _bad_forward_xla(x, bias, seed, *, activation, rate):
    z = activate(x.astype(_f32) + bias.astype(_f32), activation)
    return (z * random.dropout_multiplier(seed, x.shape, rate)).astype(x.dtype)


def _bad_backward_xla(dy, x, bias, seed, *, activation, rate):
    z = x.astype(_f32) + bias.astype(_f32)
    dz = dy.astype(_f32) * random.dropout_multiplier(seed, dy.shape, rate) * activation_derivative(z, activation)
    return dz.astype(x.dtype), _row_sum(dz).astype(bias.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _bias_act_dropout(x, bias, seed, activation, rate):
    return _bias_act_dropout_fwd(x, bias, seed, activation, rate)[0]


def _bias_act_dropout_fwd(x, bias, seed, activation, rate):
    forward_xla = functools.partial(_bad_forward_xla, activation=activation, rate=rate)
    y = _common.dispatch("bias_act_dropout", forward_xla, None, (x, bias, seed))
    return y, (x, bias, seed)


def _bias_act_dropout_bwd(activation, rate, res, dy):
    x, bias, seed = res
    backward_xla = functools.partial(_bad_backward_xla, activation=activation, rate=rate)
    dx, dbias = _common.dispatch("bias_act_dropout", backward_xla, None, (dy, x, bias, seed))
    return dx, dbias, None


_bias_act_dropout.defvjp(_bias_act_dropout_fwd, _bias_act_dropout_bwd)


def bias_act_dropout(
    x: jax.Array,
    bias: jax.Array,
    *,
    activation: Activation = "relu",
    dropout_rate: float = 0.0,
    seed: jax.Array | None = None,
) -> jax.Array:
    """``dropout(act(x + bias))``: the middle of a feed-forward block.

    Args:
      x: (..., H) output of a GEMM without bias, f32, bf16 or f16.
      bias: (H,), f32 or x's dtype.
      activation: "relu", "gelu" (exact, erf) or "gelu_tanh" (tanh approximation).
      dropout_rate, seed: as in ``dropout``.
    """
    _common.check_activation("x", x)
    _common.check_param("bias", bias, (x.shape[-1],), x.dtype)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    _common.check_dropout(dropout_rate, seed)
    if dropout_rate == 0.0:
        seed = None
    return _bias_act_dropout(x, bias, seed, activation, float(dropout_rate))
