"""ls_jax.ops.fp8_quantize against a NumPy reference of the quantization and delayed scaling Flax's FP8 ops define
(the XLA implementation; tests/kernels/test_kernels_quantize.py holds the CUDA kernel to the same reference)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.fp8_reference import bits, history_for, reference, sample

from ls_jax.ops import fp8_quantize

quantize = jax.jit(fp8_quantize, static_argnums=3)


@pytest.mark.parametrize("fp8", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
def test_quantize_matches_the_reference_bit_for_bit(dtype, fp8):
    x = sample((37, 70), dtype)
    history = history_for(0.75 if dtype != jnp.float16 else 0.01, fp8)  # float16 stops at 65504
    previous = np.float32(7.0)  # 1 / (1 / 7) is not 7 in float32: the fallback must divide twice
    q, q_t, scale, next_history = quantize(jnp.asarray(x), jnp.asarray(history), jnp.asarray([previous]), fp8)
    want_q, want_t, want_scale, want_history = reference(x, history, previous, fp8)
    assert q.dtype == fp8 and q.shape == (37, 70) and q_t.shape == (70, 37)
    np.testing.assert_array_equal(bits(q), bits(want_q))
    np.testing.assert_array_equal(bits(q_t), bits(want_t))
    assert scale.shape == (1,) and scale.dtype == jnp.float32 and scale[0] == want_scale
    assert next_history.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(next_history), want_history)


def test_scale_and_history_are_flax_s():
    """The scale from the history and the next history, as Flax's FP8 ops compute them, bit for bit: from a history
    with a largest entry, from an all-zero one (the previous scale stays) and from one holding inf or NaN."""
    from flax.linen import fp8_ops

    x = jnp.asarray(sample((16, 32), jnp.float32, seed=3))
    fp8_max = jnp.finfo(jnp.float8_e4m3fn).max.astype(jnp.float32)
    for history in (history_for(0.37, jnp.float8_e4m3fn), np.zeros(8, np.float32), np.array([1.0, np.inf, 2.0])):
        for extreme in (None, np.nan):
            if extreme is not None:
                history = history.copy()
                history[-1] = extreme
            previous = jnp.asarray([7.0], jnp.float32)
            _, _, scale, next_history = quantize(x, jnp.asarray(history, jnp.float32), previous, jnp.float8_e4m3fn)
            want = fp8_ops.compute_scale(jnp.max(jnp.asarray(history, jnp.float32)), previous, fp8_max)
            np.testing.assert_array_equal(np.asarray(scale), np.asarray(want))
            flax_history = fp8_ops.compute_amax_history(x, jnp.asarray(history, jnp.float32))
            np.testing.assert_array_equal(np.asarray(next_history), np.asarray(flax_history))


def test_out_of_range_values_saturate_and_nan_carries_through():
    x = np.array([[1e6, -1e6, np.inf, -np.inf, np.nan, 3.0]], np.float32)
    q, _, _, history = fp8_quantize(
        jnp.asarray(x), jnp.zeros(4, jnp.float32), jnp.ones((1,), jnp.float32), jnp.float8_e4m3fn
    )
    values = np.asarray(q).astype(np.float32)[0]
    np.testing.assert_array_equal(values[:4], [448.0, -448.0, 448.0, -448.0])
    assert np.isnan(values[4]) and values[5] == 3.0
    assert np.isnan(float(history[0]))


def test_flax_fp8_products_quantize_the_same_but_for_their_rounding_of_x_over_s():
    """Flax rounds x / s to x's dtype first (bfloat16: 8 bits), then to FP8 (3): at most one FP8 step apart, on a
    few percent of the elements (double rounding)."""
    from flax.linen import fp8_ops

    x = jnp.asarray(sample((64, 64), jnp.bfloat16, seed=1))
    history = jnp.asarray(history_for(0.3, jnp.float8_e4m3fn))
    q, _, scale, _ = fp8_quantize(x, history, jnp.ones((1,), jnp.float32), jnp.float8_e4m3fn)
    flax_q = fp8_ops.quantize(x, jnp.float8_e4m3fn, scale, x.dtype)
    steps = np.abs(bits(q).astype(np.int16) - bits(flax_q).astype(np.int16))  # same sign: codes are ordered
    assert steps.max() <= 1 and np.mean(steps) < 0.05, (steps.max(), np.mean(steps))


def test_an_empty_input_puts_a_zero_amax_in_front():
    history = jnp.asarray([5.0, 6.0, 7.0], jnp.float32)
    q, q_t, scale, next_history = fp8_quantize(
        jnp.zeros((0, 16), jnp.bfloat16), history, jnp.ones((1,), jnp.float32), jnp.float8_e5m2
    )
    assert q.shape == (0, 16) and q_t.shape == (16, 0)
    np.testing.assert_array_equal(np.asarray(next_history), [0.0, 7.0, 5.0])
    assert float(scale[0]) == np.float32(1.0) / (np.float32(57344.0) / np.float32(7.0))


@pytest.mark.parametrize(
    "args, message",
    [
        ((np.zeros((2, 3, 4), np.float32), np.zeros(4, np.float32), np.ones(1, np.float32)), "x must be 2-D"),
        ((np.zeros((2, 3), np.int32), np.zeros(4, np.float32), np.ones(1, np.float32)), "x must be float32"),
        ((np.zeros((2, 3), np.float32), np.zeros((2, 2), np.float32), np.ones(1, np.float32)), "history must be"),
        ((np.zeros((2, 3), np.float32), np.zeros(0, np.float32), np.ones(1, np.float32)), "history must be"),
        ((np.zeros((2, 3), np.float32), np.zeros(4, np.float32), np.ones(2, np.float32)), "scale must be float32[1]"),
    ],
)
def test_bad_input_is_one_line(args, message):
    x, history, scale = args
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        fp8_quantize(jnp.asarray(x), jnp.asarray(history), jnp.asarray(scale), jnp.float8_e4m3fn)


def test_a_dtype_that_is_not_fp8_is_one_line():
    with pytest.raises(ValueError, match="dtype must be float8_e4m3fn"):
        fp8_quantize(jnp.zeros((2, 3)), jnp.zeros(4), jnp.ones(1), jnp.bfloat16)


def test_the_cuda_kernel_updates_the_history_and_scale_in_place(monkeypatch):
    """Lowered for CUDA with kernels enabled, the call aliases history to next_history and scale to s (operands 1
    and 2 to results 3 and 2): a step that donates its scaling state then copies none of it."""
    from ls_jax import backend

    monkeypatch.setattr(backend, "kernels_enabled", lambda: True)
    step = jax.jit(lambda x, history, scale: fp8_quantize(x, history, scale, jnp.float8_e4m3fn), donate_argnums=(1, 2))
    args = (jnp.zeros((64, 32), jnp.bfloat16), jnp.zeros(16, jnp.float32), jnp.ones(1, jnp.float32))
    text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    call = next(line for line in text.splitlines() if "custom_call @ls_fp8_quantize" in line)
    aliases = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", call)
    assert sorted(aliases) == [("2", "2"), ("3", "1")]
