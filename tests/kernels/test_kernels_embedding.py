"""GPU: the embedding kernels (lookup, scale, positions, dropout, padding; sorted-segment backward) against XLA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.kernels import assert_backends_agree, kernel_targets, on_backend, value_and_grads
from helpers.ops import normal, random_cotangent, seed_array

from ls_jax import ops

pytestmark = pytest.mark.gpu

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
VOCAB, POSITIONS, PAD = 97, 40, 0


def _tokens(seed, batch, length):
    """Ids with padding, repeats of a few frequent ids, and out-of-range ids (clipped by the op)."""
    rng = np.random.default_rng(seed)
    tokens = rng.choice([PAD, 1, 2, 3, *range(VOCAB)], size=(batch, length))
    tokens[0, -1], tokens[-1, 0] = -5, VOCAB + 7
    return jnp.asarray(tokens, jnp.int32)


def _embed_case(hidden, dtype, table_dtype, pos_dtype, rate, seed):
    """(run, args): forward and backward of ops.embed on one configuration."""
    tokens = _tokens(seed, 3, 32)
    table = normal(seed + 1, (VOCAB, hidden), table_dtype)
    pos_table = None if pos_dtype is None else normal(seed + 2, (POSITIONS, hidden), pos_dtype)

    def run(table, pos_table, cotangent, dropout_seed):
        op = lambda t, p: ops.embed(
            tokens, t, p, scale=2.0, padding_id=PAD, dropout_rate=rate, seed=dropout_seed, dtype=dtype
        )
        return value_and_grads(op)((table, pos_table), cotangent)

    cotangent = random_cotangent(seed + 3, jnp.zeros(tokens.shape + (hidden,), dtype))
    return run, (table, pos_table, cotangent, seed_array(seed))


_CASES = [
    (hidden, dtype, table_dtype, pos_dtype, rate)
    for hidden in (1, 33, 1024)
    for dtype, table_dtype, pos_dtype, rate in [(F32, F32, F32, 0.1), (BF16, F32, BF16, 0.1), (F16, F16, None, 0.0)]
] + [(1023, BF16, BF16, F32, 0.0), (4096, F32, F32, None, 0.1), (8192 + 8, F16, F32, F32, 0.1)]


@pytest.mark.parametrize("hidden, dtype, table_dtype, pos_dtype, rate", _CASES)
def test_embed_matches_xla(hidden, dtype, table_dtype, pos_dtype, rate):
    run, args = _embed_case(hidden, dtype, table_dtype, pos_dtype, rate, seed=hidden)
    expected = {"ls_embed_grad", "ls_embed_fwd" if pos_dtype is None else "ls_embed_pos_fwd"}
    assert kernel_targets(run, *args) == expected
    got, want = on_backend("ffi", run, *args), on_backend("xla", run, *args)
    assert_backends_agree(got, want, dtype, "embed")
    np.testing.assert_array_equal(np.asarray(got[0] == 0), np.asarray(want[0] == 0))


def test_embed_gradient_of_a_repeated_token_is_deterministic():
    tokens = jnp.full((64, 128), 5, jnp.int32).at[:, ::7].set(11)
    table = normal(0, (VOCAB, 1024), F32)
    cotangent = random_cotangent(1, jnp.zeros(tokens.shape + (1024,), BF16))
    run = value_and_grads(lambda t: ops.embed(tokens, t, dropout_rate=0.1, seed=seed_array(2), dtype=BF16))
    first = on_backend("ffi", run, (table,), cotangent)
    second = on_backend("ffi", run, (table,), cotangent)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert_backends_agree(first, on_backend("xla", run, (table,), cotangent), BF16)
    dtable = np.asarray(first[1][0])
    untouched = np.setdiff1d(np.arange(VOCAB), [5, 11])
    assert not np.any(dtable[untouched]) and np.all(np.any(dtable[[5, 11]] != 0, axis=1))


@pytest.mark.parametrize("hidden, dtype", [(768, BF16), (33, F32)])
def test_embed_gradient_of_long_runs_split_into_chunks(hidden, dtype):
    """Runs far longer than a warp's chunk, starting off chunk boundaries: one id at every position (BERT's
    segment ids), and ids -3 and -1 clipped into the padding id's row among real padding tokens."""
    rng = np.random.default_rng(7)
    mixed = rng.choice([PAD, -3, -1, 1, 2], size=(5, 61))
    for tokens in (jnp.zeros((9, 203), jnp.int32), jnp.asarray(mixed, jnp.int32)):
        table = normal(3, (VOCAB, hidden), F32)
        cotangent = random_cotangent(4, jnp.zeros(tokens.shape + (hidden,), dtype))
        run = value_and_grads(
            lambda t: ops.embed(tokens, t, padding_id=PAD, dropout_rate=0.1, seed=seed_array(5), dtype=dtype)
        )
        first, second = (on_backend("ffi", run, (table,), cotangent)[1][0] for _ in range(2))
        np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
        want = on_backend("xla", run, (table,), cotangent)[1][0]
        assert_backends_agree(first, want, dtype, "embed gradient")
