"""Compare training runs from any devices: read run logs, relate runs to a baseline, score and rank them.

Run logs follow docs/run-log.md: each run is a ``run`` record (its configuration) followed, when it ended, by a
``summary`` record (its results). A `Comparison` relates the runs of one task:

* against a baseline run b: speedup_i = t_b / t_i (above 1 is faster), cost ratio_i = c_i / c_b and energy
  ratio_i = e_i / e_b (below 1 is cheaper / less energy);
* by the weighted score of the study this project follows (BERT-base fine-tuned on IMDb on V100, A100, A10, T4,
  TPU v2 and TPU v3, scored by time, cost, energy and hardware utilization). With every quantity divided by its
  maximum over the runs scored (T_i = t_i / max_j t_j, likewise C, E, and U for MFU, so each lies in (0, 1])::

      score_i = w_t * T_i + w_c * C_i + w_e * E_i - w_u * U_i        (lower is better)

  Missing values are never taken as zero: a run whose cost, energy or MFU is null in its log is not scored when
  that term has a non-zero weight (the notes say which runs and why), and the maxima run over the scored runs
  only. A term whose maximum is 0 (e.g. every run was free) is 0 for every run.

Repeated runs of one configuration stay separate rows; only `speedups_by_model_and_batch` averages them.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1


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


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run: its configuration (the ``run`` record) and its results (the ``summary`` record)."""

    source: Path
    run_id: str
    task: str
    device_kind: str
    device_count: int
    backend: str
    precision: str
    model: str
    params: int | None
    batch_size: int
    batch_unit: str  # "tokens" (max tokens per batch) or "examples"
    grad_accum: int
    steps: int
    trained: int | None  # how much data the run trained on, in trained_unit
    trained_unit: str  # "tokens" or "examples"
    completed: bool
    stop_reason: str | None
    train_time_s: float
    cost_usd: float | None
    energy_j: float | None
    energy_estimated: bool
    throughput: float | None  # trained / train_time_s, in trained_unit per second
    mfu: float | None
    bleu: float | None
    accuracy: float | None

    @property
    def configuration(self) -> tuple[str, int, str, str]:
        """What a speedup compares: device kind and count, kernel backend, precision."""
        return self.device_kind, self.device_count, self.backend, self.precision

    @property
    def configuration_label(self) -> str:
        return f"{self.device_kind} x{self.device_count} {self.backend} {self.precision}"

    @property
    def batch_label(self) -> str:
        accum = f" x{self.grad_accum} accum" if self.grad_accum > 1 else ""
        return f"{self.batch_size} {self.batch_unit}{accum}"


# Keys read from each record, with the JSON type they must have and whether null is allowed.
_RUN_KEYS: dict[str, tuple[type, bool]] = {
    "schema": (int, False),
    "run_id": (str, False),
    "task": (str, False),
    "device_kind": (str, False),
    "device_count": (int, False),
    "backend": (str, False),
    "precision": (str, False),
    "model": (str, False),
    "params": (int, True),
    "batch": (dict, False),
}
_SUMMARY_KEYS: dict[str, tuple[type, bool]] = {
    "completed": (bool, False),
    "stop_reason": (str, True),
    "steps": (int, False),
    "train_time_s": (float, False),
    "mfu": (float, True),
    "energy_j": (float, True),
    "energy_source": (str, True),
    "cost_usd": (float, True),
}
# What a task counts: the summary holds <count> and <count>_per_s for the first of these it logs.
_COUNTS = ("tokens", "examples")


_JSON_TYPE_NAMES = {bool: "boolean", int: "integer", float: "number", str: "string", dict: "object"}


def _is_kind(value: Any, kind: type) -> bool:
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def _fields(record: dict[str, Any], keys: Mapping[str, tuple[type, bool]], where: str) -> dict[str, Any]:
    """The values of ``keys`` in ``record``; ValueError naming the record and the key when one is absent or wrong."""
    values = {}
    for key, (kind, nullable) in keys.items():
        if key not in record:
            raise ValueError(f"{where}: the {record['type']!r} record has no key {key!r} (see docs/run-log.md)")
        value = record[key]
        if value is None and not nullable:
            raise ValueError(f"{where}: {key} is null in the {record['type']!r} record")
        if value is not None and not _is_kind(value, kind):
            raise ValueError(f"{where}: {key}={value!r} in the {record['type']!r} record is not a JSON "
                             f"{_JSON_TYPE_NAMES[kind]}")
        values[key] = value
    return values


