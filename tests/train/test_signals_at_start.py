"""A signal at any moment before the first training step: ``python -m train.wmt`` ends with 128 + the signal's number
and one line, never a traceback or a crash, whether it lands in the imports, the setup (the state's compilation) or
the compilation of the training step."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# (signal, seconds after the start) and (signal, seconds after "compiling the training step" is printed)
AFTER_START = [(signal.SIGINT, 0.3), (signal.SIGTERM, 1.5), (signal.SIGINT, 3.0)]
AFTER_COMPILING = [(signal.SIGINT, 0.0), (signal.SIGTERM, 1.0)]
COMPILING = "compiling the training step"


def start(run_dir: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "train.wmt", "--steps", "3", "--run-dir", str(run_dir), "--no-tensorboard"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def check_stopped(process: subprocess.Popen, signum: int, stderr_so_far: str = "") -> None:
    out, err = process.communicate(timeout=300)
    err = stderr_so_far + err
    lines = [line for line in (out + err).splitlines() if line.strip() and line != COMPILING + " for 3 batch shapes"]
    assert process.returncode == 128 + signum, (process.returncode, out, err)
    assert len(lines) == 1 and lines[0].startswith(f"stopped by {signal.Signals(signum).name}"), lines
    assert "Traceback" not in err and "Segmentation" not in err


@pytest.mark.parametrize("signum, delay", AFTER_START, ids=[f"{s.name}-{d}s" for s, d in AFTER_START])
def test_a_signal_while_starting_is_one_line(tmp_path, signum, delay):
    process = start(tmp_path / "run")
    time.sleep(delay)
    process.send_signal(signum)
    check_stopped(process, signum)


@pytest.mark.parametrize("signum, delay", AFTER_COMPILING, ids=[f"{s.name}-{d}s" for s, d in AFTER_COMPILING])
def test_a_signal_while_compiling_the_step_is_one_line(tmp_path, signum, delay):
    process = start(tmp_path / "run")
    seen = ""
    while COMPILING not in seen:
        line = process.stderr.readline()
        assert line, f"the run ended before compiling: {seen}"
        seen += line
    time.sleep(delay)
    process.send_signal(signum)
    check_stopped(process, signum, seen)


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(20))
def test_twenty_signals_during_compilation(tmp_path, attempt):
    """The state's compilation (the first seconds after the imports) and the step's, a signal every 0.4 s apart."""
    signum = (signal.SIGINT, signal.SIGTERM)[attempt % 2]
    process = start(tmp_path / "run")
    seen = ""
    if attempt >= 10:  # the step's compilation
        while COMPILING not in seen:
            line = process.stderr.readline()
            assert line, f"the run ended before compiling: {seen}"
            seen += line
    time.sleep((attempt % 10) * 0.4 + (0 if attempt >= 10 else 1.0))
    process.send_signal(signum)
    check_stopped(process, signum, seen)
