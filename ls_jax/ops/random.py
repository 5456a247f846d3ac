"""Counter-based dropout masks shared bit for bit by the XLA and CUDA implementations.

A dropout seed is a ``uint32[2]`` array: the Philox-4x32-10 key. Element ``i`` (row-major flat index of the
tensor being dropped) draws 16 bits: half ``i % 2`` (0 the low half) of word ``(i % 8) // 2`` of
``philox4x32(counter=(i // 8, 0, 0, 0), key=seed)``, and is kept when its draw is ``>= keep_threshold(rate)``,
i.e. with probability ``1 - threshold / 2**16`` (the rate rounded to a multiple of 2**-16; FlashAttention's
dropout draws 8 bits). One Philox call thus serves eight elements, which halves the integer work the kernels spend
on masks against 32-bit draws. The CUDA kernels compute the same draws, so both backends drop exactly the same
elements for the same seed, and a backward pass regenerates its mask from the seed instead of storing it.

Every op with dropout takes its seed helpers from here: ``dropout_seed`` (a seed from a JAX key),
``dropout_attributes`` (the kernels' threshold and scale) and ``seed_operand`` (the kernels' seed input).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_PHILOX_M0 = 0xD2511F53
_PHILOX_M1 = 0xCD9E8D57
_PHILOX_W0 = 0x9E3779B9
_PHILOX_W1 = 0xBB67AE85
_PHILOX_ROUNDS = 10
_DRAW_BITS = 16
_DRAWS_PER_CALL = 8  # four 32-bit words, two 16-bit draws each


def dropout_seed(key: jax.Array) -> jax.Array:
    """A ``uint32[2]`` dropout seed from a JAX PRNG key: a threefry key's own two words (raw ``uint32[2]`` or typed),
    else two words drawn from the key.

    A threefry key that came out of ``fold_in`` or ``split`` (a Flax module's ``make_rng``) is already threefry's
    output; drawing bits from it would run threefry again, a kernel launch of its own for every dropout in a step.
    """
    data = jax.random.key_data(key)
    if data.shape == (2,) and data.dtype == jnp.uint32:
        return data
    return jax.random.bits(key, (2,), jnp.uint32)


def keep_threshold(rate: float) -> int:
    """The threshold below which an element's 16-bit draw drops it: ``round(rate * 2**16)``, at most 2**16 - 1."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
    return min(int(round(rate * 2.0**_DRAW_BITS)), 2**_DRAW_BITS - 1)


def dropout_attributes(rate: float) -> dict[str, np.generic]:
    """FFI attributes of a kernel that drops at ``rate``: ``threshold`` (uint32, ``keep_threshold``) and ``scale``
    (f32 multiplier of kept elements, rounded from ``1 / (1 - rate)`` as the XLA implementation's f32 arithmetic
    rounds it), so both backends drop and scale identically. Rate 0 gives (0, 1): no dropout."""
    return {"threshold": np.uint32(keep_threshold(rate)), "scale": np.float32(1.0 / (1.0 - rate))}


def seed_operand(seed: jax.Array | None) -> jax.Array:
    """The seed operand of a dropout kernel: ``seed``, or zeros (never read) when the rate is 0."""
    return jnp.zeros((2,), jnp.uint32) if seed is None else seed


def _mulhilo(a: jax.Array, multiplier: int) -> tuple[jax.Array, jax.Array]:
    """High and low 32 bits of ``a * multiplier``, from one 64-bit product.

    The product is formed in uint64 inside a scoped ``jax.enable_x64`` (the caller's x64 setting is untouched;
    only this intermediate is 64-bit): GPUs do it in one wide multiply, where four 16-bit partial products take
    several.
    """
    with jax.enable_x64(True):
        product = a.astype(jnp.uint64) * jnp.uint64(multiplier)
        return (product >> jnp.uint64(32)).astype(jnp.uint32), product.astype(jnp.uint32)


def philox4x32(counter: tuple[jax.Array, ...], key: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
    """Philox-4x32-10 (Salmon et al., 2011) on uint32 arrays of any common shape: 4 counter words, 2 key words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_index in range(_PHILOX_ROUNDS):
        if round_index:
            k0 = k0 + jnp.uint32(_PHILOX_W0)
            k1 = k1 + jnp.uint32(_PHILOX_W1)
        hi0, lo0 = _mulhilo(c0, _PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, _PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def _philox_words(seed: jax.Array, shape: tuple[int, ...]) -> tuple[int, tuple[jax.Array, ...]]:
    """The element count of ``shape`` and the four Philox words (ceil(size / 8),) whose halves cover it."""
    size = 1
    for dim in shape:
        size *= dim
    calls = -(-size // _DRAWS_PER_CALL)
    if calls >= 2**32:
        raise ValueError(f"dropout over {size} elements exceeds the 2**35-element Philox counter range")
    counter = jnp.arange(calls, dtype=jnp.uint32)
    zero = jnp.zeros_like(counter)
    seed = seed.astype(jnp.uint32)
    return size, philox4x32((counter, zero, zero, zero), (seed[0], seed[1]))


def _halves(words: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """The eight 16-bit draws of each call, in element order: low then high half of each word."""
    low_mask = jnp.uint32(2**_DRAW_BITS - 1)
    return tuple(half for word in words for half in (word & low_mask, word >> _DRAW_BITS))


def _interleave(draws: tuple[jax.Array, ...], size: int, shape: tuple[int, ...]) -> jax.Array:
    """Element ``i`` of ``shape`` from ``draws[i % 8][i // 8]``."""
    return jnp.stack(draws, axis=-1).reshape(-1)[:size].reshape(shape)


def random_draws(seed: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Each element's 16-bit draw (as uint32) of ``shape``: half ``i % 2`` of word ``(i % 8) // 2`` of Philox at
    counter ``i // 8``."""
    size, words = _philox_words(seed, shape)
    return _interleave(_halves(words), size, shape)


def keep_mask(seed: jax.Array, shape: tuple[int, ...], rate: float) -> jax.Array:
    """Boolean mask of ``shape``, True where an element survives dropout at ``rate``.

    Each draw is compared with the threshold behind an optimization barrier, before the interleave. XLA on GPU
    does not fuse the Philox rounds into the interleave's consumer, so something crosses memory between the two
    fusions; the barrier makes that a 1-byte flag instead of a 4-byte word. Without the barrier XLA moves the
    comparison into the consumer and writes the words.
    """
    size, words = _philox_words(seed, shape)
    threshold = jnp.uint32(keep_threshold(rate))
    kept = jax.lax.optimization_barrier(tuple(draw >= threshold for draw in _halves(words)))
    return _interleave(kept, size, shape)


def keep_multiplier(keep: jax.Array, rate: float) -> jax.Array:
    """``keep / (1 - rate)`` as fp32 for a boolean keep mask."""
    return keep.astype(jnp.float32) * (1.0 / (1.0 - rate))


def dropout_multiplier(seed: jax.Array | None, shape: tuple[int, ...], rate: float) -> jax.Array | float:
    """``keep / (1 - rate)`` as fp32 of ``shape``, or the scalar 1.0 when ``rate == 0``."""
    if rate == 0.0:
        return 1.0
    assert seed is not None
    return keep_multiplier(keep_mask(seed, shape, rate), rate)
