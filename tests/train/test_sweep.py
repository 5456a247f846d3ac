"""`python -m train.sweep`: grid expansion, the run directory of each run, skip and resume, other devices, the
best run of earlier grids, and a clear error for every bad input. Training runs in this process (train.imdb.task.main)
on a tiny model for a few steps."""

import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train.compare import scoring
from train.errors import Interrupted, UsageError
from train.harness.training import run_training
from train.imdb import task as imdb
from train.records import runlog
from train.sweep import runner as sweep
from train.sweep import spec as sweep_spec

COMPARE_DATA = Path(__file__).parents[1] / "data" / "compare"
REPO = Path(__file__).resolve().parents[2]

TINY = """
name = "{name}"
out = "{out}"
[axes]
task = "imdb"
preset = "bert-tiny"
max_seq_len = 16
batch_size = 4
steps = {steps}
[flags]
log_every = 1
checkpoint_every = 1
no_tensorboard = true
vocab_size = 200
[[grid]]
optimizer = ["adan"]
"""


def tiny_spec(tmp_path, steps=2, name="tiny"):
    return sweep_spec.parse(TINY.format(name=name, out=tmp_path / "out", steps=steps))


class InProcess:
    """Runs `python -m train.imdb ...` command lines in this process, recording them."""

    def __init__(self):
        self.commands = []

    def __call__(self, command):
        assert command[:3] == ["python", "-m", "train.imdb"]
        self.commands.append(command)
        with contextlib.redirect_stdout(io.StringIO()):
            return run_training(imdb.TASK, command[3:])


def never(command):
    raise AssertionError(f"nothing should run here, got {command}")


def run(spec, runner, device="cpu"):
    return sweep.run_sweep(spec, device=lambda: device, runner=runner)


# ------------------------------------------------------------------------------------------------ expansion


def test_grid_expands_to_the_product_of_its_axes_plus_common_axes_and_flags():
    spec = sweep_spec.parse("""
name = "grid"
[axes]
task = "imdb"
steps = 10
lr = 1e-3
[flags]
no_tensorboard = true
[[grid]]
optimizer = ["optax-adamw", "adan"]
precision = ["fp32", "bf16", "fp16", "fp8"]
backend = ["xla", "ffi"]
[[grid]]
optimizer = "adan"
precision = "fp32"
backend = "xla"
seed = [1]
[[grid]]
optimizer = "adan"
precision = "fp32"
backend = "xla"
""")
    points = sweep_spec.points(spec)
    assert len(points) == 2 * 4 * 2 + 1  # the third grid's one point is the first grid's: it runs once
    names = [point.name for point in points]
    assert len(set(names)) == len(names)
    assert names[0] == "imdb-optax-adamw-lr0.001-fp32-xla-s10"
    assert points[0].flags(spec.flags) == [
        "--optimizer",
        "optax-adamw",
        "--lr",
        "0.001",
        "--precision",
        "fp32",
        "--backend",
        "xla",
        "--steps",
        "10",
        "--no-tensorboard",
    ]
    assert spec.out == Path("runs/grid")


def test_from_best_fills_the_axes_it_leaves_out():
    spec = sweep_spec.parse("""
name = "best"
[axes]
task = "imdb"
[[grid]]
optimizer = ["optax-adamw", "adan"]
precision = ["fp32", "bf16"]
[[grid]]
batch_size = [16, 64]
from_best = "balance"
""")
    assert len(sweep_spec.points(spec)) == 4  # the best is not known yet
    best = {"task": "imdb", "optimizer": "adan", "precision": "bf16"}
    later = sweep_spec.points(spec, [None, best])[4:]
    assert [point.name for point in later] == ["imdb-adan-bf16-b16", "imdb-adan-bf16-b64"]


