"""Real processes of the toy harness task (`helpers.toy_task`) for fault tests: start one, signal it at a line of
its stderr, and read what it left in its run directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QUIET = ["--no-progress", "--no-tensorboard"]


def saved_steps(run_dir: Path) -> list[int]:
    """The steps of the complete checkpoints in ``run_dir``."""
    return sorted(int(p.name) for p in (Path(run_dir) / "checkpoints").iterdir() if p.name.isdigit())


def start(run_dir: Path | None, *flags: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m helpers.toy_task --run-dir RUN_DIR --no-progress --no-tensorboard FLAGS`` (no --run-dir when
    ``run_dir`` is None), its stdout and stderr piped as text."""
    environment = {**os.environ, "PYTHONPATH": f"{REPO / 'tests'}{os.pathsep}{REPO}", **(env or {})}
    where = [] if run_dir is None else ["--run-dir", str(run_dir)]
    return subprocess.Popen(
        [sys.executable, "-m", "helpers.toy_task", *where, *QUIET, *flags],
        cwd=REPO,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_line(process: subprocess.Popen, line: str, timeout: float = 240) -> list[str]:
    """Reads ``process``'s stderr until a line containing ``line``; returns the lines read."""
    seen = []
    deadline = time.monotonic() + timeout
    for text in process.stderr:
        seen.append(text)
        if line in text:
            return seen
        assert time.monotonic() < deadline, "".join(seen)
    pytest.fail(f"{line!r} never printed: {''.join(seen)}")


def signal_at_line(
    process: subprocess.Popen, line: str, signum: int = signal.SIGTERM, timeout: float = 240
) -> tuple[str, int]:
    """Sends ``signum`` once ``process`` has printed ``line`` on stderr; returns (stderr, exit code)."""
    seen = wait_for_line(process, line, timeout)
    process.send_signal(signum)
    rest = process.stderr.read()
    process.wait(timeout=120)
    return "".join(seen) + rest, process.returncode
