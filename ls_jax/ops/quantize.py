"""FP8 quantization with delayed scaling, for FP8 matrix products (kernel: fp8_quantize.cu).

    s             = 1 / (fp8_max / max(history))            (1 / (1 / scale) when that maximum is 0, inf or NaN)
    q             = fp8(clip(x * (1 / s), -fp8_max, fp8_max)) (rows, cols), in float32
    q_t           = q transposed                              (cols, rows)
    next_history  = history rolled by one, max |x| in front    float32[H]

as Flax's FP8 ops compute them (``flax.linen.fp8_ops``: ``compute_scale`` gives ``s`` from the history of the steps
before, ``quantize`` gives ``q`` with ``s`` rounded to x's dtype, ``compute_amax_history`` the next history; fp8_max
448 for float8_e4m3fn and 57344 for float8_e5m2; NaN stays NaN, values beyond fp8_max saturate), but for the
quotient: Flax divides in x's dtype, here x is multiplied by the reciprocal in float32 on both backends (XLA on a
CPU computed a jitted x / s that way, which differs from the division at FP8 rounding ties).
The kernel's divisions are correctly rounded; XLA's on a GPU may be an ulp off, so a value on an FP8 rounding
boundary can round to the neighbouring FP8 value there.

An FP8 GEMM on Hopper takes both operands with the contracted axis innermost, so the product that contracts the
rows (a weight gradient, ``q_t @ ...``) needs ``q_t``. The kernel computes ``s``, writes both layouts and the next
history in one pass over x, where XLA runs a reduction of the history, the cast and transpose, a reduction of x and
an update of the history; it writes ``s`` and the next history over the buffers of ``scale`` and ``history``, so a
jitted step that donates them updates them in place. Quantization is a step inside an FP8 product's forward and
backward, not a function to differentiate: the op has no gradient.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from ls_jax.ops import _common

FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)


def _quantize_xla(x, history, scale, *, dtype):
    fp8_max = jnp.finfo(dtype).max.astype(jnp.float32)
    scale = fp8_ops.compute_scale(jnp.max(history), scale, fp8_max)
    inverse = 1.0 / scale.astype(x.dtype).astype(jnp.float32)
    scaled = x.astype(jnp.float32) * inverse
    q = jnp.clip(scaled, -fp8_max, fp8_max).astype(dtype)
    amax = jnp.max(jnp.abs(x), initial=0).astype(jnp.float32)
    return q, q.T, scale, jnp.roll(history, shift=-1).at[0].set(amax)


def _quantize_ffi(x, history, scale, *, dtype):
    rows, cols = x.shape
    results = (
        jax.ShapeDtypeStruct((rows, cols), dtype),
        jax.ShapeDtypeStruct((cols, rows), dtype),
        jax.ShapeDtypeStruct((1,), jnp.float32),
        jax.ShapeDtypeStruct(history.shape, jnp.float32),
        jax.ShapeDtypeStruct((2,), jnp.uint32),  # the kernel's amax and finished-block count
    )
    # The kernel overwrites the history and the scale: a step that donates them copies neither.
    quantize = jax.ffi.ffi_call("ls_fp8_quantize", results, vmap_method="sequential", input_output_aliases={1: 3, 2: 2})
    q, q_t, scale, next_history, _ = quantize(x, history, scale)
    return q, q_t, scale, next_history


def fp8_quantize(
    x: jax.Array, history: jax.Array, scale: jax.Array, dtype: Any
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(q, q_t, s, next_history)`` of ``x`` quantized to ``dtype``, as the module docstring states.

    Args:
      x: (rows, cols), float32, bfloat16 or float16.
      history: float32[H], the amax of x's last H steps (Flax's ``amax_history``), H >= 1.
      scale: float32[1], the previous step's scale, kept when the history gives none.
      dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.

    Returns:
      q (rows, cols) and q_t (cols, rows) in ``dtype``; s float32[1], the scale x / s used (this step's scale);
      next_history float32[H].
    """
    _common.check_activation("x", x)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D (rows, cols), got shape {x.shape}; reshape it to (-1, {x.shape[-1]}) first")
    if history.ndim != 1 or history.shape[0] < 1 or history.dtype != jnp.float32:
        raise ValueError(f"history must be float32[H] with H >= 1, got {history.dtype}{list(history.shape)}")
    if scale.shape != (1,) or scale.dtype != jnp.float32:
        raise ValueError(f"scale must be float32[1], got {scale.dtype}{list(scale.shape)}")
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in FP8_DTYPES]:
        raise ValueError(f"dtype must be float8_e4m3fn or float8_e5m2, got {jnp.dtype(dtype)}")
    xla = functools.partial(_quantize_xla, dtype=dtype)
    ffi = functools.partial(_quantize_ffi, dtype=dtype)
    return _common.dispatch("fp8_quantize", xla, ffi, (x, history, scale))
