"""A run's start-up in named parts, counted from the process's start, and a wall time the summary names."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from train.harness import startup
from train.records import runlog

REPO = Path(__file__).resolve().parents[2]
_ENV = {"PYTHONPATH": f"{REPO / 'tests'}:{REPO}", "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
ONE_TIME = ("startup", "compilation", "first_execution", "evaluation", "checkpoints")


def test_the_clock_starts_when_the_tools_load_before_their_imports():
    waited = 0.6
    code = (
        f"import time, train; time.sleep({waited}); from train.harness.startup import tools_loaded_at; "
        "print(time.monotonic() - tools_loaded_at())"
    )
    age = float(subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True).stdout)
    assert waited <= age < waited + 10


def test_a_wrapper_that_execs_the_cli_is_not_counted(tmp_path):
    """bash runs the last command of ``-c`` in its own process: the seconds it slept before are not the run's."""
    run_dir = tmp_path / "run"
    command = f"sleep 4 && exec {sys.executable} -m helpers.toy_task --run-dir {run_dir} --steps 2 --no-progress"
    done = subprocess.run(["bash", "-c", command], cwd=REPO, env=_ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    summary = runlog.read(run_dir / runlog.LOG_FILENAME)[-1]
    assert summary["startup_parts"]["imports"] < 3.9


def test_each_mark_closes_its_part_and_a_part_may_come_twice():
    clock = startup.StartupClock(started_at=time.monotonic() - 1.0)
    clock.mark("imports")
    time.sleep(0.05)
    clock.mark("state")
    clock.mark("state")
    assert clock.parts["imports"] >= 1.0
    assert 0.05 <= clock.parts["state"] < 1.0
    with pytest.raises(ValueError, match="unknown start-up part 'data'"):
        clock.mark("data")


def test_a_cli_run_names_its_start_up_and_its_wall_time(tmp_path):
    run_dir = tmp_path / "run"
    flags = ["--run-dir", str(run_dir), "--steps", "4", "--no-progress", "--no-tensorboard"]
    done = subprocess.run(
        [sys.executable, "-m", "helpers.toy_task", *flags],
        cwd=REPO,
        env=_ENV,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    summary = runlog.read(run_dir / runlog.LOG_FILENAME)[-1]
    parts = summary["startup_parts"]
    assert list(parts) == list(startup.PARTS)
    assert parts["imports"] > 0.1  # JAX alone takes longer to import
    assert sum(parts.values()) == pytest.approx(summary["startup"]["time_s"], rel=1e-6)
    # Every second of the wall time but the last records' writing is in a named window (a checkpoint's write that
    # finishes in the background included).
    named = summary["train_time_s"] + sum(summary[name]["time_s"] for name in ONE_TIME)
    assert named <= summary["wall_time_s"] < named + 0.25
    assert "  start-up    imports " in done.stdout
    assert json.loads((run_dir / "config.json").read_text())["task"] == "toy"


def test_a_resumed_run_keeps_the_wall_time_after_its_last_checkpoint(tmp_path):
    """The final evaluation and the final checkpoint's wait come after the checkpoint saves the counters; a run
    resumed from it still counts them, from the summary the earlier segment wrote."""
    from helpers import toy_task
    from helpers.toy_runs import QUIET

    run_dir = tmp_path / "run"
    log = run_dir / runlog.LOG_FILENAME
    assert toy_task.main(["--run-dir", str(run_dir), *QUIET, "--steps", "4", "--eval-seconds", "0.5"]) == 0
    first = runlog.read(log)[-1]
    assert first["evaluation"]["count"] == 1 and first["evaluation"]["time_s"] >= 0.5
    assert toy_task.main(["--resume", str(run_dir), "--steps", "8"]) == 0
    second = runlog.read(log)[-1]
    assert [r["type"] for r in runlog.read(log)].count("summary") == 1
    assert second["evaluation"]["count"] == 2
    assert second["evaluation"]["time_s"] >= first["evaluation"]["time_s"] + 0.5
    assert second["checkpoints"]["count"] > first["checkpoints"]["count"]
    assert (
        second["wall_time_s"] >= first["wall_time_s"] + second["evaluation"]["time_s"] - first["evaluation"]["time_s"]
    )
    named = second["train_time_s"] + sum(second[name]["time_s"] for name in ONE_TIME)
    assert named <= second["wall_time_s"] < named + 0.5


def test_work_after_a_checkpoint_missing_from_an_older_summary_is_left_as_saved():
    from train.costs.windows import Tally
    from train.harness.progress import Counters

    counters = Counters(wall_time_s=10.0, evaluation=Tally(1, 2.0, 3.0))
    counters.add_work_after_checkpoint(
        {"wall_time_s": 14.0, "wall_energy_j": 50.0, "checkpoints": {"count": 2, "time_s": 1.5, "energy_j": None}}
    )
    assert counters.evaluation == Tally(1, 2.0, 3.0)
    assert counters.checkpoints == Tally(2, 1.5, None)
    assert (counters.wall_time_s, counters.wall_energy_j) == (14.0, 50.0)


def test_the_devices_warm_up_on_a_thread_of_their_own():
    """The first program runs on every local device from the warm-up's thread, not the caller's."""
    import jax

    compiled_on = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **_: (
            compiled_on.append(threading.current_thread().name)
            if event == "/jax/core/compile/backend_compile_duration"
            else None
        )
    )
    thread = startup.warm_up_devices()
    assert thread is not threading.current_thread()
    thread.join(timeout=60)
    assert not thread.is_alive() and "warm-up-devices" in compiled_on
