"""LayerNorm over the last axis, with an optional fused residual add (and bias + dropout before it).

    s = x,  or  s = x + residual,  or  s = residual + dropout(x + bias)
    y = (s - mean(s)) * rstd * gamma + beta,   rstd = 1 / sqrt(var(s) + eps)

Shapes: x, residual (..., H); gamma, beta (H,). Statistics are f32. Residuals saved for the backward:
s (activation dtype), mean and rstd (f32, one per row) and gamma. The backward is

    xhat = (s - mean) * rstd,  g = dy * gamma
    dgamma = sum_rows(dy * xhat),  dbeta = sum_rows(dy)
    ds = rstd * (g - mean(g) - xhat * mean(g * xhat))  (+ dsum, the cotangent of s when s is returned)

s is returned with a residual, and without one on request (``return_input``): a pre-LN sublayer adds its input
to its output, and the backward kernel then adds that path's cotangent instead of a separate XLA add.

The third form is ``ops.bias_dropout_residual`` (one sublayer's tail) and the next sublayer's LayerNorm in one
kernel each way: s is bias_dropout_residual's output to the bit, and the backward also returns that op's
gradients, dx = round(ds) * keep / (1 - p) and dbias = sum_rows(dx), with dresidual = ds. Against the two ops
it saves the read of s forward and the read of ds backward (4 passes over (..., H) instead of 5, and 5 of 6).

Implementations (XLA here, CUDA in ffi_kernels) share these signatures:
  forward(x, gamma, beta) -> (y, mean, rstd)
  add_forward(x, residual, gamma, beta) -> (y, s, mean, rstd)
  backward(dy, s, mean, rstd, gamma) -> (ds, dgamma, dbeta)
  add_backward(dy, dsum, s, mean, rstd, gamma) -> (ds, dgamma, dbeta)
  bias_dropout_residual_forward(x, bias, residual, gamma, beta, seed) -> (y, s, mean, rstd)
  bias_dropout_residual_backward(dy, dsum, s, mean, rstd, gamma, seed) -> (ds, dx, dgamma, dbeta, dbias)
with ds, dx in the activation dtype and dgamma, dbeta, dbias in gamma's dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.ops import _common, random
from ls_jax.ops.bias import bias_dropout_residual_backward_xla, bias_dropout_residual_forward_xla

_f32 = jnp.float32
MAX_KERNEL_HIDDEN = 8192


def _normalize(s: jax.Array, gamma: jax.Array, beta: jax.Array, eps: float):
    s32 = s.astype(_f32)
    mean = jnp.mean(s32, axis=-1)
    centered = s32 - mean[..., None]
    rstd = jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1) + eps)
    y = centered * rstd[..., None] * gamma.astype(_f32) + beta.astype(_f32)
    return y.astype(s.dtype), mean, rstd


def _forward_xla(x, gamma, beta, *, eps):
    return _normalize(x, gamma, beta, eps)


def _add_forward_xla(x, residual, gamma, beta, *, eps):
    s = x + residual
    y, mean, rstd = _normalize(s, gamma, beta, eps)
    return y, s, mean, rstd


def _grads_f32(dy, s, mean, rstd, gamma):
    dy32 = dy.astype(_f32)
    xhat = (s.astype(_f32) - mean[..., None]) * rstd[..., None]
    g = dy32 * gamma.astype(_f32)
    ds = rstd[..., None] * (g - jnp.mean(g, axis=-1, keepdims=True) - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))
    row_axes = tuple(range(dy.ndim - 1))
    return ds, jnp.sum(dy32 * xhat, axis=row_axes), jnp.sum(dy32, axis=row_axes)


def _backward_xla(dy, s, mean, rstd, gamma):
    ds, dgamma, dbeta = _grads_f32(dy, s, mean, rstd, gamma)
    return ds.astype(s.dtype), dgamma.astype(gamma.dtype), dbeta.astype(gamma.dtype)


def _add_backward_xla(dy, dsum, s, mean, rstd, gamma):
    ds, dgamma, dbeta = _grads_f32(dy, s, mean, rstd, gamma)
    ds = ds + dsum.astype(_f32)
    return ds.astype(s.dtype), dgamma.astype(gamma.dtype), dbeta.astype(gamma.dtype)


def _forward_ffi(x, gamma, beta, *, eps):
    stats = jax.ShapeDtypeStruct(x.shape[:-1], _f32)
    call = jax.ffi.ffi_call(
        "ls_layer_norm_fwd", (jax.ShapeDtypeStruct(x.shape, x.dtype), stats, stats), vmap_method="sequential"
    )
    return call(x, gamma, beta, eps=np.float32(eps))


def _add_forward_ffi(x, residual, gamma, beta, *, eps):
    activation = jax.ShapeDtypeStruct(x.shape, x.dtype)
    stats = jax.ShapeDtypeStruct(x.shape[:-1], _f32)
    call = jax.ffi.ffi_call("ls_layer_norm_add_fwd", (activation, activation, stats, stats), vmap_method="sequential")
    return call(x, residual, gamma, beta, eps=np.float32(eps))


def _partials(s: jax.Array, outputs: int) -> jax.ShapeDtypeStruct:
    """The f32 (blocks, outputs, H) scratch of a backward kernel's column sums."""
    return jax.ShapeDtypeStruct((_common.column_partials(_common.rows(s)), outputs, s.shape[-1]), _f32)


