"""GPU: the fp8_quantize kernel against the NumPy reference, bit for bit, and against the XLA implementation (within
one FP8 step: XLA's GPU division is not correctly rounded)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.fp8_reference import bits, history_for, reference, sample
from helpers.kernels import kernel_targets, on_backend

from ls_jax import backend, ops

pytestmark = pytest.mark.gpu

# Tiles of 64 x 64 with 16-byte rows: whole tiles, ragged edges (scalar paths), one row, one column, rows a multiple
# of 8 but not of 16 (q_t stored 8 bytes at a time; a translation batch of 341 sentences of 24 tokens), and the
# transformer-big FFN's hidden activations.
SHAPES = [(64, 64), (37, 70), (1, 33), (33, 1), (128, 48), (40, 64), (8184, 1024), (100, 4096), (8192, 4096)]
ONES = jnp.ones((1,), jnp.float32)


def _quantize(fp8):
    return lambda x, history, scale: ops.fp8_quantize(x, history, scale, fp8)


@pytest.mark.parametrize("fp8", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_the_reference_bit_for_bit(shape, dtype, fp8):
    x = sample(shape, dtype, seed=sum(shape))
    history = history_for(0.75 if dtype != jnp.float16 else 0.01, fp8, length=1024, seed=sum(shape))
    args = (jnp.asarray(x), jnp.asarray(history), jnp.asarray([7.0], jnp.float32))
    assert kernel_targets(_quantize(fp8), *args) == {"ls_fp8_quantize"}
    q, q_t, scale, next_history = on_backend("ffi", _quantize(fp8), *args)
    want_q, want_t, want_scale, want_history = reference(x, history, 7.0, fp8)
    np.testing.assert_array_equal(bits(q), bits(want_q))
    np.testing.assert_array_equal(bits(q_t), bits(want_t))
    assert scale[0] == want_scale
    np.testing.assert_array_equal(np.asarray(next_history), want_history)
    # XLA's float32 division on a GPU is not correctly rounded: with the reciprocal of s an ulp off, a value on an FP8
    # rounding boundary can round to the neighbouring one (codes of one sign are ordered by value), and s too.
    xla_q, xla_t, xla_scale, xla_history = on_backend("xla", _quantize(fp8), *args)
    assert np.abs(bits(q).astype(np.int16) - bits(xla_q).astype(np.int16)).max() <= 1
    np.testing.assert_array_equal(bits(xla_t), bits(xla_q).T)
    assert float(xla_scale[0]) == pytest.approx(float(want_scale), rel=3e-7)  # two ulps
    np.testing.assert_array_equal(np.asarray(xla_history), want_history)


@pytest.mark.parametrize("length", [1, 255, 256, 257, 512, 600])
def test_the_history_rolls_in_place_across_the_blocks_passes(length):
    """The last block rolls the history over itself kThreads (256) values a pass: lengths off that multiple."""
    x = sample((130, 70), jnp.bfloat16, seed=length)
    history = history_for(0.75, jnp.float8_e4m3fn, length=length, seed=length)
    args = (jnp.asarray(x), jnp.asarray(history), jnp.asarray([7.0], jnp.float32))
    _, _, scale, next_history = on_backend("ffi", _quantize(jnp.float8_e4m3fn), *args)
    _, _, want_scale, want_history = reference(x, history, 7.0, jnp.float8_e4m3fn)
    assert scale[0] == want_scale
    np.testing.assert_array_equal(np.asarray(next_history), want_history)


def test_donated_state_advances_step_by_step():
    """As a training step runs it: the history and scale donated, each call's results the next call's inputs."""
    with backend.use("ffi"):
        run = jax.jit(lambda x, h, s: ops.fp8_quantize(x, h, s, jnp.float8_e5m2)[2:], donate_argnums=(1, 2))
        history, scale = jnp.zeros(300, jnp.float32), ONES * 7
        want_history, want_scale = np.zeros(300, np.float32), np.float32(7.0)
        for step in range(4):
            x = sample((96, 200), jnp.bfloat16, seed=step) * (step + 1)
            scale, history = run(jnp.asarray(x), history, scale)
            _, _, want_scale, want_history = reference(x, want_history, want_scale, jnp.float8_e5m2)
            assert scale[0] == want_scale
            np.testing.assert_array_equal(np.asarray(history), want_history)


def test_infinities_saturate_to_the_largest_value():
    x = np.array([[np.inf, -np.inf, 1e30, -1e30, 2.0] * 4], np.float32)
    for fp8, largest in ((jnp.float8_e4m3fn, 448.0), (jnp.float8_e5m2, 57344.0)):
        q, q_t, _, history = on_backend("ffi", _quantize(fp8), x, jnp.zeros(4, jnp.float32), ONES)
        values = np.asarray(q).astype(np.float32)[0, :5]
        np.testing.assert_array_equal(values, [largest, -largest, largest, -largest, 2.0])
        np.testing.assert_array_equal(bits(q_t), bits(q).T)
        assert float(history[0]) == np.inf


def test_nan_reaches_the_history_and_q_from_any_tile():
    x = np.ones((200, 300), np.float32)
    x[150, 250] = np.nan
    q, q_t, _, history = on_backend(
        "ffi", _quantize(jnp.float8_e4m3fn), jnp.asarray(x, jnp.bfloat16), jnp.zeros(4, jnp.float32), ONES
    )
    assert np.isnan(float(history[0]))
    assert np.isnan(np.asarray(q).astype(np.float32)[150, 250]) and np.isnan(
        np.asarray(q_t).astype(np.float32)[250, 150]
    )


@pytest.mark.parametrize(
    "history", [np.zeros(1024), np.array([1.0, np.nan, 2.0]), np.array([1.0, np.inf])], ids=["zeros", "nan", "inf"]
)
def test_a_history_without_a_usable_amax_keeps_the_previous_scale(history):
    x = jnp.ones((64, 64), jnp.bfloat16)
    _, _, scale, _ = on_backend("ffi", _quantize(jnp.float8_e5m2), x, jnp.asarray(history, jnp.float32), ONES * 7)
    assert scale[0] == np.float32(1.0) / (np.float32(1.0) / np.float32(7.0))  # 6.9999995, not 7


def test_a_one_step_history_holds_this_steps_amax():
    x = np.full((70, 40), -3.0, np.float32)
    _, _, scale, history = on_backend("ffi", _quantize(jnp.float8_e4m3fn), x, jnp.asarray([5.0], jnp.float32), ONES)
    np.testing.assert_array_equal(np.asarray(history), [3.0])
    assert scale[0] == np.float32(1.0) / (np.float32(448.0) / np.float32(5.0))


@pytest.mark.parametrize("shape", [(0, 16), (300, 0)], ids=str)
def test_an_empty_input_puts_a_zero_amax_in_front(shape):
    q, q_t, scale, history = on_backend(
        "ffi", _quantize(jnp.float8_e5m2), jnp.zeros(shape, jnp.bfloat16), jnp.asarray([5.0, 6.0, 7.0]), ONES
    )
    assert q.shape == shape and q_t.shape == shape[::-1]
    np.testing.assert_array_equal(np.asarray(history), [0.0, 7.0, 5.0])
    assert scale[0] == np.float32(1.0) / (np.float32(57344.0) / np.float32(7.0))


def test_repeated_calls_start_from_a_zeroed_amax():
    """The scratch the kernel counts blocks and the amax in is zeroed on every call: a large amax of one call does
    not reach the next one's history, nor does the block count carry over."""
    run = _quantize(jnp.float8_e4m3fn)
    big = np.full((256, 256), 100.0, np.float32)
    small = np.full((256, 256), 2.0, np.float32)
    for x, amax in ((big, 100.0), (small, 2.0), (small, 2.0)):
        _, _, _, history = on_backend("ffi", run, x, jnp.zeros(8, jnp.float32), ONES)
        assert float(history[0]) == amax
