"""A run resumed with a longer ``--steps`` goes on from the learning rate it had (`train.harness.optimizer.continued`),
through the real harness on the toy task with GPT's schedule (warmup, then linear decay to 0 at --steps)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import toy_task
from helpers.toy_runs import QUIET

from train.harness.optimizer import continued, linear_warmup_decay
from train.records import runlog

PEAK = 0.05


def interval_rates(run_dir):
    """The learning rate each logged step trained with, by step."""
    return {r["step"]: r["lr"] for r in runlog.read(run_dir / runlog.LOG_FILENAME) if r["type"] == "interval"}


def test_continued_moves_from_the_saved_rate_into_the_new_schedule():
    plan = linear_warmup_decay(PEAK, 2, 40)
    moved = continued(plan, (10, 0.0), 40)  # a run that finished a 10-step decay, extended to 40 steps
    rates = [float(moved(step)) for step in range(41)]
    assert rates[:10] == pytest.approx([float(plan(step)) for step in range(10)])
    assert rates[10] == 0.0  # no jump: it goes on from the rate it had
    assert rates[10:14] == pytest.approx(np.linspace(0.0, float(plan(13)), 4))  # over a tenth of the 30 steps left
    assert rates[13:] == pytest.approx([float(plan(step)) for step in range(13, 41)])
    assert continued(plan, None, 40) is plan


def test_a_finished_linear_decay_extended_goes_on_without_a_jump_and_resumes_exactly(tmp_path, capsys):
    run_dir = tmp_path / "run"
    flags = [
        "--linear-decay",
        "--lr",
        str(PEAK),
        "--warmup-steps",
        "2",
        "--checkpoint-every",
        "2",
        "--keep-checkpoints",
        "100",
    ]
    assert toy_task.main(["--run-dir", str(run_dir), *QUIET, *flags, "--steps", "10"]) == 0
    before = interval_rates(run_dir)
    assert before[10] == pytest.approx(float(linear_warmup_decay(PEAK, 2, 10)(9)))
    capsys.readouterr()

    assert toy_task.main(["--resume", str(run_dir), "--steps", "40"]) == 0
    assert (
        f"resuming {run_dir} at step 10; its learning rate goes on from 0 into the schedule of --steps 40"
        in capsys.readouterr().err
    )
    extended = interval_rates(run_dir)
    plan = linear_warmup_decay(PEAK, 2, 40)
    assert {step: extended[step] for step in range(1, 11)} == before  # the first 10 steps are as they were
    assert extended[11] == 0.0  # step 11 trains at the rate step 10's schedule left off with, not plan(10)
    assert float(plan(10)) > 0.4 * PEAK  # what restarting the schedule would have jumped to
    assert [extended[step] for step in range(11, 15)] == pytest.approx(np.linspace(0.0, float(plan(13)), 4))
    assert [extended[step] for step in range(15, 41)] == pytest.approx([float(plan(s - 1)) for s in range(15, 41)])
    assert json.loads((run_dir / "config.json").read_text())["lr_transition"] == [10, 0.0]

    # Stopped inside the transition (steps 13 on dropped, as a kill would leave it): the same schedule again.
    log = run_dir / runlog.LOG_FILENAME
    for step in range(14, 41, 2):
        (run_dir / "checkpoints" / str(step)).rename(tmp_path / f"dropped-{step}")
    kept = [r for r in runlog.read(log) if r["type"] == "run" or r.get("step", 99) <= 12]
    log.write_text("".join(json.dumps(r) + "\n" for r in kept))
    assert toy_task.main(["--resume", str(run_dir)]) == 0
    assert "its learning rate goes on" not in capsys.readouterr().err
    assert interval_rates(run_dir) == pytest.approx(extended)


def test_a_resume_with_the_same_steps_keeps_the_schedule(tmp_path):
    run_dir = tmp_path / "run"
    flags = ["--linear-decay", "--lr", str(PEAK), "--warmup-steps", "2", "--checkpoint-every", "4"]
    assert toy_task.main(["--run-dir", str(run_dir), *QUIET, *flags, "--steps", "12"]) == 0
    straight = interval_rates(run_dir)
    for path in (run_dir / "checkpoints").iterdir():
        if path.name in ("8", "12"):
            path.rename(run_dir / f"dropped-{path.name}")
    log = run_dir / runlog.LOG_FILENAME
    log.write_text(
        "".join(json.dumps(r) + "\n" for r in runlog.read(log) if r["type"] == "run" or r.get("step", 99) <= 4)
    )
    assert toy_task.main(["--resume", str(run_dir)]) == 0
    assert interval_rates(run_dir) == pytest.approx(straight)
    assert json.loads((run_dir / "config.json").read_text())["lr_transition"] is None
    assert jnp.isclose(straight[12], linear_warmup_decay(PEAK, 2, 12)(11))
