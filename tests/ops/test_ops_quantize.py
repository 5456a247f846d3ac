"""ls_jax.ops.fp8_quantize against a NumPy reference of the quantization Flax's FP8 ops define (the XLA
implementation; tests/kernels/test_quantize_gpu.py holds the CUDA kernel to the same reference)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.fp8_reference import bits, reference, sample

from ls_jax.ops import fp8_quantize


@pytest.mark.parametrize("fp8", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
def test_quantize_matches_the_reference_bit_for_bit(dtype, fp8):
    x = sample((37, 70), dtype)
    scale = 0.75 if dtype != jnp.float16 else 0.01  # float16 stops at 65504: stay inside its range
    q, q_t, amax = jax.jit(fp8_quantize, static_argnums=2)(jnp.asarray(x), jnp.asarray([scale], jnp.float32), fp8)
    want_q, want_t, want_amax = reference(x, scale, fp8)
    assert q.dtype == fp8 and q.shape == (37, 70) and q_t.shape == (70, 37)
    np.testing.assert_array_equal(bits(q), bits(want_q))
    np.testing.assert_array_equal(bits(q_t), bits(want_t))
    assert amax.shape == (1,) and amax.dtype == jnp.float32 and float(amax[0]) == want_amax


def test_out_of_range_values_saturate_and_nan_carries_through():
    x = np.array([[1e6, -1e6, np.inf, -np.inf, np.nan, 3.0]], np.float32)
    q, _, amax = fp8_quantize(jnp.asarray(x), jnp.ones((1,), jnp.float32), jnp.float8_e4m3fn)
    values = np.asarray(q).astype(np.float32)[0]
    np.testing.assert_array_equal(values[:4], [448.0, -448.0, 448.0, -448.0])
    assert np.isnan(values[4]) and values[5] == 3.0
    assert np.isnan(float(amax[0]))


def test_flax_fp8_products_quantize_the_same_but_for_their_rounding_of_x_over_s():
    """Flax rounds x / s to x's dtype first (bfloat16: 8 bits), then to FP8 (3): at most one FP8 step apart, on a
    few percent of the elements (double rounding)."""
    from flax.linen import fp8_ops

    x = jnp.asarray(sample((64, 64), jnp.bfloat16, seed=1))
    scale = jnp.asarray([0.3], jnp.float32)
    q, _, _ = fp8_quantize(x, scale, jnp.float8_e4m3fn)
    flax_q = fp8_ops.quantize(x, jnp.float8_e4m3fn, scale, x.dtype)
    steps = np.abs(bits(q).astype(np.int16) - bits(flax_q).astype(np.int16))  # same sign: codes are ordered
    assert steps.max() <= 1 and np.mean(steps) < 0.05, (steps.max(), np.mean(steps))


def test_an_empty_input_gives_empty_outputs_and_zero_amax():
    q, q_t, amax = fp8_quantize(jnp.zeros((0, 16), jnp.bfloat16), jnp.ones((1,), jnp.float32), jnp.float8_e5m2)
    assert q.shape == (0, 16) and q_t.shape == (16, 0) and float(amax[0]) == 0.0


@pytest.mark.parametrize(
    "args, message",
    [
        ((np.zeros((2, 3, 4), np.float32), np.ones(1, np.float32), jnp.float8_e4m3fn), "x must be 2-D"),
        ((np.zeros((2, 3), np.int32), np.ones(1, np.float32), jnp.float8_e4m3fn), "x must be float32"),
        ((np.zeros((2, 3), np.float32), np.ones(2, np.float32), jnp.float8_e4m3fn), "scale must be float32[1]"),
        ((np.zeros((2, 3), np.float32), np.ones(1, np.float32), jnp.bfloat16), "dtype must be float8_e4m3fn"),
    ],
)
def test_bad_input_is_one_line(args, message):
    x, scale, dtype = args
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        fp8_quantize(jnp.asarray(x), jnp.asarray(scale), dtype)
