"""Data parallelism end to end: `python -m train.imdb` on 1 device, 2 devices of one process (with and without the
sharded optimizer), 2 processes on localhost, a resume on another device count and FP8 on 2 devices, each in its own
process.

Dropout is off and everything is f32, so every way of splitting the same global batch must give the losses of one
device (to f32 rounding of sums taken in another order)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from train.errors import UsageError
from train.harness.parallel import process_counts

ROOT = Path(__file__).resolve().parents[2]
COMMON = [
    "--batch-size",
    "8",
    "--dropout",
    "0",
    "--precision",
    "fp32",
    "--eval-every",
    "100",
    "--log-every",
    "1",
    "--no-progress",
    "--no-tensorboard",
    "--backend",
    "xla",
]


def _env(devices: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    # XLA's CPU collectives abort a rendezvous that waits 40 s for a device's thread; a loaded 2-core machine can
    # leave one that long, so the tests allow 5 minutes.
    flags = (
        f"--xla_force_host_platform_device_count={devices} --xla_cpu_collective_call_terminate_timeout_seconds=300"
        " --xla_cpu_collective_call_warn_stuck_timeout_seconds=60"
    )
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", XLA_FLAGS=flags, **extra)
    return env


def _train(run_dir: Path, *args: str, devices: int = 1, timeout: int = 600) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "train.imdb", *COMMON, "--run-dir", str(run_dir), *args],
        cwd=ROOT,
        env=_env(devices),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "run.jsonl").read_text().splitlines()]


def _losses(run_dir: Path) -> np.ndarray:
    return np.array([r["loss"] for r in _records(run_dir) if r["type"] == "interval"])


def _device_count(run_dir: Path) -> int:
    return next(r["device_count"] for r in _records(run_dir) if r["type"] == "run")


@pytest.fixture(scope="module")
def one_device(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("dp") / "one"
    _train(run_dir, "--steps", "6")
    return run_dir


@pytest.mark.parametrize(
    "sharded", [pytest.param(False, marks=pytest.mark.slow), True], ids=["replicated", "sharded-optimizer"]
)
def test_two_devices_match_one_device(one_device, tmp_path, sharded):
    run_dir = tmp_path / "two"
    _train(run_dir, "--steps", "6", *(["--shard-optimizer"] if sharded else []), devices=2)
    assert _device_count(run_dir) == 2
    reference = _losses(one_device)
    assert len(reference) == 6
    np.testing.assert_allclose(_losses(run_dir), reference, rtol=1e-5)


def test_fp8_trains_on_two_devices(tmp_path):
    """FP8 with data parallelism: the layers' ordered backward takes the scaling state (it failed to trace), and
    every interval logs its amax ratio."""
    run_dir = tmp_path / "fp8"
    _train(run_dir, "--steps", "3", "--precision", "fp8", devices=2)
    assert _device_count(run_dir) == 2
    intervals = [r for r in _records(run_dir) if r["type"] == "interval"]
    assert len(intervals) == 3
    assert all(np.isfinite(r["loss"]) and r["fp8_amax_ratio"] > 0 for r in intervals)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _two_processes(cwd: Path, *args: str, pythonpath: str = str(ROOT)) -> None:
    """`train.imdb` with ``args`` as two processes of one CPU device each, joined over localhost."""
    port = _free_port()
    command = [sys.executable, "-m", "train.imdb", *COMMON, *args, "--distributed"]
    processes = [
        subprocess.Popen(
            command,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(
                1,
                PYTHONPATH=pythonpath,
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JAX_NUM_PROCESSES="2",
                JAX_PROCESS_ID=str(rank),
            ),
        )
        for rank in range(2)
    ]
    outputs = [process.communicate(timeout=600) for process in processes]
    for process, (_, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr[-3000:]


def test_two_processes_match_one_process(one_device, tmp_path):
    """Without --run-dir: both processes must agree on one new runs/<run id> and check it at the same time."""
    _two_processes(tmp_path, "--steps", "6")
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert _device_count(run_dir) == 2
    np.testing.assert_allclose(_losses(run_dir), _losses(one_device), rtol=1e-5)


SLOW_PROFILER = """
import os, time
import jax.profiler

_start = jax.profiler.start_trace


def _slow_start(*args, **kwargs):
    time.sleep(float(os.environ["SLOW_PROFILER_START_S"]))
    return _start(*args, **kwargs)


if os.environ.get("JAX_PROCESS_ID") == "1":
    jax.profiler.start_trace = _slow_start
"""


def test_a_slow_profiler_start_in_one_process_is_in_no_step_time(tmp_path, monkeypatch):
    """Process 1's profiler takes 6 s to start: process 0, whose log times the steps, waits for it outside every
    step, not inside the traced step's all-reduce."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SLOW_PROFILER)
    monkeypatch.setenv("SLOW_PROFILER_START_S", "6")
    run_dir = tmp_path / "run"
    _two_processes(
        tmp_path,
        "--steps",
        "5",
        "--profile-steps",
        "3:3",
        "--run-dir",
        str(run_dir),
        pythonpath=f"{hooks}{os.pathsep}{ROOT}",
    )
    times = [r["step_time_s"] for r in _records(run_dir) if r["type"] == "interval"]
    assert len(times) == 5
    assert max(times) < 3, times
    assert (run_dir / "profile").is_dir()


@pytest.mark.slow
def test_sharded_checkpoint_resumes_on_another_device_count(one_device, tmp_path):
    """A checkpoint of 2 devices with a sharded optimizer holds the replicated state: 1 device continues it exactly
    as it continues the 1-device run's own checkpoint."""
    sharded = tmp_path / "sharded"
    _train(sharded, "--steps", "6", "--shard-optimizer", devices=2)
    continued = {}
    for name, source in (("from-sharded", sharded), ("from-one", one_device)):
        run_dir = tmp_path / name
        subprocess.run(["cp", "-r", str(source), str(run_dir)], check=True)
        _train(run_dir, "--resume", str(run_dir), "--steps", "8")
        continued[name] = _losses(run_dir)
    assert len(continued["from-one"]) == 8
    np.testing.assert_allclose(continued["from-sharded"], continued["from-one"], rtol=1e-5)


# ------------------------------------------------------------------------------------------- bad input


def test_a_batch_the_devices_cannot_share_is_one_line(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "train.imdb",
            *COMMON,
            "--run-dir",
            str(tmp_path / "r"),
            "--batch-size",
            "3",
            "--steps",
            "1",
        ],
        cwd=ROOT,
        env=_env(2),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "error: --batch-size 3 is not a multiple of the 2 devices"


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"}, "must be integers"),
        ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}, "JAX_PROCESS_ID 2 must be in 0 .. JAX_NUM_PROCESSES - 1"),
        ({"JAX_NUM_PROCESSES": "0"}, "JAX_NUM_PROCESSES must be >= 1"),
    ],
)
def test_process_numbers_out_of_range_are_one_line(environ, message):
    with pytest.raises(UsageError, match=message):
        process_counts(environ)
    assert process_counts({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}) == {"num_processes": 2, "process_id": 1}
