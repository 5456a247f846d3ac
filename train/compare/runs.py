"""Runs read from run logs (docs/run-log.md) for `train.compare`.

Each run is a ``run`` record (its configuration) followed, when it ended, by a ``summary`` record (its results).
Every record read is checked against the run log's one schema (`train.records.runlog.validate`); a problem is named by
file, line and key. A log normally holds one run; every ``run`` record starts a new one. A schema-1 log (written
before the windows of train.costs.windows were logged) reads with its warm-up, steady state and wall energy
unknown, and its energy covering the training loop (compilation and evaluations included). A log that cannot be
read, and a run whose summary holds no usable training time (a run stopped before its first step, a NaN), are left
out with a note naming them; the other logs are compared.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from train.records import runlog


@dataclasses.dataclass(frozen=True)
class Warmup:
    """The summary's ``warmup`` window: the first steps of each segment until the step time settled."""

    steps: int
    time_s: float
    energy_j: float | None
    cost_usd: float | None


@dataclasses.dataclass(frozen=True)
class Steady:
    """The summary's ``steady`` window: the steps after warm-up, and their rates over their own time."""

    steps: int
    time_s: float
    step_time_s: float | None
    throughput: float | None  # in the run's trained_unit per second
    tflops_per_s: float | None
    mfu: float | None
    energy_j: float | None
    power_w: float | None
    cost_usd: float | None


@dataclasses.dataclass(frozen=True)
class LoggedRun:
    """One training run as its log tells it: its configuration (the ``run`` record) and its results (the ``summary``
    record)."""

    source: Path
    run_id: str
    task: str
    device_kind: str
    device_count: int
    backend: str
    precision: str
    optimizer: str
    model: str
    params: int | None
    batch_size: int
    batch_unit: str  # "tokens" (max tokens per batch), "examples", or "rows of L tokens" (packed LM rows)
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
    metrics: dict[str, float]  # the last evaluation's quality metrics (bleu, accuracy, perplexity: the task's own)
    memory: dict[str, Any] | None = None  # the summary's memory anatomy (train/costs/memory.py); older logs lack it
    schema: int = runlog.SCHEMA_VERSION
    implementation: str = "ls_jax"  # the model's implementation; logs that do not name one trained ls_jax's
    wall_time_s: float | None = None
    wall_energy_j: float | None = None  # schema 1: unknown
    wall_cost_usd: float | None = None
    warmup: Warmup | None = None  # schema 1: unknown
    steady: Steady | None = None  # schema 1: unknown

    @property
    def name(self) -> str:
        """The run's name in reports: its run directory's name (a sweep names each by its point), or the log
        file's own name when it is not a run directory's ``run.jsonl``."""
        return self.source.parent.name if self.source.name == runlog.LOG_FILENAME else self.source.stem

    @property
    def configuration(self) -> tuple[str, int, str, str, str]:
        """What a speedup compares: device kind and count, implementation, kernel backend, precision."""
        return self.device_kind, self.device_count, self.implementation, self.backend, self.precision

    @property
    def configuration_label(self) -> str:
        return f"{self.device_kind} x{self.device_count} {self.implementation} {self.backend} {self.precision}"

    @property
    def study_label(self) -> str:
        """What the study's grid varies: device, implementation, backend, precision, optimizer and batch."""
        return f"{self.configuration_label} {self.optimizer} {self.batch_label}"

    @property
    def kernel_label(self) -> str:
        """How the model ran: its implementation, the fused ops' backend and the precision."""
        return f"{self.implementation} {self.backend} {self.precision}"

    @property
    def batch_label(self) -> str:
        accum = f" x{self.grad_accum} accum" if self.grad_accum > 1 else ""
        return f"{self.batch_size} {self.batch_unit}{accum}"


# What a task counts: the summary holds <count> and <count>_per_s for the first of these it logs.
_COUNTS = ("tokens", "examples")


def _checked(
    record: dict[str, Any], where: str, counted: Iterable[str] = (), schema: int = runlog.SCHEMA_VERSION
) -> dict[str, Any]:
    """``record`` after `train.records.runlog.validate`; ValueError naming ``where`` and the key when it breaks the
    schema."""
    try:
        runlog.validate(record, counted, schema=schema)
    except runlog.RecordError as err:
        raise ValueError(err.at(where)) from None
    return record


def _trained(summary: dict[str, Any], where: str, schema: int) -> tuple[int | None, str, float | None]:
    """(amount trained on, its unit, amount per second) from the first count in _COUNTS the summary logs."""
    for name in _COUNTS:
        if name in summary:
            _checked(summary, where, counted=(name,), schema=schema)
            return summary[name], name, summary[f"{name}_per_s"]
    return None, _COUNTS[0], None


