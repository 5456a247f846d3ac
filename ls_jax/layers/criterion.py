"""Label-smoothed cross-entropy criterion over ``ls_jax.ops.label_smoothed_cross_entropy``."""

from __future__ import annotations

import dataclasses

import jax

from ls_jax import ops


@dataclasses.dataclass(frozen=True)
class CrossEntropyCriterion:
    """Summed label-smoothed cross entropy with padding ignored (LightSeq's cross-entropy layer; no parameters).

        loss = (1 - eps) * nll - eps / (V - 1) * sum_{j != y} log p_j,  summed over non-pad tokens

    Attributes:
      epsilon: label smoothing in [0, 1).
      padding_idx: label to ignore, or None to count every token.
    """

    epsilon: float = 0.1
    padding_idx: int | None = 0

    def __post_init__(self):
        if not 0.0 <= self.epsilon < 1.0:
            raise ValueError(f"epsilon must be in [0, 1), got {self.epsilon}")

    def __call__(self, logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """logits (..., V), labels (...) int -> (loss_sum f32, nll_sum f32, num_tokens int32).

        Divide the sums by ``num_tokens`` (summed across devices and accumulation steps) for per-token values.
        """
        return ops.label_smoothed_cross_entropy(logits, labels, epsilon=self.epsilon, pad_id=self.padding_idx)