def _backward_call(target: str, s: jax.Array, gamma: jax.Array):
    """The backward kernel: returns (ds, dgamma, dbeta, partials), the last an f32 (blocks, 2, H) scratch."""
    param = jax.ShapeDtypeStruct(gamma.shape, gamma.dtype)
    return jax.ffi.ffi_call(
        target, (jax.ShapeDtypeStruct(s.shape, s.dtype), param, param, _partials(s, 2)), vmap_method="sequential"
    )


def _backward_ffi(dy, s, mean, rstd, gamma):
    ds, dgamma, dbeta, _ = _backward_call("ls_layer_norm_bwd", s, gamma)(dy, s, mean, rstd, gamma)
    return ds, dgamma, dbeta


def _add_backward_ffi(dy, dsum, s, mean, rstd, gamma):
    ds, dgamma, dbeta, _ = _backward_call("ls_layer_norm_add_bwd", s, gamma)(dy, dsum, s, mean, rstd, gamma)
    return ds, dgamma, dbeta


def _bias_dropout_residual_layer_norm_forward_xla(x, bias, residual, gamma, beta, seed, *, eps, rate):
    s = bias_dropout_residual_forward_xla(x, bias, residual, seed, rate=rate)
    y, mean, rstd = _normalize(s, gamma, beta, eps)
    return y, s, mean, rstd


def _bias_dropout_residual_layer_norm_backward_xla(dy, dsum, s, mean, rstd, gamma, seed, *, rate):
    ds, dgamma, dbeta = _add_backward_xla(dy, dsum, s, mean, rstd, gamma)
    dx, dbias = bias_dropout_residual_backward_xla(ds, seed, rate=rate, bias_dtype=gamma.dtype)
    return ds, dx, dgamma, dbeta, dbias


def _bias_dropout_residual_layer_norm_forward_ffi(x, bias, residual, gamma, beta, seed, *, eps, rate):
    activation = jax.ShapeDtypeStruct(x.shape, x.dtype)
    stats = jax.ShapeDtypeStruct(x.shape[:-1], _f32)
    call = jax.ffi.ffi_call(
        "ls_bias_dropout_residual_layer_norm_fwd", (activation, activation, stats, stats), vmap_method="sequential"
    )
    operands = (x, bias, residual, gamma, beta, random.seed_operand(seed))
    return call(*operands, eps=np.float32(eps), **random.dropout_attributes(rate))


