"""The backward pass of data-parallel training with its gradient communication overlapped, as a schedule (the
LightSeq follow-up study's backward-time model, its section 3.5.2).

The backward runs stages (layers) one after another in backward order; stage i computes for ``compute[i]``
seconds and then its gradients can be all-reduced, which takes ``comm[i]`` seconds on one channel that carries one
all-reduce at a time. With c_i the end of stage i's compute (the running sum of ``compute``), its all-reduce runs
from s_i = max(c_i, e_{i-1}) to e_i = s_i + comm[i] (e_0 = 0), and the backward, communication included, ends at
max(c_last, e_last): the time the last communication finishes.
"""

from __future__ import annotations

from typing import Sequence


def communication_schedule(compute: Sequence[float], comm: Sequence[float]) -> list[tuple[float, float]]:
    """(start, end) of each stage's all-reduce; ``compute`` and ``comm`` are per stage, in backward order."""
    if len(compute) != len(comm):
        raise ValueError(f"compute has {len(compute)} stages but comm has {len(comm)}")
    if any(value < 0 for value in (*compute, *comm)):
        raise ValueError("stage durations must be >= 0")
    schedule, compute_end, channel_free = [], 0.0, 0.0
    for busy, send in zip(compute, comm):
        compute_end += busy
        start = max(compute_end, channel_free)
        channel_free = start + send
        schedule.append((start, channel_free))
    return schedule


def overlapped_backward(compute: Sequence[float], comm: Sequence[float]) -> float:
    """The end of the backward with overlapped communication: max(sum(compute), end of the last all-reduce)."""
    schedule = communication_schedule(compute, comm)
    return max(float(sum(compute)), schedule[-1][1] if schedule else 0.0)


def relative_error(estimate: float, measured: float) -> float:
    """(estimate - measured) / measured."""
    return (estimate - measured) / measured


def model_stages(
    backward: float, layers: Sequence[tuple[str, int, float, float]], rest_comm: float
) -> list[tuple[str, float, float]]:
    """The stages (name, compute, comm) of a model's backward, from per-layer measurements.

    ``layers``: (name, count, one layer's backward, one layer's all-reduce) per kind of repeated layer, in backward
    order. The backward not spent in those layers (``backward`` minus their sum: the output projection and loss,
    which run first, and the embeddings) is one stage that runs first and communicates nothing; the gradients of
    every parameter outside the repeated layers (embeddings, which the tied output projection also updates, final
    LayerNorms, ...) are complete only when the whole backward is, so they are one last stage of ``rest_comm``.
    """
    in_layers = sum(count * compute for _, count, compute, _ in layers)
    stages = [("outside the repeated layers", max(backward - in_layers, 0.0), 0.0)]
    for name, count, compute, comm in layers:
        stages.extend((f"{name} {count - index}", compute, comm) for index in range(count))
    stages.append(("gradients outside the repeated layers", 0.0, rest_comm))
    return stages
