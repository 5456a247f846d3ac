"""The run directory: where a run keeps its configuration, run log and checkpoints, and how ``--resume`` continues
a run from it exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import jax

from train.records import runlog
from train.errors import UsageError

CONFIG_FILENAME = "config.json"


def load_saved_config(run_dir: str | Path) -> dict[str, Any]:
    """The resolved configuration a run saved in its directory (what ``--resume`` starts from)."""
    path = Path(run_dir) / CONFIG_FILENAME
    if not path.is_file():
        raise UsageError(f"--resume {run_dir}: no {CONFIG_FILENAME} there; is it a run directory?")
    return json.loads(path.read_text(encoding="utf-8"))


def prepare_run_dir(resume: str | None, run_dir: str | None, run_id: str) -> Path:
    """The run directory (``--resume``, ``--run-dir`` or runs/<run_id>), created and proven writable.

    Raises:
      UsageError: a new run would overwrite an existing one, or the directory cannot be written.
    """
    if resume:
        path = Path(resume)
    else:
        path = Path(run_dir or Path("runs") / run_id)
        if (path / runlog.LOG_FILENAME).exists():
            raise UsageError(f"{path} already holds a run; pass --resume {path} or another --run-dir")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{jax.process_index()}"  # one per process: they check at once
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"cannot write the run directory {path}: {err.strerror or err}") from err
    return path


def save_config(run_dir: Path, config: Mapping[str, Any]) -> None:
    if jax.process_index() == 0:
        (run_dir / CONFIG_FILENAME).write_text(json.dumps(dict(config), indent=2) + "\n", encoding="utf-8")
