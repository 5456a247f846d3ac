"""GPU: the fp8_quantize kernel against the NumPy reference, bit for bit, and against the XLA implementation (within
one FP8 step: XLA's GPU division is not correctly rounded)."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers.fp8_reference import bits, reference, sample
from helpers.kernels import kernel_targets, on_backend

from ls_jax import ops

pytestmark = pytest.mark.gpu

# Tiles of 64 x 64 with 16-byte rows: whole tiles, ragged edges (scalar paths), one row, one column, and the
# transformer-big FFN's hidden activations.
SHAPES = [(64, 64), (37, 70), (1, 33), (33, 1), (128, 48), (100, 4096), (8192, 4096)]


@pytest.mark.parametrize("fp8", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_the_reference_bit_for_bit(shape, dtype, fp8):
    x = sample(shape, dtype, seed=sum(shape))
    scale = 0.75 if dtype != jnp.float16 else 0.01
    run = lambda x, s: ops.fp8_quantize(x, s, fp8)
    args = (jnp.asarray(x), jnp.asarray([scale], jnp.float32))
    assert kernel_targets(run, *args) == {"ls_fp8_quantize"}
    q, q_t, amax = on_backend("ffi", run, *args)
    want_q, want_t, want_amax = reference(x, scale, fp8)
    np.testing.assert_array_equal(bits(q), bits(want_q))
    np.testing.assert_array_equal(bits(q_t), bits(want_t))
    assert float(amax[0]) == want_amax
    # XLA's float32 division on a GPU is not correctly rounded: a quotient on an FP8 rounding boundary can round to
    # the neighbouring value (codes of one sign are ordered by value).
    xla_q, xla_t, xla_amax = on_backend("xla", run, *args)
    assert np.abs(bits(q).astype(np.int16) - bits(xla_q).astype(np.int16)).max() <= 1
    np.testing.assert_array_equal(bits(xla_t), bits(xla_q).T)
    assert float(xla_amax[0]) == want_amax


def test_infinities_saturate_to_the_largest_value():
    x = np.array([[np.inf, -np.inf, 1e30, -1e30, 2.0] * 4], np.float32)
    for fp8, largest in ((jnp.float8_e4m3fn, 448.0), (jnp.float8_e5m2, 57344.0)):
        q, q_t, amax = on_backend("ffi", lambda x: ops.fp8_quantize(x, jnp.ones((1,), jnp.float32), fp8), x)
        values = np.asarray(q).astype(np.float32)[0, :5]
        np.testing.assert_array_equal(values, [largest, -largest, largest, -largest, 2.0])
        np.testing.assert_array_equal(bits(q_t), bits(q).T)
        assert float(amax[0]) == np.inf


def test_nan_reaches_amax_and_q_from_any_tile():
    x = np.ones((200, 300), np.float32)
    x[150, 250] = np.nan
    q, q_t, amax = on_backend(
        "ffi",
        lambda x: ops.fp8_quantize(x, jnp.ones((1,), jnp.float32), jnp.float8_e4m3fn),
        jnp.asarray(x, jnp.bfloat16),
    )
    assert np.isnan(float(amax[0]))
    assert np.isnan(np.asarray(q).astype(np.float32)[150, 250]) and np.isnan(
        np.asarray(q_t).astype(np.float32)[250, 150]
    )


def test_an_empty_input_gives_zero_amax():
    q, q_t, amax = on_backend(
        "ffi",
        lambda x: ops.fp8_quantize(x, jnp.ones((1,), jnp.float32), jnp.float8_e5m2),
        jnp.zeros((0, 16), jnp.bfloat16),
    )
    assert q.shape == (0, 16) and q_t.shape == (16, 0) and float(amax[0]) == 0.0
