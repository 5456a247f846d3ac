"""Train the ls-jax Transformer for translation: ``python -m train.wmt [--data ...] [options]``.

With no arguments it trains ``transformer-tiny`` on the embedded synthetic translation task (`train.synthetic`)
for a few minutes on any machine and reports BLEU on its held-out test set. With ``--data text:DIR`` or
``--data tfds:wmt14_translate/de-en`` it trains on real parallel text with a shared sentencepiece vocabulary.

Every run writes a run directory (default ``runs/<run_id>``):
  config.json        the resolved configuration (``--resume`` reads it back)
  spm.model          the vocabulary
  run.jsonl          the run log of docs/run-log.md (time, tokens/s, TFLOP/s, MFU, energy, cost, loss, BLEU)
  tensorboard/       the same numbers as TensorBoard events
  checkpoints/<step> orbax checkpoints (the last --keep-checkpoints, and always one at the end)

Exit codes: 0 finished; 2 bad input (the message names the problem); 1 the loss became NaN (the last good
checkpoint is kept); 128 + signal number when SIGINT/SIGTERM stopped it (after writing a checkpoint).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import sacrebleu

from ls_jax.models import PAD_ID, PRESETS, Transformer, TransformerConfig
from ls_jax.models.decoding import beam_search, greedy_decode
from ls_jax.ops import label_smoothed_cross_entropy
from train import input_pipeline, loop, metrics, runlog
from train import tokenizer as tokenizer_lib
from train.checkpoints import CHECKPOINT_DIR, Checkpoints
from train.loop import UsageError

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
    **loop.TRAINING_DEFAULTS,
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
}


# ------------------------------------------------------------------------------------------ configuration


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m train.wmt",
        description="Train the ls-jax Transformer for translation; with no arguments, a few minutes on the "
                    "embedded synthetic task. Every run writes config.json, spm.model, run.jsonl "
                    "(docs/run-log.md), TensorBoard events and checkpoints to its run directory.",
        epilog=loop.defaults_epilog(WMT_DEFAULTS, SYNTHETIC_DEFAULTS, REAL_DATA_DEFAULTS),
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
    group.add_argument("--preset", choices=PRESETS, help="Transformer preset")
    group.add_argument("--dropout", type=float, help="override every dropout ratio of the preset")
    group.add_argument("--label-smoothing", type=float, help="label smoothing epsilon")

    group = parser.add_argument_group("evaluation")
    group.add_argument("--decode", choices=("greedy", "beam"), help="decoding for BLEU")
    group.add_argument("--beam-size", type=int, help="beam size of --decode beam")
    group.add_argument("--length-penalty", type=float, help="GNMT length penalty alpha of --decode beam")
    group.add_argument("--bleu-sentences", type=int, help="sentences per split decoded for BLEU at each "
                                                           "evaluation (default all; 0: loss only)")
    loop.add_training_arguments(parser)
    return parser


def resolve_config(given: Mapping[str, Any], saved: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Defaults, then the saved configuration of a resumed run, then the flags given now."""
    data = given.get("data", (saved or {}).get("data", WMT_DEFAULTS["data"]))
    by_data = SYNTHETIC_DEFAULTS if data == "synthetic" else REAL_DATA_DEFAULTS
    return {**WMT_DEFAULTS, **by_data, **(saved or {}), **given}


def _check_config(config: Mapping[str, Any]) -> None:
    loop.check_ranges(
        config,
        at_least_one=("steps", "max_tokens", "grad_accum", "log_every", "checkpoint_every", "keep_checkpoints",
                      "warmup_steps", "beam_size", "spm_vocab_size"),
        non_negative=("eval_every", "bleu_sentences", "weight_decay", "clip_norm"),
        fractions=("label_smoothing", "dropout"),
    )


# ------------------------------------------------------------------------------------------------ data


@dataclasses.dataclass
class Data:
    processor: Any  # sentencepiece
    train: input_pipeline.ParallelData
    eval_sets: dict[str, input_pipeline.ParallelData]  # valid, test
    references: dict[str, list[str]]  # the raw target sentences kept, per split (BLEU references)
    stats: dict[str, Any]


def _vocabulary(config: Mapping[str, Any], spm_given: str | None, run_dir: Path, corpus: input_pipeline.Corpus):
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
        return tokenizer_lib.train(
            [*src, *tgt], target, vocab_size=config["spm_vocab_size"], model_type=config["spm_model_type"],
            seed=config["seed"],
        )


def load_data(config: Mapping[str, Any], spm_given: str | None, run_dir: Path, max_len: int) -> Data:
    corpus = input_pipeline.read_corpus(
        config["data"], src_lang=config["src_lang"], tgt_lang=config["tgt_lang"], seed=config["seed"],
        tfds_data_dir=config["tfds_data_dir"],
    )
    processor = _vocabulary(config, spm_given, run_dir, corpus)
    stats: dict[str, Any] = {"vocab_size": processor.GetPieceSize(), "max_len": max_len}
    splits, references = {}, {}
    for split, (src, tgt) in corpus.items():
        encoded = input_pipeline.encode(processor, src, tgt)
        keep, kept = input_pipeline.length_filter(encoded, max_len)
        if kept.kept == 0:
            raise UsageError(f"no {split} pair is at most {max_len} tokens long; raise --max-len")
        splits[split] = encoded.take(keep)
        references[split] = [tgt[i] for i in keep]
        stats[split] = dataclasses.asdict(kept)
    eval_sets = {split: data for split, data in splits.items() if split != "train"}
    return Data(processor, splits.pop("train"), eval_sets, references, stats)


