"""The run directory: where a run keeps its configuration, run log and checkpoints, and how ``--resume`` continues
a run from it exactly."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Mapping

import jax

from train.records import runlog
from train.records.checkpoints import CheckpointCorruptError, CheckpointMismatchError, Checkpoints
from train.harness.errors import UsageError
from train.harness.loop import Counters
from train.harness.step import TrainState

CONFIG_FILENAME = "config.json"


@dataclasses.dataclass(frozen=True)
class Run:
    """What an entry point's training function starts from."""

    config: dict[str, Any]  # resolved: defaults < saved (on --resume) < given
    given: dict[str, Any]  # the flags of this invocation
    run_id: str
    run_dir: Path
    command: str  # the command line, for the run record
    started_at: float  # time.monotonic() at start, for wall_time_s
    started_utc: str


def load_saved_config(run_dir: str | Path) -> dict[str, Any]:
    """The resolved configuration a run saved in its directory (what ``--resume`` starts from)."""
    path = Path(run_dir) / CONFIG_FILENAME
    if not path.is_file():
        raise UsageError(f"--resume {run_dir}: no {CONFIG_FILENAME} there; is it a run directory?")
    return json.loads(path.read_text(encoding="utf-8"))


def prepare_run_dir(config: Mapping[str, Any], run_id: str) -> Path:
    """The run directory (``--resume``, ``--run-dir`` or runs/<run_id>), created and proven writable.

    Raises:
      UsageError: a new run would overwrite an existing one, or the directory cannot be written.
    """
    if config["resume"]:
        run_dir = Path(config["resume"])
    else:
        run_dir = Path(config["run_dir"] or Path("runs") / run_id)
        if (run_dir / runlog.LOG_FILENAME).exists():
            raise UsageError(f"{run_dir} already holds a run; pass --resume {run_dir} or another --run-dir")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{jax.process_index()}"  # one per process: they check at once
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"cannot write the run directory {run_dir}: {err.strerror or err}") from err
    return run_dir


def save_config(run_dir: Path, config: Mapping[str, Any]) -> None:
    if jax.process_index() == 0:
        (run_dir / CONFIG_FILENAME).write_text(json.dumps(dict(config), indent=2) + "\n", encoding="utf-8")


def restore_latest(
    checkpoints: Checkpoints, state: TrainState, model_signature: dict[str, Any], run_dir: Path
) -> tuple[TrainState, int, dict[str, int], Counters]:
    """(state, step, data position, counters) of the newest checkpoint that verifies, onto ``state``'s shardings.

    A checkpoint whose files cannot be read or whose arrays fail their checksum is skipped with one line naming
    it, and the next older one is tried; once one verifies, the skipped ones are moved to
    ``damaged-checkpoints/`` in the run directory. The run log is left as it is (see `train.records.runlog.truncate_for_resume`).

    Raises:
      UsageError: no checkpoint, none that verifies, or one written for another model or vocabulary.
    """
    steps = checkpoints.all_steps()
    if not steps:
        raise UsageError(f"--resume {run_dir}: no checkpoint in {checkpoints.directory}")
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    damaged = []
    for step in reversed(steps):
        try:
            restored, progress = checkpoints.restore(step, abstract, model_signature)
        except CheckpointMismatchError as err:
            raise UsageError(f"{err}; a resumed run needs the vocabulary and model it was trained with") from err
        except CheckpointCorruptError as err:
            if jax.process_index() == 0:
                print(f"warning: skipping checkpoint {step} in {checkpoints.directory}: {err}", file=sys.stderr)
            damaged.append(step)
            continue
        if jax.process_index() == 0:
            for bad in damaged:  # the resumed run writes these steps again
                print(f"moved the damaged checkpoint {bad} to {checkpoints.set_aside(bad)}", file=sys.stderr)
        return restored, step, progress["data"], Counters.from_dict(progress["counters"])
    raise UsageError(f"--resume {run_dir}: none of the checkpoints {steps} in {checkpoints.directory} can be read")
