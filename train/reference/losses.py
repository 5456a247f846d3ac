"""The plain baselines' criterion: label-smoothed cross entropy written with optax, all XLA (no fused op).

For a position with logits z (V,) and label y, the target puts 1 - eps on y and eps / (V - 1) on every other
class (fairseq's definition, which ``ls_jax.ops.label_smoothed_cross_entropy`` computes too):

    loss = cross_entropy(z, target),   nll = -log softmax(z)[y]

Positions whose label is ``ignore_label`` count for nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def label_smoothed_sums(
    logits: jax.Array, labels: jax.Array, *, epsilon: float, ignore_label: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(summed loss, summed NLL, counted positions), f32 scalars: logits (..., V), labels (...) int."""
    vocab = logits.shape[-1]
    logits = logits.astype(jnp.float32)
    counted = labels != ignore_label
    safe_labels = jnp.where(counted, labels, 0)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, safe_labels)
    off_label = epsilon / (vocab - 1)
    targets = jax.nn.one_hot(safe_labels, vocab) * (1.0 - epsilon - off_label) + off_label
    loss = optax.softmax_cross_entropy(logits, targets)
    weights = counted.astype(jnp.float32)
    return jnp.sum(loss * weights), jnp.sum(nll * weights), jnp.sum(weights)