# ----------------------------------------------------------------------------------------------- model


def model_config(config: Mapping[str, Any], vocab_size: int, precision: str) -> TransformerConfig:
    overrides: dict[str, Any] = {"dtype": loop.PRECISION_DTYPES[precision]}
    if config["dropout"] is not None:
        overrides.update(
            hidden_dropout_ratio=config["dropout"],
            attn_prob_dropout_ratio=config["dropout"],
            activation_dropout_ratio=config["dropout"],
        )
    return TransformerConfig.preset(config["preset"], vocab_size, **overrides)


def model_signature(config: Mapping[str, Any], model_cfg: TransformerConfig, precision: str) -> dict[str, Any]:
    """What a checkpoint must agree on with the run restoring it."""
    layer = model_cfg.layer
    return {
        "preset": config["preset"],
        "vocab_size": model_cfg.vocab_size,
        "hidden_size": layer.hidden_size,
        "intermediate_size": layer.intermediate_size,
        "nhead": layer.nhead,
        "encoder_layers": model_cfg.num_encoder_layers,
        "decoder_layers": model_cfg.num_decoder_layers,
        "optimizer": config["optimizer"],
        **loop.precision_signature(config, precision),
    }


def make_loss_fn(model: Transformer, epsilon: float):
    def loss_fn(params, batch, rng):
        logits = model.apply(
            {"params": params}, batch["src"], batch["tgt_in"], deterministic=False, rngs={"dropout": rng}
        )
        loss_sum, nll_sum, num_tokens = label_smoothed_cross_entropy(
            logits, batch["labels"], epsilon=epsilon, pad_id=PAD_ID
        )
        return loss_sum, num_tokens, {"nll": nll_sum}

    return loss_fn


def make_flops_fn(model_cfg: TransformerConfig):
    layer = model_cfg.layer

    def flops(shapes: Mapping[str, tuple[int, ...]]) -> float:
        grad_accum, rows, src_len = shapes["src"]
        tgt_len = shapes["tgt_in"][2]
        return grad_accum * metrics.transformer_train_flops(
            batch=rows, src_len=src_len, tgt_len=tgt_len, hidden=layer.hidden_size, ffn=layer.intermediate_size,
            encoder_layers=model_cfg.num_encoder_layers, decoder_layers=model_cfg.num_decoder_layers,
            vocab=model_cfg.vocab_size,
        )

    return flops


# -------------------------------------------------------------------------------------------- evaluation


def _gather_rows(array: jax.Array) -> np.ndarray:
    """A globally sharded array as one numpy array on every host."""
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(array))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


class Evaluator:
    """Validation (and, at the end, test) loss and BLEU of the current parameters.

    Each eval set is cut into batches of one fixed shape (rows, L) with L the set's longest padded example, so
    the loss and the decoder compile once per set; batches hold examples sorted by length so greedy decoding
    stops early.
    """

    def __init__(self, model: Transformer, data: Data, config: Mapping[str, Any], parallel: loop.DataParallel):
        self.model, self.data, self.config, self.parallel = model, data, config, parallel
        self.epsilon = config["label_smoothing"]
        self.decode_len = model.config.layer.max_seq_len
        self._loss = jax.jit(self._loss_sums, out_shardings=parallel.replicated)

    def _loss_sums(self, params, batch):
        logits = self.model.apply({"params": params}, batch["src"], batch["tgt_in"], deterministic=True)
        return label_smoothed_cross_entropy(logits, batch["labels"], epsilon=self.epsilon, pad_id=PAD_ID)

    def _batches(self, data: input_pipeline.ParallelData, limit: int | None):
        """(global indices (rows,), device batch) over the first ``limit`` examples (all for None)."""
        count = len(data) if limit is None else min(limit, len(data))
        length, plan = input_pipeline.eval_plan(
            data.example_lengths[:count], max_tokens=self.config["max_tokens"], num_shards=self.parallel.num_shards
        )
        for indices in plan:
            local = input_pipeline.host_rows(indices, jax.process_index(), jax.process_count())
            yield indices, self.parallel.put_batch(input_pipeline.make_batch(data, local, length), row_axis=0)

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
            hypotheses: dict[int, str] = {}
            for indices, batch in self._batches(data, bleu_limit):
                output = _gather_rows(self._decode(params, batch["src"]))
                texts = tokenizer_lib.decode(self.data.processor, output)
                hypotheses.update((int(i), text) for i, text in zip(indices, texts) if i >= 0)
            order = sorted(hypotheses)
            references = [self.data.references[split][i] for i in order]
            result["bleu"] = sacrebleu.corpus_bleu([hypotheses[i] for i in order], [references]).score
        return result

    def __call__(self, state: loop.TrainState, final: bool) -> list[dict[str, Any]]:
        """During training the validation split; at the end every evaluation split (valid, test)."""
        splits = list(self.data.eval_sets) if final else ["valid"]
        return [self.evaluate_split(state.params, split, self.config["bleu_sentences"]) for split in splits]


