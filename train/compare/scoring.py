"""Relate the runs of one task to a baseline run, score and rank them. A `Comparison` holds the runs

* against a baseline run b: speedup_i = t_b / t_i (above 1 is faster), cost ratio_i = c_i / c_b and energy
  ratio_i = e_i / e_b (below 1 is cheaper / less energy);
* by the weighted score of the study this project follows (BERT-base fine-tuned on IMDb on V100, A100, A10, T4,
  TPU v2 and TPU v3, scored by time, cost, energy and hardware utilization). With every quantity divided by its
  maximum over the runs scored (T_i = t_i / max_j t_j, likewise C, E, and U for MFU, so each lies in (0, 1])::

      score_i = w_t * T_i + w_c * C_i + w_e * E_i - w_u * U_i        (lower is better)

  This is the study's normalization (its Table 5.2 divides each column of its Table 5.1 by the column's
  maximum; tests/data/study-tables-5.toml). Only runs that pass the quality gate (`train.compare.quality`) are
  scored: a run that did not learn is shown and never ranked. Missing values are never taken as zero: a run whose
  cost, energy or MFU is null in its log is not scored when that term has a non-zero weight (the notes say which
  runs and why), and the maxima run over the scored runs only; but where no converged run has an MFU (a device
  without a datasheet peak, such as a CPU), the utilization term is left out of every score, with a note. A term
  whose maximum is 0 (e.g. every run was free) is 0 for every run.

The window scored (`WINDOWS`): ``whole`` (default, as the study did) takes each run's training time, cost and
energy over all its steps, warm-up included, and its MFU over them; ``steady`` takes the steady state's time,
cost and energy per unit trained (example or token) and its MFU, so runs compare by what they achieve once the
one-time work of the first steps is done.

Repeated runs of one configuration stay separate rows; only `speedups_by_model_and_batch` averages them.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from collections.abc import Iterable, Sequence

from train.compare.quality import Gate, default_gate
from train.compare.runs import LoggedRun


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


# The study's seven strategies (its Table 5.3) by its names (time, cost, energy, utilization): the first-named
# criterion weighs 0.5, the second 0.3, the third 0.1.
WEIGHT_PRESETS: dict[str, Weights] = {
    "balance": Weights(0.3, 0.3, 0.3, 0.1),
    "time_cost_energy": Weights(0.5, 0.3, 0.1, 0.1),
    "time_energy_cost": Weights(0.5, 0.1, 0.3, 0.1),
    "cost_time_energy": Weights(0.3, 0.5, 0.1, 0.1),
    "cost_energy_time": Weights(0.1, 0.5, 0.3, 0.1),
    "energy_time_cost": Weights(0.3, 0.1, 0.5, 0.1),
    "energy_cost_time": Weights(0.1, 0.3, 0.5, 0.1),
}
# Names earlier versions gave the strategies, still accepted wherever a preset is named.
PRESET_ALIASES: dict[str, str] = {
    "time_cost": "time_cost_energy",
    "time_energy": "time_energy_cost",
    "cost_time": "cost_time_energy",
    "cost_energy": "cost_energy_time",
    "energy_time": "energy_time_cost",
    "energy_cost": "energy_cost_time",
}
DEFAULT_PRESET = "balance"
WINDOWS = ("whole", "steady")
DEFAULT_WINDOW = "whole"
WINDOW_LABELS = {"whole": "whole run", "steady": "steady state"}
WARMUP_WARNING = 0.10  # of the training time: above it, a run's warm-up is worth a warning


def preset_name(text: str) -> str | None:
    """The preset ``text`` names (itself, or the study's name for an earlier alias), or None."""
    name = PRESET_ALIASES.get(text, text)
    return name if name in WEIGHT_PRESETS else None


def parse_weights(text: str) -> tuple[str, Weights]:
    """A preset name (or an alias), or four comma-separated weights ``t,c,e,u``; returns (preset name or
    "custom", weights)."""
    if (name := preset_name(text)) is not None:
        return name, WEIGHT_PRESETS[name]
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
    """A run against the baseline: speedup = t_baseline / t_run, cost = c_run / c_baseline, energy likewise (whole
    run); steady speedup = the run's steady throughput / the baseline's."""

    speedup: float
    cost: float | None
    energy: float | None
    steady_speedup: float | None = None


def _steady_throughput(run: LoggedRun) -> float | None:
    return None if run.steady is None else run.steady.throughput


def ratios_to(baseline: LoggedRun, run: LoggedRun) -> Ratios:
    return Ratios(
        speedup=baseline.train_time_s / run.train_time_s,
        cost=_ratio(run.cost_usd, baseline.cost_usd),
        energy=_ratio(run.energy_j, baseline.energy_j),
        steady_speedup=_ratio(_steady_throughput(run), _steady_throughput(baseline)),
    )


@dataclasses.dataclass(frozen=True)
class Figures:
    """What a run is scored on in one window: time, cost, energy (whole run: totals in s, USD, J; steady state:
    per unit trained) and MFU; None where the log lacks it."""

    time: float | None
    cost: float | None
    energy: float | None
    utilization: float | None


def figures(run: LoggedRun, window: str = DEFAULT_WINDOW) -> Figures:
    """The run's figures in ``window`` (`WINDOWS`). Steady state: time per unit = 1 / steady throughput, cost and
    energy per unit = the steady window's over the units it trained (throughput x its time)."""
    if window == "whole":
        return Figures(run.train_time_s, run.cost_usd, run.energy_j, run.mfu)
    steady = run.steady
    units = None if steady is None or steady.throughput is None else steady.throughput * steady.time_s
    if not units:
        return Figures(None, None, None, None if steady is None else steady.mfu)
    return Figures(steady.time_s / units, _ratio(steady.cost_usd, units), _ratio(steady.energy_j, units), steady.mfu)


@dataclasses.dataclass(frozen=True)
class Score:
    """Max-normalized terms of one run (None where the run lacks a value whose weight is 0) and the score."""

    time: float | None
    cost: float | None
    energy: float | None
    utilization: float | None
    value: float


_TERMS = (("time", "time"), ("cost", "cost"), ("energy", "energy"), ("MFU", "utilization"))


def missing_terms(run: LoggedRun, weights: Weights, window: str = DEFAULT_WINDOW) -> list[str]:
    """The weighted score terms for which ``run`` has no value in ``window``."""
    values = figures(run, window)
    return [name for name, field in _TERMS if getattr(weights, field) > 0 and getattr(values, field) is None]


def max_normalized(values: Sequence[float | None]) -> list[float | None]:
    """v_i / max_j v_j over the values present (0 for all when that maximum is 0); None stays None."""
    top = max((value for value in values if value is not None), default=0.0)
    return [None if value is None else (value / top if top > 0 else 0.0) for value in values]


def utilization_unknown(runs: Sequence[LoggedRun], eligible: Sequence[bool], window: str = DEFAULT_WINDOW) -> bool:
    """Whether no ``eligible`` run has an MFU in ``window`` (while some are eligible): the score then leaves the
    utilization term out."""
    chosen = [run for run, ok in zip(runs, eligible) if ok]
    return bool(chosen) and all(figures(run, window).utilization is None for run in chosen)


def weighted_scores(
    runs: Sequence[LoggedRun], weights: Weights, eligible: Sequence[bool] | None = None, window: str = DEFAULT_WINDOW
) -> list[Score | None]:
    """score_i = w_t T_i + w_c C_i + w_e E_i - w_u U_i over the ``eligible`` runs (default all) that have every
    weighted term in ``window``; None for others.

    T, C, E, U are time, cost, energy and MFU, each divided by its maximum over the scored runs; without an MFU
    for any eligible run, w_u is taken as 0 (`utilization_unknown`).
    """
    eligible = [True] * len(runs) if eligible is None else eligible
    if utilization_unknown(runs, eligible, window):
        weights = dataclasses.replace(weights, utilization=0.0)
    scored = [index for index, run in enumerate(runs) if eligible[index] and not missing_terms(run, weights, window)]
    values = [figures(runs[index], window) for index in scored]
    columns = [max_normalized([getattr(value, field) for value in values]) for _, field in _TERMS]
    scores: list[Score | None] = [None] * len(runs)
    for position, index in enumerate(scored):
        time, cost, energy, utilization = (column[position] for column in columns)
        terms = (
            (weights.time, time),
            (weights.cost, cost),
            (weights.energy, energy),
            (-weights.utilization, utilization),
        )
        value = sum(weight * term for weight, term in terms if weight != 0)
        scores[index] = Score(time=time, cost=cost, energy=energy, utilization=utilization, value=value)
    return scores


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Runs of one task against a baseline run, scored with ``weights`` in ``window``; ``notes`` is what a reader
    must know."""

    runs: list[LoggedRun]
    baseline: int
    weights_name: str
    weights: Weights
    ratios: list[Ratios]
    scores: list[Score | None]
    notes: list[str]
    gate: Gate
    verdicts: list[str | None]  # None: passed the quality gate; else why the run did not converge
    matrix: dict[str, list[Score | None]]  # preset -> score of each run under it
    window: str = DEFAULT_WINDOW

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


def _unequal_work_note(runs: Sequence[LoggedRun]) -> str | None:
    """A warning when the runs' totals are not comparable: they trained on amounts of data more than 1% apart."""
    amounts = [run.trained for run in runs]
    units = {run.trained_unit for run in runs}
    if None in amounts or len(units) > 1 or max(amounts) <= 1.01 * min(amounts):
        return None
    return (
        f"the runs trained on different amounts of data ({min(amounts):,} to {max(amounts):,} {units.pop()}): "
        "their time, cost and energy totals measure unequal work; compare throughput, or train each run on "
        "the same data for the same number of epochs or tokens"
    )


def warmup_note(index: int, run: LoggedRun) -> str | None:
    """One line when warm-up took more than `WARMUP_WARNING` of the run's training time."""
    if run.warmup is None or run.warmup.time_s <= WARMUP_WARNING * run.train_time_s:
        return None
    return (
        f"#{index + 1} {run.name}: warm-up took {run.warmup.time_s / run.train_time_s:.0%} of its training "
        f"time ({run.warmup.steps} steps, {run.warmup.time_s:.3g} s): its whole-run figures understate its "
        "steady state (see the steady-state table)"
    )


def schema_note(index: int, run: LoggedRun) -> str | None:
    """One line for a run whose log predates the windows (schema 1)."""
    if run.schema >= 2:
        return None
    energy = (
        ", and its energy covers compilation and evaluations besides the training steps"
        if run.energy_j is not None
        else ""
    )
    return f"#{index + 1} {run.name}: its log (schema {run.schema}) has no warm-up or steady-state figures{energy}"


def _score_notes(
    runs: Sequence[LoggedRun], weights: Weights, window: str, converged: Sequence[bool], scores: Sequence[Score | None]
) -> list[str]:
    """Why converged runs are not scored, and a term left out of every score."""
    notes = []
    if weights.utilization > 0 and utilization_unknown(runs, converged, window):
        notes.append(
            "no converged run has an MFU (no datasheet peak for its device): the scores leave the utilization term out"
        )
    for index, run in enumerate(runs):
        if scores[index] is None and converged[index]:
            missing = missing_terms(run, weights, window)
            if utilization_unknown(runs, converged, window) and "MFU" in missing:
                missing.remove("MFU")
            names = " and ".join([", ".join(missing[:-1]), missing[-1]] if len(missing) > 1 else missing)
            notes.append(
                f"#{index + 1} {run.name} is not scored: its {names} {'is' if len(missing) == 1 else 'are'} "
                f"unknown ({WINDOW_LABELS[window]}; null in its log) and weighted; a weight of 0 for a term "
                "scores runs without it"
            )
    return notes


def compare(
    runs: Sequence[LoggedRun],
    *,
    baseline: int = 0,
    weights_name: str = DEFAULT_PRESET,
    weights: Weights | None = None,
    notes: Iterable[str] = (),
    gate: Gate | None = None,
    window: str = DEFAULT_WINDOW,
) -> Comparison:
    """Ratios to ``runs[baseline]``; weighted scores in ``window`` of the runs that pass ``gate`` (default: the
    task's, `train.compare.quality.default_gate`) under ``weights`` (preset ``weights_name`` unless given) and
    under every preset (the score matrix)."""
    if not runs:
        raise ValueError("no run to compare")
    if not 0 <= baseline < len(runs):
        raise ValueError(f"baseline index {baseline} is out of range for {len(runs)} runs")
    if window not in WINDOWS:
        raise ValueError(f"score window {window!r} is not one of {', '.join(WINDOWS)}")
    if weights is None:
        weights_name, weights = parse_weights(weights_name)
    gate = gate or default_gate(runs[0].task)
    verdicts = gate.verdicts(runs)
    converged = [verdict is None for verdict in verdicts]
    scores = weighted_scores(runs, weights, converged, window)
    notes = list(notes)
    for index, (run, verdict) in enumerate(zip(runs, verdicts)):
        if verdict is not None:
            notes.append(f"#{index + 1} {run.name} did not converge ({verdict}): shown, never ranked")
        if not run.completed:
            notes.append(
                f"#{index + 1} {run.name} stopped early ({run.stop_reason}) after {run.steps} steps: its "
                "totals cover only that part"
            )
        notes += [note for note in (warmup_note(index, run), schema_note(index, run)) if note]
    notes += _score_notes(runs, weights, window, converged, scores)
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
        matrix={name: weighted_scores(runs, preset, converged, window) for name, preset in WEIGHT_PRESETS.items()},
        window=window,
    )


