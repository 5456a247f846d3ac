"""A NumPy reference of ls_jax.ops.fp8_quantize, and inputs that exercise it, for its CPU and GPU tests."""

import ml_dtypes
import numpy as np


def reference(x: np.ndarray, scale: float, dtype) -> tuple[np.ndarray, np.ndarray, float]:
    """(q, q_t, amax): x / (scale in x's dtype) in float32, clipped to the format's largest value, rounded to FP8."""
    fp8_max = float(ml_dtypes.finfo(dtype).max)
    divisor = np.float32(np.asarray(scale, np.float32).astype(x.dtype))
    scaled = x.astype(np.float32) / divisor
    q = np.clip(scaled, -fp8_max, fp8_max).astype(dtype)
    return q, q.T, float(np.max(np.abs(x.astype(np.float32))))


def sample(shape, dtype, seed=0) -> np.ndarray:
    """Values spread over the FP8 range and past it at the scales the tests use, with exact zeros."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-12, 12, shape))
    x[rng.random(shape) < 0.05] = 0.0
    return x.astype(dtype)


def bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)
