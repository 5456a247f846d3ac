"""The run directory: where a run keeps its configuration, run log and checkpoints, and how ``--resume`` continues
a run from it exactly.

One run at a time: the process that writes the directory (process 0 of a multi-process job) holds its lock
(`train.records.lock`) from the start of the run to its end. A directory whose run stopped before its first
checkpoint (a signal during compilation, an out-of-memory kill) holds nothing to continue from: a new start or a
``--resume`` there starts that run again from step 0. A start that fails before its run log begins (bad data, a bad
flag found late, a signal during setup) leaves no directory it made behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any, Iterator, Mapping

import jax

from train.errors import UsageError
from train.records import runlog
from train.records.checkpoints import CHECKPOINT_DIR, DAMAGED_DIR, complete_steps
from train.records.lock import LOCK_FILENAME, DirectoryInUse, RunDirectoryLock

CONFIG_FILENAME = "config.json"
# What a run, or a start of one that failed, leaves in its directory, and the marker a sweep writes into it first
# (the tokenizer's model, GPT's samples, the profiler's traces and the sweep's marker are named by the modules that
# write them: `train.data.tokenizer`, `train.gpt.samples`, `train.harness.training`, `train.sweep.runner`).
RUN_ENTRIES = frozenset(
    {
        CONFIG_FILENAME,
        runlog.LOG_FILENAME,
        runlog.TENSORBOARD_DIR,
        CHECKPOINT_DIR,
        DAMAGED_DIR,
        LOCK_FILENAME,
        "spm.model",
        "samples.txt",
        "profile",
        "sweep.json",
    }
)


def config_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / CONFIG_FILENAME


def load_saved_config(run_dir: str | Path) -> dict[str, Any]:
    """The resolved configuration a run saved in its directory (what ``--resume`` starts from): a JSON object."""
    path = config_path(run_dir)
    if not path.is_file():
        raise UsageError(f"--resume {run_dir}: no {CONFIG_FILENAME} there; is it a run directory?")
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"--resume {run_dir}: {path} is not a saved configuration ({err})") from None
    if not isinstance(saved, dict):
        raise UsageError(
            f"{path} holds a JSON {type(saved).__name__}, not a run's saved configuration (an object of flag values)"
        )
    return saved


def finished(run_dir: Path) -> bool:
    """Whether the run log ends with the summary of a finished run (its final evaluation done)."""
    path = run_dir / runlog.LOG_FILENAME
    records = runlog.read(path) if path.exists() else []
    return bool(records) and records[-1]["type"] == "summary" and records[-1]["completed"]


def stopped_before_first_checkpoint(run_dir: Path) -> bool:
    """Whether the directory holds a run log but no complete checkpoint and no finished summary: a run with
    nothing to continue from, which can only start again."""
    return (
        (run_dir / runlog.LOG_FILENAME).exists()
        and not complete_steps(run_dir / CHECKPOINT_DIR)
        and not finished(run_dir)
    )


@dataclasses.dataclass(frozen=True)
class Claim:
    """A run directory prepared for this start; ``restart``: it held a run stopped before its first checkpoint,
    whose log was cleared, so training starts from step 0 (also on ``--resume``)."""

    path: Path
    restart: bool


def _make(path: Path) -> Path | None:
    """Creates ``path`` and its missing parents; returns the topmost directory it created (None: it existed)."""
    missing = [parent for parent in (path, *path.parents) if not parent.exists()]
    if path.exists() and not path.is_dir():
        raise UsageError(f"the run directory {path} is a file; name a directory (new or a run's) instead")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot write the run directory {path}: {err.strerror or err}") from err
    return missing[-1] if missing else None


def _probe_writable(path: Path) -> None:
    try:
        probe = path / f".write-test-{jax.process_index()}"  # one per process: they check at once
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"cannot write the run directory {path}: {err.strerror or err}") from err


def _lock(path: Path, command: str) -> RunDirectoryLock:
    lock = RunDirectoryLock(path)
    try:
        lock.acquire(command)
    except DirectoryInUse as err:
        raise UsageError(str(err)) from None
    except OSError as err:
        raise UsageError(f"cannot write the run directory {path}: {err.strerror or err}") from err
    return lock


def _check_start(path: Path, resume: bool) -> bool:
    """Whether this start runs a stopped run again from step 0 (its log is then removed).

    Raises:
      UsageError: a new run would overwrite a run that has a checkpoint or finished.
    """
    if not stopped_before_first_checkpoint(path):
        if not resume and (path / runlog.LOG_FILENAME).exists():
            raise UsageError(f"{path} already holds a run; pass --resume {path} or another --run-dir")
        return False
    (path / runlog.LOG_FILENAME).unlink()
    return True


def _check_holds_no_other_files(path: Path) -> None:
    """Raises UsageError when a new run's directory holds files no run wrote (hidden ones aside): a run writes its
    checkpoints and logs only into a directory of its own, never among a user's files."""
    others = sorted(entry.name for entry in path.iterdir() if entry.name not in RUN_ENTRIES and entry.name[0] != ".")
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise UsageError(
            f"--run-dir {path} holds files that are not a run's ({shown}); a new run needs a new or empty "
            "directory: pass another --run-dir"
        )


@contextlib.contextmanager
def claim(resume: str | None, run_dir: str | None, run_id: str, *, command: str, owner: bool) -> Iterator[Claim]:
    """The run directory (``--resume``, ``--run-dir`` or runs/<run_id>), created, proven writable and, with
    ``owner`` (the process that writes it), locked for as long as the context lasts.

    The owner checks what the directory holds (`_check_start`) once it holds the lock, so two starts never both
    pass the check; a start refused the lock changes nothing there. When the context ends with an exception
    before the run log was begun, the owner removes the directories this start made.

    Raises:
      UsageError: another run holds the directory, a new run would overwrite an existing one or go among files
        no run wrote, or the directory cannot be written.
    """
    path = Path(resume) if resume else Path(run_dir or Path("runs") / run_id)
    made = _make(path)
    if owner and not resume:  # before the lock, whose file would stay among them
        _check_holds_no_other_files(path)
    lock = _lock(path, command) if owner else None
    try:
        restart = _check_start(path, bool(resume)) if owner else False
        _probe_writable(path)
        yield Claim(path, restart)
    except BaseException:
        if lock is not None and made is not None and not (path / runlog.LOG_FILENAME).exists():
            shutil.rmtree(made, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            lock.release()


def save_config(run_dir: Path, config: Mapping[str, Any]) -> None:
    if jax.process_index() == 0:
        config_path(run_dir).write_text(json.dumps(dict(config), indent=2) + "\n", encoding="utf-8")
