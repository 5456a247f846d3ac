"""Checkpoints of a training run with orbax: the train state (arrays) and its progress (JSON), per step.

A checkpoint holds two items: ``state``, the pytree of arrays (params, optimizer state, step, RNG key, loss
scale), and ``progress``, a JSON object with everything else a run needs to continue exactly (data position,
cumulative time/token/energy counters), a ``model`` signature that a resume compares before restoring arrays, and
a ``checksum`` of every array that a restore verifies, so a damaged checkpoint is never trained from.
The last ``keep`` checkpoints are kept. `Checkpoints.save` returns once the arrays are copied off the devices
and writes the files in the background, so training goes on while a checkpoint is written; the next `save` or
`wait` finishes that write first, and a write that failed (a full disk) is raised there, naming its step. A
damaged checkpoint is reported with the file or array that cannot be read and the reader's error.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

CHECKPOINT_DIR = "checkpoints"
DAMAGED_DIR = "damaged-checkpoints"  # beside CHECKPOINT_DIR: the checkpoints a resume could not read


class CheckpointMismatchError(ValueError):
    """The checkpoint was written for another model or vocabulary than the one being restored into."""


class CheckpointCorruptError(ValueError):
    """A checkpoint's files cannot be read, or its arrays differ from the checksum written with them."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (full disk, lost permissions); the message says what to do."""


_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _leaf_checksum(x: jax.Array) -> jax.Array:
    """sum_i (i + 1) * bits(x_i) mod 2^32 over the flattened array's bit patterns: any changed or swapped element
    changes it (up to a 2^-32 chance)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if x.dtype.itemsize == 8:
        x = jax.lax.bitcast_convert_type(x, jnp.uint32)
    bits = jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize]).astype(jnp.uint32).ravel()
    return jnp.sum(bits * jnp.arange(1, bits.size + 1, dtype=jnp.uint32), dtype=jnp.uint32)


@jax.jit
def _checksums(state: Any) -> list[jax.Array]:
    return [_leaf_checksum(leaf) for leaf in jax.tree.leaves(state)]


@jax.jit
def _all_finite(state: Any) -> jax.Array:
    leaves = [leaf for leaf in jax.tree.leaves(state) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves])) if leaves else jnp.bool_(True)


def checksum(state: Any) -> list[int]:
    """One 32-bit checksum per array of ``state`` (`_leaf_checksum`), in tree order."""
    return [int(value) for value in jax.device_get(_checksums(state))]


def is_finite(state: Any) -> bool:
    """Whether every floating-point array of ``state`` is free of NaN and infinity."""
    return bool(_all_finite(state))


_TENSORSTORE_OS_ERROR = re.compile(r"os_error_code='(\d+)'")


def _os_error(err: BaseException) -> OSError | None:
    """The OSError at the root of an orbax/asyncio failure chain, if there is one."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno is not None:
            return err
        tensorstore_code = _TENSORSTORE_OS_ERROR.search(str(err))  # TensorStore raises ValueError with the errno
        if tensorstore_code:
            code = int(tensorstore_code.group(1))
            return OSError(code, os.strerror(code))
        nested = getattr(err, "exceptions", None)  # an ExceptionGroup from concurrent writers
        if nested:
            found = [e for e in map(_os_error, nested) if e is not None]
            if found:
                return found[0]
        err = err.__cause__ or err.__context__
    return None


def _root_cause(err: BaseException) -> str:
    """``Type: first line`` of the innermost exception of a chain: orbax wraps TensorStore's message, which names
    the array and the file, in exceptions of its own."""
    seen = set()
    while id(err) not in seen and (err.__cause__ or err.__context__) is not None:
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


_JSON_FILES = ("_CHECKPOINT_METADATA", "_METADATA", "metadata", "_sharding")


def _unreadable_json(directory: Path) -> str | None:
    """The first of a checkpoint's JSON files (orbax's metadata, the progress record) that is not valid JSON."""
    for path in sorted(directory.rglob("*")):
        if path.is_file() and (path.name in _JSON_FILES or path.parent.name == "array_metadatas"):
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                return f"{path} is not valid JSON ({type(err).__name__}: {err})"
    return None


