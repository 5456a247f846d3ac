"""The comparison as text: numbers formatted for people, the tables of runs, ratios and scores, and report.md."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from train.compare.runs import LoggedRun
from train.compare.scoring import WEIGHT_PRESETS, WINDOW_LABELS, Comparison, recommendation
from train.tasks import TASKS


def _label(key: str) -> str:
    """How people read a quality metric's key (bleu: BLEU), as the task that reports it says."""
    return next((task.quality.label for task in TASKS.values() if task.quality.key == key), key)


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


def format_energy(run: LoggedRun) -> str:
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
    quality = list(dict.fromkeys(key for run in runs for key in run.metrics))  # the metrics any run logged
    header = [
        "#",
        "run",
        "device",
        "count",
        "implementation",
        "backend",
        "precision",
        "optimizer",
        "model",
        "batch",
        "training time",
        "cost",
        "energy",
        "throughput",
        "MFU",
        "wall time",
        *(_label(key) for key in quality),
        "quality gate",
    ]
    rows = []
    for index, run in enumerate(runs):
        row = [
            f"{index + 1}",
            run.name,
            run.device_kind,
            f"{run.device_count}",
            run.implementation,
            run.backend,
            run.precision,
            run.optimizer,
            run.model,
            run.batch_label,
            format_duration(run.train_time_s),
            _optional(run.cost_usd, lambda usd: f"${significant(usd)}"),
            format_energy(run),
            _optional(run.throughput, lambda rate: f"{rate:,.0f} {run.trained_unit}/s"),
            _optional(run.mfu, lambda mfu: f"{100 * mfu:.1f}%"),
            _optional(run.wall_time_s, format_duration),
        ]
        row += [_optional(run.metrics.get(key), lambda value: f"{value:.4g}") for key in quality]
        row.append("passed" if comparison.verdicts[index] is None else "NOT CONVERGED")
        rows.append(row)
    return header, rows


def steady_table(comparison: Comparison) -> tuple[list[str], list[list[str]]]:
    """Header and rows: each run's warm-up (steps, time and its share of the training time) and steady state
    (median step time, throughput, MFU, power, energy per step); n/a for logs without them."""
    header = [
        "#",
        "run",
        "configuration",
        "warm-up",
        "steady steps",
        "step time",
        "throughput",
        "MFU",
        "power",
        "energy/step",
    ]
    rows = []
    for index, run in enumerate(comparison.runs):
        warmup, steady = run.warmup, run.steady
        row = [f"{index + 1}", run.name, run.kernel_label]
        if warmup is None or steady is None:
            rows.append(row + ["n/a"] * (len(header) - len(row)))
            continue
        energy_per_step = None if steady.energy_j is None or not steady.steps else steady.energy_j / steady.steps
        rows.append(
            row
            + [
                f"{warmup.steps} steps, {format_duration(warmup.time_s)} ({warmup.time_s / run.train_time_s:.0%})",
                f"{steady.steps}",
                _optional(steady.step_time_s, lambda seconds: f"{significant(seconds)} s"),
                _optional(steady.throughput, lambda rate: f"{rate:,.0f} {run.trained_unit}/s"),
                _optional(steady.mfu, lambda mfu: f"{100 * mfu:.1f}%"),
                _optional(steady.power_w, lambda watts: f"{significant(watts)} W"),
                _optional(energy_per_step, lambda joules: f"{significant(joules)} J"),
            ]
        )
    return header, rows


def ratios_table(comparison: Comparison) -> tuple[list[str], list[list[str]]]:
    """Header and rows: speedup, cost ratio and energy ratio of each run against the baseline over the whole run,
    and its speedup in the steady state."""
    header = [
        "#",
        "run",
        "device",
        "implementation",
        "backend",
        "precision",
        "speedup",
        "cost ratio",
        "energy ratio",
        "steady speedup",
        "role",
    ]
    rows = []
    for index, (run, ratios) in enumerate(zip(comparison.runs, comparison.ratios)):
        rows.append(
            [
                f"{index + 1}",
                run.name,
                run.device_kind,
                run.implementation,
                run.backend,
                run.precision,
                f"{ratios.speedup:.2f}x",
                _optional(ratios.cost, lambda ratio: f"{ratio:.2f}x"),
                _optional(ratios.energy, lambda ratio: f"{ratio:.2f}x"),
                _optional(ratios.steady_speedup, lambda ratio: f"{ratio:.2f}x"),
                "baseline" if index == comparison.baseline else "",
            ]
        )
    return header, rows


