"""ls_jax.ops.self_attention / cross_attention against naive attention: padding, causal, dropout and layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.ops import BF16, F32, check_vjp, normal, seed_array
from test_ops_softmax import reference_attn_softmax

from ls_jax import backend, ops
from ls_jax.ops import attention
from ls_jax.ops.random import keep_mask


@pytest.fixture(params=["unfused", "fused"], autouse=True)
def formulation(request, monkeypatch):
    """Every test runs both formulations: "unfused" (the XLA backend) and "fused", the custom VJP of the CUDA
    kernels for every shape and dtype, whose XLA implementation (recomputing the probabilities from lse) runs
    when lowering for CPU."""
    if request.param == "fused":
        monkeypatch.setattr(backend, "kernels_enabled", lambda: True)
        monkeypatch.setattr(attention, "_unsupported", lambda sources: None)
    return request.param


def reference_attention(q, k, v, key_mask=None, *, causal=False, keep=None, rate=0.0):
    """softmax(q k^T / sqrt(d)) v per head, (B, Q, H, D) x (B, K, H, D) -> (B, Q, H, D), with dropout ``keep``."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    mask = None if key_mask is None else key_mask[:, None, None, :]
    probs = reference_attn_softmax(scores, mask, scale=q.shape[-1] ** -0.5, causal=causal, keep=keep, rate=rate)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def _key_mask(lengths, keys):
    return jnp.arange(keys)[None, :] < jnp.asarray(lengths)[:, None]


def _keep(seed, rate, batch, heads, queries, keys):
    return None if rate == 0.0 else keep_mask(seed, (batch, heads, queries, keys), rate)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize(
    "length, lengths, causal, rate",
    [
        (7, None, False, 0.0),
        (7, [7, 4], False, 0.3),
        (16, [16, 9], True, 0.1),
        (5, None, True, 0.2),
        (1, None, False, 0.0),
    ],
)
def test_self_attention_matches_reference(dtype, length, lengths, causal, rate):
    batch, heads, head_dim = 2, 3, 16
    qkv = normal(0, (batch, length, 3, heads, head_dim), dtype)
    key_mask = None if lengths is None else _key_mask(lengths, length)
    seed = seed_array(1)
    keep = _keep(seed, rate, batch, heads, length, length)
    op = lambda qkv: ops.self_attention(qkv, key_mask, causal=causal, dropout_rate=rate, seed=seed)
    ref = lambda qkv: reference_attention(
        qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], key_mask, causal=causal, keep=keep, rate=rate
    )
    check_vjp(op, ref, (qkv,), dtype)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("queries, keys, rate", [(3, 9, 0.0), (9, 3, 0.25), (6, 6, 0.1)])
def test_cross_attention_matches_reference(dtype, queries, keys, rate):
    batch, heads, head_dim = 2, 2, 8
    query = normal(2, (batch, queries, heads, head_dim), dtype)
    key_value = normal(3, (batch, keys, 2, heads, head_dim), dtype)
    key_mask = _key_mask([keys, max(keys - 2, 1)], keys)
    seed = seed_array(4)
    keep = _keep(seed, rate, batch, heads, queries, keys)
    op = lambda q, kv: ops.cross_attention(q, kv, key_mask, dropout_rate=rate, seed=seed)
    ref = lambda q, kv: reference_attention(q, kv[:, :, 0], kv[:, :, 1], key_mask, keep=keep, rate=rate)
    check_vjp(op, ref, (query, key_value), dtype)


@pytest.mark.parametrize("dtype, bias_dtype", [(F32, F32), (BF16, F32), (BF16, BF16)])
def test_the_projection_bias_is_added_first_and_gets_its_gradient(dtype, bias_dtype):
    batch, length, heads, head_dim, rate, seed = 2, 6, 2, 8, 0.2, seed_array(12)
    qkv = normal(13, (batch, length, 3, heads, head_dim), dtype)
    bias = normal(14, (3, heads, head_dim), bias_dtype)
    key_mask = _key_mask([6, 4], length)
    keep = _keep(seed, rate, batch, heads, length, length)
    op = lambda qkv, bias: ops.self_attention(qkv, key_mask, bias=bias, causal=True, dropout_rate=rate, seed=seed)

    def ref(qkv, bias):
        x = qkv + bias
        return reference_attention(x[:, :, 0], x[:, :, 1], x[:, :, 2], key_mask, causal=True, keep=keep, rate=rate)

    check_vjp(op, ref, (qkv, bias), dtype)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_the_query_bias_is_added_to_the_query_only(dtype):
    batch, queries, keys, heads, head_dim = 2, 5, 7, 2, 8
    query = normal(15, (batch, queries, heads, head_dim), dtype)
    key_value = normal(16, (batch, keys, 2, heads, head_dim), dtype)
    bias = normal(17, (heads, head_dim), F32)
    key_mask = _key_mask([7, 3], keys)
    op = lambda q, kv, bias: ops.cross_attention(q, kv, key_mask, bias=bias)
    ref = lambda q, kv, bias: reference_attention(q + bias, kv[:, :, 0], kv[:, :, 1], key_mask)
    check_vjp(op, ref, (query, key_value, bias), dtype)


