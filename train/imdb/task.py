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

import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.models import BertConfig
from train.data import tokenizer as tokenizer_lib
from train.errors import DataError, UsageError
from train.harness import resume
from train.harness.config import Run
from train.harness.optimizer import linear_warmup_decay
from train.harness.parallel import DataParallel
from train.harness.training import Quality, Task, TaskSetup
from train.imdb import config as imdb_config
from train.imdb import data as imdb_data
from train.imdb.config import ImdbConfig, Schedule
from train.imdb.evaluate import Evaluator
from train.imdb.model import build_classifier, build_model, make_flops_fn, make_loss_fn, model_signature


def _vocabulary(config: ImdbConfig, run_dir: Path, train: imdb_data.Split) -> imdb_data.Vocabulary:
    """The checkpoint's tokenizer (--init-from), the run directory's (--resume), or one trained on ``train``."""
    if config.init_from:
        return imdb_data.HuggingFaceVocabulary.load(config.init_from)
    own_copy = run_dir / tokenizer_lib.MODEL_FILENAME
    if config.resume:
        return imdb_data.SentencePieceVocabulary(tokenizer_lib.load(own_copy))
    # Every host trains the same (deterministic) vocabulary; only process 0 keeps its file.
    with tempfile.TemporaryDirectory() as scratch:
        path = own_copy if jax.process_index() == 0 else Path(scratch) / tokenizer_lib.MODEL_FILENAME
        try:
            return imdb_data.train_vocabulary(train.texts, path, vocab_size=config.vocab_size, seed=config.seed)
        except tokenizer_lib.VocabularyTooSmall as err:
            raise err.for_flag("--vocab-size") from None


def load_data(config: ImdbConfig, run_dir: Path) -> imdb_data.PreparedData:
    splits = imdb_data.read_dataset(
        config.data,
        test_data=config.test_data,
        valid_fraction=config.valid_fraction,
        seed=config.seed,
        text_field=config.text_field,
        label_field=config.label_field,
        tfds_data_dir=config.tfds_data_dir,
    )
    vocabulary = _vocabulary(config, run_dir, splits["train"])
    encoded = {name: imdb_data.encode_split(vocabulary, split, config.max_seq_len) for name, split in splits.items()}
    stats: dict[str, Any] = {"vocab_size": vocabulary.size, "max_seq_len": config.max_seq_len}
    for name, split in splits.items():
        stats[name] = {
            "examples": len(split),
            "truncated": encoded[name].truncated,
            "label_counts": np.bincount(split.labels).tolist(),
            "source": split.source,
        }
    return imdb_data.PreparedData(vocabulary, encoded, stats)


def check_labels(data: imdb_data.PreparedData, num_labels: int, fix: str) -> None:
    """Raises DataError naming the source and the label when a label is not in 0 .. num_labels - 1."""
    for name, split in data.splits.items():
        largest = int(split.labels.max())
        if largest >= num_labels:
            raise DataError(
                f"{data.stats[name]['source']} has label {largest}, but the model has {num_labels} "
                f"labels (0 .. {num_labels - 1}); {fix}"
            )


def _check_shapes(config: ImdbConfig, model_cfg: BertConfig, parallel: DataParallel) -> None:
    positions = model_cfg.layer.max_seq_len
    if config.max_seq_len > positions:
        raise UsageError(
            f"--max-seq-len {config.max_seq_len} exceeds the model's {positions} positions "
            f"({resume.model_name(config)}); give --max-seq-len {positions} or less"
        )
    if config.batch_size % parallel.num_shards:
        raise UsageError(f"--batch-size {config.batch_size} is not a multiple of the {parallel.num_shards} devices")


def _warn_batch_beyond_the_data(config: ImdbConfig, examples: int) -> None:
    """One ``warning:`` line when a step holds more rows than there are training examples: the rest are padding,
    left out of the loss, and every step still costs the whole batch."""
    rows = config.batch_size * config.grad_accum
    if rows > examples and jax.process_index() == 0:
        print(
            f"warning: a step holds {rows} rows (--batch-size x --grad-accum) but there are {examples} training "
            f"examples: {rows - examples} rows of every step are padding; --batch-size {examples} also takes every "
            "example in each step, in less time",
            file=sys.stderr,
        )


def setup(run: Run, precision: str, parallel: DataParallel) -> TaskSetup:
    """The vocabulary, data, model (random or pretrained) and epoch-based schedule of one run."""
    config = run.config
    data = load_data(config, run.run_dir)
    model_key, head_key = jax.random.split(jax.random.PRNGKey(config.seed))
    model_cfg, pretrained = build_model(config, data.vocabulary.size, precision, head_key)
    _check_shapes(config, model_cfg, parallel)
    check_labels(
        data,
        model_cfg.num_labels,
        "the checkpoint's config.json sets them (one without a classifier takes --num-labels)"
        if config.init_from
        else "set --num-labels",
    )
    classifier, pretrained = build_classifier(config, model_cfg, pretrained, data.vocabulary.pad_id)
    stream = imdb_data.BatchStream(
        data.splits["train"],
        batch_size=config.batch_size,
        grad_accum=config.grad_accum,
        seed=config.seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    schedule = Schedule.resolve(config, stream.steps_per_epoch)
    rows, seq_len = config.batch_size, config.max_seq_len
    _warn_batch_beyond_the_data(config, len(data.splits["train"]))

    return TaskSetup(
        init_variables=lambda key: classifier.init(key, seq_len),
        init_rng=model_key,
        pretrained_params=pretrained,
        loss_fn=make_loss_fn(classifier),
        stream=stream,
        batch_shapes=[
            {
                "input_ids": ((config.grad_accum, rows, seq_len), jnp.int32),
                "labels": ((config.grad_accum, rows), jnp.int32),
            }
        ],
        flops_fn=make_flops_fn(model_cfg),
        evaluate=Evaluator(classifier, data, config.batch_size, parallel),
        learning_rate=linear_warmup_decay(config.lr, schedule.warmup_steps, schedule.steps),
        steps=schedule.steps,
        eval_every=schedule.eval_every,
        checkpoint_every=schedule.checkpoint_every,
        model_signature=model_signature(config, model_cfg),
        implementation=config.implementation,
        model_name=resume.model_name(config),
        batch_record={"batch_size": config.batch_size, "grad_accum": config.grad_accum},
        data_record={"source": config.data, **data.stats},
        config_record={**config.to_dict(), **dataclasses.asdict(schedule)},
    )


TASK = Task(
    name="imdb",
    counted=("examples",),
    quality=Quality("accuracy", "accuracy", True, 0.6, ".2%"),  # two classes: chance is 0.5
    config_type=ImdbConfig,
    build_parser=imdb_config.build_parser,
    resolve_config=imdb_config.resolve_config,
    check_config=imdb_config.check_config,
    setup=setup,
    memory_advice="lower --batch-size (raise --grad-accum to keep the batch) or --max-seq-len, add --remat layer, "
    "or choose a smaller --preset",
    batch_axes=("batch_size", "max_seq_len"),
)