def score_table(comparison: Comparison) -> tuple[list[str], list[list[str]]]:
    """Header and rows: the scored runs ranked best first, with their normalized terms."""
    header = ["rank", "#", "run", "device", "implementation", "backend", "precision", "T", "C", "E", "U", "score"]
    rows = []
    for rank, index in enumerate(comparison.ranking, 1):
        run, score = comparison.runs[index], comparison.scores[index]
        terms = [
            _optional(term, lambda value: f"{value:.3f}")
            for term in (score.time, score.cost, score.energy, score.utilization)
        ]
        rows.append(
            [
                f"{rank}",
                f"{index + 1}",
                run.name,
                run.device_kind,
                run.implementation,
                run.backend,
                run.precision,
                *terms,
                f"{score.value:.4f}",
            ]
        )
    return header, rows


def matrix_table(comparison: Comparison) -> tuple[list[str], list[list[str]]]:
    """Header and rows: every run's score under each of the seven presets, with its rank under that preset in
    parentheses; runs that did not converge say so, runs lacking a weighted term show n/a."""
    presets = list(comparison.matrix)
    ranks = {name: {index: rank for rank, index in enumerate(comparison.ranked_under(name), 1)} for name in presets}
    header = ["#", "configuration", "energy", *presets]
    rows = []
    for index, run in enumerate(comparison.runs):
        energy = "n/a" if run.energy_j is None else ("estimated" if run.energy_estimated else "measured")
        if comparison.verdicts[index] is not None:
            cells = ["not converged"] * len(presets)
        else:
            cells = [
                _optional(comparison.matrix[name][index], lambda score: f"{score.value:.3f}")
                + (f" ({ranks[name][index]})" if index in ranks[name] else "")
                for name in presets
            ]
        rows.append([f"{index + 1}", run.study_label, energy, *cells])
    return header, rows


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.1f} MiB"


def memory_table(comparison: Comparison) -> tuple[list[str], list[list[str]]] | None:
    """Header and rows: the memory anatomy of each run that logged one (None when none did)."""
    header = [
        "#",
        "configuration",
        "params",
        "optimizer master",
        "optimizer moments",
        "temporaries",
        "grads (in temporaries)",
        "total",
        "B/param",
        "measured peak",
        "measured B/param",
    ]
    rows = []
    for index, run in enumerate(comparison.runs):
        memory = run.memory
        if not memory:
            continue
        per_param = lambda key: _optional(memory[key], lambda value: f"{value:.1f}")  # noqa: E731
        rows.append(
            [
                f"{index + 1}",
                run.study_label,
                *(
                    _mib(memory[key])
                    for key in (
                        "params_bytes",
                        "optimizer_master_bytes",
                        "optimizer_moments_bytes",
                        "temporaries_bytes",
                        "grads_bytes",
                        "total_bytes",
                    )
                ),
                per_param("bytes_per_param"),
                _mib(memory["measured_peak_bytes"]),
                per_param("measured_bytes_per_param"),
            ]
        )
    return (header, rows) if rows else None


