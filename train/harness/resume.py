"""Continuing a run with ``--resume``: what a checkpoint must agree on with the run restoring it (the model's
name and shapes; the harness adds the optimizer and precision), the newest checkpoint that verifies, and what to
say when a finished run has nothing left to train."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any, Mapping

import jax

from ls_jax.layers import LayerConfig
from train.errors import UsageError
from train.harness.config import flag
from train.harness.progress import Counters
from train.harness.step import TrainState
from train.records.checkpoints import CheckpointCorruptError, CheckpointMismatchError, Checkpoints

# Signature keys added after checkpoints were written without them, and the value such a checkpoint has: before
# --implementation every task trained the ls_jax model.
SIGNATURE_LATER_KEYS: dict[str, Any] = {"implementation": "ls_jax"}


def model_name(config: Any) -> str:
    """The preset's name, or the directory name of the pretrained model given by ``--init-from``."""
    return config.preset or Path(config.init_from).name


def layer_signature(layer: LayerConfig) -> dict[str, Any]:
    """The sizes every layer of a stack shares."""
    return {"hidden_size": layer.hidden_size, "intermediate_size": layer.intermediate_size, "nhead": layer.nhead}


def stack_signature(config: Any, vocab_size: int, layer: LayerConfig, num_layers: int) -> dict[str, Any]:
    """The signature of a single stack of ``num_layers`` layers over learned positions (BERT, GPT)."""
    return {
        "model": model_name(config),
        "vocab_size": vocab_size,
        **layer_signature(layer),
        "num_layers": num_layers,
        "positions": layer.max_seq_len,
    }


def restore_latest(
    checkpoints: Checkpoints, state: TrainState, model_signature: dict[str, Any], run_dir: Path
) -> tuple[TrainState, int, dict[str, int], Counters, float | None]:
    """(state, step, data position, counters, learning rate of the next step) of the newest checkpoint that
    verifies, onto ``state``'s shardings (the rate is None in checkpoints written before it was saved).

    A checkpoint whose files cannot be read or whose arrays fail their checksum is skipped with one line naming
    it, and the next older one is tried; once one verifies, the skipped ones are moved to
    ``damaged-checkpoints/`` in the run directory. The run log is left as it is (see
    `train.records.runlog.truncate_for_resume`).

    Raises:
      UsageError: no checkpoint, none that verifies, or one written for another model, implementation or
        vocabulary.
    """
    steps = checkpoints.all_steps()
    if not steps:
        raise UsageError(f"--resume {run_dir}: no checkpoint in {checkpoints.directory}")
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    damaged = []
    for step in reversed(steps):
        try:
            restored, progress = checkpoints.restore(step, abstract, model_signature, later_keys=SIGNATURE_LATER_KEYS)
        except CheckpointMismatchError as err:
            raise UsageError(
                f"{err}; a resumed run needs the vocabulary, model and implementation it was trained with"
            ) from err
        except CheckpointCorruptError as err:
            if jax.process_index() == 0:
                print(f"warning: skipping checkpoint {step} in {checkpoints.directory}: {err}", file=sys.stderr)
            damaged.append(step)
            continue
        if jax.process_index() == 0:
            for bad in damaged:  # the resumed run writes these steps again
                print(f"moved the damaged checkpoint {bad} to {checkpoints.set_aside(bad)}", file=sys.stderr)
        return restored, step, progress["data"], Counters.from_dict(progress["counters"]), progress.get("lr")
    raise UsageError(f"--resume {run_dir}: none of the checkpoints {steps} in {checkpoints.directory} can be read")


def transition(saved: tuple[int, float] | None, schedule: Any, kept: list[float] | None) -> list[float] | None:
    """The (step, rate) a resumed run's rate moves on from (`train.harness.optimizer.continued`): ``kept`` (the
    run's own, or None) while ``schedule`` gives the rate the restored checkpoint saved, ``saved`` = (its step,
    that rate); else ``saved`` (the run resumes with other --steps or --lr)."""
    if saved is None:
        return kept
    step, rate = saved
    return kept if abs(float(schedule(step)) - rate) <= 1e-6 * max(abs(rate), 1e-12) else [step, rate]


def changed_flags(saved: Mapping[str, Any], config: Any, given: Mapping[str, Any]) -> list[str]:
    """``--flag NEW (was OLD)`` for each flag given now that changes the resumed run's ``saved`` configuration
    (config.json), ``--resume`` and ``--steps`` apart (the resume line says where the schedule goes)."""

    def shown(value: Any) -> str:
        if value is None:
            return "default"
        return ("on" if value else "off") if isinstance(value, bool) else str(value)

    return [
        f"{flag(name)} {shown(getattr(config, name))} (was {shown(saved.get(name))})"
        for name, value in given.items()
        if value is not None
        and name not in ("resume", "steps")
        and hasattr(config, name)
        and saved.get(name) != getattr(config, name)
    ]


def say_nothing_to_do(task: str, run_dir: Path, step: int, steps: int) -> None:
    """A resumed run already at (or past) its ``--steps``: the run log stays as it is, summary included."""
    if jax.process_index() == 0:
        print(
            f"{run_dir} is already at step {step} (--steps {steps}): nothing to train; to train longer, "
            f"python -m train.{task} --resume {shlex.quote(str(run_dir))} --steps {max(steps, step) * 2}",
            file=sys.stderr,
        )
