"""Master weights: the f32 values a mixed-precision optimizer updates, beside the 16-bit params the model uses.

For bfloat16 params the state keeps only the low 16 bits of each f32 master value. A bf16 number is the high
half of an f32 one, so the params carry the rest: with ``high`` the master rounded to bf16 and ``low`` an int16,

    bits(master) = bits(high) * 2^16 + low          (u32 arithmetic, modulo 2^32)

holds exactly whenever ``high`` is within half a bf16 spacing of the master, which saves 2 of the 6 bytes per
parameter that bf16 params with a separate f32 master take. Halfway cases decide the rounding: under ties to even,
2^16 + 1 f32 values round to each even bf16, one more than 16 bits can tell apart. So the step rounds its new
params to nearest with ties away from zero (``round_to_bf16``: add 2^15 to the bits and truncate), which maps
exactly 2^16 f32 values to every bf16 and keeps the master exact. It differs from ``astype(jnp.bfloat16)`` only
where the master's low half is exactly 0x8000, both neighbours equally near.

``init`` splits against the params' own rounding, ``astype``, since that is how users cast the params they train;
at its ties (1 in 2^16 values) the low half saturates, storing a master one f32 unit in the last place smaller in
magnitude. The master follows the params each step is given: its high half is theirs (``join_halves``).

Float16 is not the high half of anything, so float16 params keep a whole f32 master.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

LOW_HALF_DTYPE = jnp.dtype(jnp.int16)
_LOW_HALF_MIN, _LOW_HALF_MAX = -(2**15), 2**15 - 1


class MasterWeightsState(NamedTuple):
    """A workspace optimizer's state with master weights: the algorithm's state (``AdamState``, ``AdanState``)
    and the master, a pytree of the params' structure: per leaf the low halves (int16) of the f32 master values
    when the params are bfloat16, the f32 master values when they are float16. ``master_params`` gives the f32
    values either way.

    The master is per leaf rather than one flat workspace so that the XLA step writes each leaf's new master and
    16-bit params from one fusion: concatenating every leaf's result into a workspace is one more pass over all
    of them, which XLA runs slowly for hundreds of leaves."""

    inner: NamedTuple
    master: Any


def is_split(storage_dtype: Any) -> bool:
    """Whether params of ``storage_dtype`` hold the high halves of their master (bfloat16 does, float16 does not)."""
    return jnp.dtype(storage_dtype) == jnp.dtype(jnp.bfloat16)


def master_dtype(storage_dtype: Any) -> np.dtype:
    """The dtype of the master's leaves in the state for params of ``storage_dtype``."""
    return LOW_HALF_DTYPE if is_split(storage_dtype) else jnp.dtype(jnp.float32)


def round_to_bf16(x: jax.Array) -> jax.Array:
    """``x`` (f32) rounded to the nearest bf16, ties away from zero; NaN stays NaN (quieted)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    high = jnp.where(jnp.isnan(x), (bits >> 16) | 0x40, (bits + 0x8000) >> 16)
    return jax.lax.bitcast_convert_type(high.astype(jnp.uint16), jnp.bfloat16)


def _high_bits(high: jax.Array) -> jax.Array:
    """bits(high) * 2^16 as u32: the bits of the f32 whose high half is bf16 ``high`` and low half zero."""
    return jax.lax.bitcast_convert_type(high, jnp.uint16).astype(jnp.uint32) << 16


def low_half(x: jax.Array, high: jax.Array) -> jax.Array:
    """The int16 ``low`` with bits(x) = bits(high) * 2^16 + low, saturated where that needs more than 16 bits.

    Args:
      x: f32 master values.
      high: bf16, ``x`` rounded to nearest (``round_to_bf16``, or ``astype`` whose ties saturate).
    """
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    high_bits = _high_bits(high)
    difference = jax.lax.bitcast_convert_type(bits - high_bits, jnp.int32)
    return jnp.clip(difference, _LOW_HALF_MIN, _LOW_HALF_MAX).astype(LOW_HALF_DTYPE)


def _is_nan(bits: jax.Array) -> jax.Array:
    return (bits & 0x7FFFFFFF) > 0x7F800000


def join_halves(high: jax.Array, low: jax.Array) -> jax.Array:
    """The f32 whose bits are bits(high) * 2^16 + low: the master value of bf16 ``high`` and int16 ``low``.

    A low half that ``high`` did not come from (params changed outside the optimizer) moves it by at most half a
    bf16 spacing, except where that would cross zero (a zero ``high``, a negative ``low``) or turn infinity into
    NaN: there the master is ``high`` itself."""
    high_bits = _high_bits(high)
    bits = high_bits + jax.lax.bitcast_convert_type(low.astype(jnp.int32), jnp.uint32)
    crossed = ((bits ^ high_bits) >> 31 == 1) | (_is_nan(bits) & ~_is_nan(high_bits))
    return jax.lax.bitcast_convert_type(jnp.where(crossed, high_bits, bits), jnp.float32)


def initial_master(params: Any, storage_dtype: Any) -> Any:
    """The master of ``params`` (any float dtype, the values to train) for params stored in ``storage_dtype``."""

    def master(p: jax.Array) -> jax.Array:
        p = p.astype(jnp.float32)
        return low_half(p, p.astype(jnp.bfloat16)) if is_split(storage_dtype) else p

    return jax.tree.map(master, params)


def master_params(state: MasterWeightsState, params: Any) -> Any:
    """The f32 master weights of ``state``, an optimizer state with master weights, whose 16-bit params are
    ``params``: what the next step updates (for evaluation in f32, or export).

    Raises:
      TypeError: ``state`` is not a ``MasterWeightsState``.
      ValueError: ``params`` do not match the master's structure.
    """
    if not isinstance(state, MasterWeightsState):
        raise TypeError(f"expected a MasterWeightsState, got {type(state).__name__}")
    if jax.tree.structure(params) != jax.tree.structure(state.master):
        raise ValueError(
            f"params do not match the master's structure:\n{jax.tree.structure(params)}\n"
            f"{jax.tree.structure(state.master)}"
        )

    def master(p: jax.Array, m: jax.Array) -> jax.Array:
        if m.dtype != LOW_HALF_DTYPE:
            return m
        if p.dtype != jnp.bfloat16 or p.shape != m.shape:
            raise ValueError(
                f"the master's low halves {m.dtype}{list(m.shape)} need bfloat16 params of their shape, "
                f"got {p.dtype}{list(p.shape)}"
            )
        return join_halves(p, m)

    return jax.tree.map(master, params, state.master)
