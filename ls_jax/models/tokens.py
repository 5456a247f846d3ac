"""Special token ids shared by the models, the decoders and the data pipeline, and token-input checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3
NUM_SPECIAL_TOKENS = 4


def prefix_lengths(tokens: jax.Array) -> jax.Array:
    """int32 (B,): the number of tokens of each (B, L) row before its first ``PAD_ID`` (L when it has none), the
    length of the row when padding is a suffix."""
    return jnp.sum(jnp.cumprod(tokens != PAD_ID, axis=1), axis=1, dtype=jnp.int32)


def check_tokens(name: str, tokens: jax.Array) -> None:
    """Raises ValueError unless ``tokens`` is an integer (batch, length) array."""
    if not jnp.issubdtype(tokens.dtype, jnp.integer) or tokens.ndim != 2:
        raise ValueError(
            f"{name} must be an integer array of shape (batch, length), got {tokens.dtype}{list(tokens.shape)}"
        )
