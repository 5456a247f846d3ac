"""Achieved occupancy and SM throughput measured by ``python -m train.bench counters``, attached to training runs.

``python -m train.compare ... --counters docs/results/counters-h100.json`` reads a counters result file and
gives each run the counters measured on its device kind with its kernel backend (ls_jax_ffi for ``ffi`` runs,
ls_jax_xla for ``xla`` runs); the utilization of a run without such a measurement stays its MFU and is labeled so.
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


class RunLike(Protocol):
    run_id: str
    device_kind: str
    backend: str
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
        workloads = result["workloads"]
    except FileNotFoundError:
        raise ValueError(f"--counters {path}: no such file; python -m train.bench counters writes one") from None
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"--counters {path}: not a counters result file (python -m train.bench counters): {err}") \
            from None
    measured = []
    for workload, entry in workloads.items():
        for implementation, record in entry["results"].items():
            total = record["total"]
            occupancy, throughput = total.get("achieved_occupancy_pct_time_weighted"), total.get(
                "sm_throughput_pct_time_weighted")
            if implementation in BACKEND_OF_IMPLEMENTATION and occupancy is not None and throughput is not None:
                measured.append(Measured(device_kind, BACKEND_OF_IMPLEMENTATION[implementation], workload,
                                         occupancy, throughput, str(path)))
    return measured


def for_run(run: RunLike, measured: Sequence[Measured]) -> Measured | None:
    """The first measurement of the run's device kind and kernel backend, if any."""
    return next((m for m in measured if m.device_kind == run.device_kind and m.backend == run.backend), None)


def table(runs: Sequence[RunLike], measured: Sequence[Measured]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of each run's utilization: measured counters where there are some, else its MFU, labeled."""
    header = ["#", "run", "utilization", "achieved occupancy", "SM throughput", "MFU"]
    rows = []
    for index, run in enumerate(runs):
        match = for_run(run, measured)
        mfu = "n/a" if run.mfu is None else f"{100 * run.mfu:.1f}%"
        if match is None:
            rows.append([f"#{index + 1}", run.run_id, "MFU (no counters for this device and backend)", "-", "-", mfu])
        else:
            rows.append([f"#{index + 1}", run.run_id, f"measured (ncu, {match.workload})",
                         f"{match.achieved_occupancy_pct:.1f}%", f"{match.sm_throughput_pct:.1f}%", mfu])
    return header, rows
