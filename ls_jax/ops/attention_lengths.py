"""Key lengths: a right-padded attention mask as one integer per row.

When the visible keys of each row are a prefix (tokens first, padding after: every batch the training harness
builds), the row is described by its length: key k of row b is visible iff ``k < lengths[b]``, i.e. the (B, K) mask

    key_mask = arange(K)[None, :] < lengths[:, None]

``ops.self_attention(qkv, lengths=...)`` and ``ops.cross_attention(..., key_lengths=...)`` take them. The XLA
implementations build exactly this mask from them, so both backends compute the same function as with the
equivalent boolean mask; cuDNN's attention takes them as its padding mask's sequence lengths with no bias tensor.
A boolean ``key_mask`` stays the way to pass an arbitrary mask: whether its rows are prefixes cannot be seen at trace
time, so it keeps the exact (bias) path. A row of length 0 sees no key: its output and gradients are 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def check_lengths(
    lengths: jax.Array | np.ndarray | None, *, batch: int, keys: int, name: str, key_mask: jax.Array | None
) -> jax.Array | None:
    """``lengths`` as int32 (B,) in [0, keys], or None when not given.

    Concrete values outside [0, keys] raise; traced values cannot be inspected and are clipped to [0, keys].

    Raises:
      ValueError: both ``key_mask`` and ``lengths`` given, or ``lengths`` not an integer (batch,) array, or a
        concrete length outside [0, keys]; the message names the problem.
    """
    if lengths is None:
        return None
    if key_mask is not None:
        raise ValueError(f"pass either key_mask (any mask) or {name} (right padding), not both")
    if not hasattr(lengths, "shape") or not hasattr(lengths, "dtype"):
        lengths = np.asarray(lengths)
    if tuple(lengths.shape) != (batch,):
        raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {tuple(lengths.shape)}")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array (the number of visible keys per row), got {lengths.dtype}")
    if not isinstance(lengths, jax.core.Tracer):
        values = np.asarray(lengths)
        if values.size and (values.min() < 0 or values.max() > keys):
            raise ValueError(
                f"{name} must be in [0, {keys}] (the number of keys), got values from {values.min()} to {values.max()}"
            )
    return jnp.clip(jnp.asarray(lengths), 0, keys).astype(jnp.int32)


def lengths_mask(lengths: jax.Array, keys: int) -> jax.Array:
    """(B, keys) boolean: True for the first ``lengths[b]`` keys of row b."""
    return jnp.arange(keys)[None, :] < lengths[:, None]
