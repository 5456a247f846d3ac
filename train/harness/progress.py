"""What a run has done so far and the records that say it: the run's totals (`Counters`, saved in every
checkpoint), the sums of one logging interval (`Interval`), and the ``run``, ``interval`` and ``summary`` records
of the run log (train.records.runlog holds their schema)."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Mapping

from ls_jax import backend as backend_lib
from train.costs import metrics as metrics_lib
from train.costs.hardware import Hardware
from train.harness.config import Run
from train.records.runlog import QUALITY_KEYS, energy_fields, identity


@dataclasses.dataclass
class Counters:
    """Totals over the whole run (all resumed segments): saved in checkpoints, reported in the summary."""

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

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Counters:
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Interval:
    """Sums over the steps since the last interval record."""

    steps: int = 0
    time_s: float = 0.0
    flops: float = 0.0
    totals: dict[str, float] = dataclasses.field(default_factory=dict)
    counts: dict[str, int] = dataclasses.field(default_factory=dict)

    def add(self, step_time: float, flops: float, totals: Mapping[str, float], counts: Mapping[str, int]) -> None:
        self.steps += 1
        self.time_s += step_time
        self.flops += flops
        for key, value in totals.items():
            self.totals[key] = self.totals.get(key, 0.0) + value
        for key, value in counts.items():
            self.counts[key] = self.counts.get(key, 0) + value


def run_record(task: str, run: Run, hardware: Hardware, *, optimizer: Mapping[str, Any], model: str, params: int,
               batch: Mapping[str, Any], data: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``run`` record that opens a run log; ``optimizer`` holds its ``optimizer*`` keys."""
    return {
        **identity(task, run.run_id, run.command, run.started_utc),
        **hardware.record_fields(),
        "backend": backend_lib.active_backend(),
        "precision": hardware.precision,
        **optimizer,
        "model": model,
        "params": params,
        "batch": dict(batch),
        "data": dict(data),
        "config": dict(config),
    }


def interval_record(step: int, interval: Interval, *, elapsed_s: float, lr: float, grad_norm: float,
                    loss_scale: float | None, hardware: Hardware, energy_j: float | None) -> dict[str, Any]:
    """The ``interval`` record of the steps summed in ``interval``, the last of them ``step``; ``elapsed_s`` is the
    run's training time so far. Loss and nll stay null when every step of the interval was skipped (fp16 overflow).
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
        "peak_memory_bytes": metrics_lib.peak_memory_bytes(hardware.local_devices),
        **energy_fields(energy_j, hardware.energy.source),
        "cost_usd": metrics_lib.cost_usd(elapsed_s, hardware.device_count, hardware.price_per_device_hour),
    }


def summary_record(counters: Counters, hardware: Hardware, stop_reason: str, steps: int) -> dict[str, Any]:
    """The ``summary`` record from the run's totals."""
    train_time = counters.train_time_s
    measured_steps = len(counters.step_times)
    tflops = counters.flops / train_time / 1e12 if train_time > 0 else None
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
        **energy_fields(counters.energy_j, hardware.energy.source),
        "energy_estimated": counters.energy_j is not None and hardware.energy.source == "estimated",
        "cost_usd": metrics_lib.cost_usd(train_time, hardware.device_count, hardware.price_per_device_hour),
        "final_loss": counters.last_loss,
        **{key: counters.last_eval.get(key) for key in QUALITY_KEYS},
        "memory": None,
    }
