"""``python -m train.gpt`` end to end on CPU: the default job (run log, perplexity against the entropy floor,
samples), the comparison report, text data with a trained or given sentencepiece model, 2048-token rows, exact
resume, a Hugging Face GPT-2 checkpoint scored as transformers scores it, and bad input."""

import contextlib
import io
import json
import math
import shutil

import jax
import numpy as np
import pytest
import test_train_runlog
from test_gpt_model import tiny_model, write_gpt2_directory
from test_train_wmt import compilation_cache, state_arrays  # noqa: F401 - compilation_cache is a fixture

from ls_jax import backend
from ls_jax.models import hf
from train.compare import report as compare
from train.compare import runs as run_logs
from train.data import tokenizer as tokenizer_lib
from train.errors import EXIT_DATA, EXIT_USAGE
from train.gpt import config as gpt_config
from train.gpt import data as gpt_data
from train.gpt import synthetic as gpt_synthetic
from train.gpt import task as gpt
from train.gpt.samples import SAMPLES_FILENAME
from train.harness import compile_cache
from train.harness.training import run_training
from train.records import runlog

FLOP_TOLERANCE = 0.05
QUIET = ["--no-progress", "--no-tensorboard"]
OTHER_COUNTS = {"target_tokens", "target_tokens_per_s"}  # wmt's; gpt counts tokens only


def check_log_schema(records):
    test_train_runlog.check_log_schema(records, ("tokens",), undocumented=OTHER_COUNTS)


def write_documents(path, count, seed=0):
    """``count`` synthetic-grammar documents, one per line."""
    path.write_text("\n".join(gpt_synthetic.synthetic_corpus(seed, train=count, valid=0)["train"]) + "\n")
    return path


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    return write_documents(tmp_path_factory.mktemp("text") / "docs.txt", 300)


def text_job(text_file, run_dir, *extra):
    return [
        "--data",
        f"text:{text_file}",
        "--run-dir",
        str(run_dir),
        "--preset",
        "gpt2-tiny",
        "--max-seq-len",
        "16",
        "--batch-size",
        "8",
        "--vocab-size",
        "120",
        "--samples",
        "2",
        "--sample-tokens",
        "8",
        *QUIET,
        *extra,
    ]


def sample_texts(run_dir):
    """The generated texts of samples.txt (the lines under each ``--- sample`` header)."""
    blocks = (run_dir / SAMPLES_FILENAME).read_text().split("--- sample ")[1:]
    return [block.split("---\n", 1)[1].rstrip("\n") for block in blocks]


# ------------------------------------------------------------------------------------------ default job


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, compilation_cache):  # noqa: F811
    run_dir = tmp_path_factory.mktemp("default") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = run_training(
            gpt.TASK,
            ["--steps", "6", "--log-every", "3", "--checkpoint-every", "3", "--no-progress", "--run-dir", str(run_dir)],
        )
    return code, run_dir, printed.getvalue()


