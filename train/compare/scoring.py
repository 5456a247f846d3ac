"""Relate the runs of one task to a baseline run, score and rank them. A `Comparison` holds the runs

* against a baseline run b: speedup_i = t_b / t_i (above 1 is faster), cost ratio_i = c_i / c_b and energy
  ratio_i = e_i / e_b (below 1 is cheaper / less energy);
* by the weighted score of the study this project follows (BERT-base fine-tuned on IMDb on V100, A100, A10, T4,
  TPU v2 and TPU v3, scored by time, cost, energy and hardware utilization). With every quantity divided by its
  maximum over the runs scored (T_i = t_i / max_j t_j, likewise C, E, and U for MFU, so each lies in (0, 1])::

      score_i = w_t * T_i + w_c * C_i + w_e * E_i - w_u * U_i        (lower is better)

  This is the study's normalization (its Table 5.4 divides each column of its Table 5.1 by the column's
  maximum). Only runs that pass the quality gate (`train.compare.quality`) are scored: a run that did not learn is
  shown and never ranked. Missing values are never taken as zero: a run whose cost, energy or MFU is null in its log is not scored when
  that term has a non-zero weight (the notes say which runs and why), and the maxima run over the scored runs
  only. A term whose maximum is 0 (e.g. every run was free) is 0 for every run.

Repeated runs of one configuration stay separate rows; only `speedups_by_model_and_batch` averages them.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from collections.abc import Iterable, Sequence

from train.compare.quality import Gate, default_gate
from train.compare.runs import Run


@dataclasses.dataclass(frozen=True)
class Weights:
    """Weights of the score terms: time, cost and energy count against a run, utilization (MFU) for it."""

    time: float
    cost: float
    energy: float
    utilization: float

    def __post_init__(self) -> None:
        values = dataclasses.astuple(self)
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"score weights must be finite and non-negative, got {values}")
        if not any(values[:3]):
            raise ValueError(f"score weights {values}: at least one of time, cost, energy must be positive")

    def describe(self) -> str:
        return ", ".join(f"{field.name} {getattr(self, field.name):g}" for field in dataclasses.fields(self))


# The study's seven presets (time, cost, energy, utilization): the first-named criterion weighs 0.5, the second 0.3.
WEIGHT_PRESETS: dict[str, Weights] = {
    "balance": Weights(0.3, 0.3, 0.3, 0.1),
    "time_cost": Weights(0.5, 0.3, 0.1, 0.1),
    "time_energy": Weights(0.5, 0.1, 0.3, 0.1),
    "cost_time": Weights(0.3, 0.5, 0.1, 0.1),
    "cost_energy": Weights(0.1, 0.5, 0.3, 0.1),
    "energy_time": Weights(0.3, 0.1, 0.5, 0.1),
    "energy_cost": Weights(0.1, 0.3, 0.5, 0.1),
}
DEFAULT_PRESET = "balance"


def parse_weights(text: str) -> tuple[str, Weights]:
    """A preset name, or four comma-separated weights ``t,c,e,u``; returns (name or "custom", weights)."""
    if text in WEIGHT_PRESETS:
        return text, WEIGHT_PRESETS[text]
    parts = text.split(",")
    try:
        values = [float(part) for part in parts]
    except ValueError:
        values = []
    if len(values) != 4:
        raise ValueError(
            f"--weights {text!r} is neither a preset ({', '.join(WEIGHT_PRESETS)}) "
            "nor four comma-separated numbers t,c,e,u such as 0.4,0.3,0.2,0.1"
        )
    return "custom", Weights(*values)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


@dataclasses.dataclass(frozen=True)
class Ratios:
    """A run against the baseline: speedup = t_baseline / t_run, cost = c_run / c_baseline, energy likewise."""

    speedup: float
    cost: float | None
    energy: float | None


def ratios_to(baseline: Run, run: Run) -> Ratios:
    return Ratios(
        speedup=baseline.train_time_s / run.train_time_s,
        cost=_ratio(run.cost_usd, baseline.cost_usd),
        energy=_ratio(run.energy_j, baseline.energy_j),
    )


@dataclasses.dataclass(frozen=True)
class Score:
    """Max-normalized terms of one run (None where the run lacks a value whose weight is 0) and the score."""

    time: float
    cost: float | None
    energy: float | None
    utilization: float | None
    value: float


def missing_terms(run: Run, weights: Weights) -> list[str]:
    """The weighted score terms for which ``run`` has no value."""
    terms = (("cost", weights.cost, run.cost_usd), ("energy", weights.energy, run.energy_j),
             ("MFU", weights.utilization, run.mfu))
    return [name for name, weight, value in terms if weight > 0 and value is None]


def max_normalized(values: Sequence[float | None]) -> list[float | None]:
    """v_i / max_j v_j over the values present (0 for all when that maximum is 0); None stays None."""
    top = max((value for value in values if value is not None), default=0.0)
    return [None if value is None else (value / top if top > 0 else 0.0) for value in values]


def weighted_scores(runs: Sequence[Run], weights: Weights, eligible: Sequence[bool] | None = None) -> list[Score | None]:
    """score_i = w_t T_i + w_c C_i + w_e E_i - w_u U_i over the ``eligible`` runs (default all) that have every
    weighted term; None for others.

    T, C, E, U are time, cost, energy and MFU, each divided by its maximum over the scored runs.
    """
    eligible = [True] * len(runs) if eligible is None else eligible
    scored = [index for index, run in enumerate(runs) if eligible[index] and not missing_terms(run, weights)]
    columns = [max_normalized([getattr(runs[i], key) for i in scored])
               for key in ("train_time_s", "cost_usd", "energy_j", "mfu")]
    scores: list[Score | None] = [None] * len(runs)
    for position, index in enumerate(scored):
        time, cost, energy, utilization = (column[position] for column in columns)
        terms = ((weights.time, time), (weights.cost, cost), (weights.energy, energy), (-weights.utilization, utilization))
        value = sum(weight * term for weight, term in terms if weight != 0)
        scores[index] = Score(time=time, cost=cost, energy=energy, utilization=utilization, value=value)
    return scores


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Runs of one task against a baseline run, scored with ``weights``; ``notes`` is what a reader must know."""

    runs: list[Run]
    baseline: int
    weights_name: str
    weights: Weights
    ratios: list[Ratios]
    scores: list[Score | None]
    notes: list[str]
    gate: Gate
    verdicts: list[str | None]  # None: passed the quality gate; else why the run did not converge
    matrix: dict[str, list[Score | None]]  # preset -> score of each run under it

    @property
    def converged(self) -> list[bool]:
        return [verdict is None for verdict in self.verdicts]

    def ranked_under(self, preset: str) -> list[int]:
        """Indices of the runs scored under ``preset``, best first."""
        scores = self.matrix[preset]
        return sorted((i for i, score in enumerate(scores) if score is not None), key=lambda i: scores[i].value)

    @property
    def ranking(self) -> list[int]:
        """Indices of the scored runs, best (lowest score) first."""
        scored = [index for index, score in enumerate(self.scores) if score is not None]
        return sorted(scored, key=lambda index: self.scores[index].value)


