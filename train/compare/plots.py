"""Figures of a `Comparison` (`train.compare.scoring`), as PNG files drawn with matplotlib's Agg canvas (no display
needed).

* the study's four: A cost vs energy, B energy vs time (slope = average power), C cost vs time, one point per run
  in the window the comparison scores (the whole run's totals, or the steady state's figures per unit trained; the
  axes say which), colour by implementation, backend and precision, marker by device kind, labelled with the run's
  row number, estimated energy drawn hollow and measured energy filled; D final quality by precision and optimizer;
  a red cross marks a run that did not converge;
* speedup by model size and batch: for each (model, batch) with runs of the baseline's configuration, the mean
  speedup of every other configuration over it (bars; 1 is the baseline configuration).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from train.compare.runs import LoggedRun
from train.compare.scoring import WINDOW_LABELS, Comparison, figures, speedups_by_model_and_batch
from train.compare.tables import Plot, si_scale, time_scale

MARKERS = "osD^vP*Xh<>p"
COST_VS_ENERGY = "a_cost_vs_energy.png"
ENERGY_VS_TIME = "b_energy_vs_time.png"
COST_VS_TIME = "c_cost_vs_time.png"
QUALITY = "d_quality_by_precision_and_optimizer.png"
SPEEDUP = "speedup_by_model_and_batch.png"


def _figure(width: float = 7.0, height: float = 4.8) -> Figure:
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


# Steady-state figures are per unit trained; plotted per this many units.
PER_UNITS = {"examples": 1_000, "tokens": 1_000_000}


def device_markers(runs: Sequence[LoggedRun]) -> dict[str, str]:
    """A marker per device kind, in order of first appearance."""
    kinds = list(dict.fromkeys(run.device_kind for run in runs))
    return {kind: MARKERS[i % len(MARKERS)] for i, kind in enumerate(kinds)}


def kernel_colours(runs: Sequence[LoggedRun]) -> dict[str, str]:
    """A colour per implementation, backend and precision (`LoggedRun.kernel_label`), in order of first appearance."""
    labels = list(dict.fromkeys(run.kernel_label for run in runs))
    return {label: f"C{i % 10}" for i, label in enumerate(labels)}


@dataclasses.dataclass(frozen=True)
class Axis:
    """One axis of a scatter: a value per run (None leaves the run out), its name and unit."""

    values: Sequence[float | None]
    quantity: str
    unit: str

    def scale(self, largest: float) -> tuple[float, str]:
        """(factor, label) to plot values up to ``largest`` in: minutes or hours for seconds, an SI prefix else."""
        if self.unit == "s":
            factor, unit = time_scale(largest)
            return factor, f"{self.quantity} ({unit})"
        factor, prefix = si_scale(largest)
        return factor, f"{self.quantity} ({prefix}{self.unit})"


def _labels_by_place(
    shown: Sequence[int],
    xs: Sequence[float],
    ys: Sequence[float],
    x_factor: float,
    y_factor: float,
    resolution: float = 0.02,
) -> dict[tuple[float, float], list[int]]:
    """Rows of the points drawn at one place (within ``resolution`` of each axis's largest value), so that points
    on top of each other get one label listing them rather than labels on top of each other."""
    x_step = resolution * max(xs[i] for i in shown) / x_factor or 1.0
    y_step = resolution * max(ys[i] for i in shown) / y_factor or 1.0
    places: dict[tuple[int, int], tuple[tuple[float, float], list[int]]] = {}
    for index in shown:
        px, py = xs[index] / x_factor, ys[index] / y_factor
        places.setdefault((round(px / x_step), round(py / y_step)), ((px, py), []))[1].append(index)
    return dict(places.values())


def _scatter(comparison: Comparison, x: Axis, y: Axis, title: str, hollow: Sequence[bool], path: Path) -> None:
    """One point per run with both values, colour by implementation, backend and precision, marker by device kind,
    labelled #row; ``hollow`` points have estimated energy; a red cross marks a run that did not converge."""
    shown = [
        index for index in range(len(comparison.runs)) if x.values[index] is not None and y.values[index] is not None
    ]
    x_factor, x_label = x.scale(max(x.values[i] for i in shown))
    y_factor, y_label = y.scale(max(y.values[i] for i in shown))
    runs = comparison.runs
    markers, colours = device_markers(runs), kernel_colours(runs)
    figure = _figure()
    axes = figure.add_subplot()
    for index in shown:
        run = runs[index]
        colour = colours[run.kernel_label]
        px, py = x.values[index] / x_factor, y.values[index] / y_factor
        axes.scatter(
            [px],
            [py],
            marker=markers[run.device_kind],
            s=70,
            edgecolors=colour,
            linewidths=1.5,
            facecolors="none" if hollow[index] else colour,
        )
        if comparison.verdicts[index] is not None:
            axes.scatter([px], [py], marker="x", s=110, color="red", linewidths=1.5)
    for (px, py), rows in _labels_by_place(shown, x.values, y.values, x_factor, y_factor).items():
        axes.annotate(
            " ".join(f"#{index + 1}" for index in rows), (px, py), xytext=(5, 5), textcoords="offset points", fontsize=8
        )
    shown_runs = [runs[index] for index in shown]
    handles = [
        Line2D([], [], marker="o", linestyle="none", color=colours[label], label=label)
        for label in dict.fromkeys(run.kernel_label for run in shown_runs)
    ]
    if len(kinds := list(dict.fromkeys(run.device_kind for run in shown_runs))) > 1:
        handles += [Line2D([], [], marker=markers[kind], linestyle="none", color="grey", label=kind) for kind in kinds]
    if any(hollow[index] for index in shown):
        handles += [
            Line2D([], [], marker="o", linestyle="none", color="grey", label="measured energy"),
            Line2D(
                [], [], marker="o", linestyle="none", color="grey", markerfacecolor="none", label="estimated energy"
            ),
        ]
    if any(comparison.verdicts[index] is not None for index in shown):
        handles.append(Line2D([], [], marker="x", linestyle="none", color="red", label="not converged"))
    axes.legend(handles=handles, fontsize=8)
    axes.set_xlabel(x_label)
    axes.set_ylabel(y_label)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    # Room past the largest point for its label.
    axes.set_xlim(0, 1.12 * max(x.values[i] for i in shown) / x_factor or 1.0)
    axes.set_ylim(0, 1.12 * max(y.values[i] for i in shown) / y_factor or 1.0)
    left_out = [f"#{index + 1}" for index in range(len(comparison.runs)) if index not in shown]
    if left_out:
        figure.text(
            0.01, 0.0, f"no {x.quantity} or {y.quantity} in the log of {', '.join(left_out)}", fontsize=7, va="bottom"
        )
    figure.savefig(path, dpi=120)


def scatter_axes(comparison: Comparison) -> dict[str, Axis]:
    """Time, cost and energy of each run in the comparison's window, named with it: the whole run's training
    totals, or the steady state's per `PER_UNITS` units trained."""
    runs, window = comparison.runs, comparison.window
    values = [figures(run, window) for run in runs]
    if window == "whole":
        return {
            "time": Axis([value.time for value in values], "training time, whole run", "s"),
            "cost": Axis([value.cost for value in values], "cost, whole run", "USD"),
            "energy": Axis([value.energy for value in values], "energy, whole run", "J"),
        }
    unit = runs[0].trained_unit
    per = PER_UNITS[unit]
    scaled = lambda field: [None if (v := getattr(value, field)) is None else per * v for value in values]  # noqa: E731
    label = f"per {per:,} {unit}, {WINDOW_LABELS[window]}"
    return {
        "time": Axis(scaled("time"), f"time {label}", "s"),
        "cost": Axis(scaled("cost"), f"cost {label}", "USD"),
        "energy": Axis(scaled("energy"), f"energy {label}", "J"),
    }


def _pair_plot(comparison: Comparison, x: str, y: str, title: str, path: Path) -> Plot:
    """Plot ``y`` against ``x`` (keys of `_axes`); not drawn when no run has both."""
    axes = scatter_axes(comparison)
    if not any(a is not None and b is not None for a, b in zip(axes[x].values, axes[y].values)):
        return Plot(title, None, f"no run has both {axes[x].quantity} and {axes[y].quantity}")
    hollow = [run.energy_estimated and "energy" in (x, y) for run in comparison.runs]
    _scatter(comparison, axes[x], axes[y], title, hollow, path)
    return Plot(title, path.name)


def plot_cost_vs_energy(comparison: Comparison, path: Path) -> Plot:
    return _pair_plot(comparison, "energy", "cost", "A: cost vs energy (lower left is better)", path)


def plot_energy_vs_time(comparison: Comparison, path: Path) -> Plot:
    return _pair_plot(comparison, "time", "energy", "B: energy vs training time (slope = average power)", path)


def plot_cost_vs_time(comparison: Comparison, path: Path) -> Plot:
    return _pair_plot(comparison, "time", "cost", "C: cost vs training time (slope = price per hour)", path)


def plot_quality(comparison: Comparison, path: Path) -> Plot:
    """D: every run's final quality, grouped by precision along x and coloured by optimizer; marker by
    implementation and backend;
    a red cross marks a run that did not converge, the dashed line is the gate's threshold."""
    metric = comparison.gate.metric
    title = f"D: {metric.label} by precision and optimizer"
    runs = comparison.runs
    values = [run.metrics.get(metric.key) for run in runs]
    if all(value is None for value in values):
        return Plot(title, None, f"no run has a final {metric.label}")
    precisions = list(dict.fromkeys(run.precision for run in runs))
    optimizers = list(dict.fromkeys(run.optimizer for run in runs))
    backends = list(dict.fromkeys(f"{run.implementation} {run.backend}" for run in runs))
    width = 0.8 / len(optimizers)
    figure = _figure()
    axes = figure.add_subplot()
    for index, (run, value) in enumerate(zip(runs, values)):
        if value is None:
            continue
        slot = optimizers.index(run.optimizer)
        position = precisions.index(run.precision) + (slot - (len(optimizers) - 1) / 2) * width
        backend = backends.index(f"{run.implementation} {run.backend}")
        axes.scatter([position], [value], marker=MARKERS[backend % len(MARKERS)], s=60, color=f"C{slot % 10}")
        if comparison.verdicts[index] is not None:
            axes.scatter([position], [value], marker="x", s=110, color="red", linewidths=1.5)
        axes.annotate(f"#{index + 1}", (position, value), xytext=(5, 3), textcoords="offset points", fontsize=7)
    handles = [
        Line2D([], [], marker="o", linestyle="none", color=f"C{i % 10}", label=name)
        for i, name in enumerate(optimizers)
    ]
    handles += [
        Line2D([], [], marker=MARKERS[i % len(MARKERS)], linestyle="none", color="grey", label=name)
        for i, name in enumerate(backends)
    ]
    axes.axhline(comparison.gate.threshold, color="red", linestyle="--", linewidth=1)
    handles.append(Line2D([], [], color="red", linestyle="--", label=f"threshold {comparison.gate.threshold:g}"))
    if any(verdict is not None for verdict, value in zip(comparison.verdicts, values) if value is not None):
        handles.append(Line2D([], [], marker="x", linestyle="none", color="red", label="not converged"))
    axes.legend(handles=handles, fontsize=8)
    axes.set_xticks(range(len(precisions)), precisions)
    axes.set_xlim(-0.6, len(precisions) - 0.4)
    axes.set_xlabel("precision")
    axes.set_ylabel(f"final {metric.label}")
    axes.set_title(title)
    axes.grid(axis="y", alpha=0.3)
    figure.savefig(path, dpi=120)
    return Plot(title, path.name)


def plot_speedups(comparison: Comparison, path: Path) -> Plot:
    title = "Speedup by model size and batch"
    speedups = speedups_by_model_and_batch(comparison.runs, comparison.baseline)
    reference = comparison.runs[comparison.baseline].configuration_label
    if not speedups:
        return Plot(
            title,
            None,
            f"no model and batch has runs of both the baseline configuration ({reference}) and another configuration",
        )
    groups = list(dict.fromkeys((entry.model, entry.batch_label) for entry in speedups))
    configurations = list(dict.fromkeys(entry.configuration_label for entry in speedups))
    width = 0.8 / len(configurations)
    figure = _figure(max(7.0, 1.2 * len(groups) * len(configurations) + 2), 4.8)
    axes = figure.add_subplot()
    for slot, configuration in enumerate(configurations):
        entries = {(e.model, e.batch_label): e.speedup for e in speedups if e.configuration_label == configuration}
        positions = [
            i + (slot - (len(configurations) - 1) / 2) * width for i, group in enumerate(groups) if group in entries
        ]
        bars = axes.bar(
            positions,
            [entries[group] for group in groups if group in entries],
            width,
            label=configuration,
            color=f"C{slot % 10}",
        )
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
        plot_cost_vs_energy(comparison, out_dir / COST_VS_ENERGY),
        plot_energy_vs_time(comparison, out_dir / ENERGY_VS_TIME),
        plot_cost_vs_time(comparison, out_dir / COST_VS_TIME),
        plot_quality(comparison, out_dir / QUALITY),
        plot_speedups(comparison, out_dir / SPEEDUP),
    ]