def test_default_job_end_to_end(default_run):
    code, run_dir, printed = default_run
    assert code == 0
    assert {p.name for p in run_dir.iterdir()} >= {
        "config.json",
        "run.jsonl",
        SAMPLES_FILENAME,
        "tensorboard",
        "checkpoints",
    }
    assert not (run_dir / "spm.model").exists()  # the synthetic corpus has its own word vocabulary
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [3, 6]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["data"] == "synthetic" and config["preset"] == "gpt2-tiny" and config["max_seq_len"] == 64

    records = runlog.read(run_dir / "run.jsonl")
    check_log_schema(records)
    assert [r["type"] for r in records] == ["run", "interval", "interval", "eval", "summary"]
    run, evaluation, summary = records[0], records[3], records[-1]
    assert run["task"] == "gpt" and run["model"] == "gpt2-tiny" and run["backend"] == backend.active_backend()
    assert run["precision"] == ("fp32" if jax.default_backend() == "cpu" else "bf16")
    assert run["batch"] == {"batch_size": 32, "grad_accum": 1, "seq_len": 64}
    data = run["data"]
    assert data["train_documents"] == 50_000 and data["valid_tokens"] == evaluation["tokens"]
    floor = gpt_synthetic.entropy_floor().perplexity
    assert data["entropy_floor_perplexity"] == pytest.approx(floor) and 40 < data["unigram_perplexity"] < 55
    assert run["config"]["positions"] == 256 and run["config"]["warmup_steps"] == 1

    assert evaluation["split"] == "valid" and set(evaluation["metrics"]) == {"perplexity"}
    perplexity = evaluation["metrics"]["perplexity"]
    assert perplexity == pytest.approx(math.exp(evaluation["nll"]))
    # Six steps from a uniform guess over 90 words: already below the unigram model, far above the floor.
    assert floor < perplexity < 90
    assert summary["completed"] and summary["steps"] == 6 and summary["metrics"] == evaluation["metrics"]
    assert 6 * 32 * 64 - 64 < summary["tokens"] <= 6 * 32 * 64 and summary["tokens_per_s"] > 0
    assert abs(summary["flops_per_step"] / summary["xla_flops_per_step"] - 1) < FLOP_TOLERANCE
    assert f"perplexity valid {perplexity:.3f}" in printed
    assert f"entropy floor (the best possible) {floor:.3f}" in printed


def test_default_job_writes_and_prints_samples_of_the_grammars_words(default_run):
    _, run_dir, printed = default_run
    texts = sample_texts(run_dir)
    assert len(texts) == 3 and all(text in printed for text in texts)
    words = set(gpt_synthetic.WordVocabulary().words)
    assert sum(len(text.split()) for text in texts) > 0 and all(set(text.split()) <= words for text in texts)


def test_compare_reads_a_gpt_log(default_run, tmp_path, capsys):
    _, run_dir, _ = default_run
    runs, notes = run_logs.load_runs([run_dir])
    summary = runlog.read(run_dir / "run.jsonl")[-1]
    assert notes == [] and len(runs) == 1 and runs[0].task == "gpt" and runs[0].trained_unit == "tokens"
    assert runs[0].metrics == summary["metrics"] == {"perplexity": summary["metrics"]["perplexity"]}
    assert compare.main([str(run_dir), "--weights", "1,0,0,0", "--out", str(tmp_path / "report")]) == 0
    table = capsys.readouterr().out
    assert "perplexity" in table and f"{summary['metrics']['perplexity']:.4g}" in table


def schema_2_form(records, with_perplexity=True):
    """The records as schema 2 wrote them: every quality key in every eval and summary record, null where the task
    had none (perplexity left out, as logs written before it was logged)."""
    keys = ("bleu", "accuracy", "perplexity") if with_perplexity else ("bleu", "accuracy")
    old = []
    for record in records:
        record = dict(record)
        if record["type"] == "run":
            record["schema"] = 2
        if record["type"] in ("eval", "summary"):
            metrics = record.pop("metrics")
            record.update({key: metrics.get(key) for key in keys})
        old.append(record)
    return old


