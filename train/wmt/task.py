"""Train the ls-jax Transformer for translation: ``python -m train.wmt [--data ...] [options]``.

With no arguments it trains ``transformer-tiny`` on the embedded synthetic translation task (`train.wmt.synthetic`)
for a few minutes on any machine and reports BLEU on its held-out test set. With ``--data text:DIR`` or
``--data tfds:wmt14_translate/de-en`` it trains on real parallel text with a shared sentencepiece vocabulary.

Every run writes a run directory (default ``runs/<run_id>``):
  config.json        the resolved configuration (``--resume`` reads it back)
  spm.model          the vocabulary
  run.jsonl          the run log of docs/run-log.md (time, tokens/s, TFLOP/s, MFU, energy, cost, loss, BLEU)
  tensorboard/       the same numbers as TensorBoard events
  checkpoints/<step> orbax checkpoints (the last --keep-checkpoints, and always one at the end)

Exit codes (docs/training.md): 0 finished; 2 bad flags; 3 unusable data; 4 non-finite loss or state (the
last good checkpoint is kept); 5 a checkpoint or the run log could not be written; 128 + the signal number after
SIGINT/SIGTERM (a checkpoint is written first).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import sacrebleu

from ls_jax.models import PAD_ID, PRESETS, Transformer
from ls_jax.models.decoding import beam_search, greedy_decode
from ls_jax.ops import label_smoothed_cross_entropy
from train.harness import cli, training as harness
from train.wmt import data as wmt_data
from train.costs import metrics as metrics_lib
from train.data import tokenizer as tokenizer_lib
from train.harness.errors import UsageError
from train.harness.training import format_value
from train.harness.optimizer import inverse_sqrt_schedule
from train.harness.parallel import DataParallel
from train.records.rundir import Run
from train.harness.step import TrainState
from train.wmt.model import (decode_row_bytes, decode_rows, make_flops_fn, make_loss_fn, model_config,
                             model_signature)

# Defaults by data source: the synthetic task is sized to finish in minutes on a 2-core CPU.
SYNTHETIC_DEFAULTS: dict[str, Any] = {
    "preset": "transformer-tiny",
    "dropout": 0.0,  # the task has ample data; no regularization needed, and CPU dropout masks are slow
    "steps": 320,
    "warmup_steps": 40,
    "lr": 3e-3,
    "max_tokens": 2048,
    "log_every": 20,
    "eval_every": 0,
    "checkpoint_every": 100,
    "spm_vocab_size": 512,
    "spm_model_type": "bpe",
    "decode": "greedy",
}
REAL_DATA_DEFAULTS: dict[str, Any] = {
    "preset": "transformer-base",
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
WMT_DEFAULTS: dict[str, Any] = {
    **cli.TRAINING_DEFAULTS,
    "data": "synthetic",
    "src_lang": "de",
    "tgt_lang": "en",
    "tfds_data_dir": None,
    "spm": None,
    "max_len": None,
    "label_smoothing": 0.1,
    "dropout": None,
    "beam_size": 4,
    "length_penalty": 0.6,
    "bleu_sentences": None,
    "decode_memory": None,
}
# Device memory a decoding batch may use when the device does not report its own (CPU), MiB.
HOST_DECODE_MEMORY_MIB = 1024


# ------------------------------------------------------------------------------------------ configuration


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m train.wmt",
        description="Train the ls-jax Transformer for translation; with no arguments, a few minutes on the "
                    "embedded synthetic task. Every run writes config.json, spm.model, run.jsonl "
                    "(docs/run-log.md), TensorBoard events and checkpoints to its run directory.",
        epilog=cli.defaults_epilog(WMT_DEFAULTS, SYNTHETIC_DEFAULTS, REAL_DATA_DEFAULTS),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,  # unset flags stay absent, so defaults and --resume can fill them
    )
    group = parser.add_argument_group("data")
    group.add_argument("--data", help="synthetic | text:DIR (DIR/{train,valid,test}.{src,tgt}) | tfds:NAME "
                                      "(e.g. tfds:wmt14_translate/de-en; needs tensorflow-datasets)")
    group.add_argument("--src-lang", help="source language suffix / tfds feature")
    group.add_argument("--tgt-lang", help="target language suffix / tfds feature")
    group.add_argument("--tfds-data-dir", help="TensorFlow Datasets data_dir")
    group.add_argument("--spm", help="existing sentencepiece model (pad=0 bos=1 eos=2 unk=3); default: train one "
                                     "on the training text, shared by source and target")
    group.add_argument("--spm-vocab-size", type=int, help="vocabulary size when training sentencepiece")
    group.add_argument("--spm-model-type", choices=("unigram", "bpe"), help="sentencepiece model type")
    group.add_argument("--max-len", type=int, help="drop pairs longer than this many tokens (EOS included); "
                                                   "default and upper bound: the model's max_seq_len")
    group.add_argument("--max-tokens", type=int, help="padded tokens per device per micro-batch")

    group = parser.add_argument_group("model and loss")
    group.add_argument("--preset", help=f"Transformer preset: {', '.join(PRESETS)}")
    group.add_argument("--dropout", type=float, help="override every dropout ratio of the preset")
    group.add_argument("--label-smoothing", type=float, help="label smoothing epsilon")

    group = parser.add_argument_group("evaluation")
    group.add_argument("--decode", choices=("greedy", "beam"), help="decoding for BLEU")
    group.add_argument("--beam-size", type=int, help="beam size of --decode beam")
    group.add_argument("--length-penalty", type=float, help="GNMT length penalty alpha of --decode beam")
    group.add_argument("--bleu-sentences", type=int, help="sentences per split decoded for BLEU at each "
                                                           "evaluation (default all; 0: loss only)")
    group.add_argument("--decode-memory", type=int, metavar="MIB",
                       help="device memory per device a decoding batch may use: batches hold as many sentences as "
                            "fit (and at most --max-tokens); default half the memory free on the device, "
                            f"{HOST_DECODE_MEMORY_MIB} MiB where it reports none (CPU)")
    cli.add_training_arguments(parser)
    return parser


def resolve_config(given: Mapping[str, Any], saved: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Defaults, then the saved configuration of a resumed run, then the flags given now."""
    data = given.get("data", (saved or {}).get("data", WMT_DEFAULTS["data"]))
    by_data = SYNTHETIC_DEFAULTS if data == "synthetic" else REAL_DATA_DEFAULTS
    return {**WMT_DEFAULTS, **by_data, **(saved or {}), **given}