def recommendations(comparison: Comparison) -> list[str]:
    """One sentence per preset: its best converged configuration and by how much it leads."""
    return [recommendation(comparison, name) for name in WEIGHT_PRESETS]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A pipe table, columns padded so that it also reads well as plain text."""
    widths = [max(3, *(len(cell) for cell in column)) for column in zip(header, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell.ljust(width) for cell, width in zip(cells, widths)) + " |"

    return "\n".join([line(header), line(["-" * width for width in widths]), *map(line, rows)])


WINDOW_TERMS = {
    "whole": "the training time, cost and energy of all the run's steps (warm-up included) and its MFU over them",
    "steady": "the steady state's time, cost and energy per unit trained and its MFU",
}


def score_explanation(comparison: Comparison) -> str:
    weights = comparison.weights
    return (
        f"Weights `{comparison.weights_name}` ({weights.describe()}), scoring the "
        f"{WINDOW_LABELS[comparison.window]}: T, C, E and U are {WINDOW_TERMS[comparison.window]}, each divided "
        "by its maximum over the scored runs; score = "
        f"{weights.time:g} T + {weights.cost:g} C + {weights.energy:g} E - {weights.utilization:g} U, "
        "lower is better."
    )


@dataclasses.dataclass(frozen=True)
class Plot:
    """A figure of the report: its PNG file name relative to the report, or None and why it was not drawn."""

    title: str
    file_name: str | None
    reason: str = ""


def _link(path: str | Path, report_dir: Path) -> str:
    """A markdown link to ``path`` relative to the report's directory."""
    relative = Path(os.path.relpath(Path(path).resolve(), report_dir.resolve())).as_posix()
    return f"[{relative}]({relative})"


def markdown_report(
    comparison: Comparison, *, plots: Sequence[Plot], command: str, created: str, report_dir: Path
) -> str:
    """report.md in ``report_dir``: the tables, the plots, the notes and the source of every run, linked by its
    path relative to the report, so a report kept beside its runs links them wherever the two are copied."""
    baseline = comparison.runs[comparison.baseline]
    sections = [
        "# Training run comparison",
        f"Created {created} by `{command}` from {len(comparison.runs)} runs of task `{baseline.task}`.",
        "## Runs: the whole run",
        "Training time, cost, energy, throughput and MFU cover every training step, warm-up included (compilation, "
        "evaluation and checkpoints left out); the wall time covers the whole process.",
        markdown_table(*runs_table(comparison)),
        "## Warm-up and steady state",
        "Warm-up: the first steps of each start until the step time settled (within 10% of the run's steady "
        "median); its share of the training time in parentheses. Steady state: the steps after it, their median "
        "step time and their rates over their own time.",
        markdown_table(*steady_table(comparison)),
        f"## Against the baseline: #{comparison.baseline + 1} {baseline.name} ({baseline.configuration_label})",
        "Speedup = baseline time / run time; cost and energy ratios = run / baseline (whole run); steady speedup = "
        "run / baseline steady throughput.",
        markdown_table(*ratios_table(comparison)),
        "## Weighted score",
        score_explanation(comparison),
        markdown_table(*score_table(comparison)) if comparison.ranking else "No run could be scored (see the notes).",
        "## Quality gate",
        f"A run is ranked only when its final {comparison.gate.describe()}; the others are shown and marked "
        "NOT CONVERGED.",
        "## Score matrix: the seven weight strategies",
        f"Each column scores the converged runs under one strategy of the study ({WINDOW_LABELS[comparison.window]}; "
        "T, C, E, U divided by their maxima; lower is better); the rank under it in parentheses. The energy column "
        "says whether the run's energy was measured or estimated.",
        markdown_table(*matrix_table(comparison)),
        "## Recommendation",
        "\n".join(f"- {line}" for line in recommendations(comparison)),
        "## Memory anatomy",
        "One device: params, grads (the params' shapes and dtypes), optimizer state (f32 master weights; moments "
        "and other state), temporaries (XLA's memory analysis of the compiled step: the activations kept for the "
        "backward and workspaces), their total per parameter against the rule of 18 bytes/param for "
        "mixed-precision AdamW, and the measured peak (device memory statistics; n/a where not reported).",
        markdown_table(*memory) if (memory := memory_table(comparison)) else "No run logged its memory anatomy.",
        "## Plots",
        *(
            f"![{plot.title}]({plot.file_name})" if plot.file_name else f"*{plot.title}: not drawn; {plot.reason}.*"
            for plot in plots
        ),
    ]
    if comparison.notes:
        sections += ["## Notes", "\n".join(f"- {note}" for note in comparison.notes)]
    sections += [
        "## Sources",
        "\n".join(
            f"- #{index + 1} {run.name} (run id {run.run_id}): {_link(run.source, report_dir)}"
            for index, run in enumerate(comparison.runs)
        ),
    ]
    return "\n\n".join(sections) + "\n"
