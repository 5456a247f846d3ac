"""CPU: attention at lengths 1 to 4096 against a float64 numpy reference (values and gradients, f32), for the XLA
backend (the unfused attention) and the XLA implementation of the cuDNN formulation; the cuDNN formulation's mask
operands; and lowering for CUDA to the cuDNN targets, or to the unfused fallback with its reason."""

import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.ops import normal, seed_array

import ffi_kernels
from ls_jax import backend, ops
from ls_jax.ops import _common, attention, attention_cudnn

F32, BF16 = jnp.float32, jnp.bfloat16


def reference(q, k, v, key_mask, causal, dout):
    """float64 numpy (out, dq, dk, dv) of softmax(q k^T / sqrt(d) + masks) v; a row with no visible key gives 0."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    scale = q.shape[-1] ** -0.5
    queries, keys = q.shape[1], k.shape[1]
    visible = np.ones((q.shape[0], 1, queries, keys), bool)
    if key_mask is not None:
        visible &= np.asarray(key_mask)[:, None, None, :]
    if causal:
        visible &= np.arange(keys)[None, :] <= np.arange(queries)[:, None] + (keys - queries)
    q, k, v, dout = (np.transpose(x, (0, 2, 1, 3)) for x in (q, k, v, dout))  # (B, H, L, D)
    logits = np.where(visible, q @ np.swapaxes(k, -1, -2) * scale, -np.inf)
    row_max = np.max(logits, axis=-1, keepdims=True)
    exp = np.exp(logits - np.where(np.isfinite(row_max), row_max, 0.0))
    total = exp.sum(axis=-1, keepdims=True)
    probs = np.where(total > 0, exp / np.where(total > 0, total, 1.0), 0.0)
    dp = dout @ np.swapaxes(v, -1, -2)
    dscores = probs * (dp - np.sum(dp * probs, axis=-1, keepdims=True)) * scale
    grads = (probs @ v, dscores @ k, np.swapaxes(dscores, -1, -2) @ q, np.swapaxes(probs, -1, -2) @ dout)
    return tuple(np.transpose(x, (0, 2, 1, 3)) for x in grads)  # out, dq, dk, dv as (B, L, H, D)


def _mask(kind, batch, keys, rng):
    """A (B, K) key mask: None, a prefix per row ("prefix", with one row all padding), or random ("scattered")."""
    if kind is None:
        return None
    if kind == "prefix":
        lengths = [max(keys // (b + 1) - 1, 0) for b in range(batch)]
        return jnp.arange(keys)[None, :] < jnp.asarray(lengths)[:, None]
    mask = rng.random((batch, keys)) < 0.6
    mask[-1] = False  # a row with no visible key
    return jnp.asarray(mask)


# (batch, heads, head_dim, queries, keys or None for self-attention, mask kind, causal). Large lengths keep batch,
# heads and head_dim tiny; odd lengths; causal with queries != keys goes through the internal formulation.
CASES = [
    (2, 2, 8, 1, None, None, False),
    (2, 1, 8, 7, None, "prefix", True),
    (2, 2, 16, 129, None, "scattered", False),
    (1, 2, 8, 5, 300, "prefix", False),
    (2, 1, 8, 333, 17, "scattered", False),
    (2, 1, 8, 1000, None, "scattered", True),
    (1, 1, 8, 4096, None, "prefix", True),
    (2, 1, 8, 17, 1031, None, True),  # causal, fewer queries than keys: the diagonal from the bottom right
    (2, 2, 8, 1031, 17, "scattered", True),  # causal, more queries: the first 1014 see no key
]


def _operands(index, case):
    batch, heads, head_dim, queries, keys, mask_kind, causal = case
    rng = np.random.default_rng(index)
    if keys is None:
        sources = (normal(index, (batch, queries, 3, heads, head_dim)),)
        keys = queries
    else:
        sources = (
            normal(index, (batch, queries, 1, heads, head_dim)),
            normal(50 + index, (batch, keys, 2, heads, head_dim)),
        )
    bias = normal(70 + index, sources[0].shape[2:], scale=0.5)
    return sources, bias, _mask(mask_kind, batch, keys, rng), normal(90 + index, (batch, queries, heads, head_dim))


def _public_op(sources, bias, key_mask, causal):
    if len(sources) == 1:
        return ops.self_attention(sources[0], key_mask, bias=bias, causal=causal)
    return ops.cross_attention(sources[0][:, :, 0], sources[1], key_mask, bias=bias[0])


def _cudnn_formulation_op(sources, bias, key_mask, causal):
    return attention._cudnn_attention(sources, bias, key_mask, None, None, causal, 0.0)


@functools.cache
def _expected(index):
    sources, bias, key_mask, dout = _operands(index, CASES[index])
    q, k, v = (np.asarray(x) for x in attention._split(sources, bias))
    return reference(q, k, v, key_mask, CASES[index][-1], dout)


def _check_against_reference(op, index, case):
    sources, bias, key_mask, dout = _operands(index, case)
    causal = case[-1]

    @jax.jit
    def run(sources, bias, key_mask, dout):
        out, vjp = jax.vjp(lambda s, b: op(s, b, key_mask, causal), sources, bias)
        return out, vjp(dout)

    out, (d_sources, d_bias) = run(sources, bias, key_mask, dout)
    want_out, dq, dk, dv = _expected(index)
    np.testing.assert_allclose(out, want_out, rtol=2e-4, atol=2e-5 * np.abs(want_out).max())
    want_sources = attention._join(sources, dq, dk, dv)
    for got, want in zip(d_sources, want_sources):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5 * np.abs(want).max())
    want_bias = np.sum(want_sources[0], axis=(0, 1))
    np.testing.assert_allclose(
        np.reshape(d_bias, want_bias.shape), want_bias, rtol=2e-4, atol=2e-5 * np.abs(want_bias).max()
    )
    if key_mask is not None and not np.asarray(key_mask[-1]).any():
        assert not np.asarray(out[-1]).any(), "a row with no visible key gives zeros"
    if causal and case[4] is not None and case[3] > case[4]:
        assert not np.asarray(out[:, : case[3] - case[4]]).any(), "causal queries before the first key give zeros"


_PUBLIC = [index for index, case in enumerate(CASES) if not (case[-1] and case[4] is not None)]  # cross: not causal


def _case_id(index: int) -> str:
    _, _, _, queries, keys, mask_kind, causal = CASES[index]
    return f"{queries}x{keys or queries}-{mask_kind}-{causal}"


@pytest.mark.parametrize("index", _PUBLIC, ids=[_case_id(i) for i in _PUBLIC])
def test_xla_attention_matches_float64_reference(index):
    _check_against_reference(_public_op, index, CASES[index])


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(i) for i in range(len(CASES))])
def test_cudnn_formulation_xla_implementation_matches_float64_reference(index):
    _check_against_reference(_cudnn_formulation_op, index, CASES[index])


def _fused_formulation_op(sources, bias, key_mask, causal):
    return attention._attention(sources, bias, key_mask, None, causal, 0.0)


_UP_TO_1031 = [index for index, case in enumerate(CASES) if max(case[3], case[4] or 0) <= 1031]


@pytest.mark.parametrize("index", _UP_TO_1031, ids=[_case_id(i) for i in _UP_TO_1031])
def test_fused_formulation_xla_implementation_matches_float64_reference(index):
    """The XLA implementation of the fused kernels' formulation (what a computation lowered elsewhere runs) at any
    length, including causal with queries != keys."""
    _check_against_reference(_fused_formulation_op, index, CASES[index])


def test_causal_with_fewer_queries_than_keys_is_bottom_right_aligned():
    """Query q sees keys 0 .. q + K - Q: the last query every key, the first K - Q + 1 keys."""
    sources = (normal(0, (1, 3, 1, 1, 8)), normal(1, (1, 5, 2, 1, 8)))
    out = _cudnn_formulation_op(sources, None, None, True)
    q, k, v = attention._split(sources, None)
    np.testing.assert_allclose(out, reference(q, k, v, None, True, np.zeros(q.shape))[0], rtol=1e-5, atol=1e-6)
    first_only_sees_three = reference(q[:, :1], k[:, :3], v[:, :3], None, False, np.zeros(q[:, :1].shape))[0]
    np.testing.assert_allclose(out[:, :1], first_only_sees_three, rtol=1e-5, atol=1e-6)


def test_cudnn_mask_operands_are_exact_for_any_mask():
    key_mask = jnp.array([[1, 1, 1, 0, 0, 0, 0, 0, 0], [0, 1, 0, 1, 0, 0, 0, 0, 0], [0] * 9], bool)
    seq_len_q, seq_len_kv, bias = attention_cudnn._mask_operands(key_mask, None, 4, BF16)
    np.testing.assert_array_equal(seq_len_q, [4, 4, 4])
    np.testing.assert_array_equal(seq_len_kv, [3, 4, 1])  # 1 + the last visible key, at least 1
    assert bias.shape == (3, 16) and bias.dtype == BF16, "rows padded to 16 bytes"
    bias = np.asarray(bias, np.float32)
    np.testing.assert_array_equal(bias[:, :9] == 0, key_mask)
    assert bias[:, :9][~np.asarray(key_mask)].max() < -2e4
    visible = attention_cudnn._visible_rows(key_mask, None, 9, causal=True)
    np.testing.assert_array_equal(visible[1], [False] + [True] * 8)
    assert not np.asarray(visible[2]).any() and np.asarray(visible[0]).all()
    np.testing.assert_array_equal(
        attention_cudnn._visible_rows(key_mask, None, 2, causal=False), [[1, 1], [1, 1], [0, 0]]
    )


@pytest.fixture
def kernels_enabled(monkeypatch):
    """Ops dispatch to the kernels; lowering for CUDA then needs no GPU (nothing is compiled or run)."""
    monkeypatch.setattr(backend, "kernels_enabled", lambda: True)
    monkeypatch.setattr(ffi_kernels, "sm_count", lambda: 132)
    monkeypatch.setattr(attention_cudnn, "_compute_capability", lambda: "9.0")
    monkeypatch.delenv(attention.CUDNN_ENV_VAR, raising=False)


def _lowered_targets(op, *primals):
    def run(*primals):
        out, vjp = jax.vjp(op, *primals)
        return out, vjp(jnp.ones_like(out))

    text = jax.jit(run).trace(*primals).lower(lowering_platforms=("cuda",)).as_text()
    return set(re.findall(r"custom_call @(ls_\w+)", text)), text


def test_long_attention_lowers_to_the_cudnn_targets(kernels_enabled, monkeypatch):
    monkeypatch.setattr(attention_cudnn, "missing", lambda: None)
    qkv, mask = normal(0, (2, 200, 3, 4, 128), BF16), jnp.arange(200)[None, :] < jnp.array([[150], [200]])
    op = lambda x: ops.self_attention(x, mask, causal=True, dropout_rate=0.1, seed=seed_array(0))
    targets, text = _lowered_targets(op, qkv)
    assert targets == {"ls_attention_cudnn_fwd", "ls_attention_cudnn_bwd"}
    assert "causal = true, dropout_rate = 1.000000e-01 : f32, logit_scale = 0.0883883461 : f32" in text
    assert "tensor<2x200x3x4x128xbf16>" in text and "tensor<2x4x200x1xf32>" in text
    assert "tensor<2x200xbf16>" in text, "mask_bias rows of 200 keys (a multiple of 8)"
    short_but_wide = normal(1, (2, 64, 3, 4, 256), jnp.float16)
    assert _lowered_targets(lambda x: ops.self_attention(x), short_but_wide)[0] == {
        "ls_attention_cudnn_fwd",
        "ls_attention_cudnn_bwd",
    }, "head_dim 256 on compute capability 9.x"


@pytest.mark.parametrize(
    "dtype, head_dim, reason",
    [
        (F32, 64, "cuDNN attention takes bfloat16 or float16"),
        (BF16, 20, "a multiple of 8, got 20"),
        (BF16, 264, "up to 128 (up to 256 on compute capability 9.x"),
    ],
)
def test_shapes_cudnn_does_not_take_fall_back_to_the_unfused_attention(
    kernels_enabled, monkeypatch, caplog, dtype, head_dim, reason
):
    monkeypatch.setattr(attention_cudnn, "missing", lambda: None)
    _common.log_fallback_once.cache_clear()
    qkv = normal(0, (1, 130, 3, 2, head_dim), dtype)
    with caplog.at_level(logging.WARNING, logger="ls_jax.ops"):
        targets, _ = _lowered_targets(lambda x: ops.self_attention(x, causal=True), qkv)
    assert targets == {"ls_attn_softmax_fwd", "ls_attn_softmax_bwd"}
    assert reason in caplog.text and "running the unfused attention" in caplog.text


def test_missing_cudnn_package_falls_back_in_auto_mode_and_is_an_error_under_ffi(kernels_enabled, monkeypatch, caplog):
    missing = "cuDNN attention needs the cuDNN frontend headers: pip install nvidia-cudnn-frontend (or ls-jax[gpu])"
    monkeypatch.setattr(attention_cudnn, "missing", lambda: missing)
    _common.log_fallback_once.cache_clear()
    qkv = normal(0, (1, 300, 3, 2, 64), BF16)
    with backend.use("auto"), caplog.at_level(logging.WARNING, logger="ls_jax.ops"):
        targets, _ = _lowered_targets(lambda x: ops.self_attention(x), qkv)
    assert targets == {"ls_attn_softmax_fwd", "ls_attn_softmax_bwd"} and "nvidia-cudnn-frontend" in caplog.text
    with backend.use("ffi"), pytest.raises(backend.KernelsUnavailableError, match="pip install nvidia-cudnn-frontend"):
        _lowered_targets(lambda x: ops.self_attention(x), qkv)


def test_cudnn_shape_reasons_name_the_limit(kernels_enabled):
    def reason(query_shape, key_value_shape, masked=False, causal=False, rate=0.0, dtype=BF16):
        sources = (jnp.zeros(query_shape, dtype), jnp.zeros(key_value_shape, dtype))
        return attention_cudnn.shape_reason(sources, masked, causal, rate)

    assert reason((1, 300, 1, 2, 128), (1, 500, 2, 2, 128)) is None
    assert "single query over a single key" in reason((1, 1, 1, 2, 128), (1, 1, 2, 2, 128))
    assert reason((1, 300, 1, 2, 64), (1, 500, 2, 2, 64), causal=True) is None, "bottom-right diagonal"
    assert "takes queries < keys, no key mask and no dropout" in reason(
        (1, 300, 1, 2, 64), (1, 500, 2, 2, 64), True, causal=True
    )
    assert "takes queries < keys" in reason((1, 600, 1, 2, 64), (1, 500, 2, 2, 64), causal=True)
    assert "takes queries < keys" in reason((1, 300, 1, 2, 64), (1, 500, 2, 2, 64), causal=True, rate=0.1)


def test_cudnn_attention_is_the_default_and_the_env_var_turns_it_off(kernels_enabled, monkeypatch, caplog):
    """Long attention lowers to cuDNN by default; LS_JAX_CUDNN_ATTENTION=0 gives the unfused kernels, saying why
    once; any other value is an error naming the variable."""
    monkeypatch.setattr(attention_cudnn, "missing", lambda: None)
    _common.log_fallback_once.cache_clear()
    qkv = jnp.ones((1, 256, 3, 2, 64), jnp.bfloat16)
    lowered = lambda: jax.jit(lambda x: ops.self_attention(x)).trace(qkv).lower(lowering_platforms=("cuda",)).as_text()
    assert "ls_attention_cudnn_fwd" in lowered()
    monkeypatch.setenv(attention.CUDNN_ENV_VAR, "0")
    with caplog.at_level(logging.WARNING, logger="ls_jax.ops"):
        text = lowered()
    assert "ls_attention_cudnn_fwd" not in text and "ls_attn_softmax_fwd" in text
    assert f"{attention.CUDNN_ENV_VAR}=0" in caplog.text
    monkeypatch.setenv(attention.CUDNN_ENV_VAR, "off")
    with pytest.raises(ValueError, match=f"{attention.CUDNN_ENV_VAR} must be 0 .* or 1 .*got 'off'"):
        lowered()
