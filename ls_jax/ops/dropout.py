"""Dropout and the two elementwise fusions around Transformer GEMMs.

    dropout(x)                          = x * keep / (1 - p)
    bias_dropout_residual(x, b, r)      = r + (x + b) * keep / (1 - p)
    bias_act_dropout(x, b)              = act(x + b) * keep / (1 - p),   act in relu | gelu | gelu_tanh

Shapes: x, r (..., H); b (H,). ``keep`` comes from the Philox seed (``ls_jax.ops.random``) and is regenerated
in the backward, so only the seed (and for bias_act_dropout x and b; for relu, a bit mask) is saved. Backward
with m = keep / (1 - p):

    dropout:               dx = dy * m
    bias_dropout_residual: dx = dy * m,  db = sum_rows(dx),  dr = dy
    bias_act_dropout:      dx = dy * m * act'(x + b),  db = sum_rows(dx)
    relu:                  dx = dy * [y > 0] / (1 - p)

relu's backward needs only where y > 0, which holds exactly where x + b > 0 and the element was kept: the forward
saves that as a bit mask, uint8 (..., ceil(H / 8)) as ``jnp.packbits(y > 0, axis=-1, bitorder="little")``. The
backward reads dy and one bit per element (not x, nor y, which the next GEMM keeps for its own backward), and
regenerates no mask. (An x + b that y's dtype rounds to 0 gets gradient 0: in f16, below 2**-25.)

Implementations share:
  dropout_forward(x, seed) -> y;                dropout_backward(dy, seed) -> dx
  bdr_forward(x, bias, residual, seed) -> y;    bdr_backward(dy, seed) -> (dx, dbias)
  bad_forward(x, bias, seed) -> y;              bad_backward(dy, x, bias, seed) -> (dx, dbias)
  relu_forward(x, bias, seed) -> (y, positive); relu_backward(dy, positive) -> (dx, dbias)
with dx in the activation dtype and dbias in the bias dtype; seed is None when the rate is 0.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

import ffi_kernels
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


def dropout_attributes(rate: float) -> dict[str, np.generic]:
    """FFI attributes of a kernel that drops at ``rate``: ``threshold`` (uint32, ``random.keep_threshold``) and
    ``scale`` (f32 multiplier of kept elements, rounded from ``1 / (1 - rate)`` as the XLA implementation's f32
    arithmetic rounds it), so both backends drop and scale identically. Rate 0 gives (0, 1): no dropout."""
    return {"threshold": np.uint32(random.keep_threshold(rate)), "scale": np.float32(1.0 / (1.0 - rate))}


def kernel_seed(seed: jax.Array | None) -> jax.Array:
    """The seed operand of a dropout kernel: ``seed``, or zeros (never read) when the rate is 0."""
    return jnp.zeros((2,), jnp.uint32) if seed is None else seed


def _bias_grad_outputs(dy: jax.Array, bias_dtype) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Outputs of a bias-op backward kernel: dx, dbias and the f32 (blocks, 1, H) scratch of column partials."""
    hidden = dy.shape[-1]
    partials = (ffi_kernels.column_partials(_common.rows(dy)), 1, hidden)
    return (
        jax.ShapeDtypeStruct(dy.shape, dy.dtype),
        jax.ShapeDtypeStruct((hidden,), bias_dtype),
        jax.ShapeDtypeStruct(partials, _f32),
    )


# ---- dropout ----------------------------------------------------------------------------------------------


def _dropout_forward_xla(x, seed, *, rate):
    return (x.astype(_f32) * random.dropout_multiplier(seed, x.shape, rate)).astype(x.dtype)


def _dropout_backward_xla(dy, seed, *, rate):
    return (dy.astype(_f32) * random.dropout_multiplier(seed, dy.shape, rate)).astype(dy.dtype)


def _dropout_ffi(x, seed, *, rate):
    """``x * keep / (1 - rate)`` by the ls_dropout kernel: the forward, and the backward applied to dy."""
    call = jax.ffi.ffi_call("ls_dropout", jax.ShapeDtypeStruct(x.shape, x.dtype), vmap_method="sequential")
    return call(x, seed, **dropout_attributes(rate))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dropout(x, seed, rate):
    return _dropout_fwd(x, seed, rate)[0]