def test_each_optimizer_at_its_own_lr_and_from_best_carries_the_best_ones():
    spec = sweep_spec.parse("""
name = "lr"
[axes]
task = "imdb"
[[grid]]
optimizer = "optax-adamw"
lr = 3e-4
precision = ["fp32", "bf16"]
[[grid]]
optimizer = "adan"
lr = [1e-4, 5e-5]
precision = ["fp32", "bf16"]
[[grid]]
batch_size = 64
from_best = "balance"
""")
    names = [point.name for point in sweep_spec.points(spec)]
    assert names == [
        "imdb-optax-adamw-lr0.0003-fp32",
        "imdb-optax-adamw-lr0.0003-bf16",
        "imdb-adan-lr0.0001-fp32",
        "imdb-adan-lr0.0001-bf16",
        "imdb-adan-lr5e-05-fp32",
        "imdb-adan-lr5e-05-bf16",
    ]
    best = sweep_spec.points(spec)[3].values
    (later,) = sweep_spec.points(spec, [None, None, best])[6:]
    assert later.flags({}) == ["--optimizer", "adan", "--lr", "0.0001", "--precision", "bf16", "--batch-size", "64"]


def test_best_point_is_the_best_converged_run_of_the_earlier_grids(tmp_path):
    spec = sweep_spec.parse(f"""
name = "devices"
out = "{tmp_path}"
[axes]
task = "wmt"
[[grid]]
device = ["H100-SXM", "TPU-v3"]
backend = ["ffi", "xla"]
""")
    points = {point.name: point for point in sweep_spec.points(spec)}
    for name, fixture in (
        ("wmt-H100-SXM-ffi", "h100-ffi"),
        ("wmt-H100-SXM-xla", "h100-xla"),
        ("wmt-TPU-v3-xla", "tpu-v3-8"),
    ):
        (tmp_path / name).mkdir()
        shutil.copy(COMPARE_DATA / fixture / "run.jsonl", tmp_path / name / "run.jsonl")
    # The fixtures' balance ranking: the H100 with the fused kernels first (tests/train/test_compare.py).
    assert sweep.best_point(spec, list(points.values()), "balance") == points["wmt-H100-SXM-ffi"].values
    # When best_point finds none: whether running the sweep again can change that.
    assert sweep._no_best(spec, list(points.values()), "balance").startswith(
        "none of the 3 finished runs of the grids before it passed the quality gate"
    )
    assert sweep._no_best(spec, [points["wmt-TPU-v3-ffi"]], "balance").startswith(
        "no run of the grids before it has finished here yet"
    )


def test_a_list_in_flags_repeats_a_flag_the_task_takes_more_than_once():
    spec = sweep_spec.parse('name = "x"\n[axes]\ntask = "gpt"\n[flags]\nprompt = ["Once upon", "The end"]')
    (point,) = sweep_spec.points(spec)
    assert point.flags(spec.flags)[-4:] == ["--prompt", "Once upon", "--prompt", "The end"]


