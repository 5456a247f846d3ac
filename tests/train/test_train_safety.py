"""Faults a run must survive without losing its checkpoints or its run log, through the real harness on a toy
task (`helpers.toy_task`): a finished run resumed, a non-finite update, signals outside the step loop, a full
disk, damaged checkpoint files."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import toy_task
from helpers.toy_runs import QUIET, REPO, saved_steps, signal_at_line, start

from train.harness.training import format_rate, throughput
from train.records import runlog


def saved_params(run_dir, step):
    restored = ocp.StandardCheckpointer().restore(Path(run_dir).resolve() / "checkpoints" / str(step) / "state")
    return [np.asarray(leaf) for leaf in jax.tree.leaves(restored["params"])]


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


def test_a_run_log_whose_last_line_a_kill_cut_short_resumes(tmp_path, capsys):
    """A process killed while writing leaves a partial last line: the resume drops it and goes on."""
    run_dir = tmp_path / "run"
    assert toy_task.main(["--run-dir", str(run_dir), *QUIET, "--steps", "4"]) == 0
    path = run_dir / runlog.LOG_FILENAME
    text = path.read_text()
    path.write_text(text[: len(text) - len(text.splitlines()[-1]) // 2 - 1])  # half of the summary record
    capsys.readouterr()
    assert toy_task.main(["--resume", str(run_dir), "--steps", "6"]) == 0
    records = runlog.read(path)
    assert [r["step"] for r in records if r["type"] == "interval"] == list(range(1, 7))
    assert records[-1]["type"] == "summary" and records[-1]["completed"] and records[-1]["steps"] == 6
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith(runlog.LOG_FILENAME)) == [runlog.LOG_FILENAME]


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda data: data.replace(b'"type": "interval"', b'"type": \x99"interval"', 1), "not a UTF-8 text file"),
        (lambda data: data.replace(b'"type": "interval"', b'"type": #"interval"', 1), ":2: not valid JSON"),
    ],
    ids=["flipped bytes", "a broken line"],
)
def test_a_damaged_run_log_stops_a_resume_with_one_line(damage, message, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert toy_task.main(["--run-dir", str(run_dir), *QUIET, "--steps", "4"]) == 0
    path = run_dir / runlog.LOG_FILENAME
    path.write_bytes(damage(path.read_bytes()))
    damaged = path.read_bytes()
    capsys.readouterr()
    assert toy_task.main(["--resume", str(run_dir), "--steps", "6"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}") and message in err and err.count("\n") == 1, err
    assert path.read_bytes() == damaged


def test_the_last_step_closes_an_interval_so_the_final_loss_is_the_last_steps(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert toy_task.main(["--run-dir", str(run_dir), *QUIET, "--steps", "5", "--log-every", "2"]) == 0
    records = runlog.read(run_dir / runlog.LOG_FILENAME)
    intervals = [r for r in records if r["type"] == "interval"]
    assert [r["step"] for r in intervals] == [2, 4, 5]
    assert records[-1]["final_loss"] == intervals[-1]["loss"]
    assert f"final loss  {intervals[-1]['loss']:.4f}" in capsys.readouterr().out


def test_profile_steps_past_the_last_step_are_named(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert toy_task.main(["--run-dir", str(run_dir), *QUIET, "--steps", "4", "--profile-steps", "6:9"]) == 0
    assert (
        "warning: --profile-steps 6:9 ends after the run's last step, 4: nothing is traced" in capsys.readouterr().err
    )
    assert not (run_dir / "profile").exists()


def test_a_resume_names_the_flags_it_changes(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert toy_task.main(["--run-dir", str(run_dir), *QUIET, "--steps", "2"]) == 0
    capsys.readouterr()
    flags = ["--steps", "4", "--grad-bucket-mb", "0.5", "--grad-comm-dtype", "bf16", "--keep-checkpoints", "3"]
    assert toy_task.main(["--resume", str(run_dir), *flags]) == 0
    resumed = [line for line in capsys.readouterr().err.splitlines() if line.startswith("resuming")]
    assert resumed == [  # --keep-checkpoints 3 is what the run had
        f"resuming {run_dir} at step 2 with --grad-bucket-mb 0.5 (was 25.0), --grad-comm-dtype bf16 (was default)"
    ]


def test_a_non_finite_update_is_never_checkpointed(tmp_path, capsys):
    run_dir = tmp_path / "run"
    # Step 4's loss is finite, its update (learning rate NaN) is not.
    code = toy_task.main(
        [
            "--run-dir",
            str(run_dir),
            *QUIET,
            "--steps",
            "10",
            "--checkpoint-every",
            "1",
            "--keep-checkpoints",
            "10",
            "--nan-lr-from",
            "3",
            "--log-every",
            "100",
        ]
    )
    err = capsys.readouterr().err
    assert code == 4, err
    assert saved_steps(run_dir) == [1, 2, 3]
    for step in saved_steps(run_dir):
        assert all(np.isfinite(p).all() for p in saved_params(run_dir, step)), step
    assert "the last good checkpoint is checkpoint 3 " in err
    summary = runlog.read(run_dir / runlog.LOG_FILENAME)[-1]
    assert summary["stop_reason"] == "nan" and summary["steps"] == 3
    assert "  resume " not in capsys.readouterr().out + err  # the error line says how to go on, with other flags


def edited_config(run_dir, **fields):
    config = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**config, **fields}))


def test_a_hand_edited_config_is_checked_like_its_flags(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert toy_task.main(["--run-dir", str(run_dir), *QUIET, "--steps", "2", "--checkpoint-every", "1"]) == 0
    path = run_dir / "config.json"
    saved = json.loads(path.read_text())
    cases = [
        ([1, 2, 3], "holds a JSON list, not a run's saved configuration (an object of flag values)"),
        ({**saved, "steps": "x"}, ": steps is 'x', not an integer or null; correct it there, or give --steps"),
        ({**saved, "lr": True}, ": lr is True, not a number; correct it there, or give --lr"),
        ({**saved, "lr": -1.0}, ": --lr must be a finite number > 0, got -1.0 (saved there; correct it, or give --lr)"),
    ]
    for content, message in cases:
        path.write_text(json.dumps(content))
        capsys.readouterr()
        code = toy_task.main(["--resume", str(run_dir)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and err == [f"error: {path}{'' if message[0] == ':' else ' '}{message}"], err
    path.write_text(json.dumps({**saved, "steps": "banana"}))  # a flag given now replaces the saved value
    assert toy_task.main(["--resume", str(run_dir), "--steps", "3", "--log-every", "1"]) == 0


def test_a_resume_stays_in_its_own_directory(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert toy_task.main(["--run-dir", str(run_dir), *QUIET, "--steps", "2"]) == 0
    config = (run_dir / "config.json").read_text()
    capsys.readouterr()
    assert toy_task.main(["--resume", str(run_dir), "--run-dir", str(tmp_path / "other"), "--steps", "3"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --run-dir {tmp_path / 'other'} with --resume {run_dir}: a resumed run goes on in its own directory; "
        "drop --run-dir"
    )
    assert (run_dir / "config.json").read_text() == config and not (tmp_path / "other").exists()
    assert toy_task.main(["--resume", str(run_dir), "--run-dir", str(run_dir), "--steps", "3"]) == 0


def test_sigterm_during_the_final_evaluation_saves_and_resumes_into_it(tmp_path):
    run_dir = tmp_path / "run"
    process = start(run_dir, "--steps", "4", "--checkpoint-every", "100", "--eval-seconds", "60")
    err, code = signal_at_line(process, "evaluating")
    assert code == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and f"--resume {run_dir}" in err
    summary = runlog.read(run_dir / runlog.LOG_FILENAME)[-1]
    assert summary["type"] == "summary" and summary["stop_reason"] == "signal" and summary["steps"] == 4
    assert saved_steps(run_dir) == [4]
    assert toy_task.main(["--resume", str(run_dir), "--eval-seconds", "0"]) == 0  # finishes the evaluation
    records = runlog.read(run_dir / runlog.LOG_FILENAME)
    assert records[-1]["completed"] and records[-2]["type"] == "eval" and records[-2]["step"] == 4


@pytest.mark.parametrize("signum, again", [(signal.SIGTERM, "--run-dir"), (signal.SIGINT, "--resume")])
def test_a_run_stopped_while_compiling_starts_again_from_step_0(tmp_path, capsys, signum, again):
    run_dir = tmp_path / "run"
    process = start(run_dir, "--steps", "1000000", "--checkpoint-every", "1000000", "--log-every", "1000000")
    err, code = signal_at_line(process, "compiling the training step", signum)
    assert code == 128 + signum, err
    assert "Traceback" not in err
    summary = runlog.read(run_dir / runlog.LOG_FILENAME)[-1]
    assert summary["type"] == "summary" and summary["stop_reason"] == "signal" and not summary["completed"]
    assert summary["steps"] == 0 and saved_steps(run_dir) == []
    assert (
        f"no checkpoint was written yet; start it again from step 0 with: python -m train.toy --resume {run_dir}" in err
    )

    capsys.readouterr()
    flags = ["--resume", str(run_dir)] if again == "--resume" else ["--run-dir", str(run_dir), *QUIET]
    assert toy_task.main([*flags, "--steps", "4", "--log-every", "1", "--checkpoint-every", "2"]) == 0
    assert f"{run_dir}: its run stopped before its first checkpoint; starting it again from step 0" in (
        capsys.readouterr().err
    )
    records = runlog.read(run_dir / runlog.LOG_FILENAME)
    assert [r["type"] for r in records].count("run") == 1
    assert [r["step"] for r in records if r["type"] == "interval"] == [1, 2, 3, 4]
    assert records[-1]["completed"] and records[-1]["steps"] == 4 and saved_steps(run_dir) == [2, 4]


def test_a_full_disk_stops_the_run_with_one_line(small_disk):
    run_dir = small_disk / "run"
    process = start(
        run_dir, "--steps", "100000", "--checkpoint-every", "1", "--keep-checkpoints", "100000", "--log-every", "100000"
    )
    _, err = process.communicate(timeout=600)
    assert process.returncode == 5, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "the disk is full" in errors[0] and "MiB free" in errors[0], err
    summary = runlog.read(run_dir / runlog.LOG_FILENAME)[-1]
    assert summary["type"] == "summary" and summary["stop_reason"] == "io_error"
    steps = saved_steps(run_dir)
    failed = int(errors[0].split("cannot write checkpoint ")[1].split()[0])
    assert failed == steps[-1] + 1  # the one after the last complete checkpoint
    # Checkpoints are written while training goes on: the run stops at the save after the failed one at the latest.
    assert summary["steps"] in (failed, failed + 1)
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


@pytest.mark.parametrize("verbose", [False, True])
def test_a_damaged_checkpoint_is_one_warning_naming_its_file_and_error(tmp_path, verbose):
    run_dir = tmp_path / "run"
    assert toy_task.main(["--run-dir", str(run_dir), *QUIET, "--steps", "6"]) == 0
    step_dir = run_dir / "checkpoints" / "6"
    (step_dir / "_CHECKPOINT_METADATA").write_text("garbage")  # orbax logs an error, then reads on without it
    data_files = list((step_dir / "state" / "d").iterdir())
    for path in data_files:
        path.write_bytes(path.read_bytes()[:10])
    process = start(None, "--resume", str(run_dir), "--steps", "8", *(["--verbose"] if verbose else []))
    _, err = process.communicate(timeout=240)
    assert process.returncode == 0, err
    lines = err.splitlines()
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"warning: skipping checkpoint 6 in {run_dir.resolve()}/checkpoints: its arrays cannot be read: ValueError: "
    )
    assert any(str(path) in warnings[0] for path in data_files) and "byte range" in warnings[0], warnings[0]
    assert "Traceback" not in err and "Exception ignored" not in err
    assert ("ERROR:absl:Failed to json parse Metadata file" in err) == verbose
    moved = f"moved the damaged checkpoint 6 to {run_dir.resolve()}/damaged-checkpoints/6"
    assert (lines[:3] == [warnings[0], moved, f"resuming {run_dir} at step 4"]) != verbose  # quiet: nothing before


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_learning_rate_is_one_line(value, capsys):
    assert toy_task.main([f"--lr={value}", *QUIET]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --lr must be a finite number > 0, got {float(value)}"


def test_evaluations_during_training_are_one_line_each(tmp_path, capsys):
    assert toy_task.main(["--run-dir", str(tmp_path / "run"), *QUIET, "--eval-every", "2"]) == 0
    out, err = capsys.readouterr()
    evaluations = [line for line in err.splitlines() if "evaluation:" in line]
    assert evaluations == ["step 2/6  evaluation: valid loss 1.000", "step 4/6  evaluation: valid loss 1.000"]
    assert "  final loss  " in out and "loss valid 1.000" in out  # the final evaluation is in the summary


@pytest.mark.parametrize(
    "value, text",
    [(28821.4, "28,821"), (24109.0, "24,109"), (412.0, "412"), (41.27, "41.3"), (0.5, "0.5"), (None, "n/a")],
)
def test_throughput_has_one_format_for_every_task(value, text):
    assert format_rate(value) == text
    assert throughput(("tokens", "target_tokens"), {"tokens_per_s": value, "target_tokens_per_s": value}) == (
        f"{text} tokens/s, {text} target tokens/s"
    )


def test_without_a_terminal_progress_is_one_line_per_interval(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'tests'}{os.pathsep}{REPO}"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "helpers.toy_task",
            "--run-dir",
            str(tmp_path / "run"),
            "--no-tensorboard",
            "--steps",
            "6",
            "--log-every",
            "2",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        timeout=240,
    )  # bytes: text mode reads \r as \n
    err = done.stderr.decode()
    assert done.returncode == 0, err
    assert b"\r" not in done.stderr + done.stdout  # a bar redrawing itself
    lines = [line for line in err.split("\n") if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/6", "4/6", "6/6"], err
    assert all(" loss " in line and " s/step" in line for line in lines)
