"""What a run has done so far and the records that say it: the run's totals (`Counters`, saved in every
checkpoint), the sums of one logging interval (`Interval`), and the ``run``, ``interval`` and ``summary`` records
of the run log (train.records.runlog holds their schema; train.costs.windows defines the windows the summary's
figures cover)."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable, Mapping, Sequence

from ls_jax import backend as backend_lib
from train.costs import devices as device_table
from train.costs import metrics as metrics_lib
from train.costs import windows
from train.costs.hardware import Hardware
from train.costs.windows import Tally
from train.harness import compile_cache
from train.harness.config import Run
from train.harness.host_phases import PHASES, HostPhases
from train.records.runlog import energy_fields, identity

_TALLIES = ("startup", "compilation", "first_execution", "evaluation", "checkpoints")


@dataclasses.dataclass
class Counters:
    """Totals over the whole run (all resumed segments): saved in checkpoints, reported in the summary.

    Per training step: its time, energy (every host's, once `add_step_energies` has them), FLOPs and counts;
    ``segment_starts`` are the indices of the first step of each segment (the start, then every resume), where
    a warm-up begins. ``energy_j`` is the energy from each segment's compilation on (the interval records'),
    ``wall_energy_j`` from each segment's device detection on.
    """

    train_time_s: float = 0.0
    wall_time_s: float = 0.0
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    flops: float = 0.0
    xla_flops: float = 0.0
    xla_flops_known: bool = True
    energy_j: float | None = 0.0
    step_times: list[float] = dataclasses.field(default_factory=list)
    last_loss: float | None = None
    last_eval: dict[str, Any] = dataclasses.field(default_factory=dict)
    wall_energy_j: float | None = 0.0
    step_energy_j: list[float | None] = dataclasses.field(default_factory=list)
    step_flops: list[float | None] = dataclasses.field(default_factory=list)
    step_counts: dict[str, list[int | None]] = dataclasses.field(default_factory=dict)
    segment_starts: list[int] = dataclasses.field(default_factory=list)
    startup: Tally = dataclasses.field(default_factory=Tally)  # each segment's, from its process start on
    startup_parts: dict[str, float] = dataclasses.field(default_factory=dict)  # its seconds by part, summed
    compilation: Tally = dataclasses.field(default_factory=Tally)
    first_execution: Tally = dataclasses.field(default_factory=Tally)  # the compiled steps' one-time work
    evaluation: Tally = dataclasses.field(default_factory=Tally)
    checkpoints: Tally = dataclasses.field(default_factory=Tally)
    host: HostPhases = dataclasses.field(default_factory=HostPhases)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Counters:
        """The counters a checkpoint saved. One written before the windows were counted lacks the per-step
        energies, FLOPs and counts (unknown: None), its one-time work (unknown energy) and its segments (one)."""
        fields = dict(data)
        for name in _TALLIES:
            fields[name] = Tally(**fields[name]) if name in fields else Tally(energy_j=None)
        if "segment_starts" not in fields:
            fields["segment_starts"] = [0]
            fields["wall_energy_j"] = None
        fields["host"] = HostPhases.from_dict(fields["host"]) if "host" in fields else HostPhases()
        counters = cls(**fields)
        steps = len(counters.step_times)
        counters.step_energy_j = _padded(counters.step_energy_j, steps)
        counters.step_flops = _padded(counters.step_flops, steps)
        counters.step_counts = {name: _padded(counters.step_counts.get(name, []), steps) for name in counters.counts}
        return counters

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def add_work_after_checkpoint(self, summary: Mapping[str, Any]) -> None:
        """Takes the one-time work and wall time from ``summary``, the summary record of the segment that ended
        at the checkpoint these counters came from: its final checkpoint's wait, final evaluation and the rest of
        its wall time came after the checkpoint saved the counters. A tally the summary does not hold (a log of
        an earlier version) stays as the checkpoint saved it."""
        for name in _TALLIES:
            part = summary.get(name)
            if isinstance(part, Mapping) and part.get("count", -1) >= getattr(self, name).count:
                setattr(self, name, Tally(part["count"], part["time_s"], part.get("energy_j")))
        if summary.get("wall_time_s", -1.0) >= self.wall_time_s:
            self.wall_time_s = summary["wall_time_s"]
            self.wall_energy_j = summary.get("wall_energy_j")

    def add_startup_parts(self, parts: Mapping[str, float]) -> None:
        """Adds a segment's start-up parts (`train.harness.startup.PARTS`, seconds each)."""
        for name, seconds in parts.items():
            self.startup_parts[name] = self.startup_parts.get(name, 0.0) + seconds

    def add_step(self, time_s: float, flops: float, counts: Mapping[str, int]) -> None:
        """Adds a finished training step of ``time_s`` seconds (its energy comes with `add_step_energies`)."""
        self.train_time_s += time_s
        self.step_times.append(time_s)
        self.flops += flops
        self.step_flops.append(flops)
        for name, count in counts.items():
            self.counts[name] = self.counts.get(name, 0) + count
            self.step_counts.setdefault(name, [None] * (len(self.step_times) - 1)).append(count)

    def add_step_energies(self, energies: Sequence[float | None]) -> None:
        """The energies of the steps added since the last call, in order (J, every host's; None: not measured)."""
        self.step_energy_j.extend(energies)


