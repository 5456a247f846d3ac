"""``python -m train.imdb`` end to end on CPU: the default job, its quality,
CSV and JSONL data, exact resume, the comparison report and bad input (--init-from: test_train_imdb_hf.py)."""

import contextlib
import io
import json
import shutil

import jax
import numpy as np
import pytest
import test_train_runlog
from test_train_imdb_data import write_csv, write_jsonl
from test_train_wmt import compilation_cache, state_arrays  # noqa: F401 - compilation_cache is a fixture

from ls_jax import backend
from train.compare import report as compare
from train.compare import runs as run_logs
from train.errors import EXIT_DATA, EXIT_USAGE
from train.harness.training import run_training
from train.imdb import config as imdb_config
from train.imdb import task as imdb
from train.imdb.model import preset_config
from train.records import runlog

FLOP_TOLERANCE = 0.05
TOKEN_COUNTS = {"tokens", "target_tokens", "tokens_per_s", "target_tokens_per_s"}  # wmt's; imdb counts examples
QUIET = ["--no-progress", "--no-tensorboard"]
WORDS = (
    "the movie was not very good bad great boring plot acting fun dull a truly awful film i liked it and but"
).split()


def check_log_schema(records):
    test_train_runlog.check_log_schema(records, ("examples",), undocumented=TOKEN_COUNTS)


def review_rows(count, seed):
    """(text, label) rows of random words; the label is 1 when "good" or "great" occurs."""
    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice(WORDS, size=rng.integers(3, 12))) for _ in range(count)]
    return [(text, int("good" in text.split() or "great" in text.split())) for text in texts]


@pytest.fixture(scope="module")
def csv_data(tmp_path_factory):
    directory = tmp_path_factory.mktemp("reviews")
    return (
        write_csv(directory / "train.csv", review_rows(120, 0)),
        write_csv(directory / "test.csv", review_rows(40, 1)),
    )


def csv_job(csv_data, run_dir, *extra):
    train, test = csv_data
    return [
        "--data",
        f"csv:{train}",
        "--test-data",
        f"csv:{test}",
        "--run-dir",
        str(run_dir),
        "--preset",
        "bert-tiny",
        "--max-seq-len",
        "16",
        "--batch-size",
        "8",
        "--vocab-size",
        "60",
        "--dropout",
        "0",
        "--lr",
        "1e-3",
        *QUIET,
        *extra,
    ]


# ------------------------------------------------------------------------------------------ default job


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, compilation_cache):  # noqa: F811
    run_dir = tmp_path_factory.mktemp("default") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = run_training(
            imdb.TASK,
            ["--steps", "6", "--log-every", "3", "--checkpoint-every", "3", "--no-progress", "--run-dir", str(run_dir)],
        )
    return code, run_dir, printed.getvalue()


@pytest.mark.slow
def test_default_job_end_to_end(default_run):
    code, run_dir, printed = default_run
    assert code == 0
    test_train_runlog.check_run_files(run_dir, [3, 6])
    config = json.loads((run_dir / "config.json").read_text())
    assert config["data"] == "synthetic" and config["preset"] == "bert-tiny" and config["steps"] == 6

    records = runlog.read(run_dir / "run.jsonl")
    check_log_schema(records)
    assert [r["type"] for r in records] == ["run", "interval", "interval", "eval", "eval", "summary"]
    run, summary = records[0], records[-1]
    on_cpu = jax.default_backend() == "cpu"
    assert run["task"] == "imdb" and run["model"] == "bert-tiny" and run["backend"] == backend.active_backend()
    assert run["precision"] == ("fp32" if on_cpu else "bf16")
    assert run["batch"] == {"batch_size": 32, "grad_accum": 1}
    assert run["config"]["steps_per_epoch"] == 338 and run["config"]["warmup_steps"] == 1  # 10% of 6 steps
    data = run["data"]
    assert data["max_seq_len"] == 40 and data["train"]["truncated"] == 0
    assert (data["train"]["examples"], data["valid"]["examples"], data["test"]["examples"]) == (10800, 1200, 1000)
    evals = [r for r in records if r["type"] == "eval"]
    assert [r["split"] for r in evals] == ["valid", "test"]
    assert all(
        0.0 <= r["metrics"]["accuracy"] <= 1.0 and r["loss"] > 0 and set(r["metrics"]) == {"accuracy"} for r in evals
    )
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in records if r["type"] == "interval")  # training accuracy
    assert summary["completed"] and summary["steps"] == 6 and summary["metrics"] == evals[-1]["metrics"]
    assert summary["examples"] == 6 * 32 and summary["examples_per_s"] > 0
    assert abs(summary["flops_per_step"] / summary["xla_flops_per_step"] - 1) < FLOP_TOLERANCE
    valid, test = (r["metrics"]["accuracy"] for r in evals)
    assert f"accuracy valid {valid:.2%}, test {test:.2%}" in printed


