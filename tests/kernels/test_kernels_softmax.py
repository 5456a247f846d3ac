"""GPU: the attention-softmax kernels (ls_attn_softmax_fwd / _bwd) against the XLA implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.kernels import assert_backends_agree, keep_rate_bounds, kernel_targets, on_backend, value_and_grads
from helpers.ops import normal, random_cotangent, seed_array

from ls_jax import ops

pytestmark = pytest.mark.gpu

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
TARGETS = {"ls_attn_softmax_fwd", "ls_attn_softmax_bwd"}


def _padding_mask(lengths, num_k):
    """(B, 1, 1, K) boolean mask: batch b attends to its first lengths[b] keys (0 = a fully masked batch)."""
    return (jnp.arange(num_k)[None, :] < jnp.asarray(lengths)[:, None])[:, None, None, :]


def _float_mask(seed, shape):
    """An additive mask: padding as -1e9 on a quarter of the keys plus a small bias elsewhere."""
    bias = 0.5 * normal(seed, shape, F32)
    return jnp.where(normal(seed + 1, shape, F32) > 0.67, -1e9, bias)


# (scores shape, mask, causal, dropout rate): every key-length path (W-wide and scalar lane groups, the
# block-per-row sweeps), boolean, float and per-query masks, causal with Q == K and Q < K, batch 1, a fully
# masked batch element and rank-2 scores.
CASES = [
    ((2, 3, 5, 1), None, False, 0.0),
    ((2, 3, 4, 7), ("bool", [7, 3]), False, 0.1),
    ((2, 4, 16, 64), ("float", (2, 1, 1, 64)), False, 0.1),
    ((1, 2, 128, 128), ("bool", [100]), True, 0.1),
    ((2, 2, 3, 129), None, True, 0.0),
    ((2, 2, 8, 512), ("bool", [512, 0]), False, 0.1),
    ((2, 2, 2, 600), ("float", (1, 2, 1, 600)), False, 0.0),
    ((1, 1, 2, 1024), ("float", (1, 1, 2, 1024)), False, 0.1),
    ((1, 2, 4, 1023), ("float", (1, 1, 1, 1023)), True, 0.0),
    ((2, 1, 3, 4096), ("bool", [4096, 1000]), False, 0.1),
    ((1, 1, 2, 4099), None, True, 0.1),
    ((6, 40), None, False, 0.1),
]


def _case_arrays(index, case, dtype):
    """(scores, boolean mask or None, float mask or None) of a case."""
    shape, mask_spec, _, _ = case
    scores = normal(index, shape, dtype, scale=2.0)
    if mask_spec is None:
        return scores, None, None
    if mask_spec[0] == "bool":
        return scores, _padding_mask(mask_spec[1], shape[-1]), None
    return scores, None, _float_mask(100 + index, mask_spec[1]).astype(dtype)


def _run(cases, dtype, seed):
    """``run(arrays, cotangents)`` -> per case y and the gradients of scores (and of a float mask), and its
    arguments; causal and the rate stay Python values, closed over."""

    def run(arrays, cotangents):
        results = []
        for (_, _, causal, rate), (scores, mask, float_mask), cotangent in zip(cases, arrays, cotangents):

            def op(scores, *float_mask_arg, mask=mask, causal=causal, rate=rate):
                m = float_mask_arg[0] if float_mask_arg else mask
                return ops.attn_softmax(scores, m, scale=0.7, causal=causal, dropout_rate=rate, seed=seed)

            primals = (scores,) if float_mask is None else (scores, float_mask)
            results.append(value_and_grads(op)(primals, cotangent))
        return results

    arrays = [_case_arrays(i, case, dtype) for i, case in enumerate(cases)]
    cotangents = [random_cotangent(200 + i, scores) for i, (scores, _, _) in enumerate(arrays)]
    return run, (arrays, cotangents)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_attn_softmax_matches_xla(dtype):
    run, args = _run(CASES, dtype, seed_array(0))
    assert kernel_targets(run, *args) == TARGETS
    got, want = on_backend("ffi", run, *args), on_backend("xla", run, *args)
    for case, got_case, want_case in zip(CASES, got, want):
        assert_backends_agree(got_case, want_case, dtype, f"attn_softmax{case}")


def test_dropout_drops_the_same_probabilities_as_xla():
    # f32 probabilities of these scores are never 0, so a zero in y is a dropped element.
    cases = [
        ((2, 2, 8, 64), None, False, 0.3),
        ((2, 2, 3, 7), None, False, 0.3),
        ((1, 2, 2, 4096), None, False, 0.3),
        ((1, 1, 2, 1023), None, False, 0.3),
    ]
    run, args = _run(cases, F32, seed_array(1))
    got, want = on_backend("ffi", run, *args), on_backend("xla", run, *args)
    for case, (y_ffi, _), (y_xla, _) in zip(cases, got, want):
        assert bool(jnp.any(y_xla == 0)), f"{case}: nothing dropped"
        np.testing.assert_array_equal(np.asarray(y_ffi == 0), np.asarray(y_xla == 0), err_msg=str(case))


@pytest.mark.parametrize("num_k", [256, 4096])
def test_keep_rate_scale_and_seed(num_k):
    rate = 0.1
    scores = jnp.zeros((4, 4, 64, num_k), F32)  # uniform probabilities 1 / K
    run = lambda s, seed: ops.attn_softmax(s, dropout_rate=rate, seed=seed)
    first = np.asarray(on_backend("ffi", run, scores, seed_array(2)))
    again = np.asarray(on_backend("ffi", run, scores, seed_array(2)))
    other = np.asarray(on_backend("ffi", run, scores, seed_array(3)))
    low, high = keep_rate_bounds(rate, first.size)
    assert low <= np.mean(first != 0) <= high
    kept = np.float32(np.float32(1.0 / num_k) * np.float32(1.0 / (1.0 - rate)))
    assert set(np.unique(first).tolist()) == {0.0, float(kept)}
    np.testing.assert_array_equal(first, again)
    assert np.mean(first != other) > rate * (1.0 - rate)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("num_k", [64, 1023, 4096])
def test_fully_masked_rows_are_zero(dtype, num_k):
    scores = normal(4, (2, 2, 3, num_k), dtype)
    mask = _padding_mask([num_k, 0], num_k)
    cotangent = normal(5, scores.shape, dtype)
    op = lambda s: ops.attn_softmax(s, mask, dropout_rate=0.1, seed=seed_array(4))
    y, (dscores,) = on_backend("ffi", value_and_grads(op), (scores,), cotangent)
    for value in (y, dscores):
        value = np.asarray(value, np.float32)
        assert np.all(np.isfinite(value))
        assert np.all(value[1] == 0.0)
        assert np.any(value[0] != 0.0)


def test_causal_rows_see_only_earlier_keys():
    scores = normal(6, (1, 2, 5, 9), F32)
    probs = np.asarray(on_backend("ffi", lambda s: ops.attn_softmax(s, causal=True), scores))
    visible = np.tril(np.ones((5, 9), bool), k=9 - 5)
    assert np.all(probs[..., ~visible] == 0.0)
    assert np.all(probs[..., visible] > 0.0)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)


def test_mask_broadcast_along_keys_falls_back_to_xla_forward():
    scores = normal(7, (2, 2, 3, 16), F32)
    mask = normal(8, (2, 2, 3, 1), F32) > 0  # per-query flags: the forward kernel cannot index it
    op = lambda s: ops.attn_softmax(s, mask)
    run = value_and_grads(op)
    args = ((scores,), normal(9, scores.shape, F32))
    assert kernel_targets(run, *args) == {"ls_attn_softmax_bwd"}
    assert_backends_agree(on_backend("ffi", run, *args), on_backend("xla", run, *args), F32, "keys-broadcast mask")


def test_vmap_matches_xla():
    scores = normal(10, (3, 2, 2, 4, 64), BF16)
    mask = _padding_mask([64, 10], 64)
    op = jax.vmap(lambda s: ops.attn_softmax(s, mask, scale=0.5, dropout_rate=0.1, seed=seed_array(5)))
    run = value_and_grads(op)
    args = ((scores,), normal(11, scores.shape, BF16))
    assert kernel_targets(run, *args) == TARGETS
    assert_backends_agree(on_backend("ffi", run, *args), on_backend("xla", run, *args), BF16, "vmap")