def _free_bytes(directory: Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def _state_bytes(state: Any) -> int:
    return int(sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state)))


class _WriteFailureEcho(logging.Filter):
    """Drops the records orbax's writer threads and asyncio log for a failed write (a disk error at their root):
    `Checkpoints.save` reports that failure in one line, and the other writers of the same checkpoint fail with
    it, some after ``save`` has returned."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and record.exc_info[1] is not None and _os_error(record.exc_info[1]) is not None)


_ECHO_FILTER = _WriteFailureEcho()


def _filter_write_failure_logs() -> None:
    """Puts `_WriteFailureEcho` on the loggers of orbax (absl) and asyncio, once per process."""
    for name in ("absl", "asyncio"):
        if _ECHO_FILTER not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_ECHO_FILTER)


def _quiet_closed_loop_callbacks() -> None:
    """When a save fails, TensorStore's completion callbacks of the other writers raise RuntimeError('Event loop
    is closed') into the void once orbax has closed that save's event loop: those are dropped, others printed."""
    previous = sys.unraisablehook
    if getattr(previous, "_ls_jax_quiet", False):
        return

    def hook(unraisable: Any) -> None:
        if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"):
            previous(unraisable)

    hook._ls_jax_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def remove_partial_checkpoints(directory: Path) -> list[Path]:
    """Deletes orbax's temporary directories (checkpoints whose writing never completed) under ``directory``."""
    partial = sorted(directory.glob("*.orbax-checkpoint-tmp*")) if directory.is_dir() else []
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return partial


def complete_steps(directory: Path) -> list[int]:
    """The steps of the complete checkpoints in ``directory`` (orbax names each by its step)."""
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else []


