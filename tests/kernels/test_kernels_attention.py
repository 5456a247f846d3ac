"""GPU: the fused attention kernels (ls_attention_fwd / _bwd) against the XLA backend (the unfused attention)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.kernels import assert_backends_agree, kernel_targets, on_backend, value_and_grads
from helpers.ops import normal, seed_array

import ffi_kernels
from ls_jax import ops
from ls_jax.ops import _common, random

pytestmark = pytest.mark.gpu

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
TARGETS = {"ls_attention_fwd", "ls_attention_bwd"}


def _key_mask(lengths, keys):
    return jnp.arange(keys)[None, :] < jnp.asarray(lengths)[:, None]


# (queries, keys or None for self-attention, key lengths or None, causal, dropout rate): both register sizes
# (keys <= 64 and <= 128), lengths that are not multiples of 16 or of 4 (per-element Philox), more queries than
# keys, a single position and a fully masked batch element.
CASES = [
    (64, None, [64, 30], False, 0.1),
    (7, None, None, True, 0.1),
    (128, None, [128, 77], True, 0.1),
    (100, None, None, False, 0.2),
    (1, None, None, False, 0.0),
    (64, 128, [128, 50], False, 0.1),
    (128, 40, [40, 0], False, 0.1),
    (3, 66, None, False, 0.0),
    (18, 18, [17, 18], False, 0.3),
]


def _case(index, case, dtype, heads=4, head_dim=64, batch=2):
    """(op, primals, cotangent) of a case; the op closes over the mask, rate and seed. The primals end with the
    f32 projection bias of the query source (qkv's (3, heads, 64) or the query's (heads, 64))."""
    queries, keys, lengths, causal, rate = case
    seed = seed_array(index)
    if keys is None:
        qkv = normal(index, (batch, queries, 3, heads, head_dim), dtype)
        mask = None if lengths is None else _key_mask(lengths, queries)
        op = lambda qkv, bias: ops.self_attention(qkv, mask, bias=bias, causal=causal, dropout_rate=rate, seed=seed)
        primals = (qkv, normal(300 + index, (3, heads, head_dim), F32))
    else:
        query = normal(index, (batch, queries, heads, head_dim), dtype)
        key_value = normal(100 + index, (batch, keys, 2, heads, head_dim), dtype)
        mask = None if lengths is None else _key_mask(lengths, keys)
        op = lambda q, kv, bias: ops.cross_attention(q, kv, mask, bias=bias, dropout_rate=rate, seed=seed)
        primals = (query, key_value, normal(300 + index, (heads, head_dim), F32))
    cotangent = normal(200 + index, (batch, queries, heads, head_dim), dtype)
    return op, primals, cotangent


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("index", range(len(CASES)))
def test_attention_matches_xla(dtype, index):
    op, primals, cotangent = _case(index, CASES[index], dtype)
    run = value_and_grads(op)
    assert kernel_targets(run, primals, cotangent) == TARGETS
    got, want = on_backend("ffi", run, primals, cotangent), on_backend("xla", run, primals, cotangent)
    assert_backends_agree(got, _bias_grad_summed_in_f32(want), dtype, f"attention{CASES[index]}")


@pytest.mark.parametrize("queries, keys", [(128, None), (64, 100)])
def test_blocks_that_compute_several_heads_match_xla(queries, keys):
    """Over 64 keys, with eight (batch, head) blocks per SM, more than fit at once: each GPU block computes several
    in turn, copying the next one's tiles while it computes the current one. Key lengths differ per batch
    element."""
    heads = 16
    batch = 8 * jax.devices()[0].core_count // heads
    lengths = [1 + (7 * b) % (keys or queries) for b in range(batch)]
    case = (queries, keys, lengths, keys is None, 0.1)
    op, primals, cotangent = _case(40, case, BF16, heads=heads, batch=batch)
    run = value_and_grads(op)
    got, want = on_backend("ffi", run, primals, cotangent), on_backend("xla", run, primals, cotangent)
    assert_backends_agree(got, _bias_grad_summed_in_f32(want), BF16, f"{batch} x {heads} heads {case[:2]}")


@pytest.mark.parametrize("index", [i for i, case in enumerate(CASES) if case[-1] > 0])
def test_the_backward_reads_the_keep_mask_the_forward_stored(index):
    """The forward saves its dropout keep mask for the backward, bit for bit numpy's packbits of the Philox keep
    mask (bitorder little, zero padding bits), for key counts a multiple of 8 (one Philox call per 8 keys) and not
    (a call per element), and for query counts that leave a warp's rows unused; no seed is saved."""
    queries, keys, _, _, rate = CASES[index]
    op, primals, _ = _case(index, CASES[index], BF16)

    def saved(*primals):
        return [leaf for leaf in jax.tree.leaves(jax.vjp(op, *primals)[1]) if leaf.dtype in (jnp.uint8, jnp.uint32)]

    [keep_bits] = on_backend("ffi", saved, *primals)
    batch, heads = primals[0].shape[0], primals[-1].shape[-2]
    keep = random.keep_mask(seed_array(index), (batch, heads, queries, keys or queries), rate)
    np.testing.assert_array_equal(np.asarray(keep_bits), np.packbits(np.asarray(keep), axis=-1, bitorder="little"))


