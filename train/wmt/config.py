"""The flags of ``python -m train.wmt`` as one typed configuration, `WmtConfig`, with its defaults: the dataclass
defaults are the embedded synthetic task's (sized to finish in minutes on a 2-core CPU); `REAL_DATA_DEFAULTS`
replace them for real data."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Mapping

from ls_jax.models import PRESETS
from train.errors import ArgumentParser, UsageError
from train.harness import cli
from train.harness import config as config_lib
from train.harness.config import TrainingConfig

# Device memory a decoding batch may use when the device does not report its own (CPU), MiB.
HOST_DECODE_MEMORY_MIB = 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class WmtConfig(TrainingConfig):
    """Every flag of ``python -m train.wmt`` (``--max-tokens`` is ``max_tokens``)."""

    # data
    data: str = "synthetic"
    src_lang: str = "de"
    tgt_lang: str = "en"
    tfds_data_dir: str | None = None
    spm: str | None = None
    spm_vocab_size: int = 512
    spm_model_type: str = "bpe"
    max_len: int | None = None  # the model's max_seq_len
    max_tokens: int = 2048
    # model and loss
    implementation: str = "ls_jax"  # cli.IMPLEMENTATIONS
    preset: str = "transformer-tiny"
    dropout: float | None = 0.0  # the task has ample data, and CPU dropout masks are slow; None: the preset's
    label_smoothing: float = 0.1
    # evaluation
    decode: str = "greedy"
    beam_size: int = 4
    length_penalty: float = 0.6
    bleu_sentences: int | None = None  # every sentence
    decode_memory: int | None = None  # MiB; half the device's free memory
    # training, as the synthetic task needs it; epochs: whole passes over the training pairs, in place of steps
    epochs: int | None = None
    steps: int | None = 320
    warmup_steps: int | None = 40
    lr: float = 3e-3
    log_every: int = 20
    eval_every: int | None = 0
    checkpoint_every: int | None = 100


REAL_DATA_DEFAULTS: dict[str, Any] = {
    "preset": "transformer-base",
    "dropout": None,
    "steps": 100_000,
    "warmup_steps": 4000,
    "lr": 7e-4,
    "max_tokens": 8192,
    "log_every": 100,
    "eval_every": 5000,
    "checkpoint_every": 5000,
    "spm_vocab_size": 32000,
    "spm_model_type": "unigram",
    "decode": "beam",
}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m train.wmt",
        description="Train the ls-jax Transformer (or the plain Flax one: --implementation flax) for translation; "
        "with no arguments, a few minutes on the embedded synthetic task. Every run writes config.json, "
        "spm.model, run.jsonl (docs/run-log.md), TensorBoard events and checkpoints to its run "
        "directory.",
        epilog=cli.defaults_epilog(WmtConfig, REAL_DATA_DEFAULTS),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,  # unset flags stay absent, so defaults and --resume can fill them
    )
    group = parser.add_argument_group("data")
    group.add_argument(
        "--data",
        help="synthetic[:PAIRS] (the embedded task, 20,000 training pairs or PAIRS) | text:DIR "
        "(DIR/{train,valid,test}.{src,tgt}) | tfds:NAME "
        "(e.g. tfds:wmt14_translate/de-en; needs tensorflow-datasets)",
    )
    group.add_argument("--src-lang", help="source language suffix / tfds feature")
    group.add_argument("--tgt-lang", help="target language suffix / tfds feature")
    group.add_argument("--tfds-data-dir", help="TensorFlow Datasets data_dir")
    group.add_argument(
        "--spm",
        help="existing sentencepiece model (pad=0 bos=1 eos=2 unk=3); default: train one "
        "on the training text, shared by source and target",
    )
    group.add_argument("--spm-vocab-size", type=int, help="vocabulary size when training sentencepiece")
    group.add_argument("--spm-model-type", choices=("unigram", "bpe"), help="sentencepiece model type")
    group.add_argument(
        "--max-len",
        type=int,
        help="drop pairs longer than this many tokens (EOS included); default and upper bound: the model's max_seq_len",
    )
    group.add_argument("--max-tokens", type=int, help="padded tokens per device per micro-batch")
    group.add_argument(
        "--epochs",
        type=int,
        help="train this many whole passes over the training pairs instead of --steps: an epoch's steps depend on "
        "--max-tokens and the device count (pairs are batched by length)",
    )

    group = parser.add_argument_group("model and loss")
    cli.add_implementation_argument(
        group,
        "the Transformer of train/reference/transformer.py (Flax's attention and its key/value cache for decoding)",
    )
    group.add_argument("--preset", help=f"Transformer preset: {', '.join(PRESETS)}")
    group.add_argument("--dropout", type=float, help="override every dropout ratio of the preset")
    group.add_argument("--label-smoothing", type=float, help="label smoothing epsilon")

    group = parser.add_argument_group("evaluation")
    group.add_argument("--decode", choices=("greedy", "beam"), help="decoding for BLEU")
    group.add_argument("--beam-size", type=int, help="beam size of --decode beam")
    group.add_argument("--length-penalty", type=float, help="GNMT length penalty alpha of --decode beam")
    group.add_argument(
        "--bleu-sentences",
        type=int,
        help="sentences per split decoded for BLEU at each evaluation (default all; 0: loss only)",
    )
    group.add_argument(
        "--decode-memory",
        type=int,
        metavar="MIB",
        help="device memory per device a decoding batch may use: batches hold as many sentences as "
        "fit (and at most --max-tokens); default half the memory free on the device, "
        f"{HOST_DECODE_MEMORY_MIB} MiB where it reports none (CPU)",
    )
    cli.add_training_arguments(parser)
    return parser


def resolve_config(given: Mapping[str, Any], saved: Mapping[str, Any] | None = None) -> WmtConfig:
    """Defaults (the real-data ones unless ``--data synthetic``), then a resumed run's saved configuration, then the
    flags given now."""
    data = given.get("data", (saved or {}).get("data", WmtConfig.data))
    synthetic = data.partition(":")[0] == "synthetic"
    if "epochs" in given and "steps" in given:
        raise UsageError("--epochs and --steps both set the length of the run; give one of them")
    config = config_lib.resolve(WmtConfig, given, saved, {} if synthetic else REAL_DATA_DEFAULTS)
    return dataclasses.replace(config, epochs=None) if "steps" in given else config  # a resume's new --steps wins


def check_config(config: WmtConfig) -> None:
    cli.check_ranges(
        config,
        at_least_one=(
            "steps",
            "epochs",
            "max_tokens",
            "grad_accum",
            "log_every",
            "checkpoint_every",
            "keep_checkpoints",
            "warmup_steps",
            "beam_size",
            "spm_vocab_size",
            "decode_memory",
            "max_len",
        ),
        non_negative=("eval_every", "bleu_sentences", "weight_decay", "clip_norm"),
        fractions=("label_smoothing", "dropout"),
    )
    cli.check_choice(config, "preset", PRESETS)
    cli.check_implementation(config.implementation, config.remat)
