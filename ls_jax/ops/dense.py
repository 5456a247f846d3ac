"""The GEMM of a dense layer, with the weight gradient accumulated and written in f32 by the GEMM itself.

    y  = x W + b                            in ``dtype`` (x, W and b are cast to it first)
    dx = dy W^T                             in ``dtype``
    dW = x^T dy,   db = sum_rows(dy)        in f32, then W's and b's dtype

Shapes: x (..., *in), W (*in, *out) or, with ``transposed_kernel``, (*out, *in) (a tied embedding table used as
the output projection), b (*out), y (..., *out). The GEMM runs on x flattened to (rows, prod(in)).

Autodiff of ``x @ W.astype(dtype)`` would write dW in ``dtype`` and convert it to f32 in a separate pass over
every weight (the f32 parameters' gradients), rounding it to bf16 on the way. Here the GEMM's f32 accumulator is
the gradient: no convert pass and no rounding. The op is plain XLA on every platform.

``relu_dropout_dense`` is the feed-forward block's middle and second GEMM as one op:

    y  = dropout(relu(x + c)) W             x (rows, F) the first GEMM's output, c (F), W (F, N)
    dh = dy W^T * [y > 0] / (1 - p)         dc = sum_rows(dh),   dW = relu_out^T dy in f32

The forward is ``bias_act_dropout``'s relu kernel, which saves the bit mask of relu_out > 0, and an XLA GEMM.
On CUDA the backward's first GEMM applies the mask, the dropout scale and the bias gradient in its epilogue
(cuBLASLt DRELU_BGRAD, ``ls_dense_relu_grad``), so relu's backward reads and writes nothing of its own; dc is
then rounded to x's dtype before it takes c's, as cuBLASLt writes it in the GEMM's output type. F must be a
multiple of 128 and x bf16 or f16 for that; otherwise the GEMM and relu's backward kernel run apart.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from ls_jax.ops import _common, dropout

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
        raise ValueError(f"x's last {input_axes} axes {x.shape[x.ndim - input_axes:]} must be the kernel's {in_shape}")
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


# ---- dropout(relu(x + c)) W --------------------------------------------------------------------------------

# cuBLASLt's scratch for one fused backward GEMM (NVIDIA's recommendation for Hopper).
_LT_WORKSPACE_BYTES = 32 * 2**20
_LT_MASK_COLUMNS = 128  # cuBLASLt: a ReLU bit-mask's leading dimension, in bits


def _relu_input_grad(d_out, kernel):
    """dy W^T: the (rows, F) gradient of the relu output."""
    return jax.lax.dot_general(d_out, kernel, (((1,), (1,)), ((), ())))


def _relu_grad_xla(d_out, kernel, positive, *, rate, bias_dtype):
    return dropout.relu_backward_xla(_relu_input_grad(d_out, kernel), positive, rate=rate, bias_dtype=bias_dtype)


def fused_relu_grad_unsupported(dtype: Any, hidden: int) -> str | None:
    """Why the backward GEMM cannot apply relu's mask in its epilogue for this dtype and F, or None."""
    if jnp.dtype(dtype) not in _common.LOW_PRECISION_DTYPES:
        return f"the epilogue GEMM takes bfloat16 or float16, got {jnp.dtype(dtype)}"
    if hidden % _LT_MASK_COLUMNS:
        return f"the epilogue GEMM takes F a multiple of {_LT_MASK_COLUMNS} (cuBLASLt's bit-mask), got {hidden}"
    return None