def _dropout_fwd(x, seed, rate):
    forward_xla = functools.partial(_dropout_forward_xla, rate=rate)
    forward_ffi = functools.partial(_dropout_ffi, rate=rate)
    return _common.dispatch("dropout", forward_xla, forward_ffi, (x, seed)), seed


def _dropout_bwd(rate, seed, dy):
    backward_xla = functools.partial(_dropout_backward_xla, rate=rate)
    backward_ffi = functools.partial(_dropout_ffi, rate=rate)
    return _common.dispatch("dropout", backward_xla, backward_ffi, (dy, seed)), None


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
    x, seed = _common.vary_together(x, seed)
    return _dropout(x, seed, float(rate))


# ---- bias + dropout + residual ----------------------------------------------------------------------------


def bdr_forward_xla(x, bias, residual, seed, *, rate):
    z = (x.astype(_f32) + bias.astype(_f32)) * random.dropout_multiplier(seed, x.shape, rate)
    return (residual.astype(_f32) + z).astype(x.dtype)


def bdr_backward_xla(dy, seed, *, rate, bias_dtype):
    dx = dy.astype(_f32) * random.dropout_multiplier(seed, dy.shape, rate)
    return dx.astype(dy.dtype), _row_sum(dx).astype(bias_dtype)


def _bdr_forward_ffi(x, bias, residual, seed, *, rate):
    call = jax.ffi.ffi_call(
        "ls_bias_dropout_residual_fwd", jax.ShapeDtypeStruct(x.shape, x.dtype), vmap_method="sequential"
    )
    return call(x, bias, residual, kernel_seed(seed), **dropout_attributes(rate))


def _bdr_backward_ffi(dy, seed, *, rate, bias_dtype):
    call = jax.ffi.ffi_call(
        "ls_bias_dropout_residual_bwd", _bias_grad_outputs(dy, bias_dtype), vmap_method="sequential"
    )
    dx, dbias, _ = call(dy, kernel_seed(seed), **dropout_attributes(rate))
    return dx, dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _bias_dropout_residual(x, bias, residual, seed, rate, bias_dtype):
    return _bias_dropout_residual_fwd(x, bias, residual, seed, rate, bias_dtype)[0]


def _bias_dropout_residual_fwd(x, bias, residual, seed, rate, bias_dtype):
    forward_xla = functools.partial(bdr_forward_xla, rate=rate)
    forward_ffi = functools.partial(_bdr_forward_ffi, rate=rate)
    y = _common.dispatch("bias_dropout_residual", forward_xla, forward_ffi, (x, bias, residual, seed))
    return y, seed


def _bias_dropout_residual_bwd(rate, bias_dtype, seed, dy):
    backward_xla = functools.partial(bdr_backward_xla, rate=rate, bias_dtype=bias_dtype)
    backward_ffi = functools.partial(_bdr_backward_ffi, rate=rate, bias_dtype=bias_dtype)
    dx, dbias = _common.dispatch("bias_dropout_residual", backward_xla, backward_ffi, (dy, seed))
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
    x, bias, residual, seed = _common.vary_together(x, bias, residual, seed)
    return _bias_dropout_residual(x, bias, residual, seed, float(dropout_rate), jnp.dtype(bias.dtype))


# ---- bias + activation + dropout --------------------------------------------------------------------------


def _bad_forward_xla(x, bias, seed, *, activation, rate):
    z = activate(x.astype(_f32) + bias.astype(_f32), activation)
    return (z * random.dropout_multiplier(seed, x.shape, rate)).astype(x.dtype)


def _bad_backward_xla(dy, x, bias, seed, *, activation, rate):
    z = x.astype(_f32) + bias.astype(_f32)
    dz = dy.astype(_f32) * random.dropout_multiplier(seed, dy.shape, rate) * activation_derivative(z, activation)
    return dz.astype(x.dtype), _row_sum(dz).astype(bias.dtype)


def _relu_forward_xla(x, bias, seed, *, rate):
    y = _bad_forward_xla(x, bias, seed, activation="relu", rate=rate)
    return y, _common.pack_mask(y > 0)


