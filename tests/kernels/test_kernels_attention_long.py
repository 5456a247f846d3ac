"""GPU: attention beyond the short-sequence kernels runs cuDNN's flash attention from ls_attention_cudnn_fwd / _bwd;
against the XLA backend (the unfused attention) forward and backward, dropout by its statistics and by one seed
giving one result (cuDNN's generator drops other elements than the XLA backend), and bad operands as clear errors.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.kernels import (
    TOLERANCE,
    assert_backends_agree,
    keep_rate_bounds,
    kernel_targets,
    on_backend,
    relative_error,
    value_and_grads,
)
from helpers.ops import normal, seed_array

from ls_jax import backend, ops
from ls_jax.ops import attention, attention_cudnn

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _cudnn_attention_by_default(monkeypatch):
    """cuDNN attention is the default: nothing in the environment may turn it off for these tests."""
    monkeypatch.delenv(attention.CUDNN_ENV_VAR, raising=False)


BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
TARGETS = {"ls_attention_cudnn_fwd", "ls_attention_cudnn_bwd"}


def _key_mask(kind, batch, keys, index):
    """None; "padded": a prefix per row, the last row all padding; "scattered": random, not a prefix."""
    if kind is None:
        return None
    if kind == "padded":
        lengths = [max(keys - 37 * (b + 1), 1) for b in range(batch - 1)] + [0]
        return jnp.arange(keys)[None, :] < jnp.asarray(lengths)[:, None]
    mask = np.random.default_rng(index).random((batch, keys)) < 0.7
    mask[0, -1] = True  # the last key visible: no padding for seq_len_kv to skip
    return jnp.asarray(mask)


def _case(index, queries, keys, mask_kind, causal, dtype, head_dim, rate=0.0, heads=2, batch=2):
    """(op, primals, cotangent); primals end with the f32 projection bias of the query source."""
    seed = seed_array(index)
    mask = _key_mask(mask_kind, batch, keys or queries, index)
    if keys is None:
        qkv = normal(index, (batch, queries, 3, heads, head_dim), dtype)
        op = lambda qkv, bias: ops.self_attention(qkv, mask, bias=bias, causal=causal, dropout_rate=rate, seed=seed)
        primals = (qkv, normal(300 + index, (3, heads, head_dim), F32))
    else:
        query = normal(index, (batch, queries, heads, head_dim), dtype)
        key_value = normal(100 + index, (batch, keys, 2, heads, head_dim), dtype)
        op = lambda q, kv, bias: ops.cross_attention(q, kv, mask, bias=bias, dropout_rate=rate, seed=seed)
        primals = (query, key_value, normal(300 + index, (heads, head_dim), F32))
    return op, primals, normal(200 + index, (batch, queries, heads, head_dim), dtype)


def _bias_grad_summed_in_f32(result):
    """The XLA backend's result with its bias gradient replaced by its query-source gradient summed in f32 (as the
    cuDNN formulation sums it); XLA's own sums the 16-bit gradient in 16 bits."""
    out, grads = result
    return out, (*grads[:-1], jnp.sum(grads[0].astype(F32), axis=(0, 1)))


def _assert_as_accurate_as_xla(run, primals, cotangent, dtype, label, xla_form=lambda result: result):
    """cuDNN's result (ffi) against the XLA backend's in f32 from the same 16-bit inputs, leaf by leaf: within the
    dtype's tolerance, or no further off than the XLA backend's own 16-bit result (``xla_form`` of it) is. Over
    thousands of keys a bf16 gradient is about 1% off in either implementation, so the 16-bit XLA result is not a
    reference to hold cuDNN to."""
    got = on_backend("ffi", run, primals, cotangent)
    xla16 = xla_form(on_backend("xla", run, primals, cotangent))
    wide = lambda x: x.astype(F32) if jnp.issubdtype(x.dtype, jnp.floating) else x
    reference = on_backend("xla", run, *jax.tree.map(wide, (primals, cotangent)))
    tolerance = TOLERANCE[jnp.dtype(dtype)]
    leaves = zip(jax.tree.leaves(got), jax.tree.leaves(xla16), jax.tree.leaves(reference))
    for index, (ours, theirs, exact) in enumerate(leaves):
        assert ours.shape == exact.shape and ours.dtype == theirs.dtype, f"{label} leaf {index}: shape or dtype"
        assert bool(jnp.all(jnp.isfinite(ours.astype(F32)))), f"{label} leaf {index}: non-finite values"
        error, xla_error = relative_error(ours, exact), relative_error(theirs, exact)
        assert error <= max(tolerance, 1.25 * xla_error), (
            f"{label} leaf {index}: relative error {error:.3g} against f32, the XLA backend's {xla_error:.3g}"
        )
    return got


