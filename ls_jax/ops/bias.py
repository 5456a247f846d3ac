"""The two elementwise fusions around a Transformer GEMM that has no bias of its own (kernels: bias.cu).

    bias_dropout_residual(x, b, r)      = r + (x + b) * keep / (1 - p)
    bias_act_dropout(x, b)              = act(x + b) * keep / (1 - p),   act in relu | gelu | gelu_tanh

Shapes: x, r (..., H); b (H,). ``keep`` comes from the Philox seed (``ls_jax.ops.random``) and is regenerated
in the backward, so only the seed (and for bias_act_dropout x and b; for relu, a bit mask) is saved. Backward
with m = keep / (1 - p):

    bias_dropout_residual: dx = dy * m,  db = sum_rows(dx),  dr = dy
    bias_act_dropout:      dx = dy * m * act'(x + b),  db = sum_rows(dx)
    relu:                  dx = dy * [y > 0] / (1 - p)

relu's backward needs only where y > 0, which holds exactly where x + b > 0 and the element was kept: the forward
saves that as a bit mask, uint8 (..., ceil(H / 8)) as ``jnp.packbits(y > 0, axis=-1, bitorder="little")``. The
backward reads dy and one bit per element (not x, nor y, which the next GEMM keeps for its own backward), and
regenerates no mask. (An x + b that y's dtype rounds to 0 gets gradient 0: in f16, below 2**-25.)

Implementations (XLA here, CUDA in ffi_kernels) share these signatures:
  bias_dropout_residual_forward(x, bias, residual, seed) -> y
  bias_dropout_residual_backward(dy, seed) -> (dx, dbias)
  bias_act_dropout_forward(x, bias, seed) -> y
  bias_act_dropout_backward(dy, x, bias, seed) -> (dx, dbias)
  bias_relu_dropout_forward(x, bias, seed) -> (y, positive)
  bias_relu_dropout_backward(dy, positive) -> (dx, dbias)
with dx in the activation dtype and dbias in the bias dtype; seed is None when the rate is 0.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.ops import _common, random

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


def _bias_grad_outputs(dy: jax.Array, bias_dtype) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Outputs of a bias-op backward kernel: dx, dbias and the f32 (blocks, 1, H) scratch of column partials."""
    hidden = dy.shape[-1]
    partials = (_common.column_partials(_common.rows(dy)), 1, hidden)
    return (
        jax.ShapeDtypeStruct(dy.shape, dy.dtype),
        jax.ShapeDtypeStruct((hidden,), bias_dtype),
        jax.ShapeDtypeStruct(partials, _f32),
    )


def _check_bias(x: jax.Array, bias: jax.Array) -> None:
    _common.check_activation("x", x)
    _common.check_param("bias", bias, (x.shape[-1],), x.dtype)


# ---- bias + dropout + residual ----------------------------------------------------------------------------


def bias_dropout_residual_forward_xla(x, bias, residual, seed, *, rate):
    z = (x.astype(_f32) + bias.astype(_f32)) * random.dropout_multiplier(seed, x.shape, rate)
    return (residual.astype(_f32) + z).astype(x.dtype)


def bias_dropout_residual_backward_xla(dy, seed, *, rate, bias_dtype):
    dx = dy.astype(_f32) * random.dropout_multiplier(seed, dy.shape, rate)
    return dx.astype(dy.dtype), _row_sum(dx).astype(bias_dtype)


def _bias_dropout_residual_forward_ffi(x, bias, residual, seed, *, rate):
    call = jax.ffi.ffi_call(
        "ls_bias_dropout_residual_fwd", jax.ShapeDtypeStruct(x.shape, x.dtype), vmap_method="sequential"
    )
    return call(x, bias, residual, random.seed_operand(seed), **random.dropout_attributes(rate))


def _bias_dropout_residual_backward_ffi(dy, seed, *, rate, bias_dtype):
    call = jax.ffi.ffi_call(
        "ls_bias_dropout_residual_bwd", _bias_grad_outputs(dy, bias_dtype), vmap_method="sequential"
    )
    dx, dbias, _ = call(dy, random.seed_operand(seed), **random.dropout_attributes(rate))
    return dx, dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _bias_dropout_residual(x, bias, residual, seed, rate, bias_dtype):
    return _bias_dropout_residual_fwd(x, bias, residual, seed, rate, bias_dtype)[0]


def _bias_dropout_residual_fwd(x, bias, residual, seed, rate, bias_dtype):
    forward_xla = functools.partial(bias_dropout_residual_forward_xla, rate=rate)
    forward_ffi = functools.partial(_bias_dropout_residual_forward_ffi, rate=rate)
    y = _common.dispatch("bias_dropout_residual", forward_xla, forward_ffi, (x, bias, residual, seed))
    return y, seed


