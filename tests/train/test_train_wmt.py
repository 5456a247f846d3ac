"""``python -m train.wmt`` end to end on CPU: the default job, exact resume, signals and bad input.

Compiled steps go to a compilation cache shared by this module's runs (the runs use the same shapes), so only
the first run of a configuration pays for XLA compilation.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import test_train_runlog
from test_data_text import write_corpus

from ls_jax import backend
from ls_jax.models import PRESETS
from ls_jax.optim import master
from train.data import tokenizer
from train.errors import EXIT_DATA, EXIT_USAGE
from train.harness import compile_cache
from train.harness.config import TrainingConfig
from train.harness.loop import progress_line
from train.harness.training import run_training
from train.records import runlog
from train.wmt import task as wmt

REPO = Path(__file__).resolve().parents[2]
FLOP_TOLERANCE = 0.05
# A small text-data job: short sentences (two step shapes), no dropout, a 300-piece vocabulary.
SMALL = [
    "--preset",
    "transformer-tiny",
    "--max-len",
    "16",
    "--max-tokens",
    "512",
    "--spm-vocab-size",
    "300",
    "--spm-model-type",
    "bpe",
    "--dropout",
    "0",
    "--warmup-steps",
    "5",
    "--lr",
    "1e-3",
    "--decode",
    "greedy",
    "--bleu-sentences",
    "8",
    "--no-progress",
    "--no-tensorboard",
]


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("jax-cache")
    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    previous = {name: getattr(jax.config, name) for name in names}
    for name, value in zip(names, (str(cache), 0.0, 0)):
        jax.config.update(name, value)
    yield cache
    for name, value in previous.items():
        jax.config.update(name, value)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("corpus")
    write_corpus(directory, {"train": 240, "valid": 16, "test": 16})
    long_line = " ".join(["the big dog sees a cat"] * 20)  # far beyond --max-len 16
    with open(directory / "train.de", "a") as src, open(directory / "train.en", "a") as tgt:
        for _ in range(3):
            src.write(long_line + "\n")
            tgt.write(long_line + "\n")
    return directory


def small_job(corpus_dir, run_dir, *extra):
    return ["--data", f"text:{corpus_dir}", "--run-dir", str(run_dir), *SMALL, *extra]


def state_arrays(run_dir, step):
    """The saved train state of a checkpoint, as numpy leaves (path -> array)."""
    restored = ocp.StandardCheckpointer().restore(Path(run_dir).resolve() / "checkpoints" / str(step) / "state")
    return {
        jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(restored)
    }


def check_log_schema(records):
    test_train_runlog.check_log_schema(records, ("tokens", "target_tokens"))


@pytest.mark.slow
def test_default_job_end_to_end(tmp_path, compilation_cache, capsys):
    run_dir = tmp_path / "run"
    code = run_training(
        wmt.TASK,
        [
            "--steps",
            "6",
            "--log-every",
            "3",
            "--checkpoint-every",
            "3",
            "--bleu-sentences",
            "32",
            "--no-progress",
            "--run-dir",
            str(run_dir),
        ],
    )
    assert code == 0
    test_train_runlog.check_run_files(run_dir, [3, 6])
    config = json.loads((run_dir / "config.json").read_text())
    assert config["data"] == "synthetic" and config["preset"] == "transformer-tiny" and config["steps"] == 6

    records = runlog.read(run_dir / "run.jsonl")
    check_log_schema(records)
    assert [r["type"] for r in records] == ["run", "interval", "interval", "eval", "eval", "summary"]
    run, summary = records[0], records[-1]
    on_cpu = jax.default_backend() == "cpu"
    assert run["task"] == "wmt" and run["backend"] == backend.active_backend()
    assert run["precision"] == ("fp32" if on_cpu else "bf16")  # --precision auto
    assert run["device_count"] == len(jax.devices()) and run["params"] > 0
    assert run["data"]["train"]["kept"] == 20000
    assert [r["split"] for r in records if r["type"] == "eval"] == ["valid", "test"]
    assert all(isinstance(r["metrics"]["bleu"], float) for r in records if r["type"] == "eval")
    assert summary["completed"] and summary["steps"] == 6 and isinstance(summary["metrics"]["bleu"], float)
    assert (summary["energy_j"] is None) == (summary["energy_source"] is None)
    if on_cpu:  # RAPL's counters where readable, else the per-core estimate, labelled as such
        assert summary["energy_j"] > 0 and summary["energy_source"] in ("rapl", "estimated")
    assert summary["tokens"] > summary["target_tokens"] > 0
    assert abs(summary["flops_per_step"] / summary["xla_flops_per_step"] - 1) < FLOP_TOLERANCE
    assert "BLEU valid" in capsys.readouterr().out


@pytest.mark.slow
def test_resume_gives_the_same_parameters_as_training_straight(tmp_path, corpus_dir, compilation_cache):
    assert run_training(wmt.TASK, small_job(corpus_dir, tmp_path / "straight", "--steps", "6", "--log-every", "1")) == 0
    split = tmp_path / "split"
    assert run_training(wmt.TASK, small_job(corpus_dir, split, "--steps", "3", "--log-every", "1")) == 0
    assert run_training(wmt.TASK, ["--resume", str(split), "--steps", "6"]) == 0

    straight, resumed = state_arrays(tmp_path / "straight", 6), state_arrays(split, 6)
    assert straight.keys() == resumed.keys()
    # XLA on CPU is deterministic; GPU reductions with atomics are not bit-exact run to run (unless
    # XLA_FLAGS=--xla_gpu_deterministic_ops=true), so there the bound is looser.
    atol = 1e-6 if jax.default_backend() == "cpu" else 1e-3
    for name in straight:
        np.testing.assert_allclose(resumed[name], straight[name], rtol=0, atol=atol, err_msg=name)

    records = runlog.read(split / "run.jsonl")
    check_log_schema(records)
    assert [r["step"] for r in records if r["type"] == "interval"] == [1, 2, 3, 4, 5, 6]
    straight_summary = runlog.read(tmp_path / "straight" / "run.jsonl")[-1]
    assert records[-1]["tokens"] == straight_summary["tokens"]
    train_stats = records[0]["data"]["train"]
    assert train_stats["too_long"] >= 3 and sum(train_stats.values()) == 243  # the 3 long lines are dropped


def test_a_rerun_loads_its_step_untraced_and_trains_alike(tmp_path, corpus_dir, compilation_cache):
    # A learning rate no other test uses: a step XLA's cache answered would not be kept on a CPU (`keepable`).
    flags = ("--steps", "2", "--log-every", "1", "--eval-every", "0", "--lr", "7.1e-4")
    assert run_training(wmt.TASK, small_job(corpus_dir, tmp_path / "first", *flags)) == 0
    loaded = compile_cache.use().steps_loaded
    assert run_training(wmt.TASK, small_job(corpus_dir, tmp_path / "again", *flags)) == 0
    assert compile_cache.use().steps_loaded == loaded + 2  # a step for each of the task's two batch shapes

    def losses(run_dir):
        return [r["loss"] for r in runlog.read(run_dir / "run.jsonl") if r["type"] == "interval"]

    np.testing.assert_allclose(losses(tmp_path / "again"), losses(tmp_path / "first"), rtol=1e-6)


def test_epochs_train_whole_passes_over_the_training_pairs(tmp_path, corpus_dir, compilation_cache):
    run_dir = tmp_path / "run"
    assert run_training(wmt.TASK, small_job(corpus_dir, run_dir, "--epochs", "2", "--eval-every", "0")) == 0
    summary = runlog.read(run_dir / "run.jsonl")[-1]
    progress = json.loads((run_dir / "checkpoints" / str(summary["steps"]) / "progress" / "metadata").read_text())
    # The stream stops at the end of the second epoch (epoch 1, every one of its steps taken): 2 x an epoch's steps.
    assert summary["steps"] > 2 and progress["data"] == {"epoch": 1, "index": summary["steps"] // 2}


def test_resume_with_another_vocabulary_is_refused(tmp_path, corpus_dir, compilation_cache, capsys):
    run_dir = tmp_path / "run"
    assert run_training(wmt.TASK, small_job(corpus_dir, run_dir, "--steps", "1")) == 0
    src, tgt = (corpus_dir / "train.de").read_text().splitlines(), (corpus_dir / "train.en").read_text().splitlines()
    other = tokenizer.train(src + tgt, tmp_path / "other.model", vocab_size=200, model_type="bpe")
    assert other.GetPieceSize() != 300
    assert run_training(wmt.TASK, ["--resume", str(run_dir), "--spm", str(tmp_path / "other.model")]) == 2
    err = capsys.readouterr().err
    assert f"vocab_size: checkpoint 300 vs now {other.GetPieceSize()}" in err and "Traceback" not in err


@pytest.mark.slow
def test_sigterm_leaves_a_checkpoint_that_resumes(tmp_path, corpus_dir, compilation_cache):
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(compilation_cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "PYTHONPATH": str(REPO),
    }
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "train.wmt",
            *small_job(corpus_dir, run_dir, "--steps", "100000", "--log-every", "1", "--checkpoint-every", "100000"),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = run_dir / "run.jsonl"
    deadline = time.monotonic() + 240
    while not (log.exists() and '"interval"' in log.read_text()):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no training step within 240 s"
        time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, stderr

    summary = runlog.read(log)[-1]
    assert summary["type"] == "summary" and summary["stop_reason"] == "signal" and not summary["completed"]
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [summary["steps"]]
    assert run_training(wmt.TASK, ["--resume", str(run_dir), "--steps", str(steps[0] + 1)]) == 0
    assert runlog.read(log)[-1]["steps"] == steps[0] + 1


@pytest.mark.slow
def test_fp16_logs_the_dynamic_loss_scale(tmp_path, corpus_dir, compilation_cache):
    run_dir = tmp_path / "run"
    assert (
        run_training(
            wmt.TASK, small_job(corpus_dir, run_dir, "--steps", "4", "--log-every", "2", "--precision", "fp16")
        )
        == 0
    )
    records = runlog.read(run_dir / "run.jsonl")
    check_log_schema(records)
    assert records[0]["precision"] == "fp16"
    intervals = [r for r in records if r["type"] == "interval"]
    assert all(r["loss_scale"] > 0 and np.isfinite(r["loss"]) for r in intervals)
    assert intervals[-1]["loss"] < intervals[0]["loss"]


@pytest.mark.slow
def test_master_weights_train_bf16_params_and_resume_exactly(tmp_path, corpus_dir, compilation_cache):
    flags = ("--precision", "bf16", "--master-weights", "--log-every", "1")
    assert run_training(wmt.TASK, small_job(corpus_dir, tmp_path / "straight", "--steps", "4", *flags)) == 0
    split = tmp_path / "split"
    assert run_training(wmt.TASK, small_job(corpus_dir, split, "--steps", "2", *flags)) == 0
    assert run_training(wmt.TASK, ["--resume", str(split), "--steps", "4"]) == 0

    def with_f32_master(arrays):
        """The state's arrays with the master's int16 low halves joined to the bf16 params they extend."""
        params = {name[len("['params']") :]: value for name, value in arrays.items() if name.startswith("['params']")}
        lows = {name.split("['master']", 1)[1]: name for name in arrays if "['master']" in name}
        assert params and params.keys() == lows.keys()
        for path, name in lows.items():
            assert params[path].dtype == jnp.bfloat16 and arrays[name].dtype == np.int16, name
            arrays = {**arrays, name: np.asarray(master.join_halves(params[path], arrays[name]))}
        return arrays

    straight, resumed = with_f32_master(state_arrays(tmp_path / "straight", 4)), with_f32_master(state_arrays(split, 4))
    assert straight.keys() == resumed.keys()
    for name in straight:
        np.testing.assert_allclose(resumed[name], straight[name], rtol=0, atol=1e-6, err_msg=name)
    for name, value in straight.items():
        if "['master']" in name:
            params_name = "['params']" + name.split("['master']", 1)[1]
            np.testing.assert_array_equal(straight[params_name], master.round_to_bf16(value), err_msg=name)
    intervals = [r for r in runlog.read(split / "run.jsonl") if r["type"] == "interval"]
    assert all(np.isfinite(r["loss"]) for r in intervals) and intervals[-1]["loss"] < intervals[0]["loss"]


def test_fp8_trains_and_resumes_its_scaling_state_exactly(tmp_path, corpus_dir, compilation_cache):
    """--precision fp8 on a CPU (emulated FP8 GEMMs): the scaling state is checkpointed beside the params and a
    resumed run continues it exactly; the interval records report what the quantization clipped."""
    flags = ("--precision", "fp8", "--log-every", "1")
    assert run_training(wmt.TASK, small_job(corpus_dir, tmp_path / "straight", "--steps", "4", *flags)) == 0
    split = tmp_path / "split"
    assert run_training(wmt.TASK, small_job(corpus_dir, split, "--steps", "2", *flags)) == 0
    assert run_training(wmt.TASK, ["--resume", str(split), "--steps", "4"]) == 0

    straight, resumed = state_arrays(tmp_path / "straight", 4), state_arrays(split, 4)
    assert straight.keys() == resumed.keys()
    histories = [name for name in straight if name.startswith("['scaling']") and name.endswith("amax_history']")]
    # input, kernel and output gradient of each FP8 op of transformer-tiny (2 + 2 layers): 4 per encoder layer, 6 per
    # decoder layer, the decoder's source keys and values (one op for every layer) and the tied logits
    assert len(histories) == 3 * (2 * 4 + 2 * 6 + 1 + 1)
    assert all(np.count_nonzero(straight[name]) == 4 for name in histories)  # one amax per step taken
    for name in straight:
        np.testing.assert_array_equal(resumed[name], straight[name], err_msg=name)
    intervals = [r for r in runlog.read(split / "run.jsonl") if r["type"] == "interval"]
    assert [r["step"] for r in intervals] == [1, 2, 3, 4]
    assert all(isinstance(r["fp8_overflows"], int) and r["fp8_amax_ratio"] > 0 for r in intervals)
    assert runlog.read(split / "run.jsonl")[0]["precision"] == "fp8"
    last = intervals[-1]
    assert progress_line(last, 4).endswith(
        f"fp8 clipped {last['fp8_overflows']}, amax {last['fp8_amax_ratio']:.3g}x range"
    )


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda d, c: ["--data", f"text:{d / 'absent'}", "--run-dir", str(d / "r")], "data directory not found"),
        (lambda d, c: ["--data", f"text:{c}", "--src-lang", "fr", "--run-dir", str(d / "r")], "train.fr"),
        (lambda d, c: small_job(c, d / "r", "--max-tokens", "8"), "--max-tokens 8 is smaller than the longest"),
        (lambda d, c: small_job(c, d / "r", "--max-len", "65"), "--max-len 65 exceeds the model's max_seq_len 64"),
        (lambda d, c: ["--run-dir", str(d / "file.txt" / "run")], "cannot write the run directory"),
        (lambda d, c: ["--resume", str(d)], "no config.json there"),
        (lambda d, c: ["--steps", "0"], "--steps must be >= 1"),
        (lambda d, c: ["--steps", "5", "--epochs", "1"], "--epochs and --steps both set the length of the run"),
        (lambda d, c: ["--spm", str(d / "missing.model"), "--run-dir", str(d / "r")], "missing.model"),
        (lambda d, c: ["--backend", "ffi", "--run-dir", str(d / "r")], "requires the CUDA kernels"),
        (
            lambda d, c: small_job(c, d / "r", "--master-weights", "--precision", "fp32"),
            "--master-weights needs --precision bf16 or fp16",
        ),
        (
            lambda d, c: small_job(c, d / "r", "--spm-vocab-size", "5"),
            "--spm-vocab-size 5: a vocabulary of 5 pieces cannot hold this corpus: sentencepiece needs at least",
        ),
        (
            lambda d, c: small_job(c, d / "r", "--spm-vocab-size", "3"),
            "--spm-vocab-size 3: a vocabulary of 3 pieces cannot hold this corpus: sentencepiece needs at least",
        ),
    ],
    ids=[
        "missing-dir",
        "missing-file",
        "max-tokens",
        "max-len",
        "unwritable-run-dir",
        "resume-not-a-run",
        "steps",
        "steps-and-epochs",
        "missing-spm",
        "ffi-without-cuda",
        "master-weights-fp32",
        "spm-vocab-too-small",
        "spm-vocab-below-the-special-pieces",
    ],
)
def test_bad_input_is_one_message_and_the_exit_code_of_its_class(
    tmp_path, corpus_dir, capsys, make_args, message, request
):
    (tmp_path / "file.txt").write_text("a file, not a directory")
    data_fault = request.node.callspec.id in {"missing-dir", "missing-file"}
    assert run_training(wmt.TASK, make_args(tmp_path, corpus_dir)) == (EXIT_DATA if data_fault else EXIT_USAGE)
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_empty_training_file(tmp_path, capsys):
    write_corpus(tmp_path, {"train": 20, "valid": 4})
    (tmp_path / "train.en").write_text("")
    assert run_training(wmt.TASK, ["--data", f"text:{tmp_path}", "--run-dir", str(tmp_path / "r")]) == EXIT_DATA
    assert "data file is empty" in capsys.readouterr().err


def test_unknown_preset_is_one_line(capsys):
    assert run_training(wmt.TASK, ["--preset", "transformer-huge"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"error: --preset transformer-huge: unknown; choose from {', '.join(PRESETS)}"]
    assert "transformer-base" in err


def test_unknown_device_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_training(wmt.TASK, ["--device-name", "Z80"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'Z80'" in capsys.readouterr().err


def test_existing_run_directory_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "run.jsonl").write_text("")
    (tmp_path / "checkpoints" / "100").mkdir(parents=True)  # a run with a checkpoint to continue from
    assert run_training(wmt.TASK, ["--run-dir", str(tmp_path)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (tmp_path / "run.jsonl").read_text() == ""


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit):
        run_training(wmt.TASK, ["--help"])
    text = capsys.readouterr().out
    for option in (
        "--data",
        "--spm",
        "--max-tokens",
        "--preset",
        "--precision",
        "--backend",
        "--optimizer",
        "--grad-accum",
        "--label-smoothing",
        "--decode",
        "--resume",
        "--price-per-hour",
        "--device-name",
        "--checkpoint-every",
        "--keep-checkpoints",
        "--eval-every",
        "--distributed",
    ):
        assert option in text
    assert "with --data synthetic:" in text


def test_kernels_variable_applies_when_backend_flag_is_absent(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LS_JAX_KERNELS", "ffi")  # no CUDA here: the kernels cannot load, so ffi must fail at once
    assert run_training(wmt.TASK, ["--run-dir", str(tmp_path / "r")]) == 2
    assert "requires the CUDA kernels" in capsys.readouterr().err
    monkeypatch.setenv("LS_JAX_KERNELS", "fast")
    assert run_training(wmt.TASK, ["--run-dir", str(tmp_path / "r2")]) == 2
    assert "LS_JAX_KERNELS='fast' is not a kernel mode" in capsys.readouterr().err


def test_a_bad_cudnn_attention_variable_is_one_error_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LS_JAX_CUDNN_ATTENTION", "yes")
    assert run_training(wmt.TASK, ["--run-dir", str(tmp_path / "r"), "--backend", "xla"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: LS_JAX_CUDNN_ATTENTION must be 0") and "'yes'" in err[0]
    assert not (tmp_path / "r").exists()


def test_peer_timeout_without_distributed_is_refused(tmp_path, capsys):
    assert run_training(wmt.TASK, ["--run-dir", str(tmp_path / "r"), "--peer-timeout", "30"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --peer-timeout applies only to a --distributed run; add --distributed or drop it"]


def test_backend_flag_wins_over_the_kernels_variable_which_wins_over_a_saved_run(monkeypatch):
    from train.errors import UsageError
    from train.harness import config as config_lib

    saved = {"backend": "ffi"}
    monkeypatch.setenv("LS_JAX_KERNELS", "xla")
    assert config_lib.resolve(TrainingConfig, {"backend": "ffi"}, saved, {}).backend == "ffi"
    assert config_lib.resolve(TrainingConfig, {}, saved, {}).backend == "xla"
    monkeypatch.setenv("LS_JAX_KERNELS", "cuda")
    with pytest.raises(UsageError, match="set it to one of them or pass --backend"):
        config_lib.resolve(TrainingConfig, {}, None, {})
    monkeypatch.delenv("LS_JAX_KERNELS")
    assert config_lib.resolve(TrainingConfig, {}, saved, {}).backend == "ffi"
    assert config_lib.resolve(TrainingConfig, {}, None, {}).backend == "auto"
