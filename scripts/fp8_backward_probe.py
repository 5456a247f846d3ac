"""Which FP8 backward XLA compiles to FP8 GEMMs: one GEMM's forward + backward (``x @ w``, bf16 operands) at
transformer-big's shapes, per variant the median of 50 jit-compiled steps after 10 and how many of the step's three
products XLA made cuBLASLt FP8 GEMMs (one JSON line each).

    python3 scripts/fp8_backward_probe.py                   # on a GPU; --quick: small shapes, a CPU smoke run
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python3 scripts/fp8_backward_probe.py

Variants: ``bf16``; ``flax``, Flax's FP8 op (``fp8_scaled_dot_general``, the plain Flax references' FP8 path, whose
backward multiplies at ``Precision.HIGHEST``); ``default``, the same quantization with both backward products at
``Precision.DEFAULT``, to see whether XLA then rewrites them to FP8 GEMMs.
"""

import argparse
import functools
import json

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from train.bench import common

SHAPES = ((8192, 1024, 4096), (8192, 4096, 1024), (16384, 1024, 1024))
QUICK_SHAPES = ((64, 32, 48),)
FP8_GEMM = 'custom_call_target="__cublas$lt$matmul$f8"'
HISTORY = 16


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _dot_default(x, q_x, x_scale, w, q_w, w_scale, grad_meta, out_dtype):
    """``q_x (M, K) @ q_w (K, N)`` in FP8; its backward quantizes dy to e5m2 and multiplies at DEFAULT precision,
    the gradients going to the unquantized ``x`` and ``w`` (as Flax's ``quantized_dot``)."""
    return jax.lax.dot_general(q_x, q_w, (((1,), (0,)), ((), ())), preferred_element_type=out_dtype)


def _dot_default_fwd(x, q_x, x_scale, w, q_w, w_scale, grad_meta, out_dtype):
    residuals = (q_x, x_scale, q_w, w_scale, grad_meta)
    return _dot_default(x, q_x, x_scale, w, q_w, w_scale, grad_meta, out_dtype), residuals


def _dot_default_bwd(out_dtype, residuals, g):
    q_x, x_scale, q_w, w_scale, (g_scale, g_history) = residuals
    new_scale, new_history = fp8_ops.update_fp8_meta(g, jnp.float8_e5m2, g_scale, g_history)
    q_g = fp8_ops.quantize(g, jnp.float8_e5m2, new_scale, out_dtype)
    dx = jax.lax.dot_general(q_g, q_w, (((1,), (1,)), ((), ())), preferred_element_type=out_dtype)
    dw = jax.lax.dot_general(q_x, q_g, (((0,), (0,)), ((), ())), preferred_element_type=out_dtype)
    dx = fp8_ops.dequantize(dx, out_dtype, w_scale * new_scale)
    dw = fp8_ops.dequantize(dw, out_dtype, x_scale * new_scale)
    return dx, None, None, dw, None, None, (new_scale, new_history)


_dot_default.defvjp(_dot_default_fwd, _dot_default_bwd)


def fp8_default(x, w, meta):
    """FP8 ``x @ w`` with ``meta`` = (scale, amax history) per x, w and dy; the quantization of Flax's ops."""
    (x_scale, x_history), (w_scale, w_history), grad_meta = meta
    q_x, new_x_scale = fp8_ops.in_q(x.dtype, jnp.float8_e4m3fn, x, x_scale, x_history)
    q_w, new_w_scale = fp8_ops.in_q(x.dtype, jnp.float8_e4m3fn, w, w_scale, w_history)
    y = _dot_default(x, q_x, new_x_scale, w, q_w, new_w_scale, grad_meta, x.dtype)
    return fp8_ops.out_dq(x.dtype, new_x_scale, new_w_scale, y)


def fp8_flax(x, w, meta):
    (x_scale, x_history), (w_scale, w_history), (g_scale, g_history) = meta
    return fp8_ops.fp8_scaled_dot_general(
        x,
        w,
        (((1,), (0,)), ((), ())),
        preferred_element_type=x.dtype,
        lhs_scale=x_scale,
        rhs_scale=w_scale,
        grad_scale=g_scale,
        lhs_amax_history=x_history,
        rhs_amax_history=w_history,
        grad_amax_history=g_history,
        quantize_compute_type=x.dtype,
    )


VARIANTS = {"bf16": lambda x, w, meta: x @ w, "flax": fp8_flax, "default": fp8_default}


def measure(variant: str, rows: int, k: int, n: int, steps: int) -> dict:
    x = jax.random.normal(jax.random.PRNGKey(0), (rows, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(1), (k, n), jnp.bfloat16) / k**0.5
    meta = tuple((jnp.ones((1,), jnp.float32), jnp.zeros((HISTORY,), jnp.float32)) for _ in range(3))
    dot = VARIANTS[variant]
    dy = jax.random.normal(jax.random.PRNGKey(2), (rows, n), jnp.bfloat16)

    def forward_and_backward(x, w, meta, dy):
        y, pullback = jax.vjp(lambda x, w, meta: dot(x, w, meta), x, w, meta)
        return y, pullback(dy)

    step = jax.jit(forward_and_backward)
    gemms = step.lower(x, w, meta, dy).compile().as_text().count(FP8_GEMM)
    timing = common.time_call(lambda: step(x, w, meta, dy), warmup=10, samples=steps, inner=1)
    return {"variant": variant, "shape": [rows, k, n], "ms": timing["median_s"] * 1e3, "fp8_gemms": gemms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes and few steps (a CPU smoke run)")
    args = parser.parse_args()
    for rows, k, n in QUICK_SHAPES if args.quick else SHAPES:
        for variant in VARIANTS:
            print(json.dumps(measure(variant, rows, k, n, 3 if args.quick else 50)), flush=True)


if __name__ == "__main__":
    main()