def _bias_dropout_residual_layer_norm_backward_ffi(dy, dsum, s, mean, rstd, gamma, seed, *, rate):
    activation = jax.ShapeDtypeStruct(s.shape, s.dtype)
    param = jax.ShapeDtypeStruct(gamma.shape, gamma.dtype)
    call = jax.ffi.ffi_call(
        "ls_bias_dropout_residual_layer_norm_bwd",
        (activation, activation, param, param, param, _partials(s, 3)),
        vmap_method="sequential",
    )
    *grads, _ = call(dy, dsum, s, mean, rstd, gamma, random.seed_operand(seed), **random.dropout_attributes(rate))
    return tuple(grads)


def _unsupported(x: jax.Array) -> str | None:
    if x.shape[-1] > MAX_KERNEL_HIDDEN:
        return f"hidden size {x.shape[-1]} exceeds the kernel limit of {MAX_KERNEL_HIDDEN}"
    if x.shape[-1] == 0:
        return "hidden size 0"
    return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm(x, gamma, beta, eps):
    return _layer_norm_fwd(x, gamma, beta, eps)[0]


def _layer_norm_fwd(x, gamma, beta, eps):
    forward_xla = functools.partial(_forward_xla, eps=eps)
    forward_ffi = functools.partial(_forward_ffi, eps=eps)
    y, mean, rstd = _common.dispatch("layer_norm", forward_xla, forward_ffi, (x, gamma, beta), _unsupported(x))
    return y, (x, mean, rstd, gamma)


