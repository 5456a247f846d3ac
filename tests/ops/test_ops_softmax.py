"""ls_jax.ops.attn_softmax against a naive masked softmax: padding, causal, additive masks and dropout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.ops import BF16, F32, check_vjp, normal, random_cotangent, seed_array

from ls_jax.ops import attn_softmax
from ls_jax.ops.random import keep_mask


def reference_attn_softmax(scores, mask=None, *, scale=1.0, causal=False, keep=None, rate=0.0):
    """softmax(scale * scores + mask) over keys; masked keys get probability 0, a row with none left is all 0."""
    num_q, num_k = scores.shape[-2:]
    logits = scores * scale
    valid = jnp.ones(scores.shape, bool)
    if mask is not None and mask.dtype == jnp.bool_:
        valid = valid & mask
    elif mask is not None:
        logits = logits + mask
    if causal:
        valid = valid & jnp.tril(jnp.ones((num_q, num_k), bool), k=num_k - num_q)
    logits = jnp.where(valid, logits, -jnp.inf)
    live_row = jnp.any(logits > -jnp.inf, axis=-1, keepdims=True)
    logits = jnp.where(live_row, logits, 0.0)
    exp = jnp.exp(logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True)))
    probs = jnp.where(live_row, exp / jnp.sum(exp, axis=-1, keepdims=True), 0.0)
    if keep is not None:
        probs = probs * keep / (1.0 - rate)
    return probs


def _padding_mask(batch, num_k, lengths):
    """(B, 1, 1, K) boolean mask: key k of batch b is attended when k < lengths[b]."""
    return (jnp.arange(num_k)[None, :] < jnp.asarray(lengths)[:, None])[:, None, None, :]


def _check(scores, mask=None, *, float_mask=False, scale=1.0, causal=False, rate=0.0, seed=None, dtype=F32):
    """Values and VJP against the reference; a float mask is a differentiated input."""
    keep = None if rate == 0.0 else keep_mask(seed, scores.shape, rate)
    kwargs = dict(scale=scale, causal=causal)

    def op(scores, *mask_arg):
        m = mask_arg[0] if float_mask else mask
        return attn_softmax(scores, m, dropout_rate=rate, seed=seed, **kwargs)

    def ref(scores, *mask_arg):
        m = mask_arg[0] if float_mask else mask
        return reference_attn_softmax(scores, m, keep=keep, rate=rate, **kwargs)

    primals = (scores, mask) if float_mask else (scores,)
    return check_vjp(op, ref, primals, dtype)


DTYPES = [F32, BF16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 4, 8), (1, 1, 1, 5), (4, 6), (1, 1, 3, 1023)])
def test_unmasked_matches_reference(shape, dtype):
    _check(normal(0, shape, dtype, scale=3.0), scale=0.5, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_padding_mask_matches_reference(dtype):
    scores = normal(1, (3, 2, 5, 9), dtype, scale=2.0)
    _check(scores, _padding_mask(3, 9, [9, 4, 1]), scale=0.125, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_shape", [(2, 1, 5, 9), (5, 9), (1, 9)])
def test_additive_float_mask_and_its_gradient(mask_shape, dtype):
    """A float mask is added to the logits; its gradient is reduced over the axes it was broadcast along."""
    scores = normal(2, (2, 3, 5, 9), dtype, scale=2.0)
    mask = normal(3, mask_shape, dtype, scale=2.0)
    _, (_, dmask) = _check(scores, mask, float_mask=True, scale=0.7, dtype=dtype)
    assert dmask.shape == mask_shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_q, num_k", [(3, 7), (1, 6), (6, 6)])
def test_causal_with_cache_matches_reference(num_q, num_k, dtype):
    """Q < K: the queries are the last Q positions (decoding with a key/value cache)."""
    scores = normal(4, (2, 2, num_q, num_k), dtype, scale=2.0)
    _check(scores, _padding_mask(2, num_k, [num_k, num_k - 1]), causal=True, dtype=dtype)


def test_causal_keeps_keys_up_to_the_aligned_position():
    probs = attn_softmax(jnp.zeros((3, 5), F32), causal=True)
    expected = np.array([[1 / 3, 1 / 3, 1 / 3, 0, 0], [1 / 4, 1 / 4, 1 / 4, 1 / 4, 0], [1 / 5] * 5], np.float32)
    np.testing.assert_allclose(probs, expected, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_matches_reference_with_keep_mask(dtype):
    scores = normal(5, (2, 2, 4, 33), dtype, scale=2.0)
    _check(scores, _padding_mask(2, 33, [33, 20]), scale=0.25, rate=0.2, seed=seed_array(11), dtype=dtype)


def _fully_masked_case(mask_kind):
    """Scores (2, 2, 3, 6) where every row of batch 1 has no key left."""
    scores = normal(6, (2, 2, 3, 6), F32, scale=2.0)
    if mask_kind == "bool":
        return scores, _padding_mask(2, 6, [6, 0])
    return scores, jnp.where(_padding_mask(2, 6, [6, 0]), 0.0, -jnp.inf).astype(F32)


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_fully_masked_rows_are_zero_with_zero_gradient(mask_kind, rate):
    scores, mask = _fully_masked_case(mask_kind)
    seed = seed_array(0) if rate else None
    probs, vjp = jax.vjp(lambda s: attn_softmax(s, mask, dropout_rate=rate, seed=seed), scores)
    (dscores,) = vjp(random_cotangent(0, probs))
    assert np.all(np.isfinite(probs)) and np.all(np.isfinite(dscores))
    np.testing.assert_array_equal(probs[1], 0.0)
    np.testing.assert_array_equal(dscores[1], 0.0)
    assert np.all(np.abs(np.asarray(dscores[0])) > 0)
    if mask_kind == "float":
        dmask = jax.grad(lambda m: jnp.sum(attn_softmax(scores, m) * random_cotangent(1, scores)))(mask)
        assert np.all(np.isfinite(dmask))
        np.testing.assert_array_equal(dmask[1], 0.0)


def test_causal_row_with_all_keys_padded_is_zero():
    scores = normal(7, (1, 1, 4, 4), F32)
    probs = attn_softmax(scores, _padding_mask(1, 4, [0]), causal=True)
    np.testing.assert_array_equal(probs, 0.0)


def test_rows_sum_to_one_without_dropout():
    scores = normal(8, (2, 3, 4, 17), F32, scale=5.0)
    probs = attn_softmax(scores, _padding_mask(2, 17, [17, 3]), causal=True)
    np.testing.assert_allclose(jnp.sum(probs, axis=-1), 1.0, rtol=1e-6)


def test_boolean_mask_gets_no_gradient_and_float_mask_grad_is_logit_grad():
    """d/dmask of an additive mask equals d/dlogits = d/dscores / scale."""
    scores, mask = normal(9, (1, 2, 3, 5), F32), normal(10, (1, 2, 3, 5), F32)
    cotangent = random_cotangent(2, scores)
    dscores, dmask = jax.grad(lambda s, m: jnp.sum(attn_softmax(s, m, scale=0.25) * cotangent), (0, 1))(scores, mask)
    np.testing.assert_allclose(dmask, dscores / 0.25, rtol=1e-6)


def _bad_call(scores=None, mask=None, **kwargs):
    scores = jnp.zeros((2, 2, 3, 5), F32) if scores is None else scores
    return attn_softmax(scores, mask, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(scores=jnp.zeros((2, 3, 5), jnp.int32)), "scores must be float32, bfloat16 or float16, got int32"),
        (dict(scores=np.zeros((2, 3, 5), np.float64)), "scores must be float32, bfloat16 or float16, got float64"),
        (dict(scores=jnp.zeros((5,), F32)), "scores must have rank >= 2"),
        (dict(mask=jnp.ones((2, 2, 3, 4), bool)), r"mask of shape \(2, 2, 3, 4\) does not broadcast"),
        (dict(mask=jnp.ones((3, 2, 1, 1), bool)), r"mask of shape \(3, 2, 1, 1\) does not broadcast"),
        (dict(mask=jnp.ones((1, 2, 2, 3, 5), bool)), r"mask of shape \(1, 2, 2, 3, 5\) does not broadcast"),
        (dict(mask=jnp.ones((2, 1, 1, 5), jnp.int32)), "mask must be boolean or float32/bfloat16/float16"),
        (dict(scores=jnp.zeros((1, 1, 6, 5), F32), causal=True), "causal attention needs queries <= keys"),
        (dict(dropout_rate=1.0, seed=seed_array(0)), r"dropout_rate must be in \[0, 1\), got 1.0"),
        (dict(dropout_rate=-0.1, seed=seed_array(0)), r"dropout_rate must be in \[0, 1\)"),
        (dict(dropout_rate=0.1), "dropout_rate > 0 needs a seed"),
        (dict(dropout_rate=0.1, seed=jnp.zeros(2, jnp.int32)), r"seed must be a uint32\[2\] array, got int32\[2\]"),
        (dict(dropout_rate=0.1, seed=jnp.zeros(3, jnp.uint32)), r"seed must be a uint32\[2\] array, got uint32\[3\]"),
        (dict(scale=0.0), "scale must be finite and nonzero"),
        (dict(scale=float("inf")), "scale must be finite and nonzero"),
    ],
)
def test_bad_inputs_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _bad_call(**kwargs)
