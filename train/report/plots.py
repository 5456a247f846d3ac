"""Figures of a `Comparison` (`train.report.scoring`), as PNG files drawn with matplotlib's Agg canvas (no display
needed).

* time vs cost and time vs energy: one point per run, marker and colour by device kind, labelled with the run's
  row number; estimated energy is drawn hollow, measured energy filled;
* speedup by model size and batch: for each (model, batch) with runs of the baseline's configuration, the mean
  speedup of every other configuration over it (bars; 1 is the baseline configuration).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from train.report.runs import Run
from train.report.scoring import Comparison, speedups_by_model_and_batch
from train.report.tables import Plot, si_scale, time_scale

MARKERS = "osD^vP*Xh<>p"
TIME_VS_COST = "time_vs_cost.png"
TIME_VS_ENERGY = "time_vs_energy.png"
SPEEDUP = "speedup_by_model_and_batch.png"


def _figure(width: float = 7.0, height: float = 4.8) -> Figure:
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def device_styles(runs: Sequence[Run]) -> dict[str, tuple[str, str]]:
    """(marker, colour) per device kind, in order of first appearance."""
    kinds = list(dict.fromkeys(run.device_kind for run in runs))
    return {kind: (MARKERS[i % len(MARKERS)], f"C{i % 10}") for i, kind in enumerate(kinds)}


def _scatter_against_time(comparison: Comparison, values: Sequence[float | None], quantity: str, unit: str,
                          hollow: Sequence[bool], path: Path) -> None:
    """Scatter of ``values`` (one per run, None to leave a run out) against training time."""
    shown = [(index, run, value) for index, (run, value) in enumerate(zip(comparison.runs, values))
             if value is not None]
    longest = max(run.train_time_s for _, run, _ in shown)
    largest = max(value for _, _, value in shown)
    time_factor, time_unit = time_scale(longest)
    value_factor, prefix = si_scale(largest)
    styles = device_styles(comparison.runs)
    figure = _figure()
    axes = figure.add_subplot()
    labelled = set()
    for index, run, value in shown:
        marker, colour = styles[run.device_kind]
        x, y = run.train_time_s / time_factor, value / value_factor
        axes.scatter([x], [y], marker=marker, s=70, edgecolors=colour, linewidths=1.5,
                     facecolors="none" if hollow[index] else colour,
                     label=None if run.device_kind in labelled else run.device_kind)
        labelled.add(run.device_kind)
        axes.annotate(f"#{index + 1}", (x, y), xytext=(5, 5), textcoords="offset points", fontsize=8)
    handles, _ = axes.get_legend_handles_labels()
    if any(hollow[index] for index, _, _ in shown):
        handles += [Line2D([], [], marker="o", linestyle="none", color="grey", label="measured energy"),
                    Line2D([], [], marker="o", linestyle="none", color="grey", markerfacecolor="none",
                           label="estimated energy")]
    axes.legend(handles=handles, fontsize=8)
    axes.set_xlabel(f"training time ({time_unit})")
    axes.set_ylabel(f"{quantity} ({prefix}{unit})")
    axes.set_title(f"Training time vs {quantity} (lower left is better)")
    axes.grid(alpha=0.3)
    # Room past the largest point for its label.
    axes.set_xlim(0, 1.12 * longest / time_factor)
    if largest > 0:
        axes.set_ylim(0, 1.12 * largest / value_factor)
    left_out = [f"#{index + 1}" for index, value in enumerate(values) if value is None]
    if left_out:
        figure.text(0.01, 0.0, f"no {quantity} in the log of {', '.join(left_out)}", fontsize=7, va="bottom")
    figure.savefig(path, dpi=120)


def plot_time_vs_cost(comparison: Comparison, path: Path) -> Plot:
    title = "Training time vs cost"
    costs = [run.cost_usd for run in comparison.runs]
    if all(cost is None for cost in costs):
        return Plot(title, None, "no run has a cost")
    _scatter_against_time(comparison, costs, "cost", "USD", [False] * len(costs), path)
    return Plot(title, path.name)


def plot_time_vs_energy(comparison: Comparison, path: Path) -> Plot:
    title = "Training time vs energy"
    energies = [run.energy_j for run in comparison.runs]
    if all(energy is None for energy in energies):
        return Plot(title, None, "no run has an energy figure")
    hollow = [run.energy_estimated for run in comparison.runs]
    _scatter_against_time(comparison, energies, "energy", "J", hollow, path)
    return Plot(title, path.name)


def plot_speedups(comparison: Comparison, path: Path) -> Plot:
    title = "Speedup by model size and batch"
    speedups = speedups_by_model_and_batch(comparison.runs, comparison.baseline)
    reference = comparison.runs[comparison.baseline].configuration_label
    if not speedups:
        return Plot(title, None, f"no model and batch has runs of both the baseline configuration ({reference}) "
                                 "and another configuration")
    groups = list(dict.fromkeys((entry.model, entry.batch_label) for entry in speedups))
    configurations = list(dict.fromkeys(entry.configuration_label for entry in speedups))
    width = 0.8 / len(configurations)
    figure = _figure(max(7.0, 1.2 * len(groups) * len(configurations) + 2), 4.8)
    axes = figure.add_subplot()
    for slot, configuration in enumerate(configurations):
        entries = {(e.model, e.batch_label): e.speedup for e in speedups if e.configuration_label == configuration}
        positions = [i + (slot - (len(configurations) - 1) / 2) * width for i, group in enumerate(groups)
                     if group in entries]
        bars = axes.bar(positions, [entries[group] for group in groups if group in entries], width,
                        label=configuration, color=f"C{slot % 10}")
        axes.bar_label(bars, fmt="%.2fx", fontsize=8)
    axes.axhline(1.0, color="black", linewidth=1, linestyle="--", label=f"baseline: {reference}")
    axes.set_xticks(range(len(groups)), [f"{model}\n{batch}" for model, batch in groups], fontsize=8)
    axes.set_ylabel("speedup (baseline time / time)")
    axes.set_title(title)
    axes.legend(fontsize=8)
    axes.grid(axis="y", alpha=0.3)
    figure.savefig(path, dpi=120)
    return Plot(title, path.name)


def write_plots(comparison: Comparison, out_dir: Path) -> list[Plot]:
    """Draws every figure into ``out_dir``; a figure without data is reported as not drawn."""
    return [
        plot_time_vs_cost(comparison, out_dir / TIME_VS_COST),
        plot_time_vs_energy(comparison, out_dir / TIME_VS_ENERGY),
        plot_speedups(comparison, out_dir / SPEEDUP),
    ]
