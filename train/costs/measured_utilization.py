"""Achieved occupancy and SM throughput measured by ``python -m train.bench counters``, attached to training runs.

``python -m train.compare ... --counters docs/results/counters-h100.json`` reads a counters result file and
gives each run the counters measured on its device kind with its kernel backend (ls_jax_ffi for ``ffi`` runs,
ls_jax_xla for ``xla`` runs), on the run's model where the file has it and else labeled as measured on another
model; the utilization of a run without such a measurement stays its MFU and is labeled so.
Both quantities are the kernel-time-weighted means over every profiled kernel (a short kernel weighs less than a
long GEMM), of ``sm__warps_active.avg.pct_of_peak_sustained_active`` (achieved occupancy) and
``sm__throughput.avg.pct_of_peak_sustained_elapsed``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

BACKEND_OF_IMPLEMENTATION = {"ls_jax_ffi": "ffi", "ls_jax_xla": "xla"}
MODEL_OF_WORKLOAD = {"wmt-big-6e6d": "transformer-big", "bert-base": "bert-base"}
"""The training model (``--preset``) each whole-model counters workload is; encoder-block is one layer of none."""


class RunLike(Protocol):
    name: str  # the run's name in reports (its run directory's)
    device_kind: str
    backend: str
    model: str
    mfu: float | None


@dataclasses.dataclass(frozen=True)
class Measured:
    """Occupancy and SM throughput (percent of peak) of one implementation's workload on one device kind."""

    device_kind: str
    backend: str
    workload: str
    achieved_occupancy_pct: float
    sm_throughput_pct: float
    source: str


def load(path: Path) -> list[Measured]:
    """Every (workload, ls_jax implementation) of a counters result file; ValueError naming the file otherwise."""
    try:
        result: dict[str, Any] = json.loads(path.read_text())
        device_kind = result["environment"]["device_kind"]
        totals = [
            (workload, implementation, record["total"])
            for workload, entry in result["workloads"].items()
            for implementation, record in entry["results"].items()
        ]
        measured = [
            Measured(
                device_kind,
                BACKEND_OF_IMPLEMENTATION[implementation],
                workload,
                total["achieved_occupancy_pct_time_weighted"],
                total["sm_throughput_pct_time_weighted"],
                str(path),
            )
            for workload, implementation, total in totals
            if implementation in BACKEND_OF_IMPLEMENTATION
            and total.get("achieved_occupancy_pct_time_weighted") is not None
            and total.get("sm_throughput_pct_time_weighted") is not None
        ]
    except FileNotFoundError:
        raise ValueError(f"--counters {path}: no such file; python -m train.bench counters writes one") from None
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(
            f"--counters {path}: not a counters result file (python -m train.bench counters): "
            f"{type(err).__name__} {err}"
        ) from None
    return measured


def same_model(measured: Measured, run: RunLike) -> bool:
    """Whether the counters' workload is the run's model (``MODEL_OF_WORKLOAD``)."""
    return MODEL_OF_WORKLOAD.get(measured.workload) == run.model


def for_run(run: RunLike, measured: Sequence[Measured]) -> Measured | None:
    """The measurement of the run's device kind and kernel backend, on the run's model when there is one, else the
    first on another model (`table` labels it so); None when none has its device kind and backend."""
    fitting = [m for m in measured if m.device_kind == run.device_kind and m.backend == run.backend]
    return next((m for m in fitting if same_model(m, run)), fitting[0] if fitting else None)


def table(runs: Sequence[RunLike], measured: Sequence[Measured]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of each run's utilization: measured counters where there are some, else its MFU, labeled."""
    header = ["#", "run", "utilization", "achieved occupancy", "SM throughput", "MFU"]
    rows = []
    for index, run in enumerate(runs):
        match = for_run(run, measured)
        mfu = "n/a" if run.mfu is None else f"{100 * run.mfu:.1f}%"
        if match is None:
            rows.append([f"#{index + 1}", run.name, "MFU (no counters for this device and backend)", "-", "-", mfu])
        else:
            where = match.workload if same_model(match, run) else f"{match.workload}, not {run.model}"
            rows.append(
                [
                    f"#{index + 1}",
                    run.name,
                    f"measured (ncu, {where})",
                    f"{match.achieved_occupancy_pct:.1f}%",
                    f"{match.sm_throughput_pct:.1f}%",
                    mfu,
                ]
            )
    return header, rows