def _unequal_work_note(runs: Sequence[Run]) -> str | None:
    """A warning when the runs' totals are not comparable: they trained on amounts of data more than 1% apart."""
    amounts = [run.trained for run in runs]
    units = {run.trained_unit for run in runs}
    if None in amounts or len(units) > 1 or max(amounts) <= 1.01 * min(amounts):
        return None
    return (f"the runs trained on different amounts of data ({min(amounts):,} to {max(amounts):,} {units.pop()}): "
            "their time, cost and energy totals measure unequal work; compare throughput, or train each run on "
            "the same data for the same number of epochs or tokens")


def compare(runs: Sequence[Run], *, baseline: int = 0, weights_name: str = DEFAULT_PRESET,
            weights: Weights | None = None, notes: Iterable[str] = (), gate: Gate | None = None) -> Comparison:
    """Ratios to ``runs[baseline]``; weighted scores of the runs that pass ``gate`` (default: the task's,
    `train.compare.quality.default_gate`) under ``weights`` (preset ``weights_name`` unless given) and under every
    preset (the score matrix)."""
    if not runs:
        raise ValueError("no run to compare")
    if not 0 <= baseline < len(runs):
        raise ValueError(f"baseline index {baseline} is out of range for {len(runs)} runs")
    if weights is None:
        weights_name, weights = parse_weights(weights_name)
    gate = gate or default_gate(runs[0].task)
    verdicts = gate.verdicts(runs)
    converged = [verdict is None for verdict in verdicts]
    scores = weighted_scores(runs, weights, converged)
    notes = list(notes)
    for index, (run, verdict) in enumerate(zip(runs, verdicts)):
        if verdict is not None:
            notes.append(f"#{index + 1} {run.run_id} did not converge ({verdict}): shown, never ranked")
        if not run.completed:
            notes.append(f"#{index + 1} {run.run_id} stopped early ({run.stop_reason}) after {run.steps} steps: its "
                         "totals cover only that part")
        if scores[index] is None and converged[index]:
            missing = missing_terms(run, weights)
            names = " and ".join([", ".join(missing[:-1]), missing[-1]] if len(missing) > 1 else missing)
            notes.append(f"#{index + 1} {run.run_id} is not scored: its {names} {'is' if len(missing) == 1 else 'are'} "
                         "unknown (null in its log) and weighted; a weight of 0 for a term scores runs without it")
    work_note = _unequal_work_note(runs)
    if work_note:
        notes.append(work_note)
    return Comparison(
        runs=list(runs),
        baseline=baseline,
        weights_name=weights_name,
        weights=weights,
        ratios=[ratios_to(runs[baseline], run) for run in runs],
        scores=scores,
        notes=notes,
        gate=gate,
        verdicts=verdicts,
        matrix={name: weighted_scores(runs, preset, converged) for name, preset in WEIGHT_PRESETS.items()},
    )


