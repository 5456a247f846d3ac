"""Fine-tune BERT for sentiment classification: ``python -m train.imdb [--data ...] [--init-from DIR] [options]``.

With no arguments it trains a small BERT (``bert-tiny``: 2 layers, hidden 128) from scratch on the embedded
synthetic review task (`train.imdb.synthetic`) for 3 epochs, a few minutes on any machine, and reports accuracy on
its held-out sets. ``--data tfds:imdb_reviews`` (or ``csv:PATH`` / ``jsonl:PATH``) trains on real reviews;
``--init-from DIR`` starts from a local Hugging Face BERT checkpoint and its tokenizer.

Every run writes a run directory (default ``runs/<run_id>``):
  config.json        the configuration (``--resume`` reads it back)
  spm.model          the vocabulary trained on the data (not with --init-from: the checkpoint's tokenizer is used)
  run.jsonl          the run log of docs/run-log.md (time, examples/s, TFLOP/s, MFU, energy, cost, loss, accuracy)
  tensorboard/       the same numbers as TensorBoard events
  checkpoints/<step> orbax checkpoints (the last --keep-checkpoints, and always one at the end)

Exit codes (docs/training.md): 0 finished; 2 bad flags; 3 unusable data; 4 non-finite loss or state (the
last good checkpoint is kept); 5 a checkpoint or the run log could not be written; 128 + the signal number after
SIGINT/SIGTERM (a checkpoint is written first).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.models import BertConfig, BertForSequenceClassification
from train.harness import cli, training as harness, signature
from train.imdb import data as imdb_data
from train.data import tokenizer as tokenizer_lib
from train.data import stream as data_lib
from train.data.stream import host_rows
from train.harness.errors import DataError, UsageError
from train.harness.training import format_value
from train.imdb.model import (
    PRESETS, build_model, classification_sums, make_flops_fn, make_loss_fn, model_signature,
)
from train.harness.optimizer import linear_warmup_decay
from train.harness.parallel import DataParallel
from train.records.rundir import Run
from train.harness.step import TrainState

WARMUP_FRACTION = 0.1  # of the training steps, when --warmup-steps is not given

SYNTHETIC_DEFAULTS: dict[str, Any] = {
    "preset": "bert-tiny",
    "dropout": 0.0,  # ample data, no regularization needed; and CPU dropout masks are slow
    "max_seq_len": 40,
    "lr": 5e-4,
    "vocab_size": 1000,
    "log_every": 25,
}
REAL_DATA_DEFAULTS: dict[str, Any] = {
    "preset": "bert-base",
    "max_seq_len": 256,
    "lr": 2e-5,
    "vocab_size": 30000,
    "log_every": 100,
}
IMDB_DEFAULTS: dict[str, Any] = {
    **cli.TRAINING_DEFAULTS,
    "data": "synthetic",
    "test_data": None,
    "valid_fraction": 0.1,
    "text_field": "text",
    "label_field": "label",
    "tfds_data_dir": None,
    "init_from": None,
    "num_labels": None,
    "dropout": None,  # the model's own ratios
    "batch_size": 32,
    "epochs": 3,
    "steps": None,  # epochs x steps per epoch
    "warmup_steps": None,  # WARMUP_FRACTION of the steps
    "weight_decay": 0.01,
    "clip_norm": 1.0,
    "eval_every": None,  # every epoch
    "checkpoint_every": None,  # every epoch
}


# ------------------------------------------------------------------------------------------ configuration


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m train.imdb",
        description="Fine-tune BERT for sentiment classification; with no arguments, a few minutes on the embedded "
                    "synthetic review task. Every run writes config.json, the vocabulary, run.jsonl "
                    "(docs/run-log.md), TensorBoard events and checkpoints to its run directory.",
        epilog=cli.defaults_epilog(
            IMDB_DEFAULTS, SYNTHETIC_DEFAULTS, REAL_DATA_DEFAULTS,
            notes=f"--steps: epochs x steps per epoch; --warmup-steps: {WARMUP_FRACTION:.0%} of the steps (linear "
                  "warmup, then linear decay to 0);\n--eval-every and --checkpoint-every: one epoch (--eval-every 0: "
                  "only at the end)\n",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,  # unset flags stay absent, so defaults and --resume can fill them
    )
    group = parser.add_argument_group("data")
    group.add_argument("--data", help="synthetic | csv:PATH | jsonl:PATH | tfds:NAME (e.g. tfds:imdb_reviews; "
                                      "needs tensorflow-datasets)")
    group.add_argument("--test-data", help="csv:PATH | jsonl:PATH | tfds:NAME: the test set (default: the "
                                           "source's own test split where it has one)")
    group.add_argument("--valid-fraction", type=float,
                       help="fraction of the training examples held out (by --seed) for validation")
    group.add_argument("--text-field", help="column / JSON key / tfds feature holding the text")
    group.add_argument("--label-field", help="column / JSON key / tfds feature holding the label (0 .. "
                                             "num_labels - 1)")
    group.add_argument("--tfds-data-dir", help="TensorFlow Datasets data_dir")
    group.add_argument("--vocab-size", type=int, help="size of the sentencepiece vocabulary trained on the "
                                                      "training text (not with --init-from)")
    group.add_argument("--max-seq-len", type=int,
                       help="tokens per example, [CLS] and [SEP] included: longer texts are cut, and EVERY batch is "
                            "padded to this length, so the training step has one shape and compiles once")
    group.add_argument("--batch-size", type=int, help="examples per micro-batch over all devices (a multiple of the "
                                                      "device count)")
    group.add_argument("--epochs", type=int, help="passes over the training examples (--steps overrides it)")

    group = parser.add_argument_group("model")
    group.add_argument("--preset", help=f"BERT shape for a randomly initialized model: {', '.join(PRESETS)}")
    group.add_argument("--init-from", metavar="DIR",
                       help="a local Hugging Face BERT directory (config.json, model.safetensors or "
                            "pytorch_model.bin, vocab.txt or tokenizer.json): its weights (a classifier is "
                            "initialized when it has none) and its tokenizer; needs transformers")
    group.add_argument("--num-labels", type=int, help="classes (default 2; with --init-from the checkpoint's)")
    group.add_argument("--dropout", type=float, help="override every dropout ratio of the model")
    cli.add_training_arguments(parser)
    return parser


def resolve_config(given: Mapping[str, Any], saved: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Defaults, then the saved configuration of a resumed run, then the flags given now."""
    chosen = {**(saved or {}), **given}
    by_data = SYNTHETIC_DEFAULTS if chosen.get("data", IMDB_DEFAULTS["data"]) == "synthetic" else REAL_DATA_DEFAULTS
    config = {**IMDB_DEFAULTS, **by_data, **chosen}
    if config["init_from"]:
        if "preset" in chosen:
            raise UsageError("--preset and --init-from exclude each other: the checkpoint's config.json is the shape")
        config["preset"] = None
    return config


