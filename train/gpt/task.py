"""Train a GPT-2 language model: ``python -m train.gpt [--data ...] [--init-from DIR] [options]``.

With no arguments it trains ``gpt2-tiny`` (2 layers, hidden 128) from scratch on the embedded synthetic corpus
(`train.gpt.synthetic`) for a few minutes on any machine, reports the held-out perplexity next to the corpus's
entropy floor (the best any model can do) and prints a few generated documents. ``--data text:PATH`` or
``--data tfds:NAME`` trains on real text (a sentencepiece vocabulary trained on it, or ``--spm-model``);
``--init-from DIR`` continues training a local Hugging Face GPT-2 with its own tokenizer. Documents are packed
into full rows of ``--max-seq-len`` tokens (`train.gpt.data`).

Every run writes a run directory (default ``runs/<run_id>``):
  config.json        the configuration (``--resume`` reads it back)
  spm.model          the sentencepiece vocabulary (text and tfds data without --init-from)
  run.jsonl          the run log of docs/run-log.md (time, tokens/s, TFLOP/s, MFU, energy, cost, loss, perplexity)
  samples.txt        the texts generated at the end
  tensorboard/       the same numbers as TensorBoard events
  checkpoints/<step> orbax checkpoints (the last --keep-checkpoints, and always one at the end)

Exit codes (docs/training.md): 0 finished; 2 bad flags; 3 unusable data; 4 non-finite loss or state (the
last good checkpoint is kept); 5 a checkpoint or the run log could not be written; 128 + the signal number after
SIGINT/SIGTERM (a checkpoint is written first).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp

from ls_jax.models.gpt import PRESETS, GPTConfig, GPTLMHeadModel
from train.harness import cli, training as harness, signature
from train.gpt import data as gpt_data, model as gpt_model, synthetic as gpt_synthetic
from train.data import tokenizer as tokenizer_lib
from train.harness.errors import UsageError
from train.gpt.samples import FinalReport, Sampler
from train.harness.training import format_value
from train.harness.optimizer import linear_warmup_decay
from train.harness.parallel import DataParallel
from train.harness.precision import PRECISION_DTYPES
from train.records.rundir import Run
from train.harness.step import TrainState

WARMUP_FRACTION = 0.1  # of the training steps, when --warmup-steps is not given

# The synthetic corpus is sized so that these steps (about 0.8 of an epoch) finish in minutes on a 2-core CPU.
SYNTHETIC_DEFAULTS: dict[str, Any] = {
    "preset": "gpt2-tiny",
    "max_seq_len": 64,
    "batch_size": 32,
    "steps": 300,
    "lr": 3e-3,
    "log_every": 25,
    "eval_every": 100,
    "checkpoint_every": 100,
    "sample_tokens": 40,
}
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
GPT_DEFAULTS: dict[str, Any] = {
    **cli.TRAINING_DEFAULTS,
    "data": "synthetic",
    "text_field": "text",
    "tfds_valid_split": "validation",
    "tfds_data_dir": None,
    "valid_fraction": 0.05,
    "spm_model": None,
    "vocab_size": 16000,
    "preset": None,
    "positions": None,  # the preset's
    "init_from": None,
    "dropout": None,  # the model's own ratios
    "warmup_steps": None,  # WARMUP_FRACTION of the steps
    "weight_decay": 0.01,
    "clip_norm": 1.0,
    "samples": 3,
    "prompt": None,
    "temperature": 1.0,
    "top_k": None,  # every token
}


# ------------------------------------------------------------------------------------------ configuration


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m train.gpt",
        description="Train a GPT-2 language model; with no arguments, a few minutes on the embedded synthetic "
                    "corpus. Every run writes config.json, run.jsonl (docs/run-log.md), samples.txt, TensorBoard "
                    "events and checkpoints (and spm.model for text data) to its run directory.",
        epilog=cli.defaults_epilog(
            GPT_DEFAULTS, SYNTHETIC_DEFAULTS, REAL_DATA_DEFAULTS,
            notes=f"--warmup-steps: {WARMUP_FRACTION:.0%} of the steps (linear warmup, then linear decay to 0); "
                  "--top-k: every token unless given or with real data\n",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,  # unset flags stay absent, so defaults and --resume can fill them
    )
    group = parser.add_argument_group("data")
    group.add_argument("--data", help="synthetic | text:PATH (a file with one document per line, or a directory "
                                      "of .txt files, one document each) | tfds:NAME (e.g. tfds:lm1b; needs "
                                      "tensorflow-datasets)")
    group.add_argument("--text-field", help="tfds feature holding the text")
    group.add_argument("--tfds-valid-split", help="tfds split held out for validation ('' : hold out "
                                                  "--valid-fraction of the training text instead)")
    group.add_argument("--tfds-data-dir", help="TensorFlow Datasets data_dir")
    group.add_argument("--valid-fraction", type=float,
                       help="fraction of the training tokens held out for validation when the data has no "
                            "validation split")
    group.add_argument("--spm-model", help="a sentencepiece model (pad=0 bos=1 eos=2 unk=3) to tokenize with; "
                                           "default: train one on the training text")
    group.add_argument("--vocab-size", type=int, help="size of the sentencepiece vocabulary trained on the text")
    group.add_argument("--max-seq-len", type=int,
                       help="tokens per row: documents are packed, separated by end-of-document ids, into rows of "
                            "exactly this length (at most the model's positions)")
    group.add_argument("--batch-size", type=int, help="rows per micro-batch over all devices (a multiple of the "
                                                      "device count)")

    group = parser.add_argument_group("model")
    group.add_argument("--preset", help=f"GPT-2 shape of a randomly initialized model: {', '.join(PRESETS)}")
    group.add_argument("--positions", type=int,
                       help="learned positions of a randomly initialized model (default: the preset's, 256 for "
                            "gpt2-tiny and 1024 for the others); raise it to train on longer rows")
    group.add_argument("--init-from", metavar="DIR",
                       help="a local Hugging Face GPT-2 directory (config.json, model.safetensors or "
                            "pytorch_model.bin, tokenizer.json or vocab.json + merges.txt): its weights and its "
                            "tokenizer; needs transformers")
    group.add_argument("--dropout", type=float, help="override every dropout ratio of the model")

    group = parser.add_argument_group("samples generated at the end")
    group.add_argument("--samples", type=int, help="how many texts to generate (0: none)")
    group.add_argument("--prompt", action="append",
                       help="text a sample continues (repeat for several; the samples cycle through them); "
                            "default: each sample starts a new document")
    group.add_argument("--sample-tokens", type=int, help="tokens generated per sample (at most)")
    group.add_argument("--temperature", type=float, help="sampling temperature (0: greedy)")
    group.add_argument("--top-k", type=int, help="draw from the k most probable tokens only")
    cli.add_training_arguments(parser)
    return parser


def resolve_config(given: Mapping[str, Any], saved: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Defaults, then the saved configuration of a resumed run, then the flags given now."""
    chosen = {**(saved or {}), **given}
    by_data = SYNTHETIC_DEFAULTS if chosen.get("data", GPT_DEFAULTS["data"]) == "synthetic" else REAL_DATA_DEFAULTS
    config = {**GPT_DEFAULTS, **by_data, **chosen}
    if config["init_from"]:
        for key in ("preset", "positions"):
            if chosen.get(key) is not None:
                raise UsageError(f"--{key} and --init-from exclude each other: the checkpoint's config.json is the "
                                 "shape")
        config["preset"] = None
    if config["warmup_steps"] is None:
        config["warmup_steps"] = round(WARMUP_FRACTION * config["steps"])
    return config