@pytest.mark.parametrize("with_perplexity", [True, False], ids=["schema-2", "before-perplexity"])
def test_a_schema_2_log_still_reads(default_run, tmp_path, with_perplexity):
    _, run_dir, _ = default_run
    records = runlog.read(run_dir / "run.jsonl")
    old = schema_2_form(records, with_perplexity)
    (tmp_path / "run.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    runs, _ = run_logs.load_runs([tmp_path])
    assert runs[0].metrics == (records[-1]["metrics"] if with_perplexity else {})
    assert runlog.read(tmp_path / "run.jsonl")[-1]["metrics"] == runs[0].metrics
    with pytest.raises(ValueError, match="eval record lacks 'metrics'"):
        runlog.validate(old[3], ("tokens",), complete=True)  # as this version writes: a metrics object


# ------------------------------------------------------------------------------------ text data and resume


@pytest.mark.slow
def test_text_data_trains_a_vocabulary_and_continues_prompts(tmp_path, text_file, compilation_cache):  # noqa: F811
    run_dir = tmp_path / "r"
    assert (
        run_training(gpt.TASK, text_job(text_file, run_dir, "--steps", "2", "--prompt", "the cat", "--prompt", "two"))
        == 0
    )
    assert tokenizer_lib.load(run_dir / "spm.model").GetPieceSize() <= 120
    records = runlog.read(run_dir / "run.jsonl")
    check_log_schema(records)
    data = records[0]["data"]
    assert data["source"] == f"text:{text_file}" and data["train_documents"] == 300 and "valid_documents" not in data
    assert "entropy_floor_perplexity" not in data
    texts = sample_texts(run_dir)
    assert len(texts) == 2 and texts[0].startswith("the cat") and texts[1].startswith("two")

    given = tmp_path / "given"  # the same vocabulary given with --spm-model tokenizes the same rows
    assert (
        run_training(gpt.TASK, text_job(text_file, given, "--steps", "2", "--spm-model", str(run_dir / "spm.model")))
        == 0
    )
    assert (given / "spm.model").read_bytes() == (run_dir / "spm.model").read_bytes()
    assert runlog.read(given / "run.jsonl")[0]["data"] == data


@pytest.mark.slow
def test_rows_of_2048_tokens_train_with_as_many_positions(tmp_path, compilation_cache):  # noqa: F811
    text = write_documents(tmp_path / "docs.txt", 700)  # about 10k words
    run_dir = tmp_path / "r"
    assert (
        run_training(
            gpt.TASK,
            [
                "--data",
                f"text:{text}",
                "--run-dir",
                str(run_dir),
                "--preset",
                "gpt2-tiny",
                "--positions",
                "2048",
                "--max-seq-len",
                "2048",
                "--batch-size",
                "1",
                "--vocab-size",
                "120",
                "--steps",
                "1",
                "--samples",
                "1",
                "--sample-tokens",
                "4",
                *QUIET,
            ],
        )
        == 0
    )
    records = runlog.read(run_dir / "run.jsonl")
    assert records[0]["batch"]["seq_len"] == 2048 and records[0]["config"]["positions"] == 2048
    summary = records[-1]
    assert summary["completed"] and 0 < summary["tokens"] <= 2048 and summary["metrics"]["perplexity"] > 1
    assert state_arrays(run_dir, 1)["['params']['embedding']['position_embedding']"].shape == (2048, 128)


@pytest.mark.slow
def test_resume_gives_the_same_run_as_training_straight(tmp_path, text_file, compilation_cache):  # noqa: F811
    straight, split = tmp_path / "straight", tmp_path / "split"
    loaded = compile_cache.use().steps_loaded
    # A learning rate no other test uses: a step XLA's cache answered would not be kept on a CPU (`keepable`).
    flags = ("--steps", "6", "--log-every", "1", "--eval-every", "3", "--lr", "6.9e-4")
    assert run_training(gpt.TASK, text_job(text_file, straight, *flags)) == 0
    assert run_training(gpt.TASK, text_job(text_file, split, *flags, "--checkpoint-every", "3")) == 0
    # Cut the run back to its step-3 checkpoint, as a preempted run would have left it, and resume.
    shutil.rmtree(split / "checkpoints" / "6")
    (split / SAMPLES_FILENAME).unlink()
    assert run_training(gpt.TASK, ["--resume", str(split)]) == 0
    # The split run and its resume load the step the straight run kept (`train.harness.executable_cache`).
    assert compile_cache.use().steps_loaded == loaded + 2

    expected, resumed = state_arrays(straight, 6), state_arrays(split, 6)
    assert expected.keys() == resumed.keys()
    for name in expected:
        np.testing.assert_allclose(resumed[name], expected[name], rtol=0, atol=1e-6, err_msg=name)
    records = {name: runlog.read(path / "run.jsonl") for name, path in (("straight", straight), ("split", split))}
    check_log_schema(records["split"])
    assert [r["step"] for r in records["split"] if r["type"] == "interval"] == [1, 2, 3, 4, 5, 6]
    evals = {
        name: [(r["step"], r["metrics"]["perplexity"]) for r in log if r["type"] == "eval"]
        for name, log in records.items()
    }
    assert [step for step, _ in evals["split"]] == [3, 6]
    np.testing.assert_allclose(np.array(evals["split"]), np.array(evals["straight"]), rtol=1e-6)
    assert records["split"][-1]["tokens"] == records["straight"][-1]["tokens"]
    assert sample_texts(split) == sample_texts(straight)


# ------------------------------------------------------------------------------------ Hugging Face GPT-2


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp("gpt2")
    model, params = tiny_model(vocab_size=300, seq_len=32)
    write_gpt2_directory(directory, model.config, params)
    return directory


def transformers_perplexity(directory, rows):
    """exp of the mean next-token NLL of transformers' GPT2LMHeadModel over packed rows (labels -1: no loss)."""
    torch = pytest.importorskip("torch")
    import transformers

    model = transformers.GPT2LMHeadModel.from_pretrained(str(directory)).eval()
    batch = rows.batch(np.arange(rows.num_rows))
    with torch.no_grad():
        logits = model(torch.tensor(batch["input_ids"], dtype=torch.long)).logits
    labels = torch.tensor(batch["labels"], dtype=torch.long)
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=gpt_data.IGNORE_LABEL
    )
    return math.exp(float(nll))


