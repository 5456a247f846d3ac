"""Runs a module of checks under pytest in a fresh interpreter that has several CPU devices.

The rest of the suite runs with one device, and JAX fixes its device count when it starts, so multi-device checks
live in a module pytest does not collect by itself (its name does not start with ``test_``) and a test here runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def run_checks(module: Path, devices: int, timeout_s: int = 600) -> None:
    """Runs ``module``'s tests with ``devices`` host CPU devices; fails with their report when one fails."""
    # XLA's CPU collectives abort a rendezvous that waits 40 s for a device's thread, which a loaded 2-core machine
    # can make one wait: allow 5 minutes.
    flags = f"--xla_force_host_platform_device_count={devices} --xla_cpu_collective_call_terminate_timeout_seconds=300"
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}", JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(module)],
        cwd=TESTS.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout.splitlines()[-1], result.stdout[-2000:]
