"""One run per run directory (`train.records.lock`, `train.records.rundir`), with real processes of the toy task:
two runs started at once into one directory, a start refused a live directory, a killed holder, and starts that
fail before training leaving no directory behind."""

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers.toy_runs import QUIET, REPO, saved_steps, start, wait_for_line

from train.records import runlog
from train.records.lock import LOCK_FILENAME


def snapshot(directory):
    """Every file under ``directory`` with its bytes and modification time."""
    return {
        path.relative_to(directory): (path.read_bytes(), path.stat().st_mtime_ns)
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def first_to_exit(processes, timeout=240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for process in processes:
            if process.poll() is not None:
                return process
        time.sleep(0.05)
    raise AssertionError(f"none of {len(processes)} processes ended within {timeout} s")


@pytest.mark.slow
def test_two_runs_started_together_into_one_directory_one_trains(tmp_path):
    run_dir = tmp_path / "run"
    # The final evaluation takes a minute, so the run holds the directory until this test kills it.
    first, second = (start(run_dir, "--eval-seconds", "60") for _ in range(2))
    try:
        loser = first_to_exit([first, second])
        holder = second if loser is first else first
        loser_err = loser.stderr.read()
        assert loser.returncode == 2, loser_err
        assert loser_err.splitlines() == [loser_err.strip()]  # one line
        assert loser_err.startswith(f"error: {run_dir} is in use by another run (pid {holder.pid} on ")
        assert "wait for it to end, or choose another --run-dir" in loser_err
        wait_for_line(holder, "evaluating")  # steps taken, checkpoints written

        # A third start, here a --resume, into the live directory changes nothing there.
        before = snapshot(run_dir)
        third = start(None, "--resume", str(run_dir))
        _, third_err = third.communicate(timeout=240)
        assert third.returncode == 2 and third_err.startswith(
            f"error: {run_dir} is in use by another run (pid {holder.pid} on "
        ), third_err
        assert snapshot(run_dir) == before

        holder.send_signal(signal.SIGKILL)  # dies holding the lock: the kernel releases it
        holder.wait(timeout=60)
    finally:
        for process in (first, second):
            if process.poll() is None:
                process.kill()
                process.wait()
            process.stderr.close()
            process.stdout.close()

    records = runlog.read(run_dir / runlog.LOG_FILENAME)
    assert [record["type"] for record in records].count("run") == 1
    assert [record["step"] for record in records if record["type"] == "interval"] == [1, 2, 3, 4, 5, 6]
    assert saved_steps(run_dir) == [2, 4, 6]
    assert str(holder.pid) in (run_dir / LOCK_FILENAME).read_text()  # the dead holder's lock file stays

    resumed = start(None, "--resume", str(run_dir), "--eval-seconds", "0")
    _, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err
    records = runlog.read(run_dir / runlog.LOG_FILENAME)
    assert [record["type"] for record in records].count("run") == 1
    assert records[-1]["type"] == "summary" and records[-1]["completed"] and records[-1]["steps"] == 6


def test_a_start_that_fails_before_training_leaves_no_new_directory(tmp_path):
    made = tmp_path / "runs" / "new"
    given = tmp_path / "given"
    given.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'tests'}{os.pathsep}{REPO}", "LS_JAX_MEMORY_LIMIT": "100B"}
    for run_dir in (made, given):  # the memory check fails after the directory was claimed
        done = subprocess.run(
            [sys.executable, "-m", "helpers.toy_task", "--run-dir", str(run_dir), *QUIET],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("error: ") and len(done.stderr.splitlines()) == 1, done.stderr
    assert not (tmp_path / "runs").exists()  # made by the start, parents included: removed
    assert given.is_dir() and list(given.iterdir()) == [given / LOCK_FILENAME]  # the user's: kept


def test_a_new_run_refuses_a_directory_of_other_files_and_leaves_it_as_it_was(tmp_path):
    given = tmp_path / "notes"
    given.mkdir()
    for name in ("todo.txt", "data.csv", "plots", "b.txt"):
        (given / name).write_text(name)
    (given / ".hidden").write_text("")
    before = snapshot(given)
    done = subprocess.run(
        [sys.executable, "-m", "helpers.toy_task", "--run-dir", str(given), *QUIET],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": f"{REPO / 'tests'}{os.pathsep}{REPO}"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"error: --run-dir {given} holds files that are not a run's (b.txt, data.csv, plots and 1 more); a new run "
        "needs a new or empty directory: pass another --run-dir\n"
    )
    assert snapshot(given) == before  # nothing written there, no lock file either


def test_the_run_directory_names_every_file_the_tools_write_there():
    from train.data import tokenizer
    from train.gpt import samples
    from train.harness import training
    from train.records import rundir
    from train.sweep import runner

    assert {
        tokenizer.MODEL_FILENAME,
        samples.SAMPLES_FILENAME,
        training.PROFILE_DIR,
        runner.MARKER,
    } <= rundir.RUN_ENTRIES