def _warmup(summary: dict[str, Any]) -> Warmup | None:
    part = summary.get("warmup")
    return None if part is None else Warmup(part["steps"], part["time_s"], part["energy_j"], part["cost_usd"])


def _steady(summary: dict[str, Any], unit: str) -> Steady | None:
    part = summary.get("steady")
    if part is None:
        return None
    return Steady(
        part["steps"],
        part["time_s"],
        part["step_time_s"],
        part.get(f"{unit}_per_s"),
        part["tflops_per_s"],
        part["mfu"],
        part["energy_j"],
        part["power_w"],
        part["cost_usd"],
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _batch(batch: dict[str, Any], where: str) -> tuple[int, str, int]:
    """(size, unit, grad_accum) of a ``batch`` entry: {max_tokens or batch_size, grad_accum}; a batch of packed
    rows (``seq_len`` given, as GPT's) counts rows of that many tokens."""
    sizes = [(batch[key], unit) for key, unit in (("max_tokens", "tokens"), ("batch_size", "examples")) if key in batch]
    accum = batch.get("grad_accum")
    if len(sizes) != 1 or not _is_int(sizes[0][0]) or not _is_int(accum) or accum < 1:
        raise ValueError(f"{where}: batch={batch!r} must hold max_tokens or batch_size, and grad_accum >= 1 (integers)")
    size, unit = sizes[0]
    if unit == "examples" and _is_int(batch.get("seq_len")):
        unit = f"rows of {batch['seq_len']} tokens"
    return size, unit, accum


class UnusableRun(ValueError):
    """A well-formed run whose summary cannot be compared (no finite, positive training time): left out with a
    note, the other runs are compared."""


def _check_usable(results: dict[str, Any], run_id: str, where: str) -> None:
    """Raises UnusableRun for a run that trained no step, and for a non-finite number anywhere in its summary (the
    harness logs those as null, so such a log was changed by hand) or a training time that is not > 0."""
    if results["train_time_s"] == 0 and results["steps"] == 0:
        raise UnusableRun(
            f"left out run {run_id} ({where}): it stopped before its first step, so it has no time to compare"
        )
    for key, value in results.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise UnusableRun(f"left out run {run_id} ({where}): {key}={value} is not a finite number")
    if results["train_time_s"] <= 0:
        raise UnusableRun(f"left out run {run_id} ({where}): train_time_s={results['train_time_s']} must be > 0")


def _run(source: Path, run_record: dict[str, Any], run_where: str, summary: dict[str, Any], where: str) -> LoggedRun:
    config = _checked(run_record, run_where)
    schema = config["schema"]
    if schema not in runlog.READABLE_SCHEMAS:
        raise ValueError(
            f"{run_where}: run-log schema {schema}; this version of ls-jax reads schema "
            f"{', '.join(map(str, runlog.READABLE_SCHEMAS[:-1]))} and {runlog.READABLE_SCHEMAS[-1]}"
        )
    results = runlog.upgrade(_checked(summary, where, schema=schema), schema)
    _check_usable(results, config["run_id"], where)
    if (results["energy_j"] is None) != (results["energy_source"] is None):
        raise ValueError(
            f"{where}: energy_j and energy_source must both be null or both be set, got "
            f"{results['energy_j']!r} and {results['energy_source']!r}"
        )
    batch_size, batch_unit, grad_accum = _batch(config["batch"], run_where)
    trained, trained_unit, throughput = _trained(summary, where, schema)
    return LoggedRun(
        source=source,
        run_id=config["run_id"],
        task=config["task"],
        device_kind=config["device_kind"],
        device_count=config["device_count"],
        backend=config["backend"],
        precision=config["precision"],
        optimizer=config["optimizer"],
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
        metrics=dict(results["metrics"]),
        memory=results.get("memory"),
        schema=schema,
        implementation=config.get("implementation", "ls_jax"),
        wall_time_s=float(results["wall_time_s"]),
        wall_energy_j=results.get("wall_energy_j"),
        wall_cost_usd=results.get("wall_cost_usd"),
        warmup=_warmup(results),
        steady=_steady(results, trained_unit),
    )


def is_run_log(path: Path) -> bool:
    """Whether a JSONL file starts with a run-log ``run`` record."""
    with path.open(encoding="utf-8", errors="replace") as file:
        first = file.readline()
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and record.get("type") == "run" and "schema" in record


def read_run_log(path: Path) -> tuple[list[LoggedRun], list[str]]:
    """The runs of one log, and a note for each run skipped because it has no summary.

    A log normally holds one run; every ``run`` record starts a new one (e.g. logs concatenated with ``cat``).
    """
    records, truncated = runlog.read_numbered(path)
    if not records:
        raise ValueError(f"{path}: holds no complete run-log record (one JSON object per line)")
    number, first = records[0]
    if first["type"] != "run":
        raise ValueError(
            f"{path}:{number}: the first record is {first['type']!r}; a run log starts with a 'run' record"
        )
    runs, notes = [], []
    starts = [i for i, (_, record) in enumerate(records) if record["type"] == "run"] + [len(records)]
    for start, end in zip(starts, starts[1:]):
        run_number, run_record = records[start]
        summaries = [(n, r) for n, r in records[start + 1 : end] if r["type"] == "summary"]
        if not summaries:
            reason = "its last line is cut short" if truncated and end == len(records) else "it has no summary record"
            notes.append(
                f"skipped run {run_record.get('run_id', '?')} in {path}: {reason} "
                "(still running, or killed before it could finish its log)"
            )
            continue
        summary_number, summary = summaries[-1]
        try:
            runs.append(_run(path, run_record, f"{path}:{run_number}", summary, f"{path}:{summary_number}"))
        except UnusableRun as err:
            notes.append(str(err))
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
            logs, unreadable = [], []
            for path in candidates:
                try:
                    if is_run_log(path):
                        logs.append(path)
                except OSError as err:
                    unreadable.append(path)
                    notes.append(f"left out {path}: {err.strerror or err}")
            notes += [
                f"passed over {path}: not a run log (no 'run' record first)"
                for path in candidates
                if path not in logs and path not in unreadable
            ]
            if not logs:
                raise FileNotFoundError(
                    f"{entry}: no run logs (*.jsonl starting with a 'run' record) in this directory"
                )
        elif entry.is_file():
            logs = [entry]
        else:
            raise FileNotFoundError(f"{entry}: no such file or directory")
        found.update(dict.fromkeys(path.resolve() for path in logs))
    return list(found), notes


def load_runs(paths: Iterable[str | Path]) -> tuple[list[LoggedRun], list[str]]:
    """Every run with a summary in the logs named by ``paths`` (files or directories), and notes on what was left out:
    runs without a summary or a usable time, and logs that cannot be read (each note names the file, line and key).

    Raises:
      FileNotFoundError: a path does not exist, or a directory holds no run log.
      ValueError: no run is left to compare (the message holds the notes).
    """
    logs, notes = find_run_logs(paths)
    runs: list[LoggedRun] = []
    for log in logs:
        try:
            log_runs, log_notes = read_run_log(log)
        except ValueError as err:  # its message names the file (and line)
            notes.append(f"left out {err}")
            continue
        except OSError as err:
            notes.append(f"left out {log}: {err.strerror or err}")
            continue
        runs += log_runs
        notes += log_notes
    first_seen: dict[str, LoggedRun] = {}
    unique = []
    for run in runs:
        if run.run_id in first_seen:
            notes.append(
                f"left out run {run.run_id} from {run.source}: the same run id was read from "
                f"{first_seen[run.run_id].source}"
            )
            continue
        first_seen[run.run_id] = run
        unique.append(run)
    if not unique:
        raise ValueError("no run to compare: " + "; ".join(notes))
    return unique, notes


def select_task(runs: Sequence[LoggedRun], task: str | None) -> list[LoggedRun]:
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


def find_baseline(runs: Sequence[LoggedRun], spec: str | None) -> int:
    """Index of the baseline run: ``spec`` is a run id, a row number (``#1`` or ``1`` is the first) or a unique
    substring of a run id or log path; None means the slowest run, the one with the lowest throughput (the first
    run where no run logs one), so every other run's speedup reads as how much faster it is."""
    if spec is None:
        measured = [index for index, run in enumerate(runs) if run.throughput is not None]
        return min(measured, key=lambda index: runs[index].throughput) if measured else 0
    for index, run in enumerate(runs):
        if run.run_id == spec:
            return index
    number = spec.removeprefix("#")
    if number.isdigit():
        if 1 <= int(number) <= len(runs):
            return int(number) - 1
        raise ValueError(f"--baseline {spec}: the runs are numbered #1 to #{len(runs)}")
    matches = [index for index, run in enumerate(runs) if spec in run.run_id or spec in str(run.source)]
    if len(matches) == 1:
        return matches[0]
    ids = ", ".join(runs[index].run_id for index in matches) if matches else ", ".join(run.run_id for run in runs)
    if matches:
        raise ValueError(f"--baseline {spec!r} matches {len(matches)} runs ({ids}); give more of the run id or its #")
    raise ValueError(f"--baseline {spec!r} matches no run id or log path; the runs are {ids}")