def test_the_backward_rejects_a_keep_mask_of_the_wrong_shape():
    ffi_kernels.load()  # the target is called directly, not through an op that loads the library
    qkv, dout = normal(0, (1, 16, 3, 2, 64), BF16), normal(1, (1, 16, 2, 64), BF16)
    lse, bias = jnp.zeros((1, 2, 16), F32), jnp.zeros((3, 2, 64), BF16)
    outputs = (jax.ShapeDtypeStruct(qkv.shape, BF16), jax.ShapeDtypeStruct((1, 1, 3, 2, 64), F32))
    call = jax.ffi.ffi_call("ls_attention_bwd", outputs)
    backward = jax.jit(
        lambda keep_bits: call(
            dout,
            qkv,
            qkv,
            bias,
            lse,
            keep_bits,
            causal=False,
            logit_scale=np.float32(0.125),
            **random.dropout_attributes(0.1),
        )
    )
    message = r"keep_bits must have shape \(1, 2, 16, 2\), got \(1, 2, 16, 16\)"
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        jax.block_until_ready(backward(jnp.zeros((1, 2, 16, 16), jnp.uint8)))


def _bias_grad_summed_in_f32(result):
    """The XLA backend's result with its bias gradient replaced by its query-source gradient summed in f32: XLA's
    own bias gradient reduces that bf16/f16 gradient in bf16/f16 (1% off over 256 rows), the kernels sum in f32."""
    out, grads = result
    return out, (*grads[:-1], jnp.sum(grads[0].astype(F32), axis=(0, 1)))


def test_dropout_drops_the_probabilities_attn_softmax_drops():
    """With v = identity over 64 keys, out holds the dropped probabilities: zero exactly where the XLA
    attn_softmax (the same Philox mask of (B, H, Q, K)) drops."""
    batch, heads, length, rate, seed = 2, 3, 64, 0.3, seed_array(20)
    qk = normal(21, (batch, length, 2, heads, length), BF16)
    identity = jnp.broadcast_to(jnp.eye(length, dtype=BF16)[None, :, None, :], (batch, length, heads, length))
    qkv = jnp.concatenate([qk, identity[:, :, None]], axis=2)
    out = on_backend("ffi", lambda x: ops.self_attention(x, dropout_rate=rate, seed=seed), qkv)

    def dropped_probs(qkv):
        scores = jnp.einsum("bqhd,bkhd->bhqk", qkv[:, :, 0], qkv[:, :, 1])
        return ops.attn_softmax(scores.astype(F32), scale=length**-0.5, dropout_rate=rate, seed=seed)

    probs = on_backend("xla", dropped_probs, qkv)
    expected_zero = np.asarray(jnp.transpose(probs, (0, 2, 1, 3)) == 0)
    assert 0.2 < expected_zero.mean() < 0.4
    np.testing.assert_array_equal(np.asarray(out == 0), expected_zero)


@pytest.mark.parametrize(
    "dtype, length, head_dim, reason",
    [
        (F32, 16, 64, "cuDNN attention takes bfloat16 or float16"),
        (BF16, 129, 20, "a multiple of 8, got 20"),
        (F16, 16, 36, "a multiple of 8, got 36"),
    ],
    ids=["float32", "longer than 128, head_dim 20", "head_dim 36"],
)
def test_shapes_neither_fused_kernels_nor_cudnn_take_run_the_softmax_kernels(dtype, length, head_dim, reason, caplog):
    """Longer sequences and other head_dims go to cuDNN (tests/test_kernels_attention_long.py) where it takes them."""
    op, primals, cotangent = _case(30, (length, None, None, True, 0.1), dtype, heads=2, head_dim=head_dim)
    run = value_and_grads(op)
    _common.log_fallback_once.cache_clear()
    assert kernel_targets(run, primals, cotangent) == {"ls_attn_softmax_fwd", "ls_attn_softmax_bwd"}
    assert "ls_jax.ops.attention: running the unfused attention" in caplog.text
    assert reason in caplog.text
    got, want = on_backend("ffi", run, primals, cotangent), on_backend("xla", run, primals, cotangent)
    assert_backends_agree(got, want, dtype, f"fallback {dtype.__name__} {length} {head_dim}")
