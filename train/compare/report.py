"""Compare training runs from any devices by time, cost, energy and utilization.

    python -m train.compare LOG_OR_DIR ... [--task T] [--baseline RUN] [--weights PRESET | --weights t,c,e,u]
                                           [--score-window whole|steady] [--quality-threshold Q]
                                           [--quality-margin F] [--out DIR]

Reads run logs (docs/run-log.md; a directory is searched recursively for *.jsonl run logs), prints the tables
(the whole run and the steady state side by side) and writes report.md with the tables (the score under all
seven presets at once among them), a recommendation per preset, and PNG plots to --out (default
reports/<UTC time>/). The arithmetic lives in train.compare (reading, scoring, tables, plots); docs/compare.md
explains the score.
"""

from __future__ import annotations

import argparse
import datetime
import math
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from train.compare import plots, quality, scoring, tables
from train.compare import runs as run_logs
from train.costs import measured_utilization
from train.errors import ArgumentParser
from train.records import runlog
from train.tasks import TASKS

EXIT_USAGE = 2


def _presets_help() -> str:
    lines = [f"  {name:<17} {weights.describe()}" for name, weights in scoring.WEIGHT_PRESETS.items()]
    aliases = ", ".join(f"{old} = {new}" for old, new in scoring.PRESET_ALIASES.items())
    return (
        "the study's weight presets (time, cost, energy, utilization):\n"
        + "\n".join(lines)
        + f"\nearlier names, still accepted: {aliases}"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m train.compare",
        description=(
            "Tables, a weighted score and plots comparing training runs (run.jsonl logs) from any devices.\n\n"
            "score = w_t*T + w_c*C + w_e*E - w_u*U, lower is better, where T, C, E, U are time, cost, energy\n"
            "and MFU, each divided by its maximum over the runs scored: by default over the whole run (every\n"
            "training step, warm-up included, as the study scored), with --score-window steady per unit trained in\n"
            "the steady state. A run whose cost, energy or MFU is null is not scored while that term's weight is\n"
            "non-zero (never counted as zero; without an MFU for any converged run, utilization is left out). A run\n"
            "whose final quality misses --quality-threshold or lies more than --quality-margin below the best\n"
            "run's did not converge: it is shown and never ranked. See docs/compare.md."
        ),
        epilog=_presets_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "logs",
        nargs="+",
        metavar="LOG_OR_DIR",
        help="run.jsonl files, or directories searched recursively for *.jsonl run logs",
    )
    parser.add_argument("--task", help="compare the runs of this task (needed when the logs hold several tasks)")
    parser.add_argument(
        "--baseline",
        metavar="RUN",
        help="baseline run: run id, row number (#1 is the first run) or a unique substring of a "
        "run id or log path (default: the slowest run, the one with the lowest throughput)",
    )
    parser.add_argument(
        "--weights",
        default=scoring.DEFAULT_PRESET,
        metavar="PRESET|t,c,e,u",
        help=f"score weights: a preset ({', '.join(scoring.WEIGHT_PRESETS)}) or four "
        f"comma-separated numbers (default: {scoring.DEFAULT_PRESET})",
    )
    add_window_argument(parser)
    thresholds = ", ".join(f"{name} {task.quality.label} {task.quality.threshold:g}" for name, task in TASKS.items())
    parser.add_argument(
        "--quality-threshold",
        type=float,
        metavar="Q",
        help=f"the final quality a run must reach to be ranked (perplexity: at most); default per task: {thresholds}",
    )
    parser.add_argument(
        "--quality-margin",
        type=float,
        metavar="F",
        help="a run more than this fraction worse than the best run's quality is not ranked "
        f"(default {quality.DEFAULT_MARGIN:g})",
    )
    parser.add_argument("--out", type=Path, metavar="DIR", help="report directory (default: reports/<UTC time>/)")
    parser.add_argument(
        "--counters",
        type=Path,
        metavar="FILE",
        help="a counters result file (python -m train.bench counters): measured achieved occupancy "
        "and SM throughput for the runs of its device and backend, MFU labeled otherwise",
    )
    return parser