def recommendation(comparison: Comparison, preset: str) -> str:
    """In words: the best converged run under ``preset`` and its margin over the runner-up."""
    ranked = comparison.ranked_under(preset)
    if not ranked:
        if any(comparison.converged):
            return (
                f"{preset}: no converged run could be scored: each lacks a weighted term (time, cost, energy or "
                "MFU; see the notes)"
            )
        return f"{preset}: no converged run could be scored"
    scores, runs = comparison.matrix[preset], comparison.runs
    best = ranked[0]
    text = f"{preset}: #{best + 1} ({runs[best].study_label}), score {scores[best].value:.3f}"
    if len(ranked) == 1:
        return text + ", the only converged run scored"
    second = ranked[1]
    gap = scores[second].value - scores[best].value
    return (
        text + f", {gap:.3f} below the runner-up #{second + 1} ({runs[second].study_label}, {scores[second].value:.3f})"
    )


@dataclasses.dataclass(frozen=True)
class GroupSpeedup:
    """Mean speedup of one configuration over the baseline's configuration, for one model and batch."""

    model: str
    batch_label: str
    configuration_label: str
    speedup: float


def speedups_by_model_and_batch(runs: Sequence[LoggedRun], baseline: int) -> list[GroupSpeedup]:
    """Within each (model, batch) group that has runs of the baseline's configuration: mean(t_ref) / mean(t_config)
    for every other configuration, groups ordered by model size then batch size."""
    reference = runs[baseline].configuration
    groups: dict[tuple, dict[tuple, list[LoggedRun]]] = collections.defaultdict(lambda: collections.defaultdict(list))
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
                speedups.append(
                    GroupSpeedup(
                        model=members[0].model,
                        batch_label=members[0].batch_label,
                        configuration_label=members[0].configuration_label,
                        speedup=reference_time / statistics.fmean(run.train_time_s for run in members),
                    )
                )
    return speedups