def preset_positions(config: Mapping[str, Any]) -> int:
    """The learned positions of a randomly initialized model: --positions, else the preset's."""
    return config["positions"] or GPTConfig.preset(config["preset"]).layer.max_seq_len


def check_sequence_fits(seq_len: int, positions: int, model: str, fix: str) -> None:
    if seq_len > positions:
        raise UsageError(f"--max-seq-len {seq_len} is longer than the {positions} positions of {model}; {fix}")


def _check_config(config: Mapping[str, Any]) -> None:
    cli.check_ranges(
        config,
        at_least_one=("steps", "batch_size", "grad_accum", "log_every", "checkpoint_every", "keep_checkpoints",
                      "vocab_size", "max_seq_len", "positions", "sample_tokens", "top_k"),
        non_negative=("warmup_steps", "weight_decay", "clip_norm", "eval_every", "samples", "temperature"),
        fractions=("valid_fraction", "dropout"),
    )
    if config["warmup_steps"] >= config["steps"]:
        raise UsageError(f"--warmup-steps {config['warmup_steps']} leaves no step of the {config['steps']} to train "
                         "at the peak rate")
    if config["init_from"]:
        return
    if config["preset"] not in PRESETS:
        raise UsageError(f"unknown --preset {config['preset']!r}; valid presets are {', '.join(PRESETS)}")
    check_sequence_fits(config["max_seq_len"], preset_positions(config), config["preset"],
                        f"lower --max-seq-len, or give the model more positions with --positions "
                        f"{config['max_seq_len']}")