def _layer_norm_bwd(eps, res, dy):
    s, mean, rstd, gamma = res
    return _common.dispatch("layer_norm", _backward_xla, _backward_ffi, (dy, s, mean, rstd, gamma), _unsupported(s))


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def _add_backward(res, dy, dsum):
    s, mean, rstd, gamma = res
    return _common.dispatch(
        "layer_norm", _add_backward_xla, _add_backward_ffi, (dy, dsum, s, mean, rstd, gamma), _unsupported(s)
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm_and_input(x, gamma, beta, eps):
    return _layer_norm_and_input_fwd(x, gamma, beta, eps)[0]


def _layer_norm_and_input_fwd(x, gamma, beta, eps):
    y, res = _layer_norm_fwd(x, gamma, beta, eps)
    return (y, x), res


def _layer_norm_and_input_bwd(eps, res, cotangents):
    return _add_backward(res, *cotangents)


_layer_norm_and_input.defvjp(_layer_norm_and_input_fwd, _layer_norm_and_input_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _add_layer_norm(x, residual, gamma, beta, eps):
    return _add_layer_norm_fwd(x, residual, gamma, beta, eps)[0]


def _add_layer_norm_fwd(x, residual, gamma, beta, eps):
    forward_xla = functools.partial(_add_forward_xla, eps=eps)
    forward_ffi = functools.partial(_add_forward_ffi, eps=eps)
    y, s, mean, rstd = _common.dispatch(
        "layer_norm", forward_xla, forward_ffi, (x, residual, gamma, beta), _unsupported(x)
    )
    return (y, s), (s, mean, rstd, gamma)


def _add_layer_norm_bwd(eps, res, cotangents):
    ds, dgamma, dbeta = _add_backward(res, *cotangents)
    return ds, ds, dgamma, dbeta


_add_layer_norm.defvjp(_add_layer_norm_fwd, _add_layer_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _bias_dropout_residual_layer_norm(x, bias, residual, gamma, beta, seed, eps, rate):
    return _bias_dropout_residual_layer_norm_fwd(x, bias, residual, gamma, beta, seed, eps, rate)[0]


def _bias_dropout_residual_layer_norm_fwd(x, bias, residual, gamma, beta, seed, eps, rate):
    forward_xla = functools.partial(_bias_dropout_residual_layer_norm_forward_xla, eps=eps, rate=rate)
    forward_ffi = functools.partial(_bias_dropout_residual_layer_norm_forward_ffi, eps=eps, rate=rate)
    y, s, mean, rstd = _common.dispatch(
        "layer_norm", forward_xla, forward_ffi, (x, bias, residual, gamma, beta, seed), _unsupported(x)
    )
    return (y, s), (s, mean, rstd, gamma, seed)


def _bias_dropout_residual_layer_norm_bwd(eps, rate, res, cotangents):
    s, mean, rstd, gamma, seed = res
    backward_xla = functools.partial(_bias_dropout_residual_layer_norm_backward_xla, rate=rate)
    backward_ffi = functools.partial(_bias_dropout_residual_layer_norm_backward_ffi, rate=rate)
    ds, dx, dgamma, dbeta, dbias = _common.dispatch(
        "layer_norm", backward_xla, backward_ffi, (*cotangents, s, mean, rstd, gamma, seed), _unsupported(s)
    )
    return dx, dbias, ds, dgamma, dbeta, None


_bias_dropout_residual_layer_norm.defvjp(_bias_dropout_residual_layer_norm_fwd, _bias_dropout_residual_layer_norm_bwd)


def layer_norm(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array,
    *,
    eps: float = 1e-5,
    residual: jax.Array | None = None,
    bias: jax.Array | None = None,
    dropout_rate: float = 0.0,
    seed: jax.Array | None = None,
    return_input: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """LayerNorm of ``x``, of ``x + residual``, or of ``residual + dropout(x + bias)``, over the last axis.

    Args:
      x: activations (..., H) in f32, bf16 or f16.
      gamma, beta: scale and shift (H,), both f32 or both x's dtype.
      eps: added to the variance.
      residual: optional (..., H) of x's dtype, added to x before normalizing.
      bias, dropout_rate, seed: with ``residual``, normalize ``residual + dropout(x + bias)`` instead
        (``ops.bias_dropout_residual`` and this LayerNorm in one kernel): bias (H,) of gamma's dtype (zeros
        when only dropout is asked for), dropout_rate and seed as in ``ops.dropout``.
      return_input: without ``residual``, also return ``x``: use that copy where x is needed again (a pre-LN
        residual) and the backward adds its cotangent to the LayerNorm gradient in the same kernel.

    Returns:
      ``y`` of x's shape and dtype; with ``residual``, the pair ``(y, s)`` of y and the normalized sum s; with
      ``return_input``, the pair ``(y, x)``.
    """
    _common.check_activation("x", x)
    hidden = x.shape[-1]
    _common.check_param("gamma", gamma, (hidden,), x.dtype)
    _common.check_param("beta", beta, (hidden,), x.dtype)
    _common.check_same_dtype("beta", beta, "gamma", gamma)
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    _common.check_dropout(dropout_rate, seed)
    fused_tail = bias is not None or dropout_rate > 0.0
    if residual is None:
        if fused_tail:
            raise ValueError("bias and dropout_rate need a residual: they normalize residual + dropout(x + bias)")
    else:
        if return_input:
            raise ValueError("return_input applies without a residual; with one, the sum x + residual is returned")
        if residual.shape != x.shape:
            raise ValueError(f"residual has shape {residual.shape} but x has {x.shape}; they must match")
        _common.check_same_dtype("residual", residual, "x", x)
    if fused_tail:
        bias = jnp.zeros((hidden,), gamma.dtype) if bias is None else bias
        _common.check_param("bias", bias, (hidden,), x.dtype)
        _common.check_same_dtype("bias", bias, "gamma", gamma)
    seed = seed if dropout_rate > 0.0 else None
    x, gamma, beta, residual, bias, seed = _common.vary_together(x, gamma, beta, residual, bias, seed)
    if residual is None:
        if return_input:
            return _layer_norm_and_input(x, gamma, beta, float(eps))
        return _layer_norm(x, gamma, beta, float(eps))
    if not fused_tail:
        return _add_layer_norm(x, residual, gamma, beta, float(eps))
    return _bias_dropout_residual_layer_norm(x, bias, residual, gamma, beta, seed, float(eps), float(dropout_rate))