@pytest.mark.slow
def test_init_from_gpt2_scores_the_checkpoint_as_transformers_does(gpt2_dir, text_file, tmp_path):
    run_dir = tmp_path / "run"
    # A vanishing learning rate leaves the weights as loaded, so the evaluation scores the checkpoint itself.
    assert (
        run_training(
            gpt.TASK,
            [
                "--init-from",
                str(gpt2_dir),
                "--data",
                f"text:{text_file}",
                "--max-seq-len",
                "16",
                "--batch-size",
                "8",
                "--steps",
                "1",
                "--lr",
                "1e-20",
                "--samples",
                "1",
                "--sample-tokens",
                "4",
                "--run-dir",
                str(run_dir),
                *QUIET,
            ],
        )
        == 0
    )
    records = runlog.read(run_dir / "run.jsonl")
    check_log_schema(records)
    assert records[0]["model"] == gpt2_dir.name and not (run_dir / "spm.model").exists()
    assert records[0]["data"]["vocab_size"] <= 300
    tokenizer = gpt_data.HuggingFaceTokenizer.load(gpt2_dir)
    data = gpt_data.load_data(
        f"text:{text_file}", seq_len=16, max_positions=32, run_dir=tmp_path, tokenizer=tokenizer, valid_fraction=0.05
    )
    evaluation = next(r for r in records if r["type"] == "eval")
    assert evaluation["tokens"] == data.splits["valid"].num_targets
    assert evaluation["metrics"]["perplexity"] == pytest.approx(
        transformers_perplexity(gpt2_dir, data.splits["valid"]), rel=1e-4
    )


# ------------------------------------------------------------------------------------------- bad input


def write_text(path, text):
    path.write_text(text)
    return path


def weights_without_tokenizer(directory):
    model, params = tiny_model(vocab_size=40, seq_len=16)
    hf.save_pretrained(model.config, params, directory)
    return directory