# (queries, keys or None for self-attention, key mask, causal): lengths 129 to 4096, odd ones among them, cross
# attention with more and fewer queries than keys, right-padded rows (one all padding) and masks that are not prefixes.
CASES = [
    (129, None, None, False),
    (512, None, "padded", True),
    (1001, None, "scattered", False),
    (2048, None, None, True),
    (4096, None, "padded", False),
    (4095, None, "padded", True),
    (1000, 129, "scattered", False),
    (129, 2047, "padded", False),
    (511, None, "scattered", True),
    (333, 1537, None, False),
]


@pytest.mark.parametrize("head_dim", [64, 128, 40])
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize(
    "index", range(len(CASES)), ids=[f"{q}x{k or q}-{m}-{'causal' if c else 'full'}" for q, k, m, c in CASES]
)
def test_cudnn_attention_matches_xla(index, dtype, head_dim):
    queries, keys, mask_kind, causal = CASES[index]
    heads, batch = (1, 2) if (keys or queries) >= 2048 else (2, 2)
    op, primals, cotangent = _case(index, queries, keys, mask_kind, causal, dtype, head_dim, heads=heads, batch=batch)
    run = value_and_grads(op)
    assert kernel_targets(run, primals, cotangent) == TARGETS
    got = _assert_as_accurate_as_xla(
        run, primals, cotangent, dtype, f"cudnn attention {CASES[index]} {head_dim}", _bias_grad_summed_in_f32
    )
    if mask_kind == "padded":
        assert not np.asarray(got[0][-1], np.float32).any(), "the all-padding row gives zeros"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("queries, keys", [(200, 520), (131, 1037), (1, 4096), (1000, 4095)])
def test_causal_cross_attention_with_fewer_queries_is_bottom_right_aligned(queries, keys, dtype, head_dim):
    """The internal formulation with queries < keys: query q sees keys 0 .. q + K - Q (no mask, no dropout)."""
    sources = (normal(0, (2, queries, 1, 2, head_dim), dtype), normal(1, (2, keys, 2, 2, head_dim), dtype))
    run = value_and_grads(lambda q, kv: attention._cudnn_attention((q, kv), None, None, None, None, True, 0.0))
    cotangent = normal(2, (2, queries, 2, head_dim), dtype)
    assert kernel_targets(run, sources, cotangent) == TARGETS
    _assert_as_accurate_as_xla(run, sources, cotangent, dtype, f"causal cross attention {queries}x{keys} {head_dim}")


def _dropped_probabilities(rate, seed, queries=1024, keys=128, heads=2, batch=2):
    """Cross attention with v = identity over 128 keys, so out holds the dropped and rescaled probabilities
    (B, Q, H, K); also the undropped probabilities and the gradient of the values for a cotangent."""
    query = normal(30, (batch, queries, heads, keys), BF16, scale=0.3)
    keys_part = normal(31, (batch, keys, 1, heads, keys), BF16, scale=0.3)
    identity = jnp.broadcast_to(jnp.eye(keys, dtype=BF16)[None, :, None, None, :], (batch, keys, 1, heads, keys))
    key_value = jnp.concatenate([keys_part, identity], axis=2)
    cotangent = normal(32, (batch, queries, heads, keys), BF16)

    def run(q, kv):
        out, vjp = jax.vjp(lambda q, kv: ops.cross_attention(q, kv, dropout_rate=rate, seed=seed), q, kv)
        return out, vjp(cotangent)[1][:, :, 1]

    out, d_values = on_backend("ffi", run, query, key_value)
    probs = on_backend("xla", lambda q, kv: ops.cross_attention(q, kv), query, key_value)
    return out, probs, d_values, cotangent