def _padded(values: list[Any], length: int) -> list[Any]:
    """``values`` with None in front up to ``length``: the entries a checkpoint did not record."""
    return [None] * (length - len(values)) + list(values)


@dataclasses.dataclass
class Interval:
    """Sums over the steps since the last interval record."""

    steps: int = 0
    time_s: float = 0.0
    flops: float = 0.0
    totals: dict[str, float] = dataclasses.field(default_factory=dict)
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    fp8_overflows: int = 0  # quantized tensors that clipped values, summed over the steps

    def add(self, step_time: float, flops: float, totals: Mapping[str, float], counts: Mapping[str, int]) -> None:
        self.steps += 1
        self.time_s += step_time
        self.flops += flops
        for key, value in totals.items():
            self.totals[key] = self.totals.get(key, 0.0) + value
        for key, value in counts.items():
            self.counts[key] = self.counts.get(key, 0) + value


def run_record(
    task: str,
    run: Run,
    hardware: Hardware,
    *,
    optimizer: Mapping[str, Any],
    implementation: str,
    model: str,
    params: int,
    batch: Mapping[str, Any],
    data: Mapping[str, Any],
    config: Mapping[str, Any],
) -> dict[str, Any]:
    """The ``run`` record that opens a run log; ``optimizer`` holds its ``optimizer*`` keys, ``implementation``
    says whose model trained (flax: the plain baseline, ls_jax: the fused one)."""
    return {
        **identity(task, run.run_id, run.command, run.started_utc),
        **hardware.record_fields(),
        "backend": backend_lib.active_backend(),
        "precision": hardware.precision,
        **optimizer,
        "implementation": implementation,
        "model": model,
        "params": params,
        "batch": dict(batch),
        "data": dict(data),
        "config": dict(config),
    }


def interval_record(
    step: int,
    interval: Interval,
    *,
    elapsed_s: float,
    lr: float,
    grad_norm: float,
    loss_scale: float | None,
    hardware: Hardware,
    energy_j: float | None,
    fp8_amax_ratio: float | None = None,
) -> dict[str, Any]:
    """The ``interval`` record of the steps summed in ``interval``, the last of them ``step``; ``elapsed_s`` is the
    run's training time so far. Loss and nll stay null when every step of the interval was skipped (fp16 overflow).
    ``fp8_amax_ratio`` (the last step's, `train.harness.step.fp8_metrics`) is given in fp8 runs only, which also
    report the interval's FP8 overflows; both are null otherwise.
    """
    weight = max(interval.totals.get("weight", 0.0), 1.0)
    tflops = interval.flops / interval.time_s / 1e12 if interval.time_s > 0 else None
    return {
        "type": "interval",
        "step": step,
        "elapsed_s": elapsed_s,
        "step_time_s": interval.time_s / interval.steps,
        **{f"{name}_per_s": count / interval.time_s for name, count in interval.counts.items()},
        "tflops_per_s": tflops,
        "mfu": metrics_lib.mfu(tflops, hardware.peak_tflops_per_device, hardware.device_count),
        "loss": None,
        "nll": None,
        **{key: value / weight for key, value in interval.totals.items() if key != "weight"},
        "lr": lr,
        "grad_norm": grad_norm,
        "loss_scale": loss_scale,
        "fp8_overflows": None if fp8_amax_ratio is None else interval.fp8_overflows,
        "fp8_amax_ratio": fp8_amax_ratio,
        "peak_memory_bytes": metrics_lib.peak_memory_bytes(hardware.local_devices),
        **energy_fields(energy_j, hardware.energy.source),
        "cost_usd": device_table.cost_usd(elapsed_s, hardware.device_count, hardware.price_per_device_hour),
    }


def _cost(seconds: float, hardware: Hardware) -> float | None:
    return device_table.cost_usd(seconds, hardware.device_count, hardware.price_per_device_hour)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def tally_part(tally: Tally, hardware: Hardware) -> dict[str, Any]:
    """A one-time window of the summary: how often it ran, its time, energy and cost."""
    return {
        "count": tally.count,
        "time_s": tally.time_s,
        "energy_j": tally.energy_j,
        "cost_usd": _cost(tally.time_s, hardware),
    }


