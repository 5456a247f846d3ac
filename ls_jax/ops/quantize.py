"""FP8 quantization for FP8 matrix products (kernel: fp8_quantize.cu).

    q     = fp8(clip(x / s, -fp8_max, fp8_max))    (rows, cols), x / s in float32
    q_t   = q transposed                           (cols, rows)
    amax  = max |x|                                float32[1]

as ``flax.linen.fp8_ops.quantize`` computes ``q`` (``s`` the tensor's scale, rounded to x's dtype; fp8_max 448 for
float8_e4m3fn and 57344 for float8_e5m2; NaN stays NaN, values beyond fp8_max saturate) and its amax update takes
``amax``. Flax rounds x / s to x's dtype, which XLA may skip inside a fusion (it allows excess precision: jitted and
eager results then differ); here the division is float32 on both backends. The kernel's division is correctly
rounded; XLA's on a GPU may be an ulp off, so a quotient on an FP8 rounding boundary can round to the neighbouring
FP8 value there. An FP8 GEMM on Hopper takes both operands with the contracted axis innermost, so the product that
contracts the rows (a weight gradient, ``q_t @ ...``) needs ``q_t``; the kernel writes both layouts and the amax
from one read of x, where XLA's fusions read x again for the amax. Quantization is a step inside an FP8 product's
forward and backward, not a function to differentiate: the op has no gradient.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ls_jax.ops import _common

FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)


def _quantize_xla(x, scale, *, dtype):
    fp8_max = jnp.finfo(dtype).max.astype(jnp.float32)
    scaled = x.astype(jnp.float32) / scale.astype(x.dtype).astype(jnp.float32)
    q = jnp.clip(scaled, -fp8_max, fp8_max).astype(dtype)
    return q, q.T, jnp.max(jnp.abs(x), initial=0).astype(jnp.float32).reshape(1)


def _quantize_ffi(x, scale, *, dtype):
    rows, cols = x.shape
    results = (
        jax.ShapeDtypeStruct((rows, cols), dtype),
        jax.ShapeDtypeStruct((cols, rows), dtype),
        jax.ShapeDtypeStruct((1,), jnp.float32),
    )
    return jax.ffi.ffi_call("ls_fp8_quantize", results, vmap_method="sequential")(x, scale)


def fp8_quantize(x: jax.Array, scale: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(q, q_t, amax)`` of ``x`` quantized to ``dtype`` by ``scale``, as the module docstring states.

    Args:
      x: (rows, cols), float32, bfloat16 or float16.
      scale: float32[1], the scale ``s`` (x / s is what FP8 holds).
      dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.

    Returns:
      q (rows, cols) and q_t (cols, rows) in ``dtype``; amax float32[1].
    """
    _common.check_activation("x", x)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D (rows, cols), got shape {x.shape}; reshape it to (-1, {x.shape[-1]}) first")
    if scale.shape != (1,) or scale.dtype != jnp.float32:
        raise ValueError(f"scale must be float32[1], got {scale.dtype}{list(scale.shape)}")
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in FP8_DTYPES]:
        raise ValueError(f"dtype must be float8_e4m3fn or float8_e5m2, got {jnp.dtype(dtype)}")
    xla = functools.partial(_quantize_xla, dtype=dtype)
    ffi = functools.partial(_quantize_ffi, dtype=dtype)
    return _common.dispatch("fp8_quantize", xla, ffi, (x, scale))