def _bias_dropout_residual_bwd(rate, bias_dtype, seed, dy):
    backward_xla = functools.partial(bias_dropout_residual_backward_xla, rate=rate, bias_dtype=bias_dtype)
    backward_ffi = functools.partial(_bias_dropout_residual_backward_ffi, rate=rate, bias_dtype=bias_dtype)
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
      dropout_rate, seed: as in ``ls_jax.ops.dropout``.
    """
    _check_bias(x, bias)
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {residual.shape} but x has {x.shape}; they must match")
    _common.check_same_dtype("residual", residual, "x", x)
    _common.check_dropout(dropout_rate, seed)
    if dropout_rate == 0.0:
        seed = None
    x, bias, residual, seed = _common.vary_together(x, bias, residual, seed)
    return _bias_dropout_residual(x, bias, residual, seed, float(dropout_rate), jnp.dtype(bias.dtype))


# ---- bias + activation + dropout --------------------------------------------------------------------------


def _bias_act_dropout_forward_xla(x, bias, seed, *, activation, rate):
    z = activate(x.astype(_f32) + bias.astype(_f32), activation)
    return (z * random.dropout_multiplier(seed, x.shape, rate)).astype(x.dtype)


def _bias_act_dropout_backward_xla(dy, x, bias, seed, *, activation, rate):
    z = x.astype(_f32) + bias.astype(_f32)
    dz = dy.astype(_f32) * random.dropout_multiplier(seed, dy.shape, rate) * activation_derivative(z, activation)
    return dz.astype(x.dtype), _row_sum(dz).astype(bias.dtype)


def _bias_relu_dropout_forward_xla(x, bias, seed, *, rate):
    y = _bias_act_dropout_forward_xla(x, bias, seed, activation="relu", rate=rate)
    return y, _common.pack_mask(y > 0)


def _bias_relu_dropout_backward_xla(dy, positive, *, rate, bias_dtype):
    scale = random.dropout_attributes(rate)["scale"]
    dz = jnp.where(_common.unpack_mask(positive, dy.shape[-1]), dy.astype(_f32) * scale, 0.0)
    return dz.astype(dy.dtype), _row_sum(dz).astype(bias_dtype)


def _bias_relu_dropout_forward_ffi(x, bias, seed, *, rate):
    mask = jax.ShapeDtypeStruct((*x.shape[:-1], _common.packed_width(x.shape[-1])), jnp.uint8)
    call = jax.ffi.ffi_call(
        "ls_bias_relu_dropout_fwd", (jax.ShapeDtypeStruct(x.shape, x.dtype), mask), vmap_method="sequential"
    )
    return tuple(call(x, bias, random.seed_operand(seed), **random.dropout_attributes(rate)))


def _bias_relu_dropout_backward_ffi(dy, positive, *, rate, bias_dtype):
    call = jax.ffi.ffi_call("ls_bias_relu_dropout_bwd", _bias_grad_outputs(dy, bias_dtype), vmap_method="sequential")
    dx, dbias, _ = call(dy, positive, scale=random.dropout_attributes(rate)["scale"])
    return dx, dbias


def _activation_attributes(activation: Activation, rate: float) -> dict[str, np.generic]:
    """Attributes of the bias_act_dropout kernels: dropout's plus the activation's index in ACTIVATIONS."""
    return {"activation": np.int32(ACTIVATIONS.index(activation)), **random.dropout_attributes(rate)}


def _bias_act_dropout_forward_ffi(x, bias, seed, *, activation, rate):
    call = jax.ffi.ffi_call("ls_bias_act_dropout_fwd", jax.ShapeDtypeStruct(x.shape, x.dtype), vmap_method="sequential")
    return call(x, bias, random.seed_operand(seed), **_activation_attributes(activation, rate))


def _bias_act_dropout_backward_ffi(dy, x, bias, seed, *, activation, rate):
    call = jax.ffi.ffi_call("ls_bias_act_dropout_bwd", _bias_grad_outputs(dy, bias.dtype), vmap_method="sequential")
    dx, dbias, _ = call(dy, x, bias, random.seed_operand(seed), **_activation_attributes(activation, rate))
    return dx, dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _bias_act_dropout(x, bias, seed, activation, rate, bias_dtype):
    return _bias_act_dropout_fwd(x, bias, seed, activation, rate, bias_dtype)[0]


def _bias_act_dropout_fwd(x, bias, seed, activation, rate, bias_dtype):
    if activation == "relu":
        forward_xla = functools.partial(_bias_relu_dropout_forward_xla, rate=rate)
        forward_ffi = functools.partial(_bias_relu_dropout_forward_ffi, rate=rate)
        y, positive = _common.dispatch("bias_act_dropout", forward_xla, forward_ffi, (x, bias, seed))
        return y, (positive,)
    forward_xla = functools.partial(_bias_act_dropout_forward_xla, activation=activation, rate=rate)
    forward_ffi = functools.partial(_bias_act_dropout_forward_ffi, activation=activation, rate=rate)
    y = _common.dispatch("bias_act_dropout", forward_xla, forward_ffi, (x, bias, seed))
    return y, (x, bias, seed)


def _bias_act_dropout_bwd(activation, rate, bias_dtype, res, dy):
    if activation == "relu":
        backward_xla = functools.partial(_bias_relu_dropout_backward_xla, rate=rate, bias_dtype=bias_dtype)
        backward_ffi = functools.partial(_bias_relu_dropout_backward_ffi, rate=rate, bias_dtype=bias_dtype)
        dx, dbias = _common.dispatch("bias_act_dropout", backward_xla, backward_ffi, (dy, *res))
        return dx, dbias, None
    x, bias, seed = res
    backward_xla = functools.partial(_bias_act_dropout_backward_xla, activation=activation, rate=rate)
    backward_ffi = functools.partial(_bias_act_dropout_backward_ffi, activation=activation, rate=rate)
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
      dropout_rate, seed: as in ``ls_jax.ops.dropout``.
    """
    _check_bias(x, bias)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    _common.check_dropout(dropout_rate, seed)
    if dropout_rate == 0.0:
        seed = None
    x, bias, seed = _common.vary_together(x, bias, seed)
    return _bias_act_dropout(x, bias, seed, activation, float(dropout_rate), jnp.dtype(bias.dtype))