def _optional_number(record: dict[str, Any], key: str, where: str) -> float | None:
    """A task-specific value (e.g. bleu for wmt, accuracy for imdb): absent means null."""
    value = record.get(key)
    if value is not None and not _is_kind(value, float):
        raise ValueError(f"{where}: {key}={value!r} in the {record['type']!r} record is not a number")
    return value


def _trained(summary: dict[str, Any], where: str) -> tuple[int | None, str, float | None]:
    """(amount trained on, its unit, amount per second) from the first count in _COUNTS the summary logs."""
    for name in _COUNTS:
        if name in summary:
            amount = _fields(summary, {name: (int, True), f"{name}_per_s": (float, True)}, where)
            return amount[name], name, amount[f"{name}_per_s"]
    return None, _COUNTS[0], None


def _batch(batch: dict[str, Any], where: str) -> tuple[int, str, int]:
    """(size, unit, grad_accum) of a ``batch`` entry: {max_tokens or batch_size, grad_accum}."""
    sizes = [(batch[key], unit) for key, unit in (("max_tokens", "tokens"), ("batch_size", "examples")) if key in batch]
    accum = batch.get("grad_accum")
    if len(sizes) != 1 or not _is_kind(sizes[0][0], int) or not _is_kind(accum, int) or accum < 1:
        raise ValueError(f"{where}: batch={batch!r} must hold max_tokens or batch_size, and grad_accum >= 1 (integers)")
    return sizes[0][0], sizes[0][1], accum


def _run(source: Path, run_record: dict[str, Any], run_where: str, summary: dict[str, Any], where: str) -> Run:
    config = _fields(run_record, _RUN_KEYS, run_where)
    if config["schema"] != SCHEMA_VERSION:
        raise ValueError(f"{run_where}: run-log schema {config['schema']}; this version of ls-jax reads schema "
                         f"{SCHEMA_VERSION}")
    results = _fields(summary, _SUMMARY_KEYS, where)
    if results["train_time_s"] <= 0:
        raise ValueError(f"{where}: train_time_s={results['train_time_s']} must be positive")
    if (results["energy_j"] is None) != (results["energy_source"] is None):
        raise ValueError(f"{where}: energy_j and energy_source must both be null or both be set, got "
                         f"{results['energy_j']!r} and {results['energy_source']!r}")
    batch_size, batch_unit, grad_accum = _batch(config["batch"], run_where)
    trained, trained_unit, throughput = _trained(summary, where)
    return Run(
        source=source,
        run_id=config["run_id"],
        task=config["task"],
        device_kind=config["device_kind"],
        device_count=config["device_count"],
        backend=config["backend"],
        precision=config["precision"],
        model=config["model"],
        params=config["params"],
        batch_size=batch_size,
        batch_unit=batch_unit,
        grad_accum=grad_accum,
        steps=results["steps"],
        trained=trained,
        trained_unit=trained_unit,
        completed=results["completed"],
        stop_reason=results["stop_reason"],
        train_time_s=float(results["train_time_s"]),
        cost_usd=results["cost_usd"],
        energy_j=results["energy_j"],
        energy_estimated=results["energy_source"] == "estimated",
        throughput=throughput,
        mfu=results["mfu"],
        bleu=_optional_number(summary, "bleu", where),
        accuracy=_optional_number(summary, "accuracy", where),
    )


