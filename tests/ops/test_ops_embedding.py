"""ls_jax.ops.embed against a naive lookup: scale, positions, padding, dropout, f32 tables with bf16 output."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.ops import BF16, F32, check_vjp, normal, random_cotangent, seed_array

from ls_jax.ops import embed
from ls_jax.ops.random import keep_mask

PAD = 0


def reference_embed(tokens, table, pos_table, *, scale, padding_id, positions, keep, rate):
    """dropout(scale * table[tokens] + pos_table[positions]), zeroed where tokens == padding_id."""
    y = table[tokens] * scale
    if pos_table is not None:
        y = y + pos_table[positions]
    if padding_id is not None:
        y = jnp.where((tokens != padding_id)[..., None], y, 0.0)
    if keep is not None:
        y = jnp.where(keep, y / (1.0 - rate), 0.0)
    return y


def _tokens(batch, length, vocab, num_pad):
    """Random ids in [1, vocab) with the last ``num_pad`` positions of row 0 padded (ids repeat)."""
    tokens = np.random.default_rng(batch * length).integers(1, vocab, (batch, length))
    tokens[0, length - num_pad :] = PAD
    return jnp.asarray(tokens, jnp.int32)


# (batch, length, vocab, hidden, positions in pos_table, padding, table dtype, output dtype, rate)
CASES = [
    (2, 6, 11, 16, 8, True, F32, F32, 0.0),
    (1, 5, 7, 33, 5, False, F32, F32, 0.0),
    (3, 9, 13, 33, 9, True, F32, BF16, 0.2),
    (2, 6, 11, 16, 10, True, BF16, BF16, 0.1),
    (2, 4, 5, 8, 4, False, F32, F32, 0.3),
]


@pytest.mark.parametrize("batch, length, vocab, hidden, num_pos, padded, table_dtype, dtype, rate", CASES)
def test_embed_matches_reference(batch, length, vocab, hidden, num_pos, padded, table_dtype, dtype, rate):
    tokens = _tokens(batch, length, vocab, num_pad=2 if padded else 0)
    table = normal(1, (vocab, hidden), table_dtype)
    seed = seed_array(3) if rate else None
    keep = keep_mask(seed, (batch, length, hidden), rate) if rate else None
    static = dict(scale=math.sqrt(hidden), padding_id=PAD if padded else None)
    positions = jnp.broadcast_to(jnp.arange(length), tokens.shape)
    pos_table = normal(2, (num_pos, hidden), table_dtype)
    y, (dtable, _) = check_vjp(
        lambda t, p: embed(tokens, t, p, dtype=dtype, dropout_rate=rate, seed=seed, **static),
        lambda t, p: reference_embed(tokens, t, p, positions=positions, keep=keep, rate=rate, **static),
        (table, pos_table),
        dtype,
    )
    assert y.dtype == dtype and y.shape == (batch, length, hidden)
    if padded:
        np.testing.assert_array_equal(y[0, -2:], 0.0)
        np.testing.assert_array_equal(dtable[PAD], 0.0)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_embed_without_position_table(dtype):
    tokens = _tokens(1, 5, 7, num_pad=1)
    check_vjp(
        lambda t: embed(tokens, t, scale=3.0, padding_id=PAD, dtype=dtype),
        lambda t: reference_embed(tokens, t, None, scale=3.0, padding_id=PAD, positions=None, keep=None, rate=0.0),
        (normal(1, (7, 33)),),
        dtype,
    )


def test_explicit_positions_and_mixed_table_dtypes():
    """Decoder-style offsets; f32 token table with a bf16 position table and bf16 output."""
    tokens = _tokens(2, 3, 9, num_pad=1)
    positions = jnp.array([[5, 6, 7], [0, 1, 2]], jnp.int32)
    table, pos_table = normal(1, (9, 12), F32), normal(2, (8, 12), BF16)
    _, (dtable, dpos) = check_vjp(
        lambda t, p: embed(tokens, t, p, padding_id=PAD, positions=positions, dtype=BF16),
        lambda t, p: reference_embed(tokens, t, p, scale=1.0, padding_id=PAD, positions=positions, keep=None, rate=0),
        (table, pos_table),
        BF16,
    )
    assert dtable.dtype == F32 and dpos.dtype == BF16
    np.testing.assert_array_equal(dpos[7], 0.0)  # position 7 belongs only to the padded token


def test_repeated_tokens_accumulate_gradient():
    tokens = jnp.array([[3, 3, 3, 1]], jnp.int32)
    dtable = jax.grad(lambda t: jnp.sum(embed(tokens, t, scale=2.0)))(jnp.zeros((5, 4), F32))
    np.testing.assert_array_equal(dtable[:, 0], [0.0, 2.0, 0.0, 6.0, 0.0])


def test_out_of_range_ids_are_clamped_consistently():
    """Documented: ids outside [0, V) read (and send gradient to) the nearest valid row."""
    tokens = jnp.array([[-4, 7]], jnp.int32)
    table = normal(1, (5, 3))
    y, vjp = jax.vjp(lambda t: embed(tokens, t), table)
    np.testing.assert_array_equal(y[0], table[jnp.array([0, 4])])
    (dtable,) = vjp(jnp.ones_like(y))
    np.testing.assert_array_equal(dtable.sum(axis=1), [3.0, 0.0, 0.0, 0.0, 3.0])


def test_dropout_mask_shared_by_forward_and_backward():
    tokens = _tokens(2, 5, 7, num_pad=0)
    table = jnp.abs(normal(1, (7, 32))) + 0.1
    y, vjp = jax.vjp(lambda t: embed(tokens, t, dropout_rate=0.5, seed=seed_array(9)), table)
    dropped = np.asarray(y == 0)
    np.testing.assert_array_equal(dropped, ~np.asarray(keep_mask(seed_array(9), y.shape, 0.5)))
    cotangent = np.asarray(random_cotangent(4, y))
    (dtable,) = vjp(jnp.asarray(cotangent))
    expected = np.zeros((7, 32), np.float32)
    np.add.at(expected, np.asarray(tokens).reshape(-1), np.where(dropped, 0.0, 2.0 * cotangent).reshape(-1, 32))
    np.testing.assert_allclose(dtable, expected, rtol=1e-6)


def _valid():
    return dict(tokens=_tokens(2, 4, 6, num_pad=1), table=normal(1, (6, 8)), pos_table=normal(2, (4, 8)))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(tokens=jnp.ones((2, 4), F32)), "tokens must be an integer array, got float32"),
        (dict(tokens=jnp.ones((8,), jnp.int32)), r"tokens must have shape \(batch, length\), got \(8,\)"),
        (dict(table=jnp.ones((6, 8), jnp.int32)), "table must be float32, bfloat16 or float16, got int32"),
        (dict(table=np.ones((6, 8), np.float64)), "table must be float32, bfloat16 or float16, got float64"),
        (dict(table=jnp.ones((6, 8), BF16), dtype=jnp.float16), "table must be float32 or float16, got bfloat16"),
        (dict(table=normal(1, (48,))), r"table must have shape \(vocab, hidden\), got \(48,\)"),
        (dict(dtype=jnp.int32), "dtype must be float32, bfloat16 or float16, got int32"),
        (dict(pos_table=normal(2, (4, 7))), r"pos_table must have shape \(4, 8\), got \(4, 7\)"),
        (dict(pos_table=jnp.ones((4, 8), jnp.float16)), "pos_table must be float32, got float16"),
        (dict(tokens=_tokens(2, 5, 6, num_pad=0)), "sequence length 5 exceeds the 4 positions of pos_table"),
        (dict(positions=jnp.zeros((2, 3), jnp.int32)), r"positions has shape \(2, 3\) but tokens has \(2, 4\)"),
        (dict(positions=jnp.zeros((2, 4), F32)), "positions must be an integer array, got float32"),
        (dict(dropout_rate=1.0, seed=seed_array(0)), r"dropout_rate must be in \[0, 1\)"),
        (dict(dropout_rate=0.1), "dropout_rate > 0 needs a seed"),
        (dict(dropout_rate=0.1, seed=jnp.zeros(4, jnp.uint32)), r"seed must be a uint32\[2\] array"),
    ],
)
def test_bad_inputs_raise_value_error(change, message):
    args = _valid() | change
    with pytest.raises(ValueError, match=message):
        embed(
            args.pop("tokens"),
            args.pop("table"),
            args.pop("pos_table"),
            **args,
        )