def _relu_grad_ffi(d_out, kernel, positive, *, rate, bias_dtype):
    hidden = kernel.shape[0]
    reason = fused_relu_grad_unsupported(d_out.dtype, hidden)
    if reason is not None:
        _common.log_fallback_once("relu_dropout_dense", reason, "the GEMM and relu's backward kernel apart")
        return dropout.relu_backward_ffi(_relu_input_grad(d_out, kernel), positive, rate=rate, bias_dtype=bias_dtype)
    outputs = (
        jax.ShapeDtypeStruct((d_out.shape[0], hidden), d_out.dtype),
        jax.ShapeDtypeStruct((hidden,), d_out.dtype),
        jax.ShapeDtypeStruct((_LT_WORKSPACE_BYTES,), jnp.uint8),
    )
    call = jax.ffi.ffi_call("ls_dense_relu_grad", outputs, vmap_method="sequential")
    dh, d_bias, _ = call(d_out, kernel, positive, scale=dropout.dropout_attributes(rate)["scale"])
    return dh, d_bias.astype(bias_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _relu_dropout_gemm(x, act_bias, kernel, seed, rate, param_dtypes):
    return _relu_dropout_gemm_fwd(x, act_bias, kernel, seed, rate, param_dtypes)[0]


def _relu_dropout_gemm_fwd(x, act_bias, kernel, seed, rate, param_dtypes):
    del param_dtypes
    hidden, positive = dropout.relu_forward(x, act_bias, seed, rate=rate)
    compute_kernel = kernel.astype(x.dtype)
    y = jax.lax.dot_general(hidden, compute_kernel, (((1,), (0,)), ((), ())))
    return y, (hidden, positive, compute_kernel)


def _relu_dropout_gemm_bwd(rate, param_dtypes, residuals, d_out):
    hidden, positive, kernel = residuals
    kernel_dtype, act_bias_dtype = param_dtypes
    grad_xla = functools.partial(_relu_grad_xla, rate=rate, bias_dtype=act_bias_dtype)
    grad_ffi = functools.partial(_relu_grad_ffi, rate=rate, bias_dtype=act_bias_dtype)
    dx, d_act_bias = _common.dispatch("relu_dropout_dense", grad_xla, grad_ffi, (d_out, kernel, positive))
    d_kernel = jax.lax.dot_general(hidden, d_out, (((0,), (0,)), ((), ())), preferred_element_type=_f32)
    return dx, d_act_bias, d_kernel.astype(kernel_dtype), None


_relu_dropout_gemm.defvjp(_relu_dropout_gemm_fwd, _relu_dropout_gemm_bwd)


def relu_dropout_dense(
    x: jax.Array,
    act_bias: jax.Array,
    kernel: jax.Array,
    *,
    dropout_rate: float = 0.0,
    seed: jax.Array | None = None,
) -> jax.Array:
    """``dropout(relu(x + act_bias)) @ kernel`` in x's dtype (see the module docstring).

    Args:
      x: (..., F) the first GEMM's output (no bias), f32, bf16 or f16.
      act_bias: (F,), f32 or x's dtype.
      kernel: (F, N), f32 or x's dtype.
      dropout_rate, seed: as in ``ls_jax.ops.dropout``.

    Returns:
      (..., N) in x's dtype.
    """
    _common.check_activation("x", x)
    hidden = x.shape[-1]
    _common.check_param("act_bias", act_bias, (hidden,), x.dtype)
    _common.check_activation("kernel", kernel)
    if kernel.ndim != 2 or kernel.shape[0] != hidden:
        raise ValueError(f"kernel must have shape ({hidden}, N) for x of shape {x.shape}, got {kernel.shape}")
    _common.check_param("kernel", kernel, kernel.shape, x.dtype)
    _common.check_dropout(dropout_rate, seed)
    if dropout_rate == 0.0:
        seed = None
    x, act_bias, kernel, seed = _common.vary_together(x, act_bias, kernel, seed)
    param_dtypes = (jnp.dtype(kernel.dtype), jnp.dtype(act_bias.dtype))
    y = _relu_dropout_gemm(x.reshape(-1, hidden), act_bias, kernel, seed, float(dropout_rate), param_dtypes)
    return y.reshape(*x.shape[:-1], kernel.shape[1])