def _records(path: Path) -> tuple[list[tuple[int, dict[str, Any]]], bool]:
    """(line number, record) pairs of a JSONL file, and whether its last line was cut short.

    A process killed while writing leaves a partial last line; that line is dropped (its run then lacks a
    summary and is skipped). Unparsable lines elsewhere are an error.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a UTF-8 text file, so not a run log") from None
    lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    records = []
    for position, (number, line) in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if position == len(lines) - 1:
                return records, True
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("type"), str):
            raise ValueError(f"{path}:{number}: a run-log record must be a JSON object with a string 'type'")
        records.append((number, record))
    return records, False


def is_run_log(path: Path) -> bool:
    """Whether a JSONL file starts with a run-log ``run`` record."""
    with path.open(encoding="utf-8", errors="replace") as file:
        first = file.readline()
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and record.get("type") == "run" and "schema" in record


def read_run_log(path: Path) -> tuple[list[Run], list[str]]:
    """The runs of one log, and a note for each run skipped because it has no summary.

    A log normally holds one run; every ``run`` record starts a new one (e.g. logs concatenated with ``cat``).
    """
    records, truncated = _records(path)
    if not records:
        raise ValueError(f"{path}: holds no complete run-log record")
    number, first = records[0]
    if first["type"] != "run":
        raise ValueError(f"{path}:{number}: the first record is {first['type']!r}; a run log starts with a 'run' record")
    runs, notes = [], []
    starts = [i for i, (_, record) in enumerate(records) if record["type"] == "run"] + [len(records)]
    for start, end in zip(starts, starts[1:]):
        run_number, run_record = records[start]
        summaries = [(n, r) for n, r in records[start + 1 : end] if r["type"] == "summary"]
        if not summaries:
            reason = "its last line is cut short" if truncated and end == len(records) else "it has no summary record"
            notes.append(f"skipped run {run_record.get('run_id', '?')} in {path}: {reason} "
                         "(still running, or killed before it could finish its log)")
            continue
        summary_number, summary = summaries[-1]
        runs.append(_run(path, run_record, f"{path}:{run_number}", summary, f"{path}:{summary_number}"))
    return runs, notes


def find_run_logs(paths: Iterable[str | Path]) -> tuple[list[Path], list[str]]:
    """Run-log files named by ``paths``, in order; a directory contributes its ``*.jsonl`` run logs, recursively.

    A file named directly must be a run log; a ``*.jsonl`` file found in a directory that does not start with a
    ``run`` record is passed over with a note.
    """
    found: dict[Path, None] = {}
    notes = []
    for entry in map(Path, paths):
        if entry.is_dir():
            candidates = sorted(entry.rglob("*.jsonl"))
            logs = [path for path in candidates if is_run_log(path)]
            notes += [f"passed over {path}: not a run log (no 'run' record first)" for path in candidates
                      if path not in logs]
            if not logs:
                raise FileNotFoundError(f"{entry}: no run logs (*.jsonl starting with a 'run' record) in this directory")
        elif entry.is_file():
            logs = [entry]
        else:
            raise FileNotFoundError(f"{entry}: no such file or directory")
        found.update(dict.fromkeys(path.resolve() for path in logs))
    return list(found), notes


def load_runs(paths: Iterable[str | Path]) -> tuple[list[Run], list[str]]:
    """Every run with a summary in the logs named by ``paths`` (files or directories), and notes on what was left out.

    Raises:
      FileNotFoundError: a path does not exist, or a directory holds no run log.
      ValueError: a log is malformed (the message names the file, line and key), or no run has a summary.
    """
    logs, notes = find_run_logs(paths)
    runs: list[Run] = []
    for log in logs:
        log_runs, log_notes = read_run_log(log)
        runs += log_runs
        notes += log_notes
    first_seen: dict[str, Run] = {}
    unique = []
    for run in runs:
        if run.run_id in first_seen:
            notes.append(f"left out run {run.run_id} from {run.source}: the same run id was read from "
                         f"{first_seen[run.run_id].source}")
            continue
        first_seen[run.run_id] = run
        unique.append(run)
    if not unique:
        raise ValueError("no run to compare: " + "; ".join(notes))
    return unique, notes


def select_task(runs: Sequence[Run], task: str | None) -> list[Run]:
    """The runs of ``task``; with ``task=None`` the runs must all be of one task (scores compare one workload)."""
    counts = collections.Counter(run.task for run in runs)
    listing = ", ".join(f"{name}: {count} run{'s' * (count > 1)}" for name, count in counts.items())
    if task is None:
        if len(counts) > 1:
            raise ValueError(f"the logs hold runs of several tasks ({listing}); choose one with --task")
        return list(runs)
    if task not in counts:
        raise ValueError(f"no run of task {task!r} in the logs ({listing})")
    return [run for run in runs if run.task == task]


def find_baseline(runs: Sequence[Run], spec: str | None) -> int:
    """Index of the baseline run: ``spec`` is a run id, a row number (#1 first) or a unique substring of a run id
    or log path; None means the first run."""
    if spec is None:
        return 0
    for index, run in enumerate(runs):
        if run.run_id == spec:
            return index
    if spec.isdigit():
        if 1 <= int(spec) <= len(runs):
            return int(spec) - 1
        raise ValueError(f"--baseline {spec}: the runs are numbered #1 to #{len(runs)}")
    matches = [index for index, run in enumerate(runs) if spec in run.run_id or spec in str(run.source)]
    if len(matches) == 1:
        return matches[0]
    ids = ", ".join(runs[index].run_id for index in matches) if matches else ", ".join(run.run_id for run in runs)
    if matches:
        raise ValueError(f"--baseline {spec!r} matches {len(matches)} runs ({ids}); give more of the run id or its #")
    raise ValueError(f"--baseline {spec!r} matches no run id or log path; the runs are {ids}")


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


def weighted_scores(runs: Sequence[Run], weights: Weights) -> list[Score | None]:
    """score_i = w_t T_i + w_c C_i + w_e E_i - w_u U_i over the runs that have every weighted term; None for others.

    T, C, E, U are time, cost, energy and MFU, each divided by its maximum over the scored runs.
    """
    scored = [index for index, run in enumerate(runs) if not missing_terms(run, weights)]
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
            weights: Weights | None = None, notes: Iterable[str] = ()) -> Comparison:
    """Ratios to ``runs[baseline]`` and weighted scores (preset ``weights_name`` unless ``weights`` is given)."""
    if not runs:
        raise ValueError("no run to compare")
    if not 0 <= baseline < len(runs):
        raise ValueError(f"baseline index {baseline} is out of range for {len(runs)} runs")
    if weights is None:
        weights_name, weights = parse_weights(weights_name)
    scores = weighted_scores(runs, weights)
    notes = list(notes)
    for index, run in enumerate(runs):
        if not run.completed:
            notes.append(f"#{index + 1} {run.run_id} stopped early ({run.stop_reason}) after {run.steps} steps: its "
                         "totals cover only that part")
        if scores[index] is None:
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
    )


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


def significant(value: float, digits: int = 3) -> str:
    """``value`` with ``digits`` significant digits in fixed-point notation, thousands separated: 0.161, 2.69, 1,235."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:,.{decimals}f}"


def si_scale(value: float) -> tuple[float, str]:
    """(factor, prefix) to print ``value`` in: the largest of 1, k, M, G, T not above it."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return factor, prefix
    return 1.0, ""


def format_energy(run: Run) -> str:
    if run.energy_j is None:
        return "n/a"
    factor, prefix = si_scale(run.energy_j)
    return f"{significant(run.energy_j / factor)} {prefix}J ({'estimated' if run.energy_estimated else 'measured'})"


def time_scale(seconds: float) -> tuple[float, str]:
    """(seconds per unit, unit) for durations up to ``seconds``: s, min or h."""
    if seconds >= 2 * 3600:
        return 3600.0, "h"
    if seconds >= 2 * 60:
        return 60.0, "min"
    return 1.0, "s"


def format_duration(seconds: float) -> str:
    factor, unit = time_scale(seconds)
    return f"{significant(seconds / factor)} {unit}"


def _optional(value: float | None, formatter: Callable[[float], str]) -> str:
    return "n/a" if value is None else formatter(value)


def runs_table(comparison: Comparison) -> tuple[list[str], list[list[str]]]:
    """Header and rows: each run's configuration and results."""
    runs = comparison.runs
    quality = [name for name, key in (("BLEU", "bleu"), ("accuracy", "accuracy"))
               if any(getattr(run, key) is not None for run in runs)]
    header = ["#", "run", "device", "count", "backend", "precision", "model", "batch", "time", "cost", "energy",
              "throughput", "MFU", *quality]
    rows = []
    for index, run in enumerate(runs):
        row = [
            f"{index + 1}", run.run_id, run.device_kind, f"{run.device_count}", run.backend, run.precision, run.model,
            run.batch_label, format_duration(run.train_time_s),
            _optional(run.cost_usd, lambda usd: f"${significant(usd)}"), format_energy(run),
            _optional(run.throughput, lambda rate: f"{rate:,.0f} {run.trained_unit}/s"),
            _optional(run.mfu, lambda mfu: f"{100 * mfu:.1f}%"),
        ]
        row += [_optional(run.bleu, lambda bleu: f"{bleu:.2f}")] if "BLEU" in quality else []
        row += [_optional(run.accuracy, lambda accuracy: f"{accuracy:.4f}")] if "accuracy" in quality else []
        rows.append(row)
    return header, rows


def ratios_table(comparison: Comparison) -> tuple[list[str], list[list[str]]]:
    """Header and rows: speedup, cost ratio and energy ratio of each run against the baseline."""
    header = ["#", "run", "device", "backend", "precision", "speedup", "cost ratio", "energy ratio", ""]
    rows = []
    for index, (run, ratios) in enumerate(zip(comparison.runs, comparison.ratios)):
        rows.append([
            f"{index + 1}", run.run_id, run.device_kind, run.backend, run.precision, f"{ratios.speedup:.2f}x",
            _optional(ratios.cost, lambda ratio: f"{ratio:.2f}x"),
            _optional(ratios.energy, lambda ratio: f"{ratio:.2f}x"),
            "baseline" if index == comparison.baseline else "",
        ])
    return header, rows


def score_table(comparison: Comparison) -> tuple[list[str], list[list[str]]]:
    """Header and rows: the scored runs ranked best first, with their normalized terms."""
    header = ["rank", "#", "run", "device", "backend", "precision", "T", "C", "E", "U", "score"]
    rows = []
    for rank, index in enumerate(comparison.ranking, 1):
        run, score = comparison.runs[index], comparison.scores[index]
        terms = [_optional(term, lambda value: f"{value:.3f}")
                 for term in (score.time, score.cost, score.energy, score.utilization)]
        rows.append([f"{rank}", f"{index + 1}", run.run_id, run.device_kind, run.backend, run.precision, *terms,
                     f"{score.value:.4f}"])
    return header, rows


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A pipe table, columns padded so that it also reads well as plain text."""
    widths = [max(3, *(len(cell) for cell in column)) for column in zip(header, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell.ljust(width) for cell, width in zip(cells, widths)) + " |"

    return "\n".join([line(header), line(["-" * width for width in widths]), *map(line, rows)])


def score_explanation(comparison: Comparison) -> str:
    weights = comparison.weights
    return (f"Weights `{comparison.weights_name}` ({weights.describe()}). T, C, E and U are time, cost, energy and "
            "MFU, each divided by its maximum over the scored runs; score = "
            f"{weights.time:g} T + {weights.cost:g} C + {weights.energy:g} E - {weights.utilization:g} U, "
            "lower is better.")


@dataclasses.dataclass(frozen=True)
class Plot:
    """A figure of the report: its PNG file name relative to the report, or None and why it was not drawn."""

    title: str
    file_name: str | None
    reason: str = ""


def markdown_report(comparison: Comparison, *, plots: Sequence[Plot], command: str, created: str) -> str:
    """report.md: the tables, the plots, the notes and the source of every run."""
    baseline = comparison.runs[comparison.baseline]
    sections = [
        "# Training run comparison",
        f"Created {created} by `{command}` from {len(comparison.runs)} runs of task `{baseline.task}`.",
        "## Runs",
        markdown_table(*runs_table(comparison)),
        f"## Against the baseline: #{comparison.baseline + 1} {baseline.run_id} ({baseline.configuration_label})",
        "Speedup = baseline time / run time; cost and energy ratios = run / baseline.",
        markdown_table(*ratios_table(comparison)),
        "## Weighted score",
        score_explanation(comparison),
        markdown_table(*score_table(comparison)) if comparison.ranking else "No run could be scored (see the notes).",
        "## Plots",
        *(f"![{plot.title}]({plot.file_name})" if plot.file_name else f"*{plot.title}: not drawn; {plot.reason}.*"
          for plot in plots),
    ]
    if comparison.notes:
        sections += ["## Notes", "\n".join(f"- {note}" for note in comparison.notes)]
    sections += ["## Sources", "\n".join(f"- #{index + 1} {run.run_id}: `{run.source}`"
                                         for index, run in enumerate(comparison.runs))]
    return "\n\n".join(sections) + "\n"