def _check_config(config: Mapping[str, Any]) -> None:
    cli.check_ranges(
        config,
        at_least_one=("steps", "max_tokens", "grad_accum", "log_every", "checkpoint_every", "keep_checkpoints",
                      "warmup_steps", "beam_size", "spm_vocab_size", "decode_memory"),
        non_negative=("eval_every", "bleu_sentences", "weight_decay", "clip_norm"),
        fractions=("label_smoothing", "dropout"),
    )
    cli.check_choice(config, "preset", PRESETS)


# ------------------------------------------------------------------------------------------------ data


@dataclasses.dataclass
class Data:
    processor: Any  # sentencepiece
    train: wmt_data.ParallelData
    eval_sets: dict[str, wmt_data.ParallelData]  # valid, test
    references: dict[str, list[str]]  # the raw target sentences kept, per split (BLEU references)
    stats: dict[str, Any]


def _vocabulary(config: Mapping[str, Any], spm_given: str | None, run_dir: Path, corpus: wmt_data.Corpus):
    """The run's sentencepiece model.

    On --resume: ``spm_given`` (a --spm passed now, which the checkpoint check then compares) or the run
    directory's copy. Otherwise --spm (copied into the run directory) or one trained on the training text.
    """
    own_copy = run_dir / tokenizer_lib.MODEL_FILENAME
    is_main = jax.process_index() == 0
    try:
        if config["resume"]:
            return tokenizer_lib.load(spm_given or own_copy)
        if config["spm"]:
            processor = tokenizer_lib.load(config["spm"])
            if is_main:
                tokenizer_lib.copy_into(config["spm"], run_dir)
            return processor
    except ValueError as err:
        raise UsageError(str(err)) from err
    src, tgt = corpus["train"]
    # Every host trains the same (deterministic) model; only process 0 keeps it, in the run directory.
    with tempfile.TemporaryDirectory() as scratch:
        target = own_copy if is_main else Path(scratch) / tokenizer_lib.MODEL_FILENAME
        try:
            return tokenizer_lib.train(
                [*src, *tgt], target, vocab_size=config["spm_vocab_size"], model_type=config["spm_model_type"],
                seed=config["seed"],
            )
        except tokenizer_lib.VocabularyTooSmall as err:
            raise UsageError(f"--spm-vocab-size {config['spm_vocab_size']}: {err}; pass --spm-vocab-size "
                             f"{err.minimum} or more") from None