@pytest.mark.parametrize("rate", [0.1, 0.3])
def test_dropout_keeps_one_minus_rate_and_scales_by_its_inverse(rate):
    out, probs, _, _ = _dropped_probabilities(rate, seed_array(40))
    out, probs = np.asarray(out, np.float32), np.asarray(probs, np.float32)
    assert (probs > 0).all(), "every probability is nonzero without dropout"
    kept = out != 0
    low, high = keep_rate_bounds(rate, kept.size)
    assert low <= kept.mean() <= high, f"kept fraction {kept.mean():.4f} outside [{low:.4f}, {high:.4f}]"
    scaled = probs[kept] / (1.0 - rate)
    np.testing.assert_allclose(out[kept], scaled, rtol=2e-2, atol=1e-2 * scaled.max())
    per_query = kept.mean(axis=-1)
    assert per_query.std() > 0.0, "keys are dropped independently, not whole rows"


def test_the_backward_drops_what_the_forward_dropped():
    """With v = identity, out = dropped probabilities P', so the values' gradient must be P'^T dout."""
    out, _, d_values, cotangent = _dropped_probabilities(0.2, seed_array(41))
    expected = jnp.einsum("bqhk,bqhd->bkhd", out.astype(F32), cotangent.astype(F32))
    assert_backends_agree(d_values.astype(F32), expected, BF16, "dv from the forward's dropout mask")


def test_one_seed_gives_one_result_and_another_seed_another():
    first, _, d_first, _ = _dropped_probabilities(0.1, seed_array(42))
    again, _, d_again, _ = _dropped_probabilities(0.1, seed_array(42))
    other, _, _, _ = _dropped_probabilities(0.1, seed_array(43))
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again))
    assert_backends_agree(d_again, d_first, BF16, "gradients for one seed")
    differs = np.asarray(first == 0) != np.asarray(other == 0)
    assert 0.1 < differs.mean() < 0.3, "another seed drops other elements"


def _assert_same_run(got, want, dtype, label):
    """The forward bit for bit; the gradients within the backends' tolerance (cuDNN's backward may accumulate dq in
    an order that varies between runs)."""
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    assert_backends_agree(got[1], want[1], dtype, label)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_masked_causal_self_attention_with_dropout_is_one_function_of_its_seed(dtype):
    """An odd length with padding (one row all padding), causal, dropout: the same seed twice gives the same result,
    another seed another, and the all-padding row stays zero."""
    op, primals, cotangent = _case(7, 1537, None, "padded", True, dtype, 128, rate=0.1)
    run = value_and_grads(op)
    assert kernel_targets(run, primals, cotangent) == TARGETS
    first, again = on_backend("ffi", run, primals, cotangent), on_backend("ffi", run, primals, cotangent)
    _assert_same_run(again, first, dtype, "masked causal dropout, one seed")
    other_op, _, _ = _case(8, 1537, None, "padded", True, dtype, 128, rate=0.1)  # the same mask, seed 8
    other = on_backend("ffi", value_and_grads(other_op), primals, cotangent)
    differs = np.asarray(first[0][0], np.float32) != np.asarray(other[0][0], np.float32)  # the row with keys
    assert differs.mean() > 0.5, "another seed drops other probabilities, changing most outputs"
    assert np.isfinite(np.asarray(first[0], np.float32)).all()
    assert not np.asarray(first[0][-1], np.float32).any(), "the all-padding row gives zeros"


def test_a_new_seed_each_step_reuses_one_compilation():
    query, key_value = normal(50, (1, 300, 2, 64), BF16), normal(51, (1, 300, 2, 2, 64), BF16)
    with_seed = jax.jit(lambda seed: ops.cross_attention(query, key_value, dropout_rate=0.1, seed=seed))
    with backend.use("ffi"):
        outs = [with_seed(seed_array(step)) for step in range(3)]
    assert with_seed._cache_size() == 1
    assert not np.array_equal(np.asarray(outs[0]), np.asarray(outs[1]))


def test_many_steps_reuse_the_workspace_free_it_and_repeat_their_result():
    """Twenty forward + backward steps at length 4096 allocate and free their workspace on the stream each time:
    every step runs and gives the first step's result, the pool saw the allocations (at least the 256 bytes of the
    widened seed), and once the steps are done none of its memory is still in use."""
    op, primals, cotangent = _case(9, 4096, None, "padded", True, BF16, 128, heads=4, batch=2)
    with backend.use("ffi"):
        step = jax.jit(value_and_grads(op))
        first = jax.block_until_ready(step(primals, cotangent))
        attention_cudnn.workspace_peak_bytes()  # resets the mark
        results = [step(primals, cotangent) for _ in range(20)]
        jax.block_until_ready(results)
    for result in results:
        _assert_same_run(result, first, BF16, "a later step")
    peak = attention_cudnn.workspace_peak_bytes()
    assert peak is not None and peak >= 256, f"workspace peak {peak}"
    assert attention_cudnn.workspace_peak_bytes() == 0, "every workspace was freed"


