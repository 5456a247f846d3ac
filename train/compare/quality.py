"""The quality gate of a comparison: a run that did not learn is shown but never ranked.

A run passes when its final quality (its task's `Quality`, `train.tasks`: imdb accuracy, wmt BLEU, gpt perplexity)
is known, is at least as good as the task's threshold, and lies within ``margin`` of the best run: q >= (1 -
margin) * q_best for a metric where higher is better, q <= (1 + margin) * q_best for perplexity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from train.compare.runs import LoggedRun
from train.harness.training import Quality
from train.tasks import TASKS

DEFAULT_MARGIN = 0.1


@dataclasses.dataclass(frozen=True)
class Gate:
    """Threshold and relative margin on ``metric``; `verdicts` applies them to runs."""

    metric: Quality
    threshold: float
    margin: float = DEFAULT_MARGIN

    def __post_init__(self) -> None:
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(
                f"--quality-margin {self.margin:g} must lie in [0, 1): a fraction of the best run's quality"
            )

    def describe(self) -> str:
        bound = "at least" if self.metric.higher_is_better else "at most"
        side = "below" if self.metric.higher_is_better else "above"
        return (
            f"{self.metric.label} {bound} {self.threshold:g} and not more than {self.margin:.0%} {side} the best run's"
        )

    def verdicts(self, runs: Sequence[LoggedRun]) -> list[str | None]:
        """Per run: None when it passes, else why it did not converge."""
        values = [run.metrics.get(self.metric.key) for run in runs]
        known = [value for value in values if value is not None]
        best = (max if self.metric.higher_is_better else min)(known) if known else None
        factor = 1.0 - self.margin if self.metric.higher_is_better else 1.0 + self.margin
        verdicts: list[str | None] = []
        for value in values:
            if value is None:
                verdicts.append(f"no final {self.metric.label} in its log")
            elif not self.metric.better_or_equal(value, self.threshold):
                verdicts.append(f"{self.metric.label} {value:.4g} misses the threshold {self.threshold:g}")
            elif not self.metric.better_or_equal(value, factor * best):
                verdicts.append(
                    f"{self.metric.label} {value:.4g} is more than {self.margin:.0%} worse than the best "
                    f"run's {best:.4g}"
                )
            else:
                verdicts.append(None)
        return verdicts


def default_gate(task: str, threshold: float | None = None, margin: float | None = None) -> Gate:
    """The gate of ``task`` with its default threshold and margin, unless given.

    Raises:
      ValueError: a task without a quality metric.
    """
    if task not in TASKS:
        raise ValueError(f"task {task!r} has no quality metric; known: {', '.join(TASKS)}")
    metric = TASKS[task].quality
    return Gate(
        metric,
        metric.threshold if threshold is None else threshold,
        DEFAULT_MARGIN if margin is None else margin,
    )