def _relu_backward_xla(dy, positive, *, rate, bias_dtype):
    dz = jnp.where(_common.unpack_mask(positive, dy.shape[-1]), dy.astype(_f32) * dropout_attributes(rate)["scale"], 0.0)
    return dz.astype(dy.dtype), _row_sum(dz).astype(bias_dtype)


def _relu_forward_ffi(x, bias, seed, *, rate):
    mask = jax.ShapeDtypeStruct((*x.shape[:-1], _common.packed_width(x.shape[-1])), jnp.uint8)
    call = jax.ffi.ffi_call(
        "ls_bias_relu_dropout_fwd", (jax.ShapeDtypeStruct(x.shape, x.dtype), mask), vmap_method="sequential"
    )
    return tuple(call(x, bias, kernel_seed(seed), **dropout_attributes(rate)))


def _relu_backward_ffi(dy, positive, *, rate, bias_dtype):
    call = jax.ffi.ffi_call("ls_bias_relu_dropout_bwd", _bias_grad_outputs(dy, bias_dtype), vmap_method="sequential")
    dx, dbias, _ = call(dy, positive, scale=dropout_attributes(rate)["scale"])
    return dx, dbias


def _activation_attributes(activation: Activation, rate: float) -> dict[str, np.generic]:
    """Attributes of the bias_act_dropout kernels: dropout's plus the activation's index in ACTIVATIONS."""
    return {"activation": np.int32(ACTIVATIONS.index(activation)), **dropout_attributes(rate)}


def _bad_forward_ffi(x, bias, seed, *, activation, rate):
    call = jax.ffi.ffi_call(
        "ls_bias_act_dropout_fwd", jax.ShapeDtypeStruct(x.shape, x.dtype), vmap_method="sequential"
    )
    return call(x, bias, kernel_seed(seed), **_activation_attributes(activation, rate))


def _bad_backward_ffi(dy, x, bias, seed, *, activation, rate):
    call = jax.ffi.ffi_call("ls_bias_act_dropout_bwd", _bias_grad_outputs(dy, bias.dtype), vmap_method="sequential")
    dx, dbias, _ = call(dy, x, bias, kernel_seed(seed), **_activation_attributes(activation, rate))
    return dx, dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _bias_act_dropout(x, bias, seed, activation, rate, bias_dtype):
    return _bias_act_dropout_fwd(x, bias, seed, activation, rate, bias_dtype)[0]


def _bias_act_dropout_fwd(x, bias, seed, activation, rate, bias_dtype):
    if activation == "relu":
        forward_xla = functools.partial(_relu_forward_xla, rate=rate)
        forward_ffi = functools.partial(_relu_forward_ffi, rate=rate)
        y, positive = _common.dispatch("bias_act_dropout", forward_xla, forward_ffi, (x, bias, seed))
        return y, (positive,)
    forward_xla = functools.partial(_bad_forward_xla, activation=activation, rate=rate)
    forward_ffi = functools.partial(_bad_forward_ffi, activation=activation, rate=rate)
    y = _common.dispatch("bias_act_dropout", forward_xla, forward_ffi, (x, bias, seed))
    return y, (x, bias, seed)


def _bias_act_dropout_bwd(activation, rate, bias_dtype, res, dy):
    if activation == "relu":
        backward_xla = functools.partial(_relu_backward_xla, rate=rate, bias_dtype=bias_dtype)
        backward_ffi = functools.partial(_relu_backward_ffi, rate=rate, bias_dtype=bias_dtype)
        dx, dbias = _common.dispatch("bias_act_dropout", backward_xla, backward_ffi, (dy, *res))
        return dx, dbias, None
    x, bias, seed = res
    backward_xla = functools.partial(_bad_backward_xla, activation=activation, rate=rate)
    backward_ffi = functools.partial(_bad_backward_ffi, activation=activation, rate=rate)
    dx, dbias = _common.dispatch("bias_act_dropout", backward_xla, backward_ffi, (dy, x, bias, seed))
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
    x, bias, seed = _common.vary_together(x, bias, seed)
    return _bias_act_dropout(x, bias, seed, activation, float(dropout_rate), jnp.dtype(bias.dtype))
