"""The GEMM of a dense layer, with the weight gradient accumulated and written in f32 by the GEMM itself.

    y  = x W + b                            in ``dtype`` (x, W and b are cast to it first)
    dx = dy W^T                             in ``dtype``
    dW = x^T dy,   db = sum_rows(dy)        in f32, then W's and b's dtype

Shapes: x (..., *in), W (*in, *out) or, with ``transposed_kernel``, (*out, *in) (a tied embedding table used as
the output projection), b (*out), y (..., *out). The GEMM runs on x flattened to (rows, prod(in)).

Autodiff of ``x @ W.astype(dtype)`` would write dW in ``dtype`` and convert it to f32 in a separate pass over
every weight (the f32 parameters' gradients), rounding it to bf16 on the way. Here the GEMM's f32 accumulator is
the gradient: no convert pass and no rounding. The op is plain XLA on every platform.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from ls_jax.ops import _common

_f32 = jnp.float32


def _kernel_dims(transposed: bool) -> tuple[int, int]:
    """(contracting axis, output axis) of the 2-D kernel."""
    return (1, 0) if transposed else (0, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gemm(x, kernel, bias, transposed, dtype, param_dtypes):
    return _gemm_fwd(x, kernel, bias, transposed, dtype, param_dtypes)[0]


def _gemm_fwd(x, kernel, bias, transposed, dtype, param_dtypes):
    del param_dtypes
    compute_kernel = kernel.astype(dtype)
    contract, _ = _kernel_dims(transposed)
    y = jax.lax.dot_general(x, compute_kernel, (((1,), (contract,)), ((), ())))
    if bias is not None:
        y = y + bias.astype(dtype)
    return y, (x, compute_kernel)


def _gemm_bwd(transposed, dtype, param_dtypes, residuals, dy):
    x, kernel = residuals
    kernel_dtype, bias_dtype = param_dtypes
    _, out_axis = _kernel_dims(transposed)
    dx = jax.lax.dot_general(dy, kernel, (((1,), (out_axis,)), ((), ())))
    if transposed:
        d_kernel = jax.lax.dot_general(dy, x, (((0,), (0,)), ((), ())), preferred_element_type=_f32)
    else:
        d_kernel = jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())), preferred_element_type=_f32)
    d_kernel = d_kernel.astype(kernel_dtype)
    if transposed:
        # A tied table's dy is the (tokens, V) logits gradient, the step's largest buffer. XLA schedules d_kernel
        # next to the table's other gradient, after the whole decoder backward, and keeps dy alive until then;
        # dx waiting for d_kernel frees dy before the decoder backward starts.
        dx, d_kernel = jax.lax.optimization_barrier((dx, d_kernel))
    d_bias = None if bias_dtype is None else jnp.sum(dy, axis=0, dtype=_f32).astype(bias_dtype)
    return dx, d_kernel, d_bias


_gemm.defvjp(_gemm_fwd, _gemm_bwd)


def dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    *,
    input_axes: int = 1,
    transposed_kernel: bool = False,
    dtype: Any = None,
) -> jax.Array:
    """``x W + b`` over x's last ``input_axes`` axes (see the module docstring).

    Args:
      x: (..., *in) activations.
      kernel: (*in, *out), or (*out, *in) with ``transposed_kernel``; f32 or ``dtype``.
      bias: optional (*out).
      input_axes: how many trailing axes of x the GEMM contracts (the kernel's leading ones, or trailing ones
        when transposed).
      transposed_kernel: the kernel's contracted axes come last.
      dtype: compute and output dtype; x's dtype when None.

    Returns:
      (..., *out) in ``dtype``.
    """
    _common.check_activation("x", x)
    _common.check_activation("kernel", kernel)
    dtype = jnp.dtype(x.dtype if dtype is None else dtype)
    if dtype not in _common.ACTIVATION_DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    if not 1 <= input_axes < kernel.ndim or input_axes > x.ndim:
        raise ValueError(
            f"input_axes must be in [1, kernel.ndim) and at most x.ndim, got {input_axes} for kernel {kernel.shape} "
            f"and x {x.shape}"
        )
    split = kernel.ndim - input_axes if transposed_kernel else input_axes
    in_shape = kernel.shape[split:] if transposed_kernel else kernel.shape[:split]
    out_shape = kernel.shape[:split] if transposed_kernel else kernel.shape[split:]
    if tuple(x.shape[x.ndim - input_axes :]) != tuple(in_shape):
        raise ValueError(f"x's last {input_axes} axes {x.shape[x.ndim - input_axes :]} must be the kernel's {in_shape}")
    if bias is not None:
        _common.check_activation("bias", bias)
        if tuple(bias.shape) != tuple(out_shape):
            raise ValueError(f"bias must have shape {tuple(out_shape)}, got {tuple(bias.shape)}")
        bias = bias.reshape(-1)
    fan_in, fan_out = math.prod(in_shape), math.prod(out_shape)
    kernel_2d = kernel.reshape((fan_out, fan_in) if transposed_kernel else (fan_in, fan_out))
    batch_shape = x.shape[: x.ndim - input_axes]
    param_dtypes = (jnp.dtype(kernel.dtype), None if bias is None else jnp.dtype(bias.dtype))
    y = _gemm(x.reshape(-1, fan_in).astype(dtype), kernel_2d, bias, bool(transposed_kernel), dtype, param_dtypes)
    return y.reshape(*batch_shape, *out_shape)
