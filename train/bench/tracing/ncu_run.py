"""Runs one `train.bench.steps.counter_workloads` child under Nsight Compute and reads back its kernels.

The child marks its one measured call with cuProfilerStart/Stop, so with ``--profile-from-start off`` ncu
profiles exactly the kernels of that call (compilation, autotuning and warm-up stay out). ncu's report goes to a
log file (``--log-file``), apart from the program's own output. This module starts no JAX backend itself: the
parent process must leave the GPU's memory to the child.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

from train.bench.tracing.ncu_report import Kernel, parse_csv

REPO_ROOT = Path(__file__).resolve().parents[3]

NCU_FALLBACKS = ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/ncu")
CHILD_MODULE = "train.bench.steps.counter_workloads"


@dataclasses.dataclass(frozen=True)
class Profile:
    """The kernels of one profiled call, the compiled HLO behind them, the child's environment and wall time."""

    kernels: list[Kernel]
    hlo: str
    environment: dict[str, Any]
    wall_s: float


def find_ncu(given: str | None) -> str:
    """The ncu executable: ``given``, else ncu on PATH, else the CUDA toolkit's; one clear error otherwise."""
    candidates = [given] if given else [shutil.which("ncu"), *NCU_FALLBACKS]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    where = f"at {given}" if given else f"on PATH or in {', '.join(NCU_FALLBACKS)}"
    raise FileNotFoundError(f"Nsight Compute (ncu) not found {where}; install Nsight Compute or pass --ncu PATH")


def metric_base(metric: str) -> str:
    """'dram__bytes_read.sum' -> 'dram__bytes_read' (ncu --query-metrics lists base names)."""
    return metric.split(".", 1)[0]


def available_metrics(ncu: str) -> set[str] | None:
    """Base metric names the local GPU supports (``ncu --query-metrics``); None when the query fails."""
    try:
        listing = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True, timeout=120, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    names = {line.split()[0] for line in listing.stdout.splitlines() if line.strip() and "__" in line.split()[0]}
    return names or None


def split_supported(metrics: Iterable[str], available: set[str] | None) -> tuple[list[str], list[str]]:
    """(metrics the GPU has, metrics it lacks); everything counts as supported when ``available`` is unknown."""
    metrics = list(metrics)
    if available is None:
        return metrics, []
    supported = [m for m in metrics if metric_base(m) in available]
    return supported, [m for m in metrics if m not in supported]


def ncu_command(
    ncu: str, metrics: Iterable[str], log_file: Path, child: list[str], max_kernels: int | None = None
) -> list[str]:
    """ncu, gated on the child's profiler range, raw CSV in base units, demangled kernel names; ``max_kernels``
    stops profiling after that many kernels (``--launch-count``).

    Only the child itself is profiled (``--target-processes application-only``): with ncu injected into the
    processes it starts too (the kernel library's build checks, ``git``), ncu ended in a segmentation fault."""
    limit = [] if max_kernels is None else ["--launch-count", str(max_kernels)]
    return [
        ncu,
        "--csv",
        "--page",
        "raw",
        "--print-units",
        "base",
        "--metrics",
        ",".join(metrics),
        "--target-processes",
        "application-only",
        "--profile-from-start",
        "off",
        "--kernel-name-base",
        "demangled",
        *limit,
        "--log-file",
        str(log_file),
        *child,
    ]


def child_command(
    workload: str, implementation: str, batch: int, seq_len: int, work_dir: Path, layers: int | None = None
) -> list[str]:
    # -X faulthandler: a crash of the child under ncu prints the Python stack that caused it
    return [
        sys.executable,
        "-X",
        "faulthandler",
        "-m",
        CHILD_MODULE,
        workload,
        implementation,
        "--batch",
        str(batch),
        "--seq-len",
        str(seq_len),
        "--hlo",
        str(work_dir / "step.hlo.txt"),
        "--env",
        str(work_dir / "environment.json"),
        *([] if layers is None else ["--layers", str(layers)]),
    ]


def run_under_ncu(
    ncu: str,
    metrics: list[str],
    child: list[str],
    work_dir: Path,
    timeout_s: float,
    what: str,
    max_kernels: int | None = None,
) -> tuple[str, float]:
    """Runs ``child`` under ncu (killing its process group after ``timeout_s``); returns ncu's report and the wall
    seconds. ``what`` names the run in the errors: a timeout (TimeoutError) or a failing ncu (RuntimeError, with the
    end of its log)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    log_file = work_dir / "ncu.csv"
    command = ncu_command(ncu, metrics, log_file, child, max_kernels)
    (work_dir / "command.txt").write_text(" ".join(command) + "\n")
    start = time.perf_counter()
    # Without preallocation XLA holds only the memory it uses: ncu saves and restores what a kernel can reach before
    # each replay, and with XLA's default pool (75% of the GPU) no kernel of a BERT-base step finished in minutes.
    environment = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    process = subprocess.Popen(command, start_new_session=True, cwd=REPO_ROOT, env=environment)  # imports this tree
    try:
        returncode = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise TimeoutError(
            f"{what} ran past {timeout_s:.0f} s under ncu; use a smaller --batch (or --case) or fewer metrics"
        ) from None
    wall_s = time.perf_counter() - start
    report = log_file.read_text() if log_file.exists() else ""
    if returncode != 0:
        tail = "\n".join(report.splitlines()[-5:])
        raise RuntimeError(
            f"ncu exited with {returncode} for {what}; the end of {log_file}:\n"
            f"{tail}\n(ERR_NVGPUCTRPERM means the GPU's performance counters need admin rights)"
        )
    return report, wall_s


def profile(
    ncu: str,
    metrics: list[str],
    workload: str,
    implementation: str,
    batch: int,
    seq_len: int,
    work_dir: Path,
    timeout_s: float,
    max_kernels: int | None = None,
    layers: int | None = None,
) -> Profile:
    """Runs the counters child under ncu and parses the report."""
    child = child_command(workload, implementation, batch, seq_len, work_dir, layers)
    report, wall_s = run_under_ncu(
        ncu, metrics, child, work_dir, timeout_s, f"{workload}/{implementation} batch {batch}", max_kernels
    )
    return Profile(
        kernels=parse_csv(report, metrics),
        hlo=(work_dir / "step.hlo.txt").read_text(),
        environment=json.loads((work_dir / "environment.json").read_text()),
        wall_s=wall_s,
    )
