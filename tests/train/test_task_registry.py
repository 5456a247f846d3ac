"""A new task is its package and one line in `train.tasks`: registered there, the toy task of tests/helpers runs,
the sweep takes it as an axis value (its own flags checked by its own parser) and train.compare scores its runs by
its own quality metric."""

import contextlib
import io

import pytest
from helpers import toy_task

from train.compare import report
from train.errors import UsageError
from train.records import runlog
from train.sweep import spec as sweep_spec
from train.tasks import TASKS

SPEC = """
name = "toy"
out = "{out}"
[axes]
task = "toy"
[flags]
no_tensorboard = true
no_progress = true
[[grid]]
steps = [2, 4]
"""


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(TASKS, "toy", toy_task.TASK)


def test_the_sweep_takes_a_registered_task_and_checks_its_flags(registered, tmp_path):
    spec = sweep_spec.parse(SPEC.format(out=tmp_path / "out"))
    points = sweep_spec.points(spec)
    assert [point.values["steps"] for point in points] == [2, 4]
    for point in points:
        sweep_spec.check_command(point, spec.flags, "toy.toml")
    with pytest.raises(UsageError, match="train.toy .*--eval-seconds"):
        sweep_spec.check_command(points[0], {**spec.flags, "eval_seconds": "soon"}, "toy.toml")


def test_an_unregistered_task_is_refused_with_the_known_ones(tmp_path):
    with pytest.raises(UsageError, match="task = 'toy' is not a known value; choose from imdb, wmt, gpt"):
        sweep_spec.points(sweep_spec.parse(SPEC.format(out=tmp_path / "out")))


def test_compare_scores_a_registered_tasks_runs_by_its_metric(registered, tmp_path):
    logs = []
    for steps in (2, 4):
        run_dir = tmp_path / f"run{steps}"
        with contextlib.redirect_stdout(io.StringIO()):
            flags = ["--run-dir", str(run_dir), "--steps", str(steps), "--no-progress", "--no-tensorboard"]
            assert toy_task.main(flags) == 0
        logs.append(str(run_dir / runlog.LOG_FILENAME))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert report.main([*logs, "--out", str(tmp_path / "report")]) == 0
    text = (tmp_path / "report" / "report.md").read_text()
    # The toy task's metric is its validation loss, lower is better: the table's quality column and the gate say so.
    assert "| loss | quality gate |" in text
    assert "ranked only when its final loss at most inf" in text
