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

import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from train.data import tokenizer as tokenizer_lib
from train.errors import UsageError
from train.gpt import config as gpt_config
from train.gpt import data as gpt_data
from train.gpt import model as gpt_model
from train.gpt import synthetic as gpt_synthetic
from train.gpt.config import GptConfig
from train.gpt.samples import FinalReport, Sampler
from train.harness import resume
from train.harness.config import Run
from train.harness.optimizer import linear_warmup_decay
from train.harness.parallel import DataParallel
from train.harness.step import TrainState
from train.harness.training import Quality, Task, TaskSetup

# ------------------------------------------------------------------------------------------------ data


def _spm_model(config: GptConfig, run_dir: Path) -> str | None:
    """The sentencepiece model to load: on --resume the run directory's copy, where the run had one."""
    own_copy = run_dir / tokenizer_lib.MODEL_FILENAME
    if config.resume and (config.data != "synthetic" or config.spm_model):
        return str(own_copy)
    return config.spm_model


def load_data(
    config: GptConfig, run_dir: Path, positions: int, tokenizer: gpt_data.Tokenizer | None
) -> gpt_data.LMData:
    """The packed splits; a vocabulary trained here is written to the run directory by process 0 only."""
    with tempfile.TemporaryDirectory() as scratch:
        return gpt_data.load_data(
            config.data,
            seq_len=config.max_seq_len,
            max_positions=positions,
            run_dir=run_dir if jax.process_index() == 0 else Path(scratch),
            tokenizer=tokenizer,
            spm_model=_spm_model(config, run_dir),
            vocab_size=config.vocab_size,
            valid_fraction=config.valid_fraction,
            seed=config.seed,
            text_field=config.text_field,
            tfds_valid_split=config.tfds_valid_split or None,
            tfds_data_dir=config.tfds_data_dir,
        )


def data_record(config: GptConfig, data: gpt_data.LMData) -> dict[str, Any]:
    """The run record's data: source, sizes, and the perplexities to judge the model by."""
    record = {
        "source": config.data,
        "max_seq_len": config.max_seq_len,
        **data.stats,
        "unigram_perplexity": gpt_data.unigram_perplexity(data.splits["train"].stream),
    }
    if config.data == "synthetic" and not config.spm_model:
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
            self.final_report(state.variables, records)
        return records


def setup(run: Run, precision: str, parallel: DataParallel) -> TaskSetup:
    """The checkpoint or preset, the packed data, the sampler and the schedule of one run."""
    config = run.config
    if config.batch_size % parallel.num_shards:
        raise UsageError(f"--batch-size {config.batch_size} is not a multiple of the {parallel.num_shards} devices")
    pretrained = gpt_model.load_checkpoint(config, precision) if config.init_from else None
    positions = pretrained.config.layer.max_seq_len if pretrained else gpt_config.preset_positions(config)
    data = load_data(config, run.run_dir, positions, pretrained.tokenizer if pretrained else None)
    model_cfg = (
        pretrained.config
        if pretrained
        else gpt_model.preset_config(
            config.preset,
            vocab_size=data.tokenizer.size,
            max_seq_len=positions,
            **gpt_model.layer_overrides(config, precision),
        )
    )
    try:
        model = gpt_model.build_model(config.implementation, model_cfg)
    except ValueError as err:
        raise UsageError(f"--implementation flax with --init-from {config.init_from}: {err}") from err
    sums = gpt_model.LM_SUMS[config.implementation]
    stream = gpt_data.LMBatchStream(
        data=data.splits["train"],
        rows=config.batch_size,
        grad_accum=config.grad_accum,
        seed=config.seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    evaluator = gpt_model.Evaluator(
        model,
        data.splits,
        config.batch_size,
        sums=sums,
        put_batch=lambda batch: parallel.put_batch(batch, row_axis=0),
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    sampler = Sampler.from_config(config, model, data.tokenizer, run.run_dir)
    records = data_record(config, data)
    baselines = {key: records[key] for key in ("unigram_perplexity", "entropy_floor_perplexity") if key in records}

    def init_variables(key: jax.Array) -> Any:
        return model.init(key, jnp.ones((1, config.max_seq_len), jnp.int32))

    return TaskSetup(
        init_variables=init_variables,
        init_rng=jax.random.PRNGKey(config.seed),
        pretrained_params=gpt_model.params_for(config.implementation, pretrained.params) if pretrained else None,
        loss_fn=gpt_model.make_loss_fn(model, sums),
        stream=stream,
        batch_shapes=[{name: (shape, jnp.int32) for name in ("input_ids", "labels")} for shape in stream.shapes()],
        flops_fn=gpt_model.make_flops_fn(model_cfg),
        evaluate=Evaluation(evaluator, FinalReport(sampler, baselines)),
        learning_rate=linear_warmup_decay(config.lr, config.warmup_steps, config.steps),
        steps=config.steps,
        eval_every=config.eval_every,
        checkpoint_every=config.checkpoint_every,
        model_signature=gpt_model.model_signature(config, model_cfg),
        implementation=config.implementation,
        model_name=resume.model_name(config),
        batch_record={"batch_size": config.batch_size, "grad_accum": config.grad_accum, "seq_len": config.max_seq_len},
        data_record=records,
        config_record={**config.to_dict(), "positions": positions, "steps_per_epoch": stream.steps_per_epoch},
    )


TASK = Task(
    name="gpt",
    counted=("tokens",),
    # The embedded corpus gives a context-free (unigram) model a perplexity of 47: at 40 or above a run has learned
    # little context.
    quality=Quality("perplexity", "perplexity", False, 40.0, ".3f"),
    config_type=GptConfig,
    build_parser=gpt_config.build_parser,
    resolve_config=gpt_config.resolve_config,
    check_config=gpt_config.check_config,
    setup=setup,
    memory_advice="lower --batch-size (raise --grad-accum to keep the batch) or --max-seq-len, add --remat layer, "
    "or choose a smaller --preset (on a CPU, e.g. --preset gpt2-tiny --max-seq-len 256)",
    batch_axes=("batch_size", "max_seq_len"),
)
