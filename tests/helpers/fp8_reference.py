"""A NumPy reference of ls_jax.ops.fp8_quantize, and inputs that exercise it, for its CPU and GPU tests."""

import ml_dtypes
import numpy as np


def delayed_scale(history: np.ndarray, scale: float, dtype) -> np.float32:
    """This step's scale from the history of the steps before, Flax's ``compute_scale`` in float32 divisions."""
    fp8_max = np.float32(ml_dtypes.finfo(dtype).max)
    amax = np.max(np.asarray(history, np.float32))
    previous = np.float32(1.0) / np.float32(scale)
    factor = fp8_max / amax if amax > 0 and np.isfinite(amax) else previous
    return np.float32(1.0) / np.float32(factor)


def reference(x: np.ndarray, history: np.ndarray, scale: float, dtype):
    """(q, q_t, s, next_history): x times 1 / (s in x's dtype) in float32, clipped to the format's largest value,
    rounded to FP8; the history rolled left by one with max |x| in front."""
    fp8_max = float(ml_dtypes.finfo(dtype).max)
    s = delayed_scale(history, scale, dtype)
    inverse = np.float32(1.0) / np.float32(np.asarray(s, np.float32).astype(x.dtype))
    q = np.clip(x.astype(np.float32) * inverse, -fp8_max, fp8_max).astype(dtype)
    amax = np.max(np.abs(x.astype(np.float32)), initial=0.0)
    next_history = np.roll(np.asarray(history, np.float32), -1)
    next_history[0] = amax
    return q, q.T, s, next_history


def sample(shape, dtype, seed=0) -> np.ndarray:
    """Values spread over the FP8 range and past it at the scales the tests use, with exact zeros."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-12, 12, shape))
    x[rng.random(shape) < 0.05] = 0.0
    return x.astype(dtype)


def history_for(scale: float, dtype, length: int = 16, seed: int = 0) -> np.ndarray:
    """An amax history whose largest entry gives about ``scale``: near fp8_max * scale but not a product that makes
    1 / (fp8_max / amax) equal amax / fp8_max; the rest smaller, zeros among them as a young history has."""
    fp8_max = float(ml_dtypes.finfo(dtype).max)
    rng = np.random.default_rng(seed)
    history = (rng.random(length) * fp8_max * scale).astype(np.float32)
    history[rng.random(length) < 0.2] = 0.0
    history[rng.integers(length)] = np.float32(fp8_max * scale * (1 + 0.01 * rng.random()))
    return history


def bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)
