"""A sweep's specification: a TOML file of grids, expanded into the runs of `python -m train.sweep`.

    name = "bert-study"          # the sweep's name: every run directory it makes carries it
    out = "runs/bert-study"      # where the run directories go (relative: to the current directory)
    weights = "balance"          # the report's score weights: a preset or "t,c,e,u" (default balance)
    quality_threshold = 0.8      # the final quality a ranked run reaches (default: the task's, train.compare)
    [axes]                       # values common to every grid: a value or a list of values
    task = "imdb"
    steps = 300
    lr = 1e-3
    [flags]                      # further flags of every run: --key value (true: a bare --key; a list:
                                 # the flag once per item, for a flag the task takes more than once)
    no_tensorboard = true
    [[grid]]                     # the runs: the product of the listed values
    optimizer = ["optax-adamw", "adan"]
    precision = ["fp32", "bf16"]
    [[grid]]                     # more runs; from_best takes the axes this grid leaves out from the best
    batch_size = [16, 64]        # converged run of the grids before it under that preset
    from_best = "balance"

Axes (`AXES`): task, device, preset, implementation, optimizer, lr, precision, backend, remat, batch_size,
max_tokens, max_seq_len, steps, epochs, seed. The learning rate is an axis because optimizers differ in the one they
train at: a grid per optimizer, each with its own lr, compares each at its own. A run's point is its value on each axis
that is set; its name joins them.

Every run's command line is parsed by its task's own parser and its configuration checked as the run would check
it, when the spec is read: a flag the task does not know, or a value out of range, stops the sweep before any run.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ls_jax.layers.config import REMAT_MODES
from train.compare.scoring import DEFAULT_PRESET, WEIGHT_PRESETS, parse_weights, preset_name
from train.costs.precision import PRECISION_DTYPES
from train.errors import UsageError
from train.harness.cli import IMPLEMENTATIONS
from train.harness.optimizer import OPTIMIZERS
from train.tasks import TASKS

BACKENDS = ("auto", "ffi", "xla")
_CHOICES: dict[str, tuple[str, ...]] = {  # the tasks are read from `TASKS` when a spec is checked
    "implementation": IMPLEMENTATIONS,
    "optimizer": OPTIMIZERS,
    "precision": ("auto", *PRECISION_DTYPES),
    "backend": BACKENDS,
    "remat": REMAT_MODES,
}
_COUNTS = ("batch_size", "max_tokens", "max_seq_len", "steps", "epochs")
AXES = (
    "task",
    "device",
    "preset",
    "implementation",
    "optimizer",
    "lr",
    "precision",
    "backend",
    "remat",
    *_COUNTS,
    "seed",
)
# Axes that are not a flag of the training command.
_NOT_FLAGS = ("task", "device")
# The short form of an axis in a run's name.
_SHORT = {
    "lr": "lr",
    "batch_size": "b",
    "max_tokens": "t",
    "max_seq_len": "l",
    "steps": "s",
    "epochs": "e",
    "seed": "seed",
    "remat": "remat-",
}
_KEYS = ("name", "out", "weights", "quality_threshold", "axes", "flags", "grid")


@dataclasses.dataclass(frozen=True)
class Point:
    """One run of a sweep: its value on each axis set."""

    axes: tuple[tuple[str, Any], ...]  # in `AXES` order

    @property
    def values(self) -> dict[str, Any]:
        return dict(self.axes)

    @property
    def task(self) -> str:
        return self.values["task"]

    @property
    def device(self) -> str | None:
        return self.values.get("device")

    @property
    def name(self) -> str:
        """E.g. ``imdb-bert-tiny-flax-adan-fp32-xla-b32-l40-s300-seed0``: file-name safe, unique within a sweep."""
        parts = [f"{_SHORT.get(key, '')}{value}" for key, value in self.axes if key != "device"]
        if self.device:
            parts.insert(1, self.device)
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", "-".join(str(part) for part in parts))

    def flags(self, extra: Mapping[str, Any]) -> list[str]:
        """The training command's flags for this point, then ``extra``'s (a later flag wins in argparse)."""
        words: list[str] = []
        for key, value in [*((k, v) for k, v in self.axes if k not in _NOT_FLAGS), *extra.items()]:
            flag = "--" + key.replace("_", "-")
            if value is True:
                words.append(flag)
            elif isinstance(value, list):  # a flag given once per item ([flags] of a repeatable flag)
                for item in value:
                    words += [flag, str(item)]
            elif value is not False:
                words += [flag, str(value)]
        return words


@dataclasses.dataclass(frozen=True)
class Grid:
    """One ``[[grid]]``: a list of values per axis (the common axes merged in) and an optional ``from_best``."""

    axes: dict[str, list[Any]]
    from_best: str | None = None

    def points(self, best: Mapping[str, Any] | None = None) -> list[Point]:
        """The product of the axes' values; with ``best`` (a point's values) its values fill the axes left out."""
        axes = dict(self.axes)
        for key, value in (best or {}).items():
            axes.setdefault(key, [value])
        ordered = [key for key in AXES if key in axes]
        return [
            Point(tuple(zip(ordered, combination)))
            for combination in itertools.product(*(axes[key] for key in ordered))
        ]


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str
    out: Path
    grids: list[Grid]
    flags: dict[str, Any]
    source: str  # the TOML text, copied into the output directory
    weights: str = DEFAULT_PRESET  # the report's score weights, as train.compare --weights takes them
    quality_threshold: float | None = None  # the quality gate's threshold (None: the task's own)


def _as_list(key: str, value: Any, where: str) -> list[Any]:
    values = value if isinstance(value, list) else [value]
    if not values:
        raise UsageError(f"{where}: axis {key!r} has no values; give at least one, or leave the axis out")
    for item in values:
        _check_value(key, item, where)
    if len(set(map(str, values))) != len(values):
        raise UsageError(f"{where}: axis {key!r} repeats a value: {values}")
    return values


def _check_value(key: str, value: Any, where: str) -> None:
    choices = tuple(TASKS) if key == "task" else _CHOICES.get(key)
    if choices is not None and value not in choices:
        raise UsageError(f"{where}: {key} = {value!r} is not a known value; choose from {', '.join(choices)}")
    if key in _COUNTS and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise UsageError(f"{where}: {key} = {value!r} must be an integer >= 1")
    if key == "lr" and (not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf):
        raise UsageError(f"{where}: lr = {value!r} must be a number > 0")
    if key == "seed" and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise UsageError(f"{where}: seed = {value!r} must be an integer >= 0")
    if key in ("preset", "device") and (not isinstance(value, str) or not value):
        raise UsageError(f"{where}: {key} = {value!r} must be a non-empty string")


def _axes(table: Mapping[str, Any], where: str) -> dict[str, list[Any]]:
    unknown = [key for key in table if key not in AXES]
    if unknown:
        raise UsageError(
            f"{where}: unknown axis {unknown[0]!r}; the axes are {', '.join(AXES)} (other training flags go in [flags])"
        )
    return {key: _as_list(key, value, where) for key, value in table.items()}


def _grid(table: Mapping[str, Any], common: Mapping[str, list[Any]], number: int, previous: int) -> Grid:
    where = f"[[grid]] #{number}"
    table = dict(table)
    from_best = table.pop("from_best", None)
    if from_best is not None:
        if not isinstance(from_best, str) or preset_name(from_best) is None:
            raise UsageError(
                f"{where}: from_best = {from_best!r} is not a weight preset; choose from {', '.join(WEIGHT_PRESETS)}"
            )
        from_best = preset_name(from_best)
        if previous == 0:
            raise UsageError(f"{where}: from_best needs a grid before it to take the best run from")
    axes = {**common, **_axes(table, where)}
    if "task" not in axes:
        raise UsageError(f"{where}: no task; set task (one of {', '.join(TASKS)}) in [axes] or the grid")
    for key in dict.fromkeys(axis for task in TASKS.values() for axis in task.batch_axes):
        tasks = [name for name, task in TASKS.items() if key in task.batch_axes]
        wrong = [task for task in axes.get(key, []) and axes["task"] if task not in tasks]
        if wrong:
            raise UsageError(
                f"{where}: axis {key} is not a flag of train.{wrong[0]} (it is of "
                f"{', '.join('train.' + t for t in tasks)})"
            )
    return Grid(axes, from_best)


def _flags(table: Any, where: str) -> dict[str, Any]:
    """The ``[flags]`` table: further flags of every run, each a string, number or true/false, or a list of them
    for a flag the task takes more than once (``prompt = ["a", "b"]``: ``--prompt a --prompt b``).

    Raises:
      UsageError: a flag the sweep sets itself, or a value of another kind.
    """
    if not isinstance(table, dict):
        raise UsageError(f"{where} must be a table of flag = value")
    for key, value in table.items():
        if key in AXES:
            raise UsageError(f"{where} sets {key!r}, which the sweep sets itself: set it in [axes] or a [[grid]]")
        if key in ("run_dir", "resume"):
            raise UsageError(f"{where} sets {key!r}: the sweep gives every run a directory of its own, in its out")
        items = value if isinstance(value, list) else [value]
        if not items or not all(isinstance(item, (str, int, float, bool)) for item in items):
            raise UsageError(
                f"{where}: {key} = {value!r}; a flag takes a string, number or true/false, or a list of them for a "
                "flag given more than once"
            )
    return dict(table)


def check_command(point: Point, flags: Mapping[str, Any], where: str) -> None:
    """Parses ``point``'s flags with its task's own parser and checks the configuration they make, as the run
    would.

    Raises:
      UsageError: a flag the task does not know, a value it cannot parse, or one out of range.
    """
    task = TASKS[point.task]
    parser = task.build_parser()

    def refuse(message: str) -> None:
        raise UsageError(f"{where}: train.{point.task} {message}")

    parser.error = refuse  # argparse would print its usage and exit; one line instead
    repeatable = {action.dest for action in parser._actions if isinstance(action, argparse._AppendAction)}
    for key, value in flags.items():
        if isinstance(value, list) and key not in repeatable:
            refuse(f"takes --{key.replace('_', '-')} once; [flags] gives it a list, {value!r}")
    given = vars(parser.parse_args(point.flags(flags)))
    try:
        task.check_config(task.resolve_config(given, None))
    except UsageError as err:
        refuse(str(err))


def _quality_threshold(value: Any, where: str) -> float | None:
    """The ``quality_threshold`` key: the final quality a run must reach to be ranked (the metric of its task, e.g.
    a perplexity of at most this), None for the task's own."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise UsageError(f"{where}: quality_threshold = {value!r} must be a number >= 0 (the task's quality metric)")
    return float(value)