# ------------------------------------------------------------------------------------------------ model


def _layer_overrides(config: Mapping[str, Any], precision: str) -> dict[str, Any]:
    overrides: dict[str, Any] = {"dtype": PRECISION_DTYPES[precision], "remat": config["remat"]}
    if config["dropout"] is not None:
        overrides.update(hidden_dropout_ratio=config["dropout"], attn_prob_dropout_ratio=config["dropout"])
    return overrides


def load_checkpoint(config: Mapping[str, Any], precision: str) -> gpt_model.Pretrained:
    """The --init-from checkpoint, its rows fitting its positions.

    Raises:
      UsageError: the directory holds another model, weights that do not fit, or too few positions.
    """
    directory = config["init_from"]
    try:
        pretrained = gpt_model.init_from(directory, **_layer_overrides(config, precision))
    except ValueError as err:
        raise UsageError(f"--init-from {directory}: {err}") from err
    check_sequence_fits(config["max_seq_len"], pretrained.config.layer.max_seq_len, f"the checkpoint {directory}",
                        "lower --max-seq-len")
    return pretrained


def model_signature(config: Mapping[str, Any], model_cfg: GPTConfig) -> dict[str, Any]:
    return signature.stack_signature(config, model_cfg.vocab_size, model_cfg.layer, model_cfg.num_layers)


# ------------------------------------------------------------------------------------------------ data


def _spm_model(config: Mapping[str, Any], run_dir: Path) -> str | None:
    """The sentencepiece model to load: on --resume the run directory's copy, where the run had one."""
    own_copy = run_dir / tokenizer_lib.MODEL_FILENAME
    if config["resume"] and (config["data"] != "synthetic" or config["spm_model"]):
        return str(own_copy)
    return config["spm_model"]


def load_data(config: Mapping[str, Any], run_dir: Path, positions: int,
              tokenizer: gpt_data.Tokenizer | None) -> gpt_data.LMData:
    """The packed splits; a vocabulary trained here is written to the run directory by process 0 only."""
    with tempfile.TemporaryDirectory() as scratch:
        return gpt_data.load_data(
            config["data"], seq_len=config["max_seq_len"], max_positions=positions,
            run_dir=run_dir if jax.process_index() == 0 else Path(scratch), tokenizer=tokenizer,
            spm_model=_spm_model(config, run_dir), vocab_size=config["vocab_size"],
            valid_fraction=config["valid_fraction"], seed=config["seed"], text_field=config["text_field"],
            tfds_valid_split=config["tfds_valid_split"] or None, tfds_data_dir=config["tfds_data_dir"],
        )