def load_data(config: Mapping[str, Any], spm_given: str | None, run_dir: Path, max_len: int) -> Data:
    corpus = wmt_data.read_corpus(
        config["data"], src_lang=config["src_lang"], tgt_lang=config["tgt_lang"], seed=config["seed"],
        tfds_data_dir=config["tfds_data_dir"],
    )
    processor = _vocabulary(config, spm_given, run_dir, corpus)
    stats: dict[str, Any] = {"vocab_size": processor.GetPieceSize(), "max_len": max_len}
    splits, references = {}, {}
    for split, (src, tgt) in corpus.items():
        encoded = wmt_data.encode(processor, src, tgt)
        keep, kept = wmt_data.length_filter(encoded, max_len)
        if kept.kept == 0:
            raise UsageError(f"no {split} pair is at most {max_len} tokens long; raise --max-len")
        splits[split] = encoded.take(keep)
        references[split] = [tgt[i] for i in keep]
        stats[split] = dataclasses.asdict(kept)
    eval_sets = {split: data for split, data in splits.items() if split != "train"}
    return Data(processor, splits.pop("train"), eval_sets, references, stats)


# -------------------------------------------------------------------------------------------- evaluation


def _gather_rows(array: jax.Array) -> np.ndarray:
    """A globally sharded array as one numpy array on every host."""
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(array))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def _least_over_hosts(value: int) -> int:
    """The smallest of every host's ``value``: hosts must agree on batch shapes."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.int64(value))))


class Evaluator:
    """Validation (and, at the end, test) loss and BLEU of the current parameters.

    Each eval set is cut into batches of one fixed shape (rows, L) with L the set's longest padded example, so
    the loss and the decoder compile once per set; batches hold examples sorted by length so greedy decoding
    stops early.
    """

    def __init__(self, model: Transformer, data: Data, config: Mapping[str, Any], parallel: DataParallel):
        self.model, self.data, self.config, self.parallel = model, data, config, parallel
        self.epsilon = config["label_smoothing"]
        self.decode_len = model.config.layer.max_seq_len
        self._loss = jax.jit(self._loss_sums, out_shardings=parallel.replicated)

    def _loss_sums(self, params, batch):
        logits = self.model.apply({"params": params}, batch["src"], batch["tgt_in"], deterministic=True)
        return label_smoothed_cross_entropy(logits, batch["labels"], epsilon=self.epsilon, pad_id=PAD_ID)

    def _batches(self, data: wmt_data.ParallelData, limit: int | None, decoding: bool = False):
        """(global indices (rows,), device batch) over the first ``limit`` examples (all for None); for
        ``decoding``, batches small enough for the decoder's memory budget (`decode_rows`)."""
        count = len(data) if limit is None else min(limit, len(data))
        length, plan = wmt_data.eval_plan(
            data.example_lengths[:count], max_tokens=self.config["max_tokens"], num_shards=self.parallel.num_shards,
            max_rows=self.decode_rows if decoding else None,
        )
        for indices in plan:
            local = wmt_data.host_rows(indices, jax.process_index(), jax.process_count())
            yield indices, self.parallel.put_batch(wmt_data.make_batch(data, local, length), row_axis=0)

    @functools.cached_property
    def decode_budget_bytes(self) -> int:
        """Device bytes a decoding batch may use: ``--decode-memory``, else half the memory free on the devices at
        the first evaluation (fixed from then on, so the decoder compiles once), the least over all hosts."""
        if self.config["decode_memory"] is not None:
            return self.config["decode_memory"] * 2**20
        free = metrics_lib.free_memory_bytes(jax.local_devices())
        return _least_over_hosts(HOST_DECODE_MEMORY_MIB * 2**20 if free is None else free // 2)

    def decode_rows(self, src_len: int) -> int:
        """Rows of ``src_len`` tokens per decoding batch: as many as the budget holds, at least one per device."""
        beams = self.config["beam_size"] if self.config["decode"] == "beam" else 1
        row_bytes = decode_row_bytes(self.model.config, src_len=src_len, decode_len=self.decode_len,
                                               beams=beams)
        return decode_rows(self.decode_budget_bytes, row_bytes, num_shards=self.parallel.num_shards)

    def _decode(self, params, src: jax.Array) -> jax.Array:
        if self.config["decode"] == "beam":
            return beam_search(
                self.model, params, src, beam_size=self.config["beam_size"], max_len=self.decode_len,
                length_penalty=self.config["length_penalty"],
            )
        return greedy_decode(self.model, params, src, max_len=self.decode_len)

    def evaluate_split(self, params, split: str, bleu_limit: int | None) -> dict[str, Any]:
        data = self.data.eval_sets[split]
        loss_sum = nll_sum = tokens = 0.0
        for _, batch in self._batches(data, None):
            loss, nll, count = jax.device_get(self._loss(params, batch))
            loss_sum, nll_sum, tokens = loss_sum + float(loss), nll_sum + float(nll), tokens + float(count)
        result = {"split": split, "loss": loss_sum / tokens, "nll": nll_sum / tokens, "bleu": None}
        if bleu_limit != 0:
            hypotheses = self.translate(params, split, bleu_limit)
            references = self.data.references[split][: len(hypotheses)]
            result["bleu"] = sacrebleu.corpus_bleu(hypotheses, [references]).score
        return result

    def translate(self, params, split: str, limit: int | None) -> list[str]:
        """The decoded translations of the first ``limit`` sentences of ``split`` (all for None), in order."""
        hypotheses: dict[int, str] = {}
        for indices, batch in self._batches(self.data.eval_sets[split], limit, decoding=True):
            output = _gather_rows(self._decode(params, batch["src"]))
            texts = tokenizer_lib.decode(self.data.processor, output)
            hypotheses.update((int(i), text) for i, text in zip(indices, texts) if i >= 0)
        return [hypotheses[i] for i in sorted(hypotheses)]

    def __call__(self, state: TrainState, final: bool) -> list[dict[str, Any]]:
        """During training the validation split; at the end every evaluation split (valid, test)."""
        splits = list(self.data.eval_sets) if final else ["valid"]
        return [self.evaluate_split(state.params, split, self.config["bleu_sentences"]) for split in splits]


# ------------------------------------------------------------------------------------------------- main


def setup(run: Run, precision: str, parallel: DataParallel) -> harness.TaskSetup:
    """The vocabulary, data, model and schedule of one run."""
    config = run.config
    # The positions limit the data filter, which runs before the vocabulary size is known.
    max_seq_len = model_config(config, len(tokenizer_lib.SPECIAL_IDS), precision).layer.max_seq_len
    max_len = config["max_len"] or max_seq_len
    if max_len > max_seq_len:
        raise UsageError(f"--max-len {max_len} exceeds the model's max_seq_len {max_seq_len} ({config['preset']})")
    data = load_data(config, run.given.get("spm"), run.run_dir, max_len)
    model_cfg = model_config(config, data.stats["vocab_size"], precision)
    model = Transformer(model_cfg)
    stream = wmt_data.BatchStream(
        data.train, max_tokens=config["max_tokens"], num_shards=parallel.num_shards, grad_accum=config["grad_accum"],
        seed=config["seed"], process_index=jax.process_index(), process_count=jax.process_count(),
    )

    def init_params(key: jax.Array) -> Any:
        dummy = jnp.ones((1, 8), jnp.int32)
        return model.init(key, dummy, dummy)["params"]

    return harness.TaskSetup(
        init_params=init_params,
        init_rng=jax.random.PRNGKey(config["seed"]),
        loss_fn=make_loss_fn(model, config["label_smoothing"]),
        stream=stream,
        batch_shapes=[{name: (shape, jnp.int32) for name in ("src", "tgt_in", "labels")} for shape in stream.shapes()],
        flops_fn=make_flops_fn(model_cfg),
        evaluate=Evaluator(model, data, config, parallel),
        learning_rate=inverse_sqrt_schedule(config["lr"], config["warmup_steps"]),
        steps=config["steps"],
        eval_every=config["eval_every"],
        checkpoint_every=config["checkpoint_every"],
        model_signature=model_signature(config, model_cfg),
        model_name=config["preset"],
        batch_record={"max_tokens": config["max_tokens"], "grad_accum": config["grad_accum"]},
        data_record={"source": config["data"], **data.stats},
        config_record=config,
    )


TASK = harness.Task(
    name="wmt",
    counted=("tokens", "target_tokens"),
    metric="BLEU",
    build_parser=build_parser,
    resolve_config=resolve_config,
    check_config=_check_config,
    setup=setup,
    throughput=lambda s: (f"{format_value(s['tokens_per_s'], '.0f')} tokens/s, "
                          f"{format_value(s['target_tokens_per_s'], '.0f')} target tokens/s"),
    score=lambda record: format_value(record["bleu"], ".2f"),
    loss_name="label-smoothed training loss, see --label-smoothing",
)