def _check_config(config: Mapping[str, Any]) -> None:
    cli.check_ranges(
        config,
        at_least_one=("steps", "epochs", "batch_size", "grad_accum", "log_every", "checkpoint_every",
                      "keep_checkpoints", "vocab_size", "num_labels"),
        non_negative=("warmup_steps", "weight_decay", "clip_norm", "eval_every"),
        fractions=("valid_fraction", "dropout"),
    )
    cli.check_choice(config, "preset", PRESETS)
    if config["max_seq_len"] < 2:
        raise UsageError(f"--max-seq-len must be >= 2 ([CLS] and [SEP]), got {config['max_seq_len']}")
    if config["init_from"] and config["num_labels"] is not None:
        raise UsageError("--num-labels cannot be combined with --init-from: the checkpoint's config.json sets it")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Step counts that depend on the size of the training set."""

    steps_per_epoch: int
    steps: int
    warmup_steps: int
    eval_every: int
    checkpoint_every: int

    @classmethod
    def resolve(cls, config: Mapping[str, Any], steps_per_epoch: int) -> Schedule:
        steps = config["steps"] or config["epochs"] * steps_per_epoch
        warmup = config["warmup_steps"]
        warmup = round(WARMUP_FRACTION * steps) if warmup is None else warmup
        if warmup >= steps:
            raise UsageError(f"--warmup-steps {warmup} leaves no step of the {steps} to train at the peak rate")
        eval_every = steps_per_epoch if config["eval_every"] is None else config["eval_every"]  # 0: at the end only
        return cls(steps_per_epoch, steps, warmup, eval_every,
                   config["checkpoint_every"] or steps_per_epoch)


# ------------------------------------------------------------------------------------------------ data


@dataclasses.dataclass
class Data:
    """The encoded splits, the vocabulary that encoded them and the facts logged in the run record."""

    vocabulary: imdb_data.Vocabulary
    splits: dict[str, imdb_data.Encoded]  # train, valid and/or test
    stats: dict[str, Any]


def _vocabulary(config: Mapping[str, Any], run_dir: Path, train: imdb_data.Split) -> imdb_data.Vocabulary:
    """The checkpoint's tokenizer (--init-from), the run directory's (--resume), or one trained on ``train``."""
    if config["init_from"]:
        return imdb_data.HuggingFaceVocabulary.load(config["init_from"])
    own_copy = run_dir / tokenizer_lib.MODEL_FILENAME
    if config["resume"]:
        return imdb_data.SentencePieceVocabulary(tokenizer_lib.load(own_copy))
    # Every host trains the same (deterministic) vocabulary; only process 0 keeps its file.
    with tempfile.TemporaryDirectory() as scratch:
        path = own_copy if jax.process_index() == 0 else Path(scratch) / tokenizer_lib.MODEL_FILENAME
        return imdb_data.train_vocabulary(train.texts, path, vocab_size=config["vocab_size"], seed=config["seed"])


def load_data(config: Mapping[str, Any], run_dir: Path) -> Data:
    splits = imdb_data.read_dataset(
        config["data"], test_data=config["test_data"], valid_fraction=config["valid_fraction"], seed=config["seed"],
        text_field=config["text_field"], label_field=config["label_field"], tfds_data_dir=config["tfds_data_dir"],
    )
    vocabulary = _vocabulary(config, run_dir, splits["train"])
    encoded = {name: imdb_data.encode_split(vocabulary, split, config["max_seq_len"]) for name, split in splits.items()}
    stats: dict[str, Any] = {"vocab_size": vocabulary.size, "max_seq_len": config["max_seq_len"]}
    for name, split in splits.items():
        stats[name] = {
            "examples": len(split),
            "truncated": encoded[name].truncated,
            "label_counts": np.bincount(split.labels).tolist(),
            "source": split.source,
        }
    return Data(vocabulary, encoded, stats)


def check_labels(data: Data, num_labels: int, fix: str) -> None:
    """Raises DataError naming the source and the label when a label is not in 0 .. num_labels - 1."""
    for name, split in data.splits.items():
        largest = int(split.labels.max())
        if largest >= num_labels:
            raise DataError(f"{data.stats[name]['source']} has label {largest}, but the model has {num_labels} "
                             f"labels (0 .. {num_labels - 1}); {fix}")


# -------------------------------------------------------------------------------------------- evaluation


class Evaluator:
    """Loss and accuracy on the evaluation splits, in batches of the training batch size (one more compiled shape).

    During training it scores the validation split (the test split when there is none); at the end every
    evaluation split.
    """

    def __init__(self, model: BertForSequenceClassification, data: Data, batch_size: int,
                 parallel: DataParallel):
        self.data, self.batch_size, self.parallel = data, batch_size, parallel
        self.splits = [name for name in imdb_data.SPLITS if name != "train" and name in data.splits]
        pad_id = data.vocabulary.pad_id

        def sums(params, batch):
            input_ids = batch["input_ids"]
            logits = model.apply({"params": params}, input_ids, input_ids != pad_id, deterministic=True)
            return classification_sums(logits, batch["labels"])

        self._sums = jax.jit(sums, out_shardings=parallel.replicated)

    def evaluate_split(self, params, name: str) -> dict[str, Any]:
        data = self.data.splits[name]
        totals = None
        for indices in data_lib.fixed_eval_plan(len(data), self.batch_size):
            local = host_rows(indices, jax.process_index(), jax.process_count())
            batch = self.parallel.put_batch(imdb_data.make_batch(data, local), row_axis=0)
            sums = self._sums(params, batch)
            totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
        loss, examples, correct = (float(value) for value in jax.device_get(totals))
        return {"split": name, "loss": loss / examples, "nll": loss / examples, "accuracy": correct / examples}

    def __call__(self, state: TrainState, final: bool) -> list[dict[str, Any]]:
        splits = self.splits if final else self.splits[:1]
        return [self.evaluate_split(state.params, name) for name in splits]


# ------------------------------------------------------------------------------------------------- main


def _check_shapes(config: Mapping[str, Any], model_cfg: BertConfig, parallel: DataParallel) -> None:
    positions = model_cfg.layer.max_seq_len
    if config["max_seq_len"] > positions:
        raise UsageError(f"--max-seq-len {config['max_seq_len']} exceeds the model's {positions} positions "
                         f"({signature.model_name(config)})")
    if config["batch_size"] % parallel.num_shards:
        raise UsageError(f"--batch-size {config['batch_size']} is not a multiple of the {parallel.num_shards} devices")


def setup(run: Run, precision: str, parallel: DataParallel) -> harness.TaskSetup:
    """The vocabulary, data, model (random or pretrained) and epoch-based schedule of one run."""
    config = run.config
    data = load_data(config, run.run_dir)
    model_key, head_key = jax.random.split(jax.random.PRNGKey(config["seed"]))
    model_cfg, pretrained = build_model(config, data.vocabulary.size, precision, head_key)
    _check_shapes(config, model_cfg, parallel)
    check_labels(data, model_cfg.num_labels,
                 "the checkpoint's config.json sets them" if config["init_from"] else "set --num-labels")
    model = BertForSequenceClassification(model_cfg)
    stream = imdb_data.BatchStream(
        data.splits["train"], batch_size=config["batch_size"], grad_accum=config["grad_accum"], seed=config["seed"],
        process_index=jax.process_index(), process_count=jax.process_count(),
    )
    schedule = Schedule.resolve(config, stream.steps_per_epoch)
    rows, seq_len = config["batch_size"], config["max_seq_len"]

    def init_params(key: jax.Array) -> Any:
        return model.init(key, jnp.ones((1, seq_len), jnp.int32))["params"]

    return harness.TaskSetup(
        init_params=init_params,
        init_rng=model_key,
        pretrained_params=pretrained,
        loss_fn=make_loss_fn(model, data.vocabulary.pad_id),
        stream=stream,
        batch_shapes=[{
            "input_ids": ((config["grad_accum"], rows, seq_len), jnp.int32),
            "labels": ((config["grad_accum"], rows), jnp.int32),
        }],
        flops_fn=make_flops_fn(model_cfg),
        evaluate=Evaluator(model, data, config["batch_size"], parallel),
        learning_rate=linear_warmup_decay(config["lr"], schedule.warmup_steps, schedule.steps),
        steps=schedule.steps,
        eval_every=schedule.eval_every,
        checkpoint_every=schedule.checkpoint_every,
        model_signature=model_signature(config, model_cfg),
        model_name=signature.model_name(config),
        batch_record={"batch_size": config["batch_size"], "grad_accum": config["grad_accum"]},
        data_record={"source": config["data"], **data.stats},
        config_record={**config, **dataclasses.asdict(schedule)},
    )


TASK = harness.Task(
    name="imdb",
    counted=("examples",),
    metric="accuracy",
    build_parser=build_parser,
    resolve_config=resolve_config,
    check_config=_check_config,
    setup=setup,
    throughput=lambda s: f"{format_value(s['examples_per_s'], '.1f')} examples/s",
    score=lambda record: format_value(record["accuracy"], ".2%"),
)