def data_record(config: Mapping[str, Any], data: gpt_data.LMData) -> dict[str, Any]:
    """The run record's data: source, sizes, and the perplexities to judge the model by."""
    record = {"source": config["data"], "max_seq_len": config["max_seq_len"], **data.stats,
              "unigram_perplexity": gpt_data.unigram_perplexity(data.splits["train"].stream)}
    if config["data"] == "synthetic" and not config["spm_model"]:
        record["entropy_floor_perplexity"] = gpt_synthetic.entropy_floor().perplexity
    return record


# ------------------------------------------------------------------------------------------------ main


class Evaluation:
    """Perplexity on the validation rows; at the end also the report of `FinalReport` (samples, baselines)."""

    def __init__(self, evaluator: gpt_model.Evaluator, final_report: FinalReport):
        self.evaluator, self.final_report = evaluator, final_report

    def __call__(self, state: TrainState, final: bool) -> list[dict[str, Any]]:
        records = self.evaluator(state, final)
        if final:
            self.final_report(state.params, records)
        return records


def setup(run: Run, precision: str, parallel: DataParallel) -> harness.TaskSetup:
    """The checkpoint or preset, the packed data, the sampler and the schedule of one run."""
    config = run.config
    if config["batch_size"] % parallel.num_shards:
        raise UsageError(f"--batch-size {config['batch_size']} is not a multiple of the {parallel.num_shards} devices")
    pretrained = load_checkpoint(config, precision) if config["init_from"] else None
    positions = pretrained.config.layer.max_seq_len if pretrained else preset_positions(config)
    data = load_data(config, run.run_dir, positions, pretrained.tokenizer if pretrained else None)
    model_cfg = pretrained.config if pretrained else gpt_model.preset_config(
        config["preset"], vocab_size=data.tokenizer.size, max_seq_len=positions,
        **_layer_overrides(config, precision))
    model = GPTLMHeadModel(model_cfg)
    stream = gpt_data.LMBatchStream(
        data=data.splits["train"], rows=config["batch_size"], grad_accum=config["grad_accum"], seed=config["seed"],
        process_index=jax.process_index(), process_count=jax.process_count(),
    )
    evaluator = gpt_model.Evaluator(
        model, data.splits, config["batch_size"], put_batch=lambda batch: parallel.put_batch(batch, row_axis=0),
        process_index=jax.process_index(), process_count=jax.process_count(),
    )
    sampler = Sampler.from_config(config, model, data.tokenizer, run.run_dir)
    records = data_record(config, data)
    baselines = {key: records[key] for key in ("unigram_perplexity", "entropy_floor_perplexity") if key in records}

    def init_params(key: jax.Array) -> Any:
        return model.init(key, jnp.ones((1, config["max_seq_len"]), jnp.int32))["params"]

    return harness.TaskSetup(
        init_params=init_params,
        init_rng=jax.random.PRNGKey(config["seed"]),
        pretrained_params=pretrained.params if pretrained else None,
        loss_fn=gpt_model.make_loss_fn(model),
        stream=stream,
        batch_shapes=[{name: (shape, jnp.int32) for name in ("input_ids", "labels")} for shape in stream.shapes()],
        flops_fn=gpt_model.make_flops_fn(model_cfg),
        evaluate=Evaluation(evaluator, FinalReport(sampler, baselines)),
        learning_rate=linear_warmup_decay(config["lr"], config["warmup_steps"], config["steps"]),
        steps=config["steps"],
        eval_every=config["eval_every"],
        checkpoint_every=config["checkpoint_every"],
        model_signature=model_signature(config, model_cfg),
        model_name=signature.model_name(config),
        batch_record={"batch_size": config["batch_size"], "grad_accum": config["grad_accum"],
                      "seq_len": config["max_seq_len"]},
        data_record=records,
        config_record={**config, "positions": positions, "steps_per_epoch": stream.steps_per_epoch},
    )


TASK = harness.Task(
    name="gpt",
    counted=("tokens",),
    metric="perplexity",
    build_parser=build_parser,
    resolve_config=resolve_config,
    check_config=_check_config,
    setup=setup,
    throughput=lambda s: f"{format_value(s['tokens_per_s'], ',.0f')} tokens/s",
    score=lambda record: format_value(record["perplexity"], ".3f"),
)

