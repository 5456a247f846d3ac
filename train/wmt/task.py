"""Train the ls-jax Transformer for translation: ``python -m train.wmt [--data ...] [options]``.

``--implementation flax`` trains the plain Flax Transformer of `train.reference.transformer` instead, through the
same harness, checkpoints, run log and BLEU.

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

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from train.data import tokenizer as tokenizer_lib
from train.errors import UsageError
from train.harness.config import Run
from train.harness.optimizer import inverse_sqrt_schedule
from train.harness.parallel import DataParallel
from train.harness.training import Quality, Task, TaskSetup
from train.wmt import config as wmt_config
from train.wmt import data as wmt_data
from train.wmt.config import WmtConfig
from train.wmt.evaluate import Evaluator
from train.wmt.model import build_model, make_criterion, make_flops_fn, make_loss_fn, model_config, model_signature

# ------------------------------------------------------------------------------------------------ data


def _vocabulary(config: WmtConfig, spm_given: str | None, run_dir: Path, corpus: wmt_data.Corpus):
    """The run's sentencepiece model.

    On --resume: ``spm_given`` (a --spm passed now, which the checkpoint check then compares) or the run
    directory's copy. Otherwise --spm (copied into the run directory) or one trained on the training text.
    """
    own_copy = run_dir / tokenizer_lib.MODEL_FILENAME
    is_main = jax.process_index() == 0
    try:
        if config.resume:
            return tokenizer_lib.load(spm_given or own_copy)
        if config.spm:
            processor = tokenizer_lib.load(config.spm)
            if is_main:
                tokenizer_lib.copy_into(config.spm, run_dir)
            return processor
    except ValueError as err:
        raise UsageError(str(err)) from err
    src, tgt = corpus["train"]
    # Every host trains the same (deterministic) model; only process 0 keeps it, in the run directory.
    with tempfile.TemporaryDirectory() as scratch:
        target = own_copy if is_main else Path(scratch) / tokenizer_lib.MODEL_FILENAME
        try:
            return tokenizer_lib.train(
                [*src, *tgt],
                target,
                vocab_size=config.spm_vocab_size,
                model_type=config.spm_model_type,
                seed=config.seed,
            )
        except tokenizer_lib.VocabularyTooSmall as err:
            raise err.for_flag("--spm-vocab-size") from None


def load_data(config: WmtConfig, spm_given: str | None, run_dir: Path, max_len: int) -> wmt_data.PreparedData:
    corpus = wmt_data.read_corpus(
        config.data,
        src_lang=config.src_lang,
        tgt_lang=config.tgt_lang,
        seed=config.seed,
        tfds_data_dir=config.tfds_data_dir,
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
    return wmt_data.PreparedData(processor, splits.pop("train"), eval_sets, references, stats)


# ------------------------------------------------------------------------------------------------- main


def setup(run: Run, precision: str, parallel: DataParallel) -> TaskSetup:
    """The vocabulary, data, model and schedule of one run."""
    config = run.config
    # The positions limit the data filter, which runs before the vocabulary size is known.
    max_seq_len = model_config(config, len(tokenizer_lib.SPECIAL_IDS), precision).layer.max_seq_len
    max_len = config.max_len or max_seq_len
    if max_len > max_seq_len:
        raise UsageError(f"--max-len {max_len} exceeds the model's max_seq_len {max_seq_len} ({config.preset})")
    data = load_data(config, config.spm if "spm" in run.given else None, run.run_dir, max_len)
    model_cfg = model_config(config, data.stats["vocab_size"], precision)
    model = build_model(config.implementation, model_cfg)
    criterion = make_criterion(config.implementation, config.label_smoothing)
    stream = wmt_data.BatchStream(
        data.train,
        max_tokens=config.max_tokens,
        num_shards=parallel.num_shards,
        grad_accum=config.grad_accum,
        seed=config.seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        multiple=wmt_data.token_multiple(precision),
    )

    def init_variables(key: jax.Array) -> Any:
        dummy = jnp.ones((1, 8), jnp.int32)
        return model.init(key, dummy, dummy)

    return TaskSetup(
        init_variables=init_variables,
        init_rng=jax.random.PRNGKey(config.seed),
        loss_fn=make_loss_fn(model, criterion),
        stream=stream,
        batch_shapes=[{name: (shape, jnp.int32) for name in ("src", "tgt_in", "labels")} for shape in stream.shapes()],
        flops_fn=make_flops_fn(model_cfg),
        evaluate=Evaluator(model, model_cfg, criterion, data, config, parallel),
        learning_rate=inverse_sqrt_schedule(config.lr, config.warmup_steps),
        steps=config.steps if config.epochs is None else config.epochs * stream.steps_per_epoch,
        eval_every=config.eval_every,
        checkpoint_every=config.checkpoint_every,
        model_signature=model_signature(config, model_cfg),
        implementation=config.implementation,
        model_name=config.preset,
        batch_record={"max_tokens": config.max_tokens, "grad_accum": config.grad_accum},
        data_record={"source": config.data, **data.stats},
        config_record=config.to_dict(),
    )


TASK = Task(
    name="wmt",
    counted=("tokens", "target_tokens"),
    quality=Quality("bleu", "BLEU", True, 1.0, ".2f"),  # a model that learned nothing scores near 0
    config_type=WmtConfig,
    build_parser=wmt_config.build_parser,
    resolve_config=wmt_config.resolve_config,
    check_config=wmt_config.check_config,
    setup=setup,
    loss_name="label-smoothed training loss, see --label-smoothing",
    memory_advice="lower --max-tokens (raise --grad-accum to keep the batch), add --remat layer, or choose a "
    "smaller --preset",
    batch_axes=("max_tokens",),
)