@pytest.mark.parametrize(
    "make_args, message",
    [
        (
            lambda d, t: text_job(write_text(d / "empty.txt", "\n \n"), d / "r"),
            "is empty: it holds no text to train on",
        ),
        (
            lambda d, t: ["--max-seq-len", "300", "--run-dir", str(d / "r")],
            "--max-seq-len 300 is longer than the 256 positions of gpt2-tiny; lower --max-seq-len, or give the model "
            "more positions with --positions 300",
        ),
        (
            lambda d, t: text_job(t, d / "r", "--preset", "gpt2-small", "--max-seq-len", "2048"),
            "--max-seq-len 2048 is longer than the 1024 positions of gpt2-small",
        ),
        (
            lambda d, t: ["--preset", "gpt3", "--run-dir", str(d / "r")],
            "unknown --preset 'gpt3'; valid presets are gpt2-tiny, gpt2-small, gpt2-medium, gpt2-large",
        ),
        (lambda d, t: text_job(t, d / "r", "--spm-model", str(d / "absent.model")), "absent.model: no such file"),
        (
            lambda d, t: [
                "--init-from",
                str(weights_without_tokenizer(d)),
                "--data",
                f"text:{t}",
                "--run-dir",
                str(d / "r"),
            ],
            "no tokenizer there",
        ),
        (
            lambda d, t: ["--init-from", str(d / "absent"), "--run-dir", str(d / "r")],
            "absent: no such directory; give a local Hugging Face GPT-2 directory",
        ),
        (lambda d, t: ["--init-from", str(d), "--preset", "gpt2-small"], "--preset and --init-from exclude"),
        (
            lambda d, t: text_job(t, d / "r", "--prompt", "the cat " * 10, "--sample-tokens", "250"),
            "that is more than the model's 256 positions",
        ),
        (
            lambda d, t: ["--top-k", "1000", "--steps", "2", "--run-dir", str(d / "r")],
            "--top-k 1000 exceeds the model's 90 tokens",
        ),
        (lambda d, t: ["--data", f"text:{d / 'absent.txt'}", "--run-dir", str(d / "r")], "no such file"),
        (lambda d, t: ["--batch-size", "0"], "--batch-size must be >= 1"),
        (lambda d, t: ["--valid-fraction", "0"], "--valid-fraction must be above 0: the run evaluates on held-out"),
        (lambda d, t: ["--steps", "4", "--warmup-steps", "4"], "--warmup-steps 4 leaves no step"),
        (lambda d, t: ["--resume", str(d)], "no config.json there"),
    ],
    ids=[
        "empty-corpus",
        "longer-than-positions",
        "longer-than-gpt2-small",
        "unknown-preset",
        "missing-spm-model",
        "init-from-without-tokenizer",
        "init-from-missing",
        "preset-and-init-from",
        "prompt-too-long",
        "top-k",
        "missing-text-file",
        "batch-size",
        "valid-fraction-0",
        "warmup",
        "resume-not-a-run",
    ],
)
def test_bad_input_is_one_message_and_the_exit_code_of_its_class(
    tmp_path, text_file, capsys, make_args, message, request
):
    data_fault = request.node.callspec.id in {"empty-corpus", "missing-text-file"}
    assert run_training(gpt.TASK, make_args(tmp_path, text_file)) == (EXIT_DATA if data_fault else EXIT_USAGE)
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and message in err


def test_help_lists_the_options_and_presets(capsys):
    with pytest.raises(SystemExit):
        run_training(gpt.TASK, ["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in (
        "--data",
        "--spm-model",
        "--vocab-size",
        "--max-seq-len",
        "--preset",
        "--positions",
        "--init-from",
        "--samples",
        "--prompt",
        "--temperature",
        "--top-k",
        "--resume",
        "gpt2-large",
    ):
        assert option in text
    assert "with --data synthetic:" in text and "with real data:" in text


def test_resolved_defaults_follow_the_data():
    assert gpt_config.resolve_config({}).preset == "gpt2-tiny"
    real = gpt_config.resolve_config({"data": "text:x", "steps": 100})
    assert (real.preset, real.max_seq_len, real.warmup_steps) == ("gpt2-small", 1024, 10)
    resumed = gpt_config.resolve_config(
        {"resume": "d"}, {"data": "text:x", "preset": "gpt2-tiny", "steps": 8, "warmup_steps": 2, "run_id": "r"}
    )
    assert (resumed.preset, resumed.steps, resumed.warmup_steps) == ("gpt2-tiny", 8, 2)
    assert gpt_config.resolve_config({"init_from": "d"}).preset is None