def _pick(values: Sequence[Any], indices: Sequence[int]) -> list[Any]:
    return [values[index] for index in indices]


def warmup_part(counters: Counters, steps: Sequence[int], hardware: Hardware) -> dict[str, Any]:
    """The summary's ``warmup``: the warm-up ``steps`` (indices) of every segment, their time, energy and cost."""
    time_s = sum(_pick(counters.step_times, steps))
    return {
        "steps": len(steps),
        "time_s": time_s,
        "energy_j": windows.total(_pick(counters.step_energy_j, steps)),
        "cost_usd": _cost(time_s, hardware),
    }


def steady_part(counters: Counters, steps: Sequence[int], hardware: Hardware) -> dict[str, Any]:
    """The summary's ``steady``: the steps (indices) after warm-up, with their median step time and their rates
    (throughput, TFLOP/s, MFU, power) over their own time."""
    time_s = sum(_pick(counters.step_times, steps))
    energy = windows.total(_pick(counters.step_energy_j, steps))
    flops = windows.total(_pick(counters.step_flops, steps))
    tflops = None if flops is None else _ratio(flops / 1e12, time_s)
    return {
        "steps": len(steps),
        "time_s": time_s,
        "step_time_s": statistics.median(_pick(counters.step_times, steps)) if steps else None,
        **{
            f"{name}_per_s": _ratio(windows.total(_pick(counters.step_counts.get(name, []), steps)), time_s)
            for name in counters.counts
        },
        "tflops_per_s": tflops,
        "mfu": metrics_lib.mfu(tflops, hardware.peak_tflops_per_device, hardware.device_count),
        "energy_j": energy,
        "energy_per_step_j": _ratio(energy, len(steps)),
        "power_w": _ratio(energy, time_s),
        "cost_usd": _cost(time_s, hardware),
    }


def summary_record(counters: Counters, hardware: Hardware, stop_reason: str, steps: int) -> dict[str, Any]:
    """The ``summary`` record from the run's totals: the training window (every step) and the wall window a user
    pays for, the warm-up and steady parts of training, and the one-time work (compilation, evaluation,
    checkpoints)."""
    train_time = counters.train_time_s
    measured_steps = len(counters.step_times)
    tflops = counters.flops / train_time / 1e12 if train_time > 0 else None
    flags = windows.warmup_flags(counters.step_times, counters.segment_starts)
    train_energy = windows.total(counters.step_energy_j)
    return {
        "type": "summary",
        "completed": stop_reason == "finished",
        "stop_reason": stop_reason,
        "steps": steps,
        "train_time_s": train_time,
        "wall_time_s": counters.wall_time_s,
        "step_time_s": statistics.median(counters.step_times) if counters.step_times else None,
        **{name: count for name, count in counters.counts.items()},
        **{f"{name}_per_s": (count / train_time if train_time > 0 else 0.0) for name, count in counters.counts.items()},
        "flops_per_step": counters.flops / measured_steps if measured_steps else None,
        "xla_flops_per_step": (
            counters.xla_flops / measured_steps if measured_steps and counters.xla_flops_known else None
        ),
        "tflops_per_s": tflops,
        "mfu": metrics_lib.mfu(tflops, hardware.peak_tflops_per_device, hardware.device_count),
        "peak_memory_bytes": metrics_lib.peak_memory_bytes(hardware.local_devices),
        **energy_fields(train_energy, hardware.energy.source),
        "energy_estimated": train_energy is not None and hardware.energy.source == "estimated",
        "cost_usd": _cost(train_time, hardware),
        "wall_energy_j": counters.wall_energy_j,
        "wall_cost_usd": _cost(counters.wall_time_s, hardware),
        "warmup": warmup_part(counters, [i for i, warm in enumerate(flags) if warm], hardware),
        "steady": steady_part(counters, [i for i, warm in enumerate(flags) if not warm], hardware),
        **{name: tally_part(getattr(counters, name), hardware) for name in _TALLIES},
        "startup_parts": dict(counters.startup_parts),
        "compile_cache": dataclasses.asdict(compile_cache.use()),
        "final_loss": counters.last_loss,
        # A checkpoint of schema 2 saved every quality key, null where the task had none.
        "metrics": {key: value for key, value in counters.last_eval.items() if value is not None},
        "host_phases": host_part(
            counters.host,
            statistics.median(counters.step_times) if counters.step_times else None,
            asynchronous=hardware.devices[0].platform != "cpu",
        ),
        "memory": None,
    }