@pytest.mark.slow
def test_compare_reads_an_imdb_log(default_run, tmp_path, capsys):
    _, run_dir, _ = default_run
    runs, notes = run_logs.load_runs([run_dir])
    assert notes == [] and len(runs) == 1
    run = runs[0]
    summary = runlog.read(run_dir / "run.jsonl")[-1]
    assert (
        run.task == "imdb"
        and run.metrics["accuracy"] == summary["metrics"]["accuracy"]
        and run.trained_unit == "examples"
    )
    assert run.batch_label == "32 examples" and run.throughput == summary["examples_per_s"]
    assert compare.main([str(run_dir), "--weights", "1,0,0,0", "--out", str(tmp_path / "report")]) == 0
    table = capsys.readouterr().out
    assert "accuracy" in table and f"| {summary['metrics']['accuracy']:.4g} " in table


@pytest.mark.slow
def test_one_epoch_of_the_default_job_is_far_above_chance(tmp_path, compilation_cache):  # noqa: F811
    assert run_training(imdb.TASK, ["--epochs", "1", "--run-dir", str(tmp_path / "run"), *QUIET]) == 0
    evals = [r for r in runlog.read(tmp_path / "run" / "run.jsonl") if r["type"] == "eval"]
    # Chance is 0.5 and counting sentiment words scores about 0.84; one epoch reaches about 0.91.
    assert [r["split"] for r in evals] == ["valid", "test"] and min(r["metrics"]["accuracy"] for r in evals) > 0.87


# ------------------------------------------------------------------------------------ data and resume


@pytest.mark.slow
def test_resume_gives_the_same_parameters_as_training_straight(tmp_path, csv_data, compilation_cache):  # noqa: F811
    assert run_training(imdb.TASK, csv_job(csv_data, tmp_path / "straight", "--steps", "6", "--log-every", "1")) == 0
    split = tmp_path / "split"
    assert (
        run_training(imdb.TASK, csv_job(csv_data, split, "--steps", "6", "--log-every", "1", "--checkpoint-every", "3"))
        == 0
    )
    # Cut the run back to its step-3 checkpoint, as a preempted run would have left it, and resume.
    shutil.rmtree(split / "checkpoints" / "6")
    assert run_training(imdb.TASK, ["--resume", str(split)]) == 0
    straight, resumed = state_arrays(tmp_path / "straight", 6), state_arrays(split, 6)
    assert straight.keys() == resumed.keys()
    atol = 1e-6 if jax.default_backend() == "cpu" else 1e-3
    for name in straight:
        np.testing.assert_allclose(resumed[name], straight[name], rtol=0, atol=atol, err_msg=name)
    records = runlog.read(split / "run.jsonl")
    check_log_schema(records)
    assert [r["step"] for r in records if r["type"] == "interval"] == [1, 2, 3, 4, 5, 6]
    assert records[0]["data"]["train"]["examples"] == 108 and records[0]["data"]["valid"]["examples"] == 12


def test_jsonl_data_trains(tmp_path, compilation_cache):  # noqa: F811
    train = write_jsonl(
        tmp_path / "train.jsonl", [{"review": text, "stars": stars} for text, stars in review_rows(40, 2)]
    )
    code = run_training(
        imdb.TASK,
        [
            "--data",
            f"jsonl:{train}",
            "--text-field",
            "review",
            "--label-field",
            "stars",
            "--valid-fraction",
            "0.25",
            "--preset",
            "bert-tiny",
            "--max-seq-len",
            "16",
            "--batch-size",
            "8",
            "--vocab-size",
            "60",
            "--steps",
            "2",
            "--run-dir",
            str(tmp_path / "r"),
            *QUIET,
        ],
    )
    assert code == 0
    records = runlog.read(tmp_path / "r" / "run.jsonl")
    assert [r["split"] for r in records if r["type"] == "eval"] == ["valid"]
    assert records[0]["data"]["valid"]["examples"] == 10