def recommendation(comparison: Comparison, preset: str) -> str:
    """In words: the best converged run under ``preset`` and its margin over the runner-up."""
    ranked = comparison.ranked_under(preset)
    if not ranked:
        if any(comparison.converged):
            return (f"{preset}: no converged run could be scored: each lacks a weighted term (cost, energy or MFU; "
                    "see the notes)")
        return f"{preset}: no converged run could be scored"
    scores, runs = comparison.matrix[preset], comparison.runs
    best = ranked[0]
    text = f"{preset}: #{best + 1} ({runs[best].study_label}), score {scores[best].value:.3f}"
    if len(ranked) == 1:
        return text + ", the only converged run scored"
    second = ranked[1]
    gap = scores[second].value - scores[best].value
    return (text + f", {gap:.3f} below the runner-up #{second + 1} ({runs[second].study_label}, "
            f"{scores[second].value:.3f})")


@dataclasses.dataclass(frozen=True)
class GroupSpeedup:
    """Mean speedup of one configuration over the baseline's configuration, for one model and batch."""

    model: str
    batch_label: str
    configuration_label: str
    speedup: float


def speedups_by_model_and_batch(runs: Sequence[Run], baseline: int) -> list[GroupSpeedup]:
    """Within each (model, batch) group that has runs of the baseline's configuration: mean(t_ref) / mean(t_config)
    for every other configuration, groups ordered by model size then batch size."""
    reference = runs[baseline].configuration
    groups: dict[tuple, dict[tuple, list[Run]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for run in runs:
        key = (run.params is None, run.params or 0, run.model, run.batch_unit, run.batch_size, run.grad_accum)
        groups[key][run.configuration].append(run)
    speedups = []
    for key in sorted(groups):
        by_configuration = groups[key]
        if reference not in by_configuration:
            continue
        reference_time = statistics.fmean(run.train_time_s for run in by_configuration[reference])
        for configuration, members in by_configuration.items():
            if configuration != reference:
                speedups.append(GroupSpeedup(
                    model=members[0].model,
                    batch_label=members[0].batch_label,
                    configuration_label=members[0].configuration_label,
                    speedup=reference_time / statistics.fmean(run.train_time_s for run in members),
                ))
    return speedups
