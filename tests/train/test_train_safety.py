"""Faults a run must survive without losing its checkpoints or its run log, through the real harness on a toy
task (`helpers.toy_task`): a finished run resumed, a non-finite update, signals outside the step loop, a full
disk, damaged checkpoint files."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from helpers import toy_task
from train.records import runlog

REPO = Path(__file__).resolve().parents[2]
QUIET = ["--no-progress", "--no-tensorboard"]


def saved_steps(run_dir):
    return sorted(int(p.name) for p in (Path(run_dir) / "checkpoints").iterdir() if p.name.isdigit())


def saved_params(run_dir, step):
    restored = ocp.StandardCheckpointer().restore(Path(run_dir).resolve() / "checkpoints" / str(step) / "state")
    return [np.asarray(leaf) for leaf in jax.tree.leaves(restored["params"])]


def start(run_dir, *flags):
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'tests'}{os.pathsep}{REPO}"}
    return subprocess.Popen([sys.executable, "-m", "helpers.toy_task", "--run-dir", str(run_dir), *QUIET, *flags],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def signal_at_line(process, line, signum=signal.SIGTERM, timeout=240):
    """Sends ``signum`` once ``process`` has printed ``line`` on stderr; returns (stderr, exit code)."""
    seen = []
    deadline = time.monotonic() + timeout
    for text in process.stderr:
        seen.append(text)
        if line in text:
            process.send_signal(signum)
            break
        assert time.monotonic() < deadline, "".join(seen)
    else:
        pytest.fail(f"{line!r} never printed: {''.join(seen)}")
    rest = process.stderr.read()
    process.wait(timeout=120)
    return "".join(seen) + rest, process.returncode


def test_resume_of_a_finished_run_is_a_no_op_then_extends(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert toy_task.main(["--run-dir", str(run_dir), *QUIET]) == 0
    log = (run_dir / runlog.LOG_FILENAME).read_text()
    capsys.readouterr()
    for flags in ([], ["--steps", "6"], ["--steps", "4"]):
        assert toy_task.main(["--resume", str(run_dir), *flags]) == 0
        assert "nothing to train" in capsys.readouterr().err
        assert (run_dir / runlog.LOG_FILENAME).read_text() == log  # the summary is kept
    assert toy_task.main(["--resume", str(run_dir), "--steps", "9"]) == 0
    records = runlog.read(run_dir / runlog.LOG_FILENAME)
    assert records[-1]["type"] == "summary" and records[-1]["completed"] and records[-1]["steps"] == 9
    assert [r["step"] for r in records if r["type"] == "interval"] == list(range(1, 10))


def test_a_non_finite_update_is_never_checkpointed(tmp_path, capsys):
    run_dir = tmp_path / "run"
    # Step 4's loss is finite, its update (learning rate NaN) is not.
    code = toy_task.main(["--run-dir", str(run_dir), *QUIET, "--steps", "10", "--checkpoint-every", "1",
                          "--keep-checkpoints", "10", "--nan-lr-from", "3", "--log-every", "100"])
    err = capsys.readouterr().err
    assert code == 4, err
    assert saved_steps(run_dir) == [1, 2, 3]
    for step in saved_steps(run_dir):
        assert all(np.isfinite(p).all() for p in saved_params(run_dir, step)), step
    assert "the last good checkpoint is checkpoint 3 " in err
    summary = runlog.read(run_dir / runlog.LOG_FILENAME)[-1]
    assert summary["stop_reason"] == "nan" and summary["steps"] == 3


def test_sigterm_during_the_final_evaluation_saves_and_resumes_into_it(tmp_path):
    run_dir = tmp_path / "run"
    process = start(run_dir, "--steps", "4", "--checkpoint-every", "100", "--eval-seconds", "60")
    err, code = signal_at_line(process, "evaluating")
    assert code == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and f"--resume {run_dir}" in err
    summary = runlog.read(run_dir / runlog.LOG_FILENAME)[-1]
    assert summary["type"] == "summary" and summary["stop_reason"] == "signal" and summary["steps"] == 4
    assert saved_steps(run_dir) == [4]
    assert toy_task.main(["--resume", str(run_dir)]) == 0  # finishes the evaluation
    records = runlog.read(run_dir / runlog.LOG_FILENAME)
    assert records[-1]["completed"] and records[-2]["type"] == "eval" and records[-2]["step"] == 4


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_compilation_ends_with_a_summary(tmp_path, signum):
    run_dir = tmp_path / "run"
    process = start(run_dir, "--steps", "1000000", "--checkpoint-every", "1000000", "--log-every", "1000000")
    err, code = signal_at_line(process, "compiling the training step", signum)
    assert code == 128 + signum, err
    assert "Traceback" not in err
    summary = runlog.read(run_dir / runlog.LOG_FILENAME)[-1]
    assert summary["type"] == "summary" and summary["stop_reason"] == "signal" and not summary["completed"]
    assert saved_steps(run_dir) in ([], [summary["steps"]])  # a checkpoint only once a step was taken


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (needs root); skipped, with the reason, where mounting is not allowed."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_stops_the_run_with_one_line(small_disk):
    run_dir = small_disk / "run"
    process = start(run_dir, "--steps", "100000", "--checkpoint-every", "1", "--keep-checkpoints", "100000",
                    "--log-every", "100000")
    _, err = process.communicate(timeout=600)
    assert process.returncode == 5, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "the disk is full" in errors[0] and "MiB free" in errors[0], err
    summary = runlog.read(run_dir / runlog.LOG_FILENAME)[-1]
    assert summary["type"] == "summary" and summary["stop_reason"] == "io_error"
    steps = saved_steps(run_dir)
    assert summary["steps"] == steps[-1] + 1  # training stopped at the failed save
    assert not [p for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name]  # the partial save is gone


def flip_bytes(path):
    data = bytearray(path.read_bytes())
    for position in range(0, len(data), max(1, len(data) // 8)):
        data[position] ^= 0xFF
    path.write_bytes(bytes(data))


def test_resume_skips_damaged_checkpoints(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert toy_task.main(["--run-dir", str(run_dir), *QUIET, "--steps", "6"]) == 0
    assert saved_steps(run_dir) == [2, 4, 6]
    for path in (run_dir / "checkpoints" / "6" / "state").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            flip_bytes(path)
    progress = run_dir / "checkpoints" / "4" / "progress" / "metadata"
    progress.write_text(progress.read_text()[: len(progress.read_text()) // 2])
    capsys.readouterr()
    assert toy_task.main(["--resume", str(run_dir), "--steps", "8"]) == 0
    err = capsys.readouterr().err
    assert "skipping checkpoint 6" in err and "skipping checkpoint 4" in err and "at step 2" in err
    assert "Traceback" not in err
    records = runlog.read(run_dir / runlog.LOG_FILENAME)
    assert [r["step"] for r in records if r["type"] == "interval"] == list(range(1, 9))
    assert records[-1]["completed"] and records[-1]["steps"] == 8


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_learning_rate_is_one_line(value, capsys):
    assert toy_task.main([f"--lr={value}", *QUIET]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --lr must be a finite number > 0, got {float(value)}"


def test_without_a_terminal_progress_is_one_line_per_interval(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'tests'}{os.pathsep}{REPO}"}
    done = subprocess.run([sys.executable, "-m", "helpers.toy_task", "--run-dir", str(tmp_path / "run"),
                           "--no-tensorboard", "--steps", "6", "--log-every", "2"],
                          cwd=REPO, env=env, capture_output=True, timeout=240)  # bytes: text mode reads \r as \n
    err = done.stderr.decode()
    assert done.returncode == 0, err
    assert b"\r" not in done.stderr + done.stdout  # a bar redrawing itself
    lines = [line for line in err.split("\n") if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/6", "4/6", "6/6"], err
    assert all(" loss " in line and " s/step" in line for line in lines)