@pytest.mark.parametrize(
    "text, message",
    [
        (
            'name = "x"\n[axes]\ntask = "imdb"\noptimizer = "adamx"',
            "optimizer = 'adamx' is not a known value; choose from",
        ),
        ('name = "x"\n[axes]\ntask = "imdb"\nprecison = "fp32"', "unknown axis 'precison'"),
        ('name = "x"\n[axes]\ntask = "imdb"\n[[grid]]\nseed = []', "axis 'seed' has no values"),
        ('name = "x"\ngrid = []', "the grid is empty"),
        ('name = "x"\n[axes]\ntask = "imdb"\nsteps = 0', "steps = 0 must be an integer >= 1"),
        ('name = "x"\n[axes]\ntask = "wmt"\nbatch_size = 8', "axis batch_size is not a flag of train.wmt"),
        ('name = "x"\n[[grid]]\noptimizer = "adan"', "no task"),
        ('name = "x"\n[axes]\ntask = "imdb"\n[[grid]]\nfrom_best = "balance"', "needs a grid before it"),
        ('name = "x"\n[axes]\ntask = "imdb"\n[flags]\nsteps = 3', "[flags] sets 'steps'"),
        ('name = "x"\n[axes]\ntask = "imdb"\n[flags]\nlr = 1e-3', "[flags] sets 'lr', which the sweep sets itself"),
        ('name = "x"\n[axes]\ntask = "imdb"\n[flags]\nrun_dir = "a"', "gives every run a directory of its own"),
        (
            'name = "x"\n[axes]\ntask = "imdb"\n[flags]\nvocab_size = [100, 200]',
            "train.imdb takes --vocab-size once; [flags] gives it a list, [100, 200]",
        ),
        (
            'name = "x"\n[axes]\ntask = "gpt"\n[flags]\nprompt = {a = 1}',
            "[flags]: prompt = {'a': 1}; a flag takes a string, number or true/false, or a list",
        ),
        ('name = "x"\n[axes]\ntask = "imdb"\nlr = 0', "lr = 0 must be a number > 0"),
        ('name = "x"\n[axes]\ntask = "imdb"\nlr = "fast"', "lr = 'fast' must be a number > 0"),
        ('name = "x"\n[axes\n', "not valid TOML"),
        ('[axes]\ntask = "imdb"', 'no name; add one, e.g. name = "my-sweep"'),
        ("", "the sweep spec is empty: a sweep spec needs a name and a task"),
        (
            'name = "x"\n[axes]\ntask = "imdb"\n[flags]\nvocab_sise = 200',
            "[[grid]] #1 (imdb): train.imdb unrecognized arguments: --vocab-sise 200",
        ),
        (
            'name = "x"\n[axes]\ntask = "gpt"\n[flags]\nvocab_size = "many"',
            "train.gpt argument --vocab-size: invalid int value: 'many'",
        ),
        ('name = "x"\n[axes]\ntask = "imdb"\n[flags]\nvocab_size = 0', "train.imdb --vocab-size must be >= 1, got 0"),
        ('name = "x"\nweights = "fastest"\n[axes]\ntask = "imdb"', "weights: 'fastest' is neither a preset"),
        ('name = "x"\nweights = [1, 2]\n[axes]\ntask = "imdb"', "weights: '1,2' is neither a preset"),
        ('name = "x"\nweights = [0, 0, 0, 1]\n[axes]\ntask = "imdb"', "at least one of time, cost, energy"),
    ],
)
def test_bad_specs_are_one_clear_line(text, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        sweep_spec.points(sweep_spec.parse(text))


def test_cli_reports_bad_spec_and_missing_file(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[axes]\ntask = "imdb"\nbackend = "cuda"\n')
    assert sweep.main([str(bad)], runner=never) == 2
    assert "error: " in (err := capsys.readouterr().err) and "backend = 'cuda' is not a known value" in err
    assert sweep.main([str(tmp_path / "none.toml")], runner=never) == 2
    assert "no such sweep spec file" in capsys.readouterr().err


def test_a_binary_spec_and_an_unknown_flag_are_one_line_before_any_run(tmp_path, capsys):
    binary = tmp_path / "spec.toml"
    binary.write_bytes(bytes(range(256)))
    assert sweep.main([str(binary)], runner=never) == 2
    assert capsys.readouterr().err == f"error: {binary} is not a sweep spec: not UTF-8 text, so not TOML\n"
    typo = tmp_path / "typo.toml"
    typo.write_text(TINY.format(name="typo", out=tmp_path / "out", steps=2).replace("log_every", "log_evry"))
    assert sweep.main([str(typo)], runner=never) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrecognized arguments: --log-evry 1" in err and "usage:" not in err
    assert not (tmp_path / "out").exists()


def test_spec_weights_score_the_report(tmp_path):
    spec = sweep_spec.parse(
        TINY.format(name="w", out=tmp_path / "out", steps=2).replace(
            'name = "w"', 'name = "w"\nweights = [0.5, 0.5, 0, 0]'
        )
    )
    assert spec.weights == "0.5,0.5,0,0" and sweep_spec.parse(TINY.format(name="d", out="o", steps=2)).weights == (
        "balance"
    )
    for name in ("h100-ffi", "h100-xla"):
        (spec.out / name).mkdir(parents=True)
        shutil.copy(COMPARE_DATA / name / "run.jsonl", spec.out / name / "run.jsonl")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert sweep.report(spec, ["h100-ffi", "h100-xla"]) == 0
    assert (
        "Weights `custom` (time 0.5, cost 0.5, energy 0, utilization 0)"
        in (spec.out / "report" / "report.md").read_text()
    )


def test_spec_quality_threshold_gates_the_best_run_and_the_report(tmp_path):
    text = f'name = "q"\nout = "{tmp_path}"\nquality_threshold = 1000\n[axes]\ntask = "wmt"\n'
    text += '[[grid]]\nbackend = ["ffi", "xla"]'
    spec = sweep_spec.parse(text)
    assert spec.quality_threshold == 1000.0
    points = sweep_spec.points(spec)
    for point, fixture in zip(points, ("h100-ffi", "h100-xla")):
        (tmp_path / point.name).mkdir()
        shutil.copy(COMPARE_DATA / fixture / "run.jsonl", tmp_path / point.name / "run.jsonl")
    assert sweep.best_point(spec, points, "balance") is None  # no BLEU reaches 1000
    lenient = dataclasses.replace(spec, quality_threshold=None)
    assert sweep.best_point(lenient, points, "balance") == points[0].values
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        sweep.report(spec, [point.name for point in points])
    assert "1000" in (tmp_path / "report" / "report.md").read_text()
    for bad in ("-1", "nan", '"high"'):
        with pytest.raises(UsageError, match="quality_threshold = .* must be a number >= 0"):
            sweep_spec.parse(text.replace("quality_threshold = 1000", f"quality_threshold = {bad}"))


def test_a_failed_run_without_a_log_is_named_as_such(tmp_path, capsys):
    spec = tiny_spec(tmp_path)
    assert run(spec, lambda command: 3) == 1
    err = capsys.readouterr().err
    assert "imdb-bert-tiny-adan-b4-l16-s2 (exit code 3, no run log: it stopped before training" in err
    assert "their logs are in" not in err


def test_a_run_stopped_by_a_signal_before_its_first_checkpoint_says_so(tmp_path, capsys):
    with pytest.raises(Interrupted):
        sweep.run_sweep(tiny_spec(tmp_path), device=lambda: "cpu", runner=lambda command: 128 + signal.SIGINT)
    out = capsys.readouterr().out
    assert "stopped by a signal, before its first checkpoint" in out and "kept" not in out


def test_device_in_out_is_this_machines_device():
    spec = sweep_spec.parse('name = "x"\nout = "docs/results/sweep-{device}"\n[axes]\ntask = "imdb"')
    assert sweep.with_device_in_out(spec, lambda: "H100-SXM").out == Path("docs/results/sweep-h100-sxm")


GPU_SPEC = sweep.DEFAULT_SPEC.parent / "bert-gpu.toml"


def test_the_gpu_spec_is_the_studys_grid_on_bert_base():
    """implementation x optimizer on bert-base at 512 tokens in bf16, then fp16, fp32 and fp8, ls_jax's XLA path
    and batch 16 and 8 for the best run of the grids before."""
    spec = sweep.load_spec(GPU_SPEC)
    first = sweep_spec.points(spec)  # what runs before any best is known
    assert [(p.values["implementation"], p.values["optimizer"]) for p in first] == [
        ("ls_jax", "optax-adamw"),
        ("ls_jax", "adan"),
        ("flax", "optax-adamw"),
        ("flax", "adan"),
    ]
    for point in first:
        assert (
            point.task,
            point.values["preset"],
            point.values["max_seq_len"],
            point.values["batch_size"],
            point.values["precision"],
            point.values["epochs"],
        ) == ("imdb", "bert-base", 512, 32, "bf16", 1)
    assert [grid.from_best for grid in spec.grids] == [None, "balance", "balance", "balance"]
    best = {**first[1].values}
    later = sweep_spec.points(spec, [None, best, best, best])[4:]
    assert [
        (p.values["implementation"], p.values["precision"], p.values.get("backend"), p.values["batch_size"])
        for p in later
    ] == [
        ("ls_jax", "fp16", None, 32),
        ("ls_jax", "fp32", None, 32),
        ("ls_jax", "fp8", None, 32),
        ("flax", "fp16", None, 32),
        ("flax", "fp32", None, 32),
        ("flax", "fp8", None, 32),
        ("ls_jax", "bf16", "xla", 32),
        ("ls_jax", "bf16", None, 16),
        ("ls_jax", "bf16", None, 8),
    ]
    assert all(p.values["optimizer"] == "adan" and p.values["max_seq_len"] == 512 for p in later)
    assert "--implementation" in first[0].flags(spec.flags) and "--no-tensorboard" in first[0].flags(spec.flags)


def test_the_gpu_spec_dry_run_lists_its_runs(tmp_path, capsys):
    assert (
        sweep.main([str(GPU_SPEC), "--device", "H100-SXM", "--out", str(tmp_path / "out"), "--dry-run"], runner=never)
        == 0
    )
    out = capsys.readouterr().out
    runs = [line for line in out.splitlines() if ": would run python -m train.imdb " in line]
    assert len(runs) == 4 and runs[0].startswith("[1/4] imdb-bert-base-ls_jax-optax-adamw-")
    assert all("--preset bert-base" in line and "--max-seq-len 512" in line for line in runs)
    assert {line.split("--implementation ")[1].split()[0] for line in runs} == {"flax", "ls_jax"}
    assert out.count("no run of the grids before it has finished here yet") == 3
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_default_spec_parses_and_expands_to_a_small_cpu_grid():
    spec = sweep.load_spec(None)
    points = sweep_spec.points(spec)
    assert len(points) == 4 and {point.task for point in points} == {"imdb"}
    assert {(point.values["optimizer"], point.values["batch_size"]) for point in points} == {
        ("optax-adamw", 16),
        ("adan", 16),
        ("optax-adamw", 32),
        ("adan", 32),
    }
    assert all(point.values["backend"] == "xla" and point.device is None for point in points)
    # Every run trains on the same examples: batch x steps is one number.
    assert {point.values["batch_size"] * point.values["steps"] for point in points} == {4800}


def test_from_best_takes_the_studys_names_and_the_earlier_ones():
    spec = sweep_spec.parse(
        'name = "x"\n[axes]\ntask = "imdb"\n[[grid]]\nseed = 0\n[[grid]]\nseed = 1\nfrom_best = "cost_time"'
    )
    assert spec.grids[1].from_best == "cost_time_energy"
    with pytest.raises(
        UsageError, match="from_best = 'fastest' is not a weight preset; choose from balance, time_cost_energy"
    ):
        sweep_spec.parse('name = "x"\n[axes]\ntask = "imdb"\n[[grid]]\nseed = 0\n[[grid]]\nfrom_best = "fastest"')


@pytest.mark.slow
def test_the_default_sweep_recommends_one_run_per_strategy_in_under_ten_minutes(tmp_path):
    """`python -m train.sweep` with no arguments, as a user runs it: its own process, a fresh directory, a CPU."""
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "train.sweep"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=900,
        check=False,
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-3000:]
    assert elapsed < 600, f"the default sweep took {elapsed:.0f} s"
    out = result.stdout
    assert "Warm-up and steady state:" in out and "| rank |" in out
    recommendations = out.split("Recommendation:\n")[1].split("\n\n")[0].splitlines()
    assert [line.split(":")[0].strip() for line in recommendations] == list(scoring.WEIGHT_PRESETS)
    for line in recommendations:
        best = r": #[1-4] \(cpu x1 ls_jax xla fp32 (optax-adamw|adan) (16|32) examples\), score \d\.\d{3}"
        assert re.search(best, line), line
    sweep_dir = tmp_path / "runs" / "sweep-cpu-default"
    assert (sweep_dir / "report" / "report.md").is_file()
    summaries = [runlog.read(path)[-1] for path in sorted(sweep_dir.glob("*/run.jsonl"))]
    assert len(summaries) == 4
    for summary in summaries:
        assert summary["completed"] and summary["cost_usd"] > 0 and summary["energy_source"] in ("rapl", "estimated")
        assert summary["warmup"]["steps"] + summary["steady"]["steps"] == summary["steps"]


# ------------------------------------------------------------------------------------------- running runs


@pytest.mark.slow
def test_run_skip_resume_and_extend(tmp_path, capsys):
    spec = tiny_spec(tmp_path)
    runner = InProcess()
    assert run(spec, runner) == 0
    run_dir = spec.out / "imdb-bert-tiny-adan-b4-l16-s2"
    assert json.loads((run_dir / "sweep.json").read_text())["sweep"] == "tiny"
    assert runlog.read(run_dir / "run.jsonl")[-1]["steps"] == 2
    out = capsys.readouterr().out
    assert "[1/1] imdb-bert-tiny-adan-b4-l16-s2: running: python -m train.imdb --run-dir" in out
    assert "[1/1] imdb-bert-tiny-adan-b4-l16-s2: finished in" in out and (spec.out / "report" / "report.md").exists()

    # Finished: skipped.
    assert run(spec, never) == 0
    assert "finished earlier, skipped" in capsys.readouterr().out

    # Killed after the checkpoint at step 1 (no summary, no checkpoint 2): resumed from step 1.
    records = runlog.read(run_dir / "run.jsonl")
    (run_dir / "run.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records if r["type"] == "run" or r.get("step", 99) <= 1)
    )
    shutil.rmtree(run_dir / "checkpoints" / "2")
    assert sweep.run_state(run_dir, spec, sweep_spec.points(spec)[0]) == "interrupted"
    assert run(spec, runner) == 0
    assert runner.commands[-1][3:5] == ["--resume", str(run_dir)]
    summary = runlog.read(run_dir / "run.jsonl")[-1]
    assert summary["type"] == "summary" and summary["completed"] and summary["steps"] == 2
    assert "resuming" in capsys.readouterr().out


def test_stopped_before_its_first_checkpoint_starts_again(tmp_path):
    spec = tiny_spec(tmp_path)
    point = sweep_spec.points(spec)[0]
    run_dir = spec.out / point.name
    run_dir.mkdir(parents=True)
    (run_dir / "sweep.json").write_text(json.dumps({"sweep": "tiny", "point": point.values}))
    (run_dir / "run.jsonl").write_text('{"type": "run", "schema": 1}\n')
    assert sweep.run_state(run_dir, spec, point) == "restart"
    with contextlib.redirect_stdout(io.StringIO()):
        assert run(spec, InProcess()) == 0  # the harness starts it again in its directory, from step 0
    records = runlog.read(run_dir / "run.jsonl")
    assert [record["type"] for record in records].count("run") == 1
    assert records[-1]["type"] == "summary" and records[-1]["completed"]
    assert json.loads((run_dir / "sweep.json").read_text())["sweep"] == "tiny"


def test_run_directory_of_another_sweep_or_none_is_an_error(tmp_path, capsys):
    spec = tiny_spec(tmp_path)
    point = sweep_spec.points(spec)[0]
    run_dir = spec.out / point.name
    run_dir.mkdir(parents=True)
    (run_dir / "sweep.json").write_text(json.dumps({"sweep": "other", "point": point.values}))
    spec_file = tmp_path / "tiny.toml"
    spec_file.write_text(spec.source)
    assert sweep.main([str(spec_file), "--device", "cpu"], runner=never) == 2
    assert f"error: {run_dir} belongs to sweep 'other', not 'tiny'" in capsys.readouterr().err
    moved = tmp_path / "moved"  # --out elsewhere: a fresh directory, nothing of the other sweep's in the way
    assert sweep.main([str(spec_file), "--device", "cpu", "--out", str(moved), "--dry-run"], runner=never) == 0
    assert f"would run python -m train.imdb --run-dir {moved}/" in capsys.readouterr().out
    (run_dir / "sweep.json").unlink()
    (run_dir / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="was not made by a sweep"):
        sweep.run_state(run_dir, spec, point)


def test_other_devices_print_commands_and_join_when_copied_back(tmp_path, capsys):
    text = TINY.format(name="remote", out=tmp_path / "out", steps=2).replace(
        'optimizer = ["adan"]', 'optimizer = ["adan"]\ndevice = ["TPU-v3", "H100-SXM"]'
    )
    spec = sweep_spec.parse(text)
    assert run(spec, never) == 0
    out = capsys.readouterr().out
    assert "for TPU-v3, run there: python -m tpu.launch --tpu TPU_NAME --zone ZONE" in out
    assert "for H100-SXM, run there: python -m train.imdb --run-dir imdb-H100-SXM-bert-tiny-adan-b4-l16-s2" in out
    assert "2 runs are for other devices" in out

    # The H100 run's directory copied back (a finished CPU-shaped log stands in for it).
    copied = spec.out / "imdb-H100-SXM-bert-tiny-adan-b4-l16-s2"
    copied.mkdir(parents=True)
    imdb_log = _finished_imdb_log(tmp_path)
    shutil.copy(imdb_log, copied / "run.jsonl")
    assert run(spec, never) == 0
    out = capsys.readouterr().out
    assert "finished on H100-SXM, copied back" in out and "1 runs are for other devices" in out
    assert (spec.out / "report" / "report.md").exists()


def _finished_imdb_log(tmp_path):
    """A finished imdb run log: the fixture H100 run recast as imdb (what matters is its shape)."""
    records = [json.loads(line) for line in (COMPARE_DATA / "h100-ffi" / "run.jsonl").read_text().splitlines()]
    records[0].update(task="imdb", batch={"batch_size": 4, "grad_accum": 1})
    for key in ("tokens", "tokens_per_s", "target_tokens", "target_tokens_per_s"):
        records[-1].pop(key)
    records[-1].update(examples=1000, examples_per_s=10.0, accuracy=0.9, bleu=None)
    path = tmp_path / "imdb-run.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records if record["type"] in ("run", "summary")))
    return path


def test_a_device_that_cannot_be_detected_is_one_line_with_the_childs_last_error(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "nosuchplatform")  # the child's jax.devices() fails on it
    with pytest.raises(UsageError) as raised:
        sweep.detect_device()
    message = str(raised.value)
    assert message.startswith("could not detect this machine's device (RuntimeError: ")
    assert "nosuchplatform" in message and "\n" not in message
    assert message.endswith("; pass --device NAME")


@pytest.mark.slow
def test_sigterm_to_the_sweep_waits_for_the_run_to_write_its_checkpoint_and_summary(tmp_path):
    """A real SIGTERM to the sweep process alone, while its run trains: the run gets it too, stops at a step
    boundary with its checkpoint and summary, and only then the sweep exits, 128 + 15, naming how to go on."""
    spec_file = tmp_path / "long.toml"
    spec_file.write_text(TINY.format(name="long", out=tmp_path / "out", steps=100000))
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "train.sweep", str(spec_file), "--device", "cpu"]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    (point,) = sweep_spec.points(sweep_spec.parse(spec_file.read_text()))
    log = tmp_path / "out" / point.name / "run.jsonl"
    deadline = time.monotonic() + 300
    while not (log.exists() and log.read_text().count('"interval"') >= 2):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no training step within 300 s"
        time.sleep(0.2)
    process.terminate()
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 128 + 15, stderr[-2000:]
    summary = runlog.read(log)[-1]
    assert summary["type"] == "summary" and summary["stop_reason"] == "signal" and not summary["completed"]
    assert (log.parent / "checkpoints" / str(summary["steps"])).is_dir()
    assert f"stopped by a signal, its checkpoint {summary['steps']} kept in" in stdout
    assert "run it again to resume" in stderr
