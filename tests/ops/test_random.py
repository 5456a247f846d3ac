"""Philox-4x32-10 and the dropout-mask layout of ls_jax.ops.random (shared bit for bit with the CUDA kernels)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.ops import seed_array

from ls_jax.ops import random

_MASK32 = 0xFFFFFFFF


def _philox_python(counter, key):
    """Philox-4x32-10 on Python ints, written from the published round function (Salmon et al., SC'11)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0 = 0xD2511F53 * c0
        p1 = 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & _MASK32, p1 & _MASK32, ((p0 >> 32) ^ c3 ^ k1) & _MASK32, p0 & _MASK32
        k0 = (k0 + 0x9E3779B9) & _MASK32
        k1 = (k1 + 0xBB67AE85) & _MASK32
    return c0, c1, c2, c3


def _philox_jax(counter, key):
    words = random.philox4x32(tuple(jnp.uint32(c) for c in counter), tuple(jnp.uint32(k) for k in key))
    return tuple(int(w) for w in words)


# Known-answer vectors of Random123's kat_vectors for philox4x32_R(10): (counter, key, output).
_KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (_MASK32, _MASK32, _MASK32, _MASK32),
        (_MASK32, _MASK32),
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter, key, expected", _KNOWN_ANSWERS)
def test_philox_known_answers(counter, key, expected):
    assert _philox_jax(counter, key) == expected
    assert _philox_python(counter, key) == expected


def test_philox_matches_python_reference_on_random_inputs():
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, size=(64, 6), dtype=np.uint64)
    counters = tuple(jnp.asarray(words[:, i], jnp.uint32) for i in range(4))
    keys = (jnp.asarray(words[:, 4], jnp.uint32), jnp.asarray(words[:, 5], jnp.uint32))
    got = np.stack([np.asarray(w) for w in random.philox4x32(counters, keys)], axis=-1)
    for row, outputs in zip(words.tolist(), got.tolist()):
        assert tuple(outputs) == _philox_python(row[:4], row[4:])


def _draw_python(i, key):
    """Element i's 16-bit draw, as random.py documents it."""
    word = _philox_python((i // 8, 0, 0, 0), key)[(i % 8) // 2]
    return (word >> (16 * (i % 2))) & 0xFFFF


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (2, 3, 4), (17,)])
def test_random_draws_layout(shape):
    """Element i (row-major) draws half i % 2 of word (i % 8) // 2 of Philox at counter (i // 8, 0, 0, 0)."""
    seed = jnp.array([0x12345678, 0x9ABCDEF0], jnp.uint32)
    flat = np.asarray(random.random_draws(seed, shape)).reshape(-1)
    assert flat.max() < 2**16
    for i, draw in enumerate(flat.tolist()):
        assert draw == _draw_python(i, (0x12345678, 0x9ABCDEF0))


def test_random_draws_are_a_prefix_across_shapes():
    """The mask depends only on the flat index, so a tensor's mask is the prefix of a larger one's."""
    seed = seed_array(3)
    small = random.random_draws(seed, (5, 3))
    large = random.random_draws(seed, (40,))
    np.testing.assert_array_equal(np.asarray(small).reshape(-1), np.asarray(large)[:15])


def test_random_draws_reject_counter_overflow():
    with pytest.raises(ValueError, match="2\\*\\*35"):
        random.random_draws(seed_array(0), (2**32, 9))


@pytest.mark.parametrize(
    "rate, threshold", [(0.0, 0), (0.1, 6554), (0.25, 2**14), (0.5, 2**15), (1 - 2**-18, 2**16 - 1)]
)
def test_keep_threshold(rate, threshold):
    assert random.keep_threshold(rate) == threshold


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5])
def test_keep_threshold_rejects_rates_outside_unit_interval(rate):
    with pytest.raises(ValueError, match="rate"):
        random.keep_threshold(rate)


def test_keep_mask_is_threshold_of_random_draws():
    seed = seed_array(1)
    draws = np.asarray(random.random_draws(seed, (9, 11)))
    keep = np.asarray(random.keep_mask(seed, (9, 11), 0.3))
    np.testing.assert_array_equal(keep, draws >= random.keep_threshold(0.3))


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_rate_within_three_sigma(rate):
    size = 1 << 20
    kept = int(jnp.sum(random.keep_mask(seed_array(7), (size,), rate)))
    sigma = np.sqrt(size * rate * (1 - rate))
    assert abs(kept - size * (1 - rate)) < 3 * sigma


def test_dropout_multiplier_scales_kept_elements():
    seed = seed_array(2)
    multiplier = np.asarray(random.dropout_multiplier(seed, (6, 8), 0.25))
    keep = np.asarray(random.keep_mask(seed, (6, 8), 0.25))
    np.testing.assert_array_equal(multiplier, np.where(keep, np.float32(1 / 0.75), 0.0))
    assert random.dropout_multiplier(None, (6, 8), 0.0) == 1.0


def test_dropout_seed_is_deterministic_uint32_pair():
    first = random.dropout_seed(jax.random.key(0))
    assert first.shape == (2,) and first.dtype == jnp.uint32
    np.testing.assert_array_equal(first, random.dropout_seed(jax.random.key(0)))
    assert not np.array_equal(first, random.dropout_seed(jax.random.key(1)))