def host_part(host: HostPhases, step_time_s: float | None, *, asynchronous: bool) -> dict[str, Any] | None:
    """The summary's ``host_phases``: milliseconds per step the host spent in each phase of the loop
    (`train.harness.host_phases`), and whether it held the device back; None before the first step.

    Only devices that run a launched step while the host goes on (``asynchronous``: GPUs, TPUs) can wait for the
    host; a CPU computes the step inside its launch, so ``host_bound`` is false there."""
    per_step = host.per_step_ms()
    if per_step is None:
        return None
    return {"steps": host.steps, **per_step, "host_bound": asynchronous and host.host_bound(step_time_s)}


def format_value(value: float | None, spec: str = ".3g", unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def _energy_cost(part: Mapping[str, Any], energy_key: str = "energy_j", cost_key: str = "cost_usd") -> str:
    return f"{format_value(part[energy_key], '.4g', ' J')}, {format_value(part[cost_key], '.4g', ' USD')}"


def describe_windows(summary: Mapping[str, Any], throughput: Callable[[Mapping[str, Any]], str]) -> list[str]:
    """The summary's windows for people: the steady state, the warm-up, the whole run (training and wall) and the
    one-time work, one line each; ``throughput`` words a record's ``<count>_per_s`` in the task's units."""
    steady, warmup = summary["steady"], summary["warmup"]
    tallies = [name for name in _TALLIES if name in summary]  # a log of schema 1 or 2 may lack one
    one_time = ", ".join(
        f"{name.replace('_', ' ')} {summary[name]['time_s']:.1f} s ({summary[name]['count']}x)"
        for name in tallies
        if summary[name]["count"]
    )
    unnamed = summary["wall_time_s"] - summary["train_time_s"] - sum(summary[name]["time_s"] for name in tallies)
    one_time += f", other {max(unnamed, 0.0):.1f} s" + _describe_cache(summary.get("compile_cache"))
    # Batches of several shapes step in different times: the mean, not the median, matches the rates.
    mean_step = steady["time_s"] / steady["steps"] if steady["steps"] else None
    return [
        f"  steady      {steady['steps']} steps, {format_value(steady['step_time_s'], '.4g', ' s')}/step (median; "
        f"mean {format_value(mean_step, '.4g', ' s')}): {throughput(steady)}, "
        f"{format_value(steady['tflops_per_s'])} TFLOP/s, MFU {format_value(steady['mfu'], '.1%')}, "
        f"{format_value(steady['energy_per_step_j'], '.4g', ' J')}/step "
        f"at {format_value(steady['power_w'], '.4g', ' W')}",
        f"  warm-up     {warmup['steps']} steps until the step time settled: {warmup['time_s']:.2f} s, "
        f"{_energy_cost(warmup)}",
        f"  training    {summary['steps']} steps, {summary['train_time_s']:.2f} s: {throughput(summary)}, "
        f"{format_value(summary['tflops_per_s'])} TFLOP/s, MFU {format_value(summary['mfu'], '.1%')}, "
        f"{_energy_cost(summary)}",
        f"  wall        {summary['wall_time_s']:.1f} s: {_energy_cost(summary, 'wall_energy_j', 'wall_cost_usd')}; "
        f"{one_time}",
        *_describe_startup(summary.get("startup_parts")),
        *_describe_host(summary.get("host_phases")),
    ]


def _describe_startup(parts: Mapping[str, float] | None) -> list[str]:
    """The start-up's line of the summary, its parts in seconds (`train.harness.startup.PARTS`)."""
    if not parts:
        return []
    return [
        "  start-up    "
        + ", ".join(f"{name.replace('_', ' ')} {seconds:.1f}" for name, seconds in parts.items())
        + " s"
    ]


def _describe_cache(cache: Mapping[str, Any] | None) -> str:
    """How much of this process's compilation came from the persistent cache, for the wall line."""
    if cache is None:
        return ""
    spent = ""
    if "backend_compile_s" in cache:  # schema 3 on
        spent = (
            f" (every program: XLA {cache['backend_compile_s']:.1f} s, tracing and lowering "
            f"{cache['trace_s'] + cache['lower_s']:.1f} s)"
        )
    if cache["directory"] is None:
        return "; compilation cache off" + spent
    untraced = " and the training step without tracing" if cache.get("steps_loaded") else ""
    return f"; {cache['hits']} of {cache['requests']} compiled programs loaded from the cache{untraced}{spent}"


def _describe_host(host: Mapping[str, Any] | None) -> list[str]:
    """The host's line of the summary (`train.harness.host_phases`); none before the first step."""
    if host is None:
        return []
    own = ", ".join(f"{phase} {host[f'{phase}_ms']:.2f}" for phase in PHASES if phase != "wait")
    line = f"  host        {own} ms/step; waited {host['wait_ms']:.2f} ms/step for the device"
    if host["host_bound"]:
        line += ": the host held the device back (a faster input pipeline or fewer devices per process helps)"
    return [line]