def _call_forward(query_source, key_value_source):
    out = jax.ShapeDtypeStruct((*query_source.shape[:2], *query_source.shape[3:]), query_source.dtype)
    stats = jax.ShapeDtypeStruct((query_source.shape[0], query_source.shape[3], query_source.shape[1], 1), F32)
    call = jax.ffi.ffi_call(attention_cudnn.FORWARD_TARGET, (out, stats))
    seed = jnp.zeros((2,), jnp.uint32)
    return jax.jit(
        lambda q, kv: call(q, kv, seed, causal=False, dropout_rate=np.float32(0.0), logit_scale=np.float32(0.125))
    )(query_source, key_value_source)


@pytest.mark.parametrize(
    "query_shape, key_value_shape, dtype, message",
    [
        ((1, 200, 1, 2, 64), (1, 300, 2, 2, 32), BF16, "must agree in batch, heads and head_dim"),
        ((1, 200, 1, 2, 12), (1, 300, 2, 2, 12), BF16, "head_dim a multiple of 8 up to 256, got 12"),
        ((1, 200, 1, 2, 64), (1, 300, 2, 2, 64), F32, "must be bfloat16 or float16 for cuDNN attention"),
    ],
)
def test_bad_operands_are_clear_errors(query_shape, key_value_shape, dtype, message):
    query_source, key_value_source = normal(60, query_shape, dtype), normal(61, key_value_shape, dtype)
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        jax.block_until_ready(_call_forward(query_source, key_value_source))


# ---- key lengths (right padding: cuDNN's sequence lengths without a bias), causal, cross, head_dim 128 / 256 ----


def _lengths(keys):
    """Right padding of four rows: 37 keys of padding, a row of length 0, a row of one key, a full row."""
    return jnp.array([keys - 37, 0, 1, keys], jnp.int32)


def _lengths_case(index, form, length, head_dim, dtype, rate=0.0, heads=2):
    """(op, primals, cotangent) for self-attention ("self", "causal") or cross attention ("cross": length // 2 + 1
    queries over length keys) with key lengths; primals end with the f32 projection bias of the query source."""
    seed, lengths = seed_array(index), _lengths(length)
    if form == "cross":
        queries = length // 2 + 1
        query = normal(index, (4, queries, heads, head_dim), dtype)
        key_value = normal(100 + index, (4, length, 2, heads, head_dim), dtype)
        op = lambda q, kv, bias: ops.cross_attention(
            q, kv, key_lengths=lengths, bias=bias, dropout_rate=rate, seed=seed
        )
        primals = (query, key_value, normal(300 + index, (heads, head_dim), F32))
    else:
        queries = length
        op = lambda qkv, bias: ops.self_attention(
            qkv, lengths=lengths, bias=bias, causal=form == "causal", dropout_rate=rate, seed=seed
        )
        primals = (
            normal(index, (4, length, 3, heads, head_dim), dtype),
            normal(300 + index, (3, heads, head_dim), F32),
        )
    return op, primals, normal(200 + index, (4, queries, heads, head_dim), dtype)


LENGTH_CASES = [  # (length, form, head_dim, dtype)
    (512, "self", 64, BF16),
    (1024, "causal", 64, BF16),
    (2048, "self", 128, BF16),
    (2048, "causal", 256, BF16),
    (1024, "cross", 128, BF16),
    (512, "cross", 256, BF16),
    (1031, "causal", 128, F16),
    (512, "self", 64, F32),
    (1024, "causal", 128, F32),
]