def test_dropout_drops_the_probabilities_attn_softmax_drops():
    """With v = identity over keys, out holds the dropped probabilities themselves: the same as attn_softmax's."""
    batch, heads, length, rate, seed = 2, 2, 8, 0.4, seed_array(5)
    qk = normal(6, (batch, length, 2, heads, length), F32)
    identity = jnp.broadcast_to(jnp.eye(length)[None, :, None, :], (batch, length, heads, length))
    qkv = jnp.concatenate([qk, identity[:, :, None]], axis=2)
    out = ops.self_attention(qkv, dropout_rate=rate, seed=seed)
    scores = jnp.einsum("bqhd,bkhd->bhqk", qkv[:, :, 0], qkv[:, :, 1])
    probs = ops.attn_softmax(scores, scale=length**-0.5, dropout_rate=rate, seed=seed)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jnp.transpose(probs, (0, 2, 1, 3))), rtol=1e-5, atol=1e-7)
    assert 0.2 < float(jnp.mean(out == 0)) < 0.6


@pytest.mark.parametrize("formulation", ["fused"], indirect=True)
def test_the_fused_backward_keeps_the_packed_keep_mask_not_the_seed():
    """The fused formulation's residuals hold the dropout keep mask packed 8 keys to a byte, which its backward
    reads, and no seed."""
    qkv, rate, seed = normal(12, (2, 11, 3, 2, 8), F32), 0.3, seed_array(13)
    _, vjp = jax.vjp(lambda x: ops.self_attention(x, dropout_rate=rate, seed=seed), qkv)
    [keep_bits] = [leaf for leaf in jax.tree.leaves(vjp) if leaf.dtype in (jnp.uint8, jnp.uint32)]
    keep = np.asarray(keep_mask(seed, (2, 2, 11, 11), rate))
    np.testing.assert_array_equal(np.asarray(keep_bits), np.packbits(keep, axis=-1, bitorder="little"))


def test_a_query_with_no_visible_key_gets_zeros_and_zero_gradient():
    qkv = normal(7, (2, 4, 3, 2, 8), F32)
    key_mask = _key_mask([4, 0], 4)
    op = lambda qkv: ops.self_attention(qkv, key_mask, dropout_rate=0.1, seed=seed_array(8))
    out, vjp = jax.vjp(op, qkv)
    (dqkv,) = vjp(jnp.ones_like(out))
    assert np.all(np.asarray(out[1]) == 0.0) and np.any(np.asarray(out[0]) != 0.0)
    assert np.all(np.isfinite(np.asarray(dqkv)))
    assert np.all(np.asarray(dqkv[1]) == 0.0)


def test_gradients_keep_the_packed_layouts():
    qkv, query = normal(9, (1, 3, 3, 2, 4), BF16), normal(10, (1, 2, 2, 4), BF16)
    key_value = normal(11, (1, 3, 2, 2, 4), BF16)
    (dqkv,) = jax.grad(lambda x: ops.self_attention(x).astype(F32).sum(), argnums=(0,))(qkv)
    dq, dkv = jax.grad(lambda q, kv: ops.cross_attention(q, kv).astype(F32).sum(), argnums=(0, 1))(query, key_value)
    assert (dqkv.shape, dqkv.dtype) == (qkv.shape, BF16)
    assert (dq.shape, dkv.shape) == (query.shape, key_value.shape)
    assert np.any(np.asarray(dkv[:, :, 1], np.float32) != 0.0)


def _bad_call(qkv=None, query=None, key_value=None, key_mask=None, **kwargs):
    if query is None:
        return ops.self_attention(normal(0, (2, 4, 3, 2, 8)) if qkv is None else qkv, key_mask, **kwargs)
    key_value = normal(1, (2, 5, 2, 2, 8)) if key_value is None else key_value
    return ops.cross_attention(query, key_value, key_mask, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(qkv=jnp.zeros((2, 4, 3, 2, 8), jnp.int32)), "qkv must be float32, bfloat16 or float16, got int32"),
        (dict(qkv=jnp.zeros((2, 4, 2, 2, 8))), r"qkv must have shape \(batch, length, 3, heads, head_dim\)"),
        (dict(key_mask=jnp.ones((2, 5), bool)), r"key_mask must have shape \(batch, keys\) = \(2, 4\), got \(2, 5\)"),
        (dict(dropout_rate=0.1), "dropout_rate > 0 needs a seed"),
        (
            dict(query=jnp.zeros((2, 3, 2, 8)), key_value=jnp.zeros((2, 5, 3, 2, 8))),
            r"key_value must have shape \(batch, keys, 2, heads, head_dim\) = \(2, keys, 2, 2, 8\)",
        ),
        (dict(query=jnp.zeros((2, 3, 2, 8), BF16)), "key_value has dtype float32 but query has bfloat16"),
        (dict(query=jnp.zeros((2, 3, 16))), r"query must have shape \(batch, queries, heads, head_dim\)"),
        (dict(bias=jnp.zeros((2, 8))), r"bias must have shape \(3, 2, 8\), got \(2, 8\)"),
        (dict(query=jnp.zeros((2, 3, 2, 8)), bias=jnp.zeros((3, 2, 8))), r"bias must have shape \(2, 8\)"),
        (dict(bias=jnp.zeros((3, 2, 8), jnp.float16)), "bias must be float32, got float16"),
    ],
)
def test_bad_inputs_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _bad_call(**kwargs)