# ------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda d, c: ["--data", f"csv:{d / 'absent.csv'}", "--run-dir", str(d / "r")], "data file not found"),
        (lambda d, c: csv_job(c, d / "r", "--text-field", "review"), "no field 'review' (fields: text, label)"),
        (
            lambda d, c: [
                "--data",
                f"csv:{write_csv(d / 'three.csv', [('a', 1), ('b', 2)] * 10)}",
                "--run-dir",
                str(d / "r"),
            ],
            "three.csv has label 2, but the model has 2 labels",
        ),
        (
            lambda d, c: ["--data", f"csv:{write_csv(d / 'empty.csv', [])}", "--run-dir", str(d / "r")],
            "holds no examples",
        ),
        (lambda d, c: csv_job(c, d / "r", "--max-seq-len", "129"), "--max-seq-len 129 exceeds the model's 128"),
        (
            lambda d, c: ["--init-from", str(d), "--preset", "bert-base", "--run-dir", str(d / "r")],
            "--preset and --init-from exclude each other",
        ),
        (lambda d, c: ["--init-from", str(d), "--run-dir", str(d / "r")], "no tokenizer in"),
        (lambda d, c: csv_job(c, d / "r", "--test-data", "synthetic"), "'synthetic' is not a data source"),
        (lambda d, c: csv_job(c, d / "r", "--steps", "4", "--warmup-steps", "4"), "--warmup-steps 4 leaves no"),
        (lambda d, c: ["--batch-size", "0"], "--batch-size must be >= 1"),
        (lambda d, c: ["--resume", str(d)], "no config.json there"),
        (lambda d, c: ["--backend", "ffi", "--run-dir", str(d / "r")], "requires the CUDA kernels"),
        (lambda d, c: ["--preset", "bert-huge"], "--preset bert-huge: unknown; choose from bert-tiny"),
        (lambda d, c: csv_job(c, d / "r", "--vocab-size", "5"), "--vocab-size 5: a vocabulary of 5 pieces cannot"),
        (lambda d, c: csv_job(c, d / "r", "--max-seq-len", "2"), "--max-seq-len must be >= 3 ([CLS], [SEP] and a"),
    ],
    ids=[
        "missing-file",
        "missing-column",
        "label-out-of-range",
        "empty-data",
        "max-seq-len",
        "preset-and-init-from",
        "no-tokenizer",
        "bad-test-data",
        "warmup",
        "batch-size",
        "resume-not-a-run",
        "ffi-without-cuda",
        "unknown-preset",
        "vocab-too-small",
        "no-room-for-text",
    ],
)
def test_bad_input_is_one_message_and_the_exit_code_of_its_class(
    tmp_path, csv_data, capsys, make_args, message, request
):
    data_fault = request.node.callspec.id in {"missing-file", "missing-column", "label-out-of-range", "empty-data"}
    assert run_training(imdb.TASK, make_args(tmp_path, csv_data)) == (EXIT_DATA if data_fault else EXIT_USAGE)
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_help_says_every_batch_has_one_shape(capsys):
    with pytest.raises(SystemExit):
        run_training(imdb.TASK, ["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "EVERY batch is padded to this length, so the training step has one shape and compiles once" in text
    for option in (
        "--data",
        "--test-data",
        "--valid-fraction",
        "--text-field",
        "--label-field",
        "--init-from",
        "--preset",
        "--batch-size",
        "--epochs",
        "--steps",
        "--optimizer",
        "--precision",
        "--backend",
        "--resume",
    ):
        assert option in text
    assert "with --data synthetic:" in text


def test_eval_every_0_means_only_at_the_end_as_in_train_wmt():
    config = imdb_config.resolve_config({"eval_every": 0})
    imdb.TASK.check_config(config)
    assert imdb_config.Schedule.resolve(config, steps_per_epoch=7).eval_every == 0
    assert imdb_config.Schedule.resolve(imdb_config.resolve_config({}), steps_per_epoch=7).eval_every == 7


@pytest.mark.parametrize("name, layers", [("bert-small", 4), ("bert-medium", 8)])
def test_compact_presets_have_their_published_shapes(name, layers):
    cfg = preset_config(name, vocab_size=1000, num_labels=2)
    assert (cfg.num_layers, cfg.layer.hidden_size, cfg.layer.intermediate_size, cfg.layer.nhead) == (
        layers,
        512,
        2048,
        8,
    )
    assert cfg.layer.hidden_size // cfg.layer.nhead == 64


def test_a_batch_beyond_the_training_examples_is_a_warning(tmp_path, csv_data, capsys):  # noqa: F811
    assert run_training(imdb.TASK, csv_job(csv_data, tmp_path / "r", "--batch-size", "128", "--steps", "1")) == 0
    err = capsys.readouterr().err
    assert (
        "warning: a step holds 128 rows (--batch-size x --grad-accum) but there are 108 training examples: 20 " in err
    )
    assert "--batch-size 108 also takes every example in each step, in less time" in err