# ------------------------------------------------------------------------------------------------- main


def _initial_state(model: Transformer, tx, seed: int, fp16: bool, param_dtype: Any, parallel: loop.DataParallel
                   ) -> loop.TrainState:
    init_key, train_key = jax.random.split(jax.random.PRNGKey(seed))

    def create():
        dummy = jnp.ones((1, 8), jnp.int32)
        params = model.init(init_key, dummy, dummy)["params"]
        return loop.TrainState.create(params, tx, train_key, fp16=fp16, param_dtype=param_dtype)

    return jax.jit(create, out_shardings=parallel.replicated)()


def _train(run: loop.Run) -> int:
    config, run_dir = run.config, run.run_dir
    is_main = jax.process_index() == 0
    hardware = loop.detect_hardware(config)
    precision = hardware.precision
    parallel = loop.DataParallel.over_all_devices()

    # The positions limit the data filter, which runs before the vocabulary size is known.
    max_seq_len = model_config(config, len(tokenizer_lib.SPECIAL_IDS), precision).layer.max_seq_len
    max_len = config["max_len"] or max_seq_len
    if max_len > max_seq_len:
        raise UsageError(f"--max-len {max_len} exceeds the model's max_seq_len {max_seq_len} ({config['preset']})")
    data = load_data(config, run.given.get("spm"), run_dir, max_len)
    model_cfg = model_config(config, data.stats["vocab_size"], precision)
    model = Transformer(model_cfg)
    signature = model_signature(config, model_cfg, precision)
    schedule = loop.inverse_sqrt_schedule(config["lr"], config["warmup_steps"])
    master_dtype = loop.master_dtype(config, precision)
    tx = loop.make_optimizer(config["optimizer"], schedule, weight_decay=config["weight_decay"],
                             clip_norm=config["clip_norm"], master_dtype=master_dtype)
    state = _initial_state(model, tx, config["seed"], precision == "fp16", master_dtype, parallel)
    checkpoints = Checkpoints(run_dir / CHECKPOINT_DIR, keep=config["keep_checkpoints"])
    counters, position = None, {"epoch": 0, "index": 0}
    if config["resume"]:
        state, position, counters = loop.restore_latest(checkpoints, state, signature, run_dir)

    stream = input_pipeline.BatchStream(
        data.train, max_tokens=config["max_tokens"], num_shards=parallel.num_shards, grad_accum=config["grad_accum"],
        seed=config["seed"], process_index=jax.process_index(), process_count=jax.process_count(), **position,
    )
    compiler = loop.StepCompiler(loop.make_train_step(make_loss_fn(model, config["label_smoothing"]), tx), parallel)
    shapes = stream.shapes()
    if is_main:
        print(f"compiling the training step for {len(shapes)} batch shapes", file=sys.stderr)
    compiler.precompile(state, [{name: (shape, jnp.int32) for name in ("src", "tgt_in", "labels")} for shape in shapes])

    run_log = runlog.RunLog(run_dir, ("tokens", "target_tokens"), enabled=is_main, tensorboard=config["tensorboard"])
    loop.save_config(run_dir, {**config, "run_id": run.run_id})
    if not config["resume"]:
        run_log.write(loop.run_record(
            "wmt", run, hardware, state, model=config["preset"],
            batch={"max_tokens": config["max_tokens"], "grad_accum": config["grad_accum"]},
            data={"source": config["data"], **data.stats}, config=config,
        ))
    result = loop.train(
        state,
        compiler=compiler,
        parallel=parallel,
        stream=stream,
        flops_fn=make_flops_fn(model_cfg),
        lr_fn=lambda step: float(schedule(step)),
        evaluate=Evaluator(model, data, config, parallel),
        hardware=hardware,
        run_log=run_log,
        checkpoints=checkpoints,
        model_signature=signature,
        config=loop.LoopConfig(
            num_steps=config["steps"], log_every=config["log_every"], eval_every=config["eval_every"],
            checkpoint_every=config["checkpoint_every"], progress_bar=config["progress"], started_at=run.started_at,
        ),
        counters=counters,
    )
    return loop.finish(
        result, run_dir, run_log, checkpoints, hardware,
        throughput=lambda s: (f"{loop.format_value(s['tokens_per_s'], '.0f')} tokens/s, "
                              f"{loop.format_value(s['target_tokens_per_s'], '.0f')} target tokens/s"),
        metric="BLEU", score=lambda record: loop.format_value(record["bleu"], ".2f"),
    )


def main(argv: Sequence[str] | None = None) -> int:
    return loop.main(
        lambda args: loop.run_entry_point("wmt", args, build_parser(), resolve_config, _check_config, _train), argv
    )


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    raise SystemExit(main())
