"""Token ids of the benchmarks' synthetic batches: uniform over the vocabulary, or Zipf-distributed as text's are.

In text a few tokens take most positions (the, a, punctuation): the k-th most frequent of a vocabulary occurs
about 1 / k as often as the first. A batch drawn that way repeats its frequent ids many times, which is what an
embedding gradient meets in training: an XLA scatter-add of the batch's rows into the table serializes on the
repeated rows, where uniform ids spread the rows over the table. Sentencepiece numbers its pieces roughly by
frequency, so the frequent ids here are the lowest.
"""

from __future__ import annotations

import numpy as np

DISTRIBUTIONS = ("uniform", "zipf")
DEFAULT = "uniform"


def zipf_probabilities(count: int) -> np.ndarray:
    """``p[k] = (1 / (k + 1)) / H``, ``H`` the sum over k < ``count``: Zipf's law with exponent 1."""
    weights = 1.0 / np.arange(1, count + 1)
    return weights / weights.sum()


def draw(rng: np.random.Generator, shape: tuple[int, ...], low: int, high: int, distribution: str) -> np.ndarray:
    """int32 ids in ``[low, high)`` of ``shape``: uniform, or ``low + k`` with probability `zipf_probabilities`."""
    if distribution == "uniform":
        return rng.integers(low, high, shape, dtype=np.int32)
    if distribution == "zipf":
        return (low + rng.choice(high - low, size=shape, p=zipf_probabilities(high - low))).astype(np.int32)
    raise ValueError(f"token id distribution must be one of {', '.join(DISTRIBUTIONS)}, got {distribution!r}")