def _weights(value: Any, where: str) -> str:
    """The ``weights`` key as train.compare's --weights takes it: a preset name or four numbers t,c,e,u."""
    text = ",".join(map(str, value)) if isinstance(value, list) else value
    if not isinstance(text, str):
        raise UsageError(f"{where}: weights = {value!r} must be a preset name or four numbers t,c,e,u")
    try:
        parse_weights(text)
    except ValueError as err:
        raise UsageError(f"{where}: weights: {str(err).removeprefix('--weights ')}") from None
    return text


def _name(document: Mapping[str, Any], where: str) -> str:
    if not document:
        raise UsageError(
            f"{where} is empty: a sweep spec needs a name and a task (see train/sweep/specs/cpu-default.toml)"
        )
    if "name" not in document:
        raise UsageError(
            f'{where}: no name; add one, e.g. name = "my-sweep" (it marks every run directory of the sweep)'
        )
    name = document["name"]
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise UsageError(f"{where}: name = {name!r} must be a non-empty string of letters, digits, '_', '.', '-'")
    return name


def parse(text: str, source: Path | None = None) -> Spec:
    """The Spec of a TOML text (read from ``source``, named in messages); ``out`` defaults to runs/<name>.

    Raises:
      UsageError: invalid TOML, an unknown key or axis, an axis value out of its choices, an empty grid, weights
        that are no preset or four numbers, or a run's flags that its task's parser or checks refuse.
    """
    where = str(source) if source else "the sweep spec"
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise UsageError(f"{where}: not valid TOML ({err})") from None
    unknown = [key for key in document if key not in _KEYS]
    if unknown:
        raise UsageError(
            f"{where}: unknown key {unknown[0]!r}; a spec has name, out, weights, quality_threshold, [axes], [flags], "
            "[[grid]]"
        )
    name = _name(document, where)
    common = _axes(document.get("axes", {}), f"{where} [axes]")
    tables = document.get("grid", [{}])
    if not isinstance(tables, list):
        raise UsageError(f"{where}: grid must be an array of tables, [[grid]]")
    grids = [_grid(table, common, number, number - 1) for number, table in enumerate(tables, 1)]
    flags = _flags(document.get("flags", {}), f"{where} [flags]")
    out = document.get("out", f"runs/{name}")
    if not isinstance(out, str) or not out:
        raise UsageError(f"{where}: out = {out!r} must be a directory path")
    for number, grid in enumerate(grids, 1):
        for point in grid.points():
            check_command(point, flags, f"{where} [[grid]] #{number} ({point.name})")
    return Spec(
        name=name,
        out=Path(out),
        grids=grids,
        flags=dict(flags),
        source=text,
        weights=_weights(document.get("weights", DEFAULT_PRESET), where),
        quality_threshold=_quality_threshold(document.get("quality_threshold"), where),
    )


def points(spec: Spec, best: Sequence[Mapping[str, Any] | None] = ()) -> list[Point]:
    """Every run of the grids without ``from_best``, then of those with it whose best (``best[i]`` for grid i) is
    known. A point listed by two grids runs once.

    Raises:
      UsageError: the spec expands to no run.
    """
    expanded: dict[str, Point] = {}
    for index, grid in enumerate(spec.grids):
        chosen = best[index] if index < len(best) else None
        if grid.from_best and chosen is None:
            continue
        for point in grid.points(chosen):
            expanded.setdefault(point.name, point)
    if not expanded and not any(grid.from_best for grid in spec.grids):
        raise UsageError(f"sweep {spec.name!r}: the grid is empty (no run to make)")
    return list(expanded.values())