class Checkpoints:
    def __init__(self, directory: str | Path, *, keep: int = 3, saved_form: Callable[[Any], Any] | None = None):
        """``saved_form`` maps the train state to what is written (e.g. a sharded optimizer state gathered)."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory).resolve()
        self._saved_form = saved_form or (lambda state: state)
        self._write_failed = False
        self._pending: tuple[int, bool, int] | None = None  # (step, it existed before, bytes) of the save in flight
        remove_partial_checkpoints(self.directory)  # what a crash cut short; nothing writes before the run opens
        _filter_write_failure_logs()
        _quiet_closed_loop_callbacks()
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, progress: dict[str, Any]) -> None:
        """Starts writing ``state`` and ``progress`` (plus the state's checksum) as checkpoint ``step``: returns once
        the arrays are copied off the devices; the files are written in the background (`wait`).

        Raises:
          CheckpointWriteError: this checkpoint, or the one before it (finished here first), could not be written;
            the partial checkpoint is removed.
        """
        self.wait()
        state = self._saved_form(state)
        progress = {**progress, "checksum": checksum(state)}
        self._pending = (step, step in self._manager.all_steps(), _state_bytes(state))
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state), progress=ocp.args.JsonSave(progress)),
                force=True,
            )
        except Exception as err:  # orbax wraps the writer's OSError in its own and asyncio's errors
            self._failed(err)

    def wait(self) -> None:
        """Returns once the checkpoint being written is on disk.

        Raises:
          CheckpointWriteError: it could not be written; the partial checkpoint is removed.
        """
        if self._pending is None:
            return
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            self._failed(err)
        self._pending = None

    def _failed(self, err: Exception) -> None:
        """Raises the failure of the pending save: a CheckpointWriteError for a disk error, else ``err`` itself."""
        step, existed, size = self._pending
        self._pending = None
        cause = _os_error(err)
        if cause is None:
            raise err
        self._write_failed = True
        self._remove_partial(step, keep_final=existed)
        raise CheckpointWriteError(cause.errno, self._write_advice(step, size, cause)) from err

    def _write_advice(self, step: int, size: int, cause: OSError) -> str:
        problem = "the disk is full" if cause.errno in (errno.ENOSPC, errno.EDQUOT) else cause.strerror or str(cause)
        free = _free_bytes(self.directory)
        free_text = "unknown" if free is None else f"{free / 2**20:.1f} MiB"
        return (
            f"cannot write checkpoint {step} in {self.directory}: {problem} ({free_text} free, a checkpoint "
            f"needs about {size / 2**20:.1f} MiB); free space there, then resume the run"
        )

    def _remove_partial(self, step: int, *, keep_final: bool) -> None:
        """Deletes what a failed save left (orbax's temporary directory), so the space comes back."""
        partial = list(self.directory.glob(f"{step}.orbax-checkpoint-tmp*"))
        if not keep_final:
            partial.append(self.directory / str(step))
        for path in partial:
            shutil.rmtree(path, ignore_errors=True)
        self._manager.reload()

    def set_aside(self, step: int) -> Path:
        """Moves a damaged checkpoint out of the way (to `DAMAGED_DIR`/<step> beside the checkpoints), keeping its
        files for inspection, so the run can write that step again."""
        target = self.directory.parent / DAMAGED_DIR / str(step)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        (self.directory / str(step)).rename(target)
        self._manager.reload()
        return target

    def progress(self, step: int) -> dict[str, Any]:
        restored = self._manager.restore(step, args=ocp.args.Composite(progress=ocp.args.JsonRestore()))
        return restored["progress"]

    def restore(
        self, step: int, abstract_state: Any, model: dict[str, Any], *, later_keys: Mapping[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """The state and progress saved at ``step``, restored onto ``abstract_state``'s shapes and shardings.

        ``later_keys`` are signature keys added after checkpoints were written without them, with the value such a
        checkpoint has: a checkpoint lacking one is compared as if it held that value.

        Raises:
          CheckpointMismatchError: the checkpoint's ``model`` signature differs from ``model``.
          CheckpointCorruptError: its files cannot be read, or the arrays do not match their checksum.
        """
        try:
            progress = self.progress(step)
        except Exception as err:  # a truncated or overwritten JSON file, a missing item
            damage = self._damage(step, "progress", err)
            raise CheckpointCorruptError(f"its progress record cannot be read: {damage}") from err
        saved = progress.get("model")
        if saved is not None:
            saved = {**(later_keys or {}), **saved}
        if saved != model:
            differences = ", ".join(
                f"{key}: checkpoint {saved.get(key)!r} vs now {model.get(key)!r}"
                for key in sorted(set(saved or {}) | set(model))
                if (saved or {}).get(key) != model.get(key)
            )
            raise CheckpointMismatchError(f"checkpoint {self.directory}/{step} does not fit this model ({differences})")
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
            )
        except Exception as err:  # TensorStore cannot decode a damaged chunk, metadata unreadable
            raise CheckpointCorruptError(f"its arrays cannot be read: {self._damage(step, 'state', err)}") from err
        if "checksum" in progress and checksum(restored["state"]) != progress["checksum"]:
            raise CheckpointCorruptError("its arrays differ from the checksum written with them")
        return restored["state"], progress

    def _damage(self, step: int, item: str, err: Exception) -> str:
        """What is wrong with ``item`` (state, progress) of checkpoint ``step``: a JSON file of it that does not
        parse, else the reader's error."""
        return _unreadable_json(self.directory / str(step) / item) or _root_cause(err)

    def close(self) -> None:
        """Waits for the writes in flight and releases the writer. A write that fails here, of a run that stops for
        another reason, is one warning. After a save that failed (and was reported as a `CheckpointWriteError`),
        its other writers may fail later with a disk error of their own, not raised, and may have recreated
        directories of the partial checkpoint after `save` removed it: removed again."""
        try:
            self.wait()
        except CheckpointWriteError as err:
            print(f"warning: {err}", file=sys.stderr)
        try:
            self._manager.wait_until_finished()
            self._manager.close()
        except Exception as err:
            if not (self._write_failed and _os_error(err) is not None):
                raise
        finally:
            if self._write_failed:
                remove_partial_checkpoints(self.directory)
