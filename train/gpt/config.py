"""The flags of ``python -m train.gpt`` as one typed configuration, `GptConfig`, with its defaults (the dataclass
defaults are the embedded synthetic corpus's, sized so that its steps, about 0.8 of an epoch, finish in minutes on a
2-core CPU; `REAL_DATA_DEFAULTS` replace them for real data)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Mapping

from ls_jax.models.gpt import PRESETS, GPTConfig
from train.errors import ArgumentParser, UsageError
from train.harness import cli
from train.harness import config as config_lib
from train.harness.config import TrainingConfig

WARMUP_FRACTION = 0.1  # of the training steps, when --warmup-steps is not given


@dataclasses.dataclass(frozen=True, kw_only=True)
class GptConfig(TrainingConfig):
    """Every flag of ``python -m train.gpt`` (``--max-seq-len`` is ``max_seq_len``)."""

    # data
    data: str = "synthetic"
    text_field: str = "text"
    tfds_valid_split: str = "validation"
    tfds_data_dir: str | None = None
    valid_fraction: float = 0.05
    spm_model: str | None = None
    vocab_size: int = 16000
    max_seq_len: int = 64
    batch_size: int = 32
    # model
    implementation: str = "ls_jax"  # cli.IMPLEMENTATIONS
    preset: str | None = "gpt2-tiny"
    positions: int | None = None  # the preset's
    init_from: str | None = None
    dropout: float | None = None  # the model's own ratios
    # samples generated at the end
    samples: int = 3
    prompt: list[str] | None = None
    sample_tokens: int = 40
    temperature: float = 1.0
    top_k: int | None = None  # every token
    # training
    steps: int | None = 300
    warmup_steps: int | None = None  # WARMUP_FRACTION of the steps
    lr: float = 3e-3
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    log_every: int = 25
    eval_every: int | None = 100
    checkpoint_every: int | None = 100


REAL_DATA_DEFAULTS: dict[str, Any] = {
    "preset": "gpt2-small",
    "max_seq_len": 1024,
    "batch_size": 8,
    "steps": 20_000,
    "lr": 6e-4,
    "log_every": 100,
    "eval_every": 1000,
    "checkpoint_every": 1000,
    "sample_tokens": 100,
    "top_k": 40,
}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m train.gpt",
        description="Train a GPT-2 language model; with no arguments, a few minutes on the embedded synthetic "
        "corpus. Every run writes config.json, run.jsonl (docs/run-log.md), samples.txt, TensorBoard "
        "events and checkpoints (and spm.model for text data) to its run directory.",
        epilog=cli.defaults_epilog(
            GptConfig,
            REAL_DATA_DEFAULTS,
            notes=f"--warmup-steps: {WARMUP_FRACTION:.0%} of the steps (linear warmup, then linear decay to 0); "
            "--top-k: every token unless given or with real data\n",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,  # unset flags stay absent, so defaults and --resume can fill them
    )
    group = parser.add_argument_group("data")
    group.add_argument(
        "--data",
        help="synthetic | text:PATH (a file with one document per line, or a directory "
        "of .txt files, one document each) | tfds:NAME (e.g. tfds:lm1b; needs "
        "tensorflow-datasets)",
    )
    group.add_argument("--text-field", help="tfds feature holding the text")
    group.add_argument(
        "--tfds-valid-split",
        help="tfds split held out for validation ('' : hold out --valid-fraction of the training text instead)",
    )
    group.add_argument("--tfds-data-dir", help="TensorFlow Datasets data_dir")
    group.add_argument(
        "--valid-fraction",
        type=float,
        help="fraction of the training tokens held out for validation when the data has no validation split",
    )
    group.add_argument(
        "--spm-model",
        help="a sentencepiece model (pad=0 bos=1 eos=2 unk=3) to tokenize with; "
        "default: train one on the training text",
    )
    group.add_argument("--vocab-size", type=int, help="size of the sentencepiece vocabulary trained on the text")
    group.add_argument(
        "--max-seq-len",
        type=int,
        help="tokens per row: documents are packed, separated by end-of-document ids, into rows of "
        "exactly this length (at most the model's positions)",
    )
    group.add_argument(
        "--batch-size", type=int, help="rows per micro-batch over all devices (a multiple of the device count)"
    )

    group = parser.add_argument_group("model")
    cli.add_implementation_argument(
        group,
        "the GPT-2 of train/reference/zoo.py, written as Hugging Face's Flax "
        "GPT-2 is (--init-from weights map onto it)",
    )
    group.add_argument("--preset", help=f"GPT-2 shape of a randomly initialized model: {', '.join(PRESETS)}")
    group.add_argument(
        "--positions",
        type=int,
        help="learned positions of a randomly initialized model (default: the preset's, 256 for "
        "gpt2-tiny and 1024 for the others); raise it to train on longer rows",
    )
    group.add_argument(
        "--init-from",
        metavar="DIR",
        help="a local Hugging Face GPT-2 directory (config.json, model.safetensors or "
        "pytorch_model.bin, tokenizer.json or vocab.json + merges.txt): its weights and its "
        "tokenizer; needs transformers",
    )
    group.add_argument("--dropout", type=float, help="override every dropout ratio of the model")

    group = parser.add_argument_group("samples generated at the end")
    group.add_argument("--samples", type=int, help="how many texts to generate (0: none)")
    group.add_argument(
        "--prompt",
        action="append",
        help="text a sample continues (repeat for several; the samples cycle through them); "
        "default: each sample starts a new document",
    )
    group.add_argument("--sample-tokens", type=int, help="tokens generated per sample (at most)")
    group.add_argument("--temperature", type=float, help="sampling temperature (0: greedy)")
    group.add_argument("--top-k", type=int, help="draw from the k most probable tokens only")
    cli.add_training_arguments(parser)
    return parser


def resolve_config(given: Mapping[str, Any], saved: Mapping[str, Any] | None = None) -> GptConfig:
    """Defaults (the real-data ones unless ``--data synthetic``), then a resumed run's saved configuration, then the
    flags given now; with ``--init-from`` the checkpoint is the shape, so there is no preset."""
    chosen = {**(saved or {}), **given}
    real = chosen.get("data", GptConfig.data) != "synthetic"
    config = config_lib.resolve(GptConfig, given, saved, REAL_DATA_DEFAULTS if real else {})
    if config.init_from:
        for name in ("preset", "positions"):
            if chosen.get(name) is not None:
                raise UsageError(
                    f"{config_lib.flag(name)} and --init-from exclude each other: the checkpoint's "
                    "config.json is the shape"
                )
        config = config.replace(preset=None)
    if config.warmup_steps is None:
        config = config.replace(warmup_steps=round(WARMUP_FRACTION * config.steps))
    return config


def preset_positions(config: GptConfig) -> int:
    """The learned positions of a randomly initialized model: --positions, else the preset's."""
    return config.positions or GPTConfig.preset(config.preset).layer.max_seq_len


