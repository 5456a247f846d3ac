"""The flags of ``python -m train.imdb`` as one typed configuration, `ImdbConfig`, with its defaults (the
dataclass defaults are the embedded synthetic task's; `REAL_DATA_DEFAULTS` replace them for real data), and the
step counts that follow from the training set's size (`Schedule`)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Mapping

from train.errors import ArgumentParser, UsageError
from train.harness import cli
from train.harness import config as config_lib
from train.harness.config import TrainingConfig

WARMUP_FRACTION = 0.1  # of the training steps, when --warmup-steps is not given


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImdbConfig(TrainingConfig):
    """Every flag of ``python -m train.imdb`` (``--max-seq-len`` is ``max_seq_len``)."""

    # data
    data: str = "synthetic"
    test_data: str | None = None  # the source's own test split
    valid_fraction: float = 0.1
    text_field: str = "text"
    label_field: str = "label"
    tfds_data_dir: str | None = None
    vocab_size: int = 1000
    max_seq_len: int = 40
    batch_size: int = 32
    epochs: int = 3
    # model
    implementation: str = "ls_jax"  # cli.IMPLEMENTATIONS
    preset: str | None = "bert-tiny"
    init_from: str | None = None
    num_labels: int | None = None  # 2, or the checkpoint's
    dropout: float | None = 0.0  # ample data, and CPU dropout masks are slow; None: the model's own ratios
    # training
    steps: int | None = None  # epochs x steps per epoch
    warmup_steps: int | None = None  # WARMUP_FRACTION of the steps
    lr: float = 5e-4
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    log_every: int = 25
    eval_every: int | None = None  # every epoch
    checkpoint_every: int | None = None  # every epoch


# bert-tiny is bert-base shrunk to train from scratch in minutes on a CPU; bert-small and bert-medium are the
# compact BERT shapes of the same names (4 and 8 layers of width 512), which train from scratch on one GPU.
PRESETS: dict[str, dict[str, Any]] = {
    "bert-tiny": dict(
        base="bert-base",
        layer=dict(hidden_size=128, intermediate_size=512, nhead=2, max_seq_len=128),
        num_layers=2,
    ),
    "bert-small": dict(base="bert-base", layer=dict(hidden_size=512, intermediate_size=2048, nhead=8), num_layers=4),
    "bert-medium": dict(base="bert-base", layer=dict(hidden_size=512, intermediate_size=2048, nhead=8), num_layers=8),
    "bert-base": dict(base="bert-base", layer={}),
    "bert-large": dict(base="bert-large", layer={}),
}


REAL_DATA_DEFAULTS: dict[str, Any] = {
    "preset": "bert-base",
    "dropout": None,
    "max_seq_len": 256,
    "lr": 2e-5,
    "vocab_size": 30000,
    "log_every": 100,
}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m train.imdb",
        description="Fine-tune BERT for sentiment classification; with no arguments, a few minutes on the embedded "
        "synthetic review task. Every run writes config.json, the vocabulary, run.jsonl "
        "(docs/run-log.md), TensorBoard events and checkpoints to its run directory.",
        epilog=cli.defaults_epilog(
            ImdbConfig,
            REAL_DATA_DEFAULTS,
            notes=f"--steps: epochs x steps per epoch; --warmup-steps: {WARMUP_FRACTION:.0%} of the steps (linear "
            "warmup, then linear decay to 0);\n--eval-every and --checkpoint-every: one epoch (--eval-every 0: "
            "only at the end)\n",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,  # unset flags stay absent, so defaults and --resume can fill them
    )
    group = parser.add_argument_group("data")
    group.add_argument(
        "--data",
        help="synthetic | csv:PATH | jsonl:PATH | tfds:NAME (e.g. tfds:imdb_reviews; needs tensorflow-datasets)",
    )
    group.add_argument(
        "--test-data",
        help="csv:PATH | jsonl:PATH | tfds:NAME: the test set (default: the source's own test split where it has one)",
    )
    group.add_argument(
        "--valid-fraction", type=float, help="fraction of the training examples held out (by --seed) for validation"
    )
    group.add_argument("--text-field", help="column / JSON key / tfds feature holding the text")
    group.add_argument("--label-field", help="column / JSON key / tfds feature holding the label (0 .. num_labels - 1)")
    group.add_argument("--tfds-data-dir", help="TensorFlow Datasets data_dir")
    group.add_argument(
        "--vocab-size",
        type=int,
        help="size of the sentencepiece vocabulary trained on the training text (not with --init-from)",
    )
    group.add_argument(
        "--max-seq-len",
        type=int,
        help="tokens per example, [CLS] and [SEP] included: longer texts are cut, and EVERY batch is "
        "padded to this length, so the training step has one shape and compiles once",
    )
    group.add_argument(
        "--batch-size", type=int, help="examples per micro-batch over all devices (a multiple of the device count)"
    )
    group.add_argument("--epochs", type=int, help="passes over the training examples (--steps overrides it)")

    group = parser.add_argument_group("model")
    cli.add_implementation_argument(
        group,
        "the BERT of train/reference/zoo.py, written as Hugging Face's Flax BERT is (--init-from weights map onto it)",
    )
    group.add_argument("--preset", help=f"BERT shape for a randomly initialized model: {', '.join(PRESETS)}")
    group.add_argument(
        "--init-from",
        metavar="DIR",
        help="a local Hugging Face BERT directory (config.json, model.safetensors or "
        "pytorch_model.bin, vocab.txt or tokenizer.json): its weights (a classifier is "
        "initialized when it has none) and its tokenizer; needs transformers",
    )
    group.add_argument(
        "--num-labels",
        type=int,
        help="classes (default 2; with --init-from the checkpoint's; one without a classifier takes any number)",
    )
    group.add_argument("--dropout", type=float, help="override every dropout ratio of the model")
    cli.add_training_arguments(parser)
    return parser


def resolve_config(given: Mapping[str, Any], saved: Mapping[str, Any] | None = None) -> ImdbConfig:
    """Defaults (the real-data ones unless ``--data synthetic``), then a resumed run's saved configuration, then the
    flags given now; with ``--init-from`` the checkpoint is the shape, so there is no preset."""
    chosen = {**(saved or {}), **given}
    real = chosen.get("data", ImdbConfig.data) != "synthetic"
    config = config_lib.resolve(ImdbConfig, given, saved, REAL_DATA_DEFAULTS if real else {})
    if config.init_from:
        if "preset" in chosen:
            raise UsageError("--preset and --init-from exclude each other: the checkpoint's config.json is the shape")
        config = config.replace(preset=None)
    return config


def check_config(config: ImdbConfig) -> None:
    cli.check_ranges(
        config,
        at_least_one=(
            "steps",
            "epochs",
            "batch_size",
            "grad_accum",
            "log_every",
            "checkpoint_every",
            "keep_checkpoints",
            "vocab_size",
            "num_labels",
        ),
        non_negative=("warmup_steps", "weight_decay", "clip_norm", "eval_every"),
        fractions=("valid_fraction", "dropout"),
    )
    cli.check_choice(config, "preset", PRESETS)
    cli.check_implementation(config.implementation, config.remat)
    if config.max_seq_len < 3:
        raise UsageError(f"--max-seq-len must be >= 3 ([CLS], [SEP] and a token of the text), got {config.max_seq_len}")
    cli.check_init_from(config.init_from, "BERT")
    if config.num_labels == 1:
        raise UsageError("--num-labels must be >= 2: a classifier of one class has nothing to learn")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Step counts that depend on the size of the training set."""

    steps_per_epoch: int
    steps: int
    warmup_steps: int
    eval_every: int
    checkpoint_every: int

    @classmethod
    def resolve(cls, config: ImdbConfig, steps_per_epoch: int) -> Schedule:
        steps = config.steps or config.epochs * steps_per_epoch
        warmup = config.warmup_steps
        warmup = round(WARMUP_FRACTION * steps) if warmup is None else warmup
        if warmup >= steps:
            raise UsageError(f"--warmup-steps {warmup} leaves no step of the {steps} to train at the peak rate")
        eval_every = steps_per_epoch if config.eval_every is None else config.eval_every  # 0: at the end only
        return cls(steps_per_epoch, steps, warmup, eval_every, config.checkpoint_every or steps_per_epoch)
