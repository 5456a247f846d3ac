"""CPU: key lengths (right padding) against the boolean key mask they stand for, values and gradients, f32 and bf16,
for the public ops (the XLA backend) and the XLA implementation of the cuDNN formulation; rows of length 0; causal
and cross attention; bad lengths as ValueErrors naming the problem; and lowering for CUDA to the cuDNN targets with
sequence lengths and no bias tensor."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.ops import normal

import ffi_kernels
from ls_jax import backend, ops
from ls_jax.ops import attention, attention_cudnn, attention_lengths

F32, BF16 = jnp.float32, jnp.bfloat16
LENGTHS = [37, 0, 64, 1]  # a row of length 0, a full row, a row of one key


def _mask(lengths, keys):
    return jnp.arange(keys)[None, :] < jnp.asarray(lengths)[:, None]


def _self_op(causal):
    def with_mask(qkv, bias, mask):
        return ops.self_attention(qkv, mask, bias=bias, causal=causal)

    def with_lengths(qkv, bias, lengths):
        return ops.self_attention(qkv, lengths=lengths, bias=bias, causal=causal)

    return with_mask, with_lengths


def _cross_op():
    def with_mask(sources, bias, mask):
        return ops.cross_attention(sources[0], sources[1], mask, bias=bias)

    def with_lengths(sources, bias, lengths):
        return ops.cross_attention(sources[0], sources[1], key_lengths=lengths, bias=bias)

    return with_mask, with_lengths


def _cudnn_formulation_op(causal):
    def with_mask(qkv, bias, mask):
        return attention._cudnn_attention((qkv,), bias, mask, None, None, causal, 0.0)

    def with_lengths(qkv, bias, lengths):
        return attention._cudnn_attention((qkv,), bias, None, jnp.asarray(lengths, jnp.int32), None, causal, 0.0)

    return with_mask, with_lengths


def _value_and_grads(op, primals, mask_or_lengths, cotangent):
    @jax.jit
    def run(primals, mask_or_lengths, cotangent):
        out, vjp = jax.vjp(lambda *p: op(*p, mask_or_lengths), *primals)
        return out, vjp(cotangent)

    return run(primals, mask_or_lengths, cotangent)


def _assert_lengths_match_mask(ops_pair, primals, keys, queries, dtype):
    with_mask, with_lengths = ops_pair
    lengths = np.asarray(LENGTHS, np.int32)
    cotangent = normal(9, (len(LENGTHS), queries, 2, 16), dtype)
    want = _value_and_grads(with_mask, primals, _mask(lengths, keys), cotangent)
    got = _value_and_grads(with_lengths, primals, jnp.asarray(lengths), cotangent)
    for got_leaf, want_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert got_leaf.dtype == want_leaf.dtype
        np.testing.assert_array_equal(np.asarray(got_leaf, np.float32), np.asarray(want_leaf, np.float32))
    out, (d_source, *_) = got
    assert not np.asarray(out[1], np.float32).any(), "a row of length 0 gives zeros"
    d_rows = d_source[0] if isinstance(d_source, tuple) else d_source
    assert not np.asarray(d_rows[1], np.float32).any(), "and no gradient"
    assert np.isfinite(np.asarray(out, np.float32)).all()


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_lengths_equal_the_prefix_mask(dtype, causal):
    primals = (normal(0, (4, 64, 3, 2, 16), dtype), normal(1, (3, 2, 16), F32, scale=0.5))
    _assert_lengths_match_mask(_self_op(causal), primals, 64, 64, dtype)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_cross_attention_key_lengths_equal_the_prefix_mask(dtype):
    primals = (
        (normal(2, (4, 24, 2, 16), dtype), normal(3, (4, 64, 2, 2, 16), dtype)),
        normal(4, (2, 16), F32, scale=0.5),
    )
    _assert_lengths_match_mask(_cross_op(), primals, 64, 24, dtype)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_formulation_xla_implementation_takes_lengths_as_the_prefix_mask(dtype, causal):
    """What the cuDNN formulation computes on a platform without the kernels, at a length beyond the fused ones."""
    primals = (normal(5, (4, 200, 3, 2, 16), dtype), normal(6, (3, 2, 16), F32, scale=0.5))
    with_mask, with_lengths = _cudnn_formulation_op(causal)
    lengths = np.asarray([150, 0, 200, 1], np.int32)
    cotangent = normal(7, (4, 200, 2, 16), dtype)
    want = _value_and_grads(with_mask, primals, _mask(lengths, 200), cotangent)
    got = _value_and_grads(with_lengths, primals, lengths, cotangent)
    for got_leaf, want_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(got_leaf, np.float32), np.asarray(want_leaf, np.float32))
    assert not np.asarray(got[0][1], np.float32).any() and not np.asarray(got[1][0][1], np.float32).any()


def test_lengths_mask_is_the_prefix():
    np.testing.assert_array_equal(
        attention_lengths.lengths_mask(jnp.array([0, 2, 3]), 3), [[0, 0, 0], [1, 1, 0], [1, 1, 1]]
    )


@pytest.mark.parametrize(
    "lengths, message",
    [
        (np.array([3, 4, 5]), r"lengths must have shape \(batch,\) = \(2,\), got \(3,\)"),
        (np.array([[3], [4]]), r"lengths must have shape \(batch,\) = \(2,\), got \(2, 1\)"),
        (np.array([3.0, 4.0]), "lengths must be an integer array .* got float"),
        (np.array([True, False]), "lengths must be an integer array .* got bool"),
        (np.array([3, 9]), r"lengths must be in \[0, 8\] \(the number of keys\), got values from 3 to 9"),
        (np.array([-1, 2]), r"lengths must be in \[0, 8\]"),
    ],
)
def test_bad_lengths_are_value_errors_naming_the_problem(lengths, message):
    qkv = jnp.zeros((2, 8, 3, 1, 8))
    with pytest.raises(ValueError, match=message):
        ops.self_attention(qkv, lengths=lengths)


def test_key_mask_and_lengths_together_are_an_error():
    qkv, mask = jnp.zeros((2, 8, 3, 1, 8)), jnp.ones((2, 8), bool)
    with pytest.raises(ValueError, match="pass either key_mask .* or lengths .*, not both"):
        ops.self_attention(qkv, mask, lengths=jnp.array([8, 8]))
    query, key_value = jnp.zeros((2, 4, 1, 8)), jnp.zeros((2, 8, 2, 1, 8))
    with pytest.raises(ValueError, match="pass either key_mask .* or key_lengths .*, not both"):
        ops.cross_attention(query, key_value, mask, key_lengths=jnp.array([8, 8]))
    with pytest.raises(ValueError, match=r"key_lengths must be in \[0, 8\]"):
        ops.cross_attention(query, key_value, key_lengths=np.array([8, 9]))


def test_traced_lengths_outside_the_range_are_clipped():
    """Under jit the values cannot be checked: a length past L means every key, a negative one none."""
    qkv = normal(8, (2, 8, 3, 1, 8))
    run = jax.jit(lambda lengths: ops.self_attention(qkv, lengths=lengths))
    np.testing.assert_array_equal(run(jnp.array([-3, 11])), run(jnp.array([0, 8])))


@pytest.fixture
def kernels_enabled(monkeypatch):
    """Ops dispatch to the kernels; lowering for CUDA then needs no GPU (nothing is compiled or run)."""
    monkeypatch.setattr(backend, "kernels_enabled", lambda: True)
    monkeypatch.setattr(ffi_kernels, "sm_count", lambda: 132)
    monkeypatch.setattr(attention_cudnn, "_compute_capability", lambda: "9.0")
    monkeypatch.setattr(attention_cudnn, "missing", lambda: None)
    monkeypatch.delenv(attention.CUDNN_ENV_VAR, raising=False)


def _cudnn_calls(op, *primals):
    """The operand types of each ls_attention_cudnn_* custom call of op's forward and backward lowered for CUDA."""

    def run(*primals):
        out, vjp = jax.vjp(op, *primals)
        return out, vjp(jnp.ones_like(out))

    text = jax.jit(run).trace(*primals).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @(ls_attention_cudnn_\w+)\(([^)]*)\)[^\n]*: \(([^)]*)\)", text)
    assert {name for name, _, _ in calls} == {"ls_attention_cudnn_fwd", "ls_attention_cudnn_bwd"}, text
    return {name: types for name, _, types in calls}


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_lengths_lower_to_cudnn_sequence_lengths_without_a_bias(kernels_enabled, head_dim, causal):
    qkv = normal(0, (2, 200, 3, 2, head_dim), BF16)
    calls = _cudnn_calls(lambda x: ops.self_attention(x, lengths=jnp.array([150, 0]), causal=causal), qkv)
    for name, types in calls.items():
        assert types.count("tensor<2xi32>") == 2, f"{name}: seq_len_q and seq_len_kv ({types})"
        assert "tensor<2x200xbf16>" not in types, f"{name}: no mask_bias operand ({types})"
    masked = _cudnn_calls(lambda x: ops.self_attention(x, jnp.arange(200)[None, :] < jnp.array([[150], [0]])), qkv)
    assert all("tensor<2x200xbf16>" in types for types in masked.values()), "a key mask keeps its bias"


def test_cross_attention_key_lengths_lower_without_a_bias(kernels_enabled):
    query, key_value = normal(0, (2, 130, 2, 64), BF16), normal(1, (2, 300, 2, 2, 64), BF16)
    calls = _cudnn_calls(lambda q, kv: ops.cross_attention(q, kv, key_lengths=jnp.array([300, 7])), query, key_value)
    for types in calls.values():
        assert types.count("tensor<2xi32>") == 2 and "bf16>" in types and "tensor<2x304xbf16>" not in types


def test_no_mask_lowers_without_length_or_bias_operands(kernels_enabled):
    calls = _cudnn_calls(lambda x: ops.self_attention(x, causal=True), normal(0, (2, 200, 3, 2, 128), BF16))
    assert all("xi32>" not in types for types in calls.values()), "the seed (ui32) only"