@pytest.mark.parametrize(
    "length, form, head_dim, dtype",
    LENGTH_CASES,
    ids=[f"{n}-{f}-{d}-{jnp.dtype(t).name}" for n, f, d, t in LENGTH_CASES],
)
def test_key_lengths_match_xla(length, form, head_dim, dtype):
    """bf16 / f16 run cuDNN with sequence lengths and no bias; f32 runs the unfused attention (its softmax kernels)
    with the mask the lengths stand for. A row of length 0 gives 0 output and 0 gradient of its sources."""
    op, primals, cotangent = _lengths_case(len(LENGTH_CASES) + length, form, length, head_dim, dtype)
    run = value_and_grads(op)
    want_targets = TARGETS if dtype != F32 else {"ls_attn_softmax_fwd", "ls_attn_softmax_bwd"}
    assert kernel_targets(run, primals, cotangent) == want_targets
    out, grads = _assert_as_accurate_as_xla(
        run, primals, cotangent, dtype, f"key lengths {length} {form} {head_dim}", _bias_grad_summed_in_f32
    )
    assert not np.asarray(out[1], np.float32).any(), "the row of length 0 gives zeros"
    for source_grad in grads[:-1]:
        assert not np.asarray(source_grad[1], np.float32).any(), "and its sources get no gradient"


def test_dropout_with_key_lengths_keeps_one_minus_rate_of_the_visible_keys():
    """Cross attention with v = identity over 128 keys and key lengths: out holds the dropped probabilities; keys
    past a row's length get exactly 0, the visible ones are kept with probability 1 - rate and scaled by its
    inverse, and one seed gives one result."""
    rate, batch, queries, keys = 0.2, 2, 1024, 128
    lengths = jnp.array([100, 128], jnp.int32)
    query = normal(33, (batch, queries, 2, keys), BF16, scale=0.3)
    keys_part = normal(34, (batch, keys, 1, 2, keys), BF16, scale=0.3)
    identity = jnp.broadcast_to(jnp.eye(keys, dtype=BF16)[None, :, None, None, :], (batch, keys, 1, 2, keys))
    key_value = jnp.concatenate([keys_part, identity], axis=2)

    def attend(seed, q, kv):
        return ops.cross_attention(q, kv, key_lengths=lengths, dropout_rate=rate, seed=seed)

    out = np.asarray(on_backend("ffi", lambda q, kv: attend(seed_array(44), q, kv), query, key_value), np.float32)
    again = np.asarray(on_backend("ffi", lambda q, kv: attend(seed_array(44), q, kv), query, key_value), np.float32)
    probs = np.asarray(
        on_backend("xla", lambda q, kv: ops.cross_attention(q, kv, key_lengths=lengths), query, key_value), np.float32
    )
    np.testing.assert_array_equal(out, again)
    assert not out[0, :, :, 100:].any() and not probs[0, :, :, 100:].any(), "keys past the length get nothing"
    visible = np.concatenate([out[0, :, :, :100].ravel(), out[1].ravel()])
    visible_probs = np.concatenate([probs[0, :, :, :100].ravel(), probs[1].ravel()])
    kept = visible != 0
    low, high = keep_rate_bounds(rate, kept.size)
    assert low <= kept.mean() <= high, f"kept fraction {kept.mean():.4f} outside [{low:.4f}, {high:.4f}]"
    scaled = visible_probs[kept] / (1.0 - rate)
    np.testing.assert_allclose(visible[kept], scaled, rtol=2e-2, atol=1e-2 * scaled.max())


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_causal_self_attention_with_key_lengths_and_dropout_is_one_function_of_its_seed(dtype):
    op, primals, cotangent = _lengths_case(61, "causal", 1024, 128, dtype, rate=0.1)
    run = value_and_grads(op)
    assert kernel_targets(run, primals, cotangent) == TARGETS
    first, again = on_backend("ffi", run, primals, cotangent), on_backend("ffi", run, primals, cotangent)
    _assert_same_run(again, first, dtype, "key lengths, causal, dropout, one seed")
    other = on_backend(
        "ffi", value_and_grads(_lengths_case(62, "causal", 1024, 128, dtype, rate=0.1)[0]), primals, cotangent
    )
    differs = np.asarray(first[0][3], np.float32) != np.asarray(other[0][3], np.float32)  # the full row
    assert differs.mean() > 0.5, "another seed drops other probabilities, changing most outputs"
    assert not np.asarray(first[0][1], np.float32).any(), "the row of length 0 gives zeros"


def test_every_graph_is_built_in_the_initialize_stage():
    """A configuration no other test uses runs forward and backward: its graphs come from XLA's initialize stage,
    and no execute handler of this process has built one."""
    op, primals, cotangent = _lengths_case(63, "self", 777, 64, BF16, heads=3)
    on_backend("ffi", value_and_grads(op), primals, cotangent)
    assert attention_cudnn.graphs_built_in_execute() == 0