def add_window_argument(parser: argparse.ArgumentParser) -> None:
    """``--score-window``: the window the score covers (`train.compare.scoring.WINDOWS`)."""
    parser.add_argument(
        "--score-window",
        choices=scoring.WINDOWS,
        default=scoring.DEFAULT_WINDOW,
        help="score the whole run (every training step, warm-up included: the study's way; default) "
        "or the steady state (time, cost and energy per unit trained after warm-up)",
    )


def _default_out_dir() -> Path:
    return Path("reports") / datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def _load(args: argparse.Namespace) -> scoring.Comparison:
    weights_name, weights = scoring.parse_weights(args.weights)
    runs, notes = run_logs.load_runs(args.logs)
    runs = run_logs.select_task(runs, args.task)
    baseline = run_logs.find_baseline(runs, args.baseline)
    gate = quality.default_gate(runs[0].task, args.quality_threshold, args.quality_margin)
    return scoring.compare(
        runs,
        baseline=baseline,
        weights_name=weights_name,
        weights=weights,
        notes=notes,
        gate=gate,
        window=args.score_window,
    )


def write_report(comparison: scoring.Comparison, out_dir: Path, command: str, extra: str = "") -> Path:
    """Writes the plots and report.md (with ``extra`` markdown at its end) into ``out_dir``; returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = plots.write_plots(comparison, out_dir)
    path = out_dir / "report.md"
    report = tables.markdown_report(
        comparison, plots=figures, command=command, created=runlog.utc_now(), report_dir=out_dir
    )
    path.write_text(report + extra)
    return path


def utilization_section(comparison: scoring.Comparison, measured: list[measured_utilization.Measured]) -> str:
    """Markdown: each run's measured occupancy and SM throughput, or its MFU labeled as such."""
    table = tables.markdown_table(*measured_utilization.table(comparison.runs, measured))
    return f"\n## Utilization: measured counters or MFU\n\n{table}\n"


def print_summary(comparison: scoring.Comparison) -> None:
    baseline = comparison.runs[comparison.baseline]
    print("Whole run (training: every step, warm-up included):")
    print(tables.markdown_table(*tables.runs_table(comparison)))
    print("\nWarm-up and steady state:")
    print(tables.markdown_table(*tables.steady_table(comparison)))
    print(f"\nAgainst the baseline #{comparison.baseline + 1} {baseline.name} ({baseline.configuration_label}):")
    print(tables.markdown_table(*tables.ratios_table(comparison)))
    print("\n" + tables.score_explanation(comparison))
    print(tables.markdown_table(*tables.score_table(comparison)) if comparison.ranking else "No run could be scored.")
    print(f"\nScore under each preset, {scoring.WINDOW_LABELS[comparison.window]} (rank in parentheses):")
    print(tables.markdown_table(*tables.matrix_table(comparison)))
    print("\nRecommendation:\n" + "\n".join(f"  {line}" for line in tables.recommendations(comparison)))
    for note in comparison.notes:
        print(f"note: {note}", file=sys.stderr)


def _check_gate_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses a quality threshold or margin that is not a finite number >= 0 (NaN, for one, would leave every run
    unranked)."""
    threshold, margin = args.quality_threshold, args.quality_margin
    if threshold is not None and not (math.isfinite(threshold) and threshold >= 0):
        parser.error(f"--quality-threshold {threshold:g}: give a finite number >= 0 (the task's quality metric)")
    if margin is not None and not (math.isfinite(margin) and margin >= 0):
        parser.error(f"--quality-margin {margin:g}: give a finite fraction >= 0")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_gate_flags(parser, args)
    try:
        comparison = _load(args)
        measured = measured_utilization.load(args.counters) if args.counters else None
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    out_dir = args.out or _default_out_dir()
    command = shlex.join(["python", "-m", "train.compare", *(sys.argv[1:] if argv is None else argv)])
    try:
        extra = "" if measured is None else utilization_section(comparison, measured)
        path = write_report(comparison, out_dir, command, extra)
    except OSError as err:
        print(f"error: cannot write the report to {out_dir}: {err}", file=sys.stderr)
        return EXIT_USAGE
    print_summary(comparison)
    if extra:
        print(extra)
    print(f"\nreport: {path}")
    return 0