def check_sequence_fits(seq_len: int, positions: int, model: str, fix: str) -> None:
    if seq_len > positions:
        raise UsageError(f"--max-seq-len {seq_len} is longer than the {positions} positions of {model}; {fix}")


def check_config(config: GptConfig) -> None:
    cli.check_ranges(
        config,
        at_least_one=(
            "steps",
            "batch_size",
            "grad_accum",
            "log_every",
            "checkpoint_every",
            "keep_checkpoints",
            "vocab_size",
            "max_seq_len",
            "positions",
            "sample_tokens",
            "top_k",
        ),
        non_negative=("warmup_steps", "weight_decay", "clip_norm", "eval_every", "samples", "temperature"),
        fractions=("valid_fraction", "dropout"),
    )
    cli.check_implementation(config.implementation, config.remat)
    cli.check_init_from(config.init_from, "GPT-2")
    if config.valid_fraction == 0:
        raise UsageError(
            "--valid-fraction must be above 0: the run evaluates on held-out tokens (at least two, cut at a "
            "document boundary), which data with a validation split of its own provides instead"
        )
    if config.warmup_steps >= config.steps:
        raise UsageError(
            f"--warmup-steps {config.warmup_steps} leaves no step of the {config.steps} to train at the peak rate"
        )
    if config.init_from:
        return
    if config.preset not in PRESETS:
        raise UsageError(f"unknown --preset {config.preset!r}; valid presets are {', '.join(PRESETS)}")
    check_sequence_fits(
        config.max_seq_len,
        preset_positions(config),
        config.preset,
        f"lower --max-seq-len, or give the model more positions with --positions {config.max_seq_len}",
    )
