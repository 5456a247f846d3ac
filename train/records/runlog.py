"""The run log of docs/run-log.md: its schema, the records a run writes, and ``run.jsonl`` (one validated JSON
object per line) with TensorBoard events.

`SCHEMA` is the doc's tables as code and `validate` its one check: the writer checks every record before it is
written and `train.compare` checks every record it reads, so a log it accepts has every key with the right type.
Throughput keys depend on what a task counts: a task counting ``tokens`` and ``target_tokens`` logs
``tokens_per_s`` and ``target_tokens_per_s`` in intervals, and ``tokens``, ``target_tokens`` and both rates in the
summary and its ``steady`` part. The summary's parts (`PARTS`: ``warmup``, ``steady``, ``startup``,
``compilation``, ``evaluation``, ``checkpoints``) are objects with a schema of their own, each one window of the run
(train.costs.windows). A task's quality metrics (BLEU, accuracy, perplexity: its own) are one ``metrics`` object
of the eval and summary records.

Schema 2 added the windows: the summary's ``energy_j`` covers the training steps (schema 1: the training loop,
compilation and evaluations included), beside the wall window and the parts. A reader takes a schema-1 log with
the schema-2 keys missing (`SCHEMA_2_KEYS`). Schema 3 gathered the quality keys of schema 1 and 2 into
``metrics``; `read` and `validate` take older records in that form (`upgrade`).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import dataclasses
import datetime
import errno
import json
import math
import os
import platform
import secrets
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from train.errors import UsageError

SCHEMA_VERSION = 3
READABLE_SCHEMAS = (1, 2, 3)
LOG_FILENAME = "run.jsonl"
TENSORBOARD_DIR = "tensorboard"
RESERVE_FILENAME = ".run.jsonl.reserve"
RESERVE_BYTES = 64 * 1024  # a summary record is about 1-4 KiB

_NUM = (int, float)
_OPT_NUM = (int, float, type(None))
_OPT_STR = (str, type(None))
_OPT_INT = (int, type(None))
_OPT_BOOL = (bool, type(None))

SCHEMA: dict[str, dict[str, tuple[type, ...]]] = {
    "run": {
        "schema": (int,),
        "run_id": (str,),
        "task": (str,),
        "command": (str,),
        "started_at": (str,),
        "git_commit": _OPT_STR,
        "git_dirty": _OPT_BOOL,
        "versions": (dict,),
        "host": (str,),
        "platform": (str,),
        "device_kind": (str,),
        "device_count": (int,),
        "peak_tflops_per_device": _OPT_NUM,
        "peak_source": _OPT_STR,
        "backend": (str,),
        "precision": (str,),
        "optimizer": (str,),
        "optimizer_implementation": _OPT_STR,
        "optimizer_hyperparameters": (dict, type(None)),
        "optimizer_kernels_per_step": _OPT_INT,
        "implementation": (str,),
        "model": (str,),
        "params": (int,),
        "batch": (dict,),
        "price_per_device_hour_usd": _OPT_NUM,
        "price_source": _OPT_STR,
        "energy_method": _OPT_STR,
        "data": (dict,),
        "config": (dict,),
    },
    "interval": {
        "step": (int,),
        "elapsed_s": _NUM,
        "step_time_s": _NUM,
        "tflops_per_s": _OPT_NUM,
        "mfu": _OPT_NUM,
        "loss": _OPT_NUM,
        "nll": _OPT_NUM,
        "lr": _NUM,
        "grad_norm": _OPT_NUM,
        "loss_scale": _OPT_NUM,
        "fp8_overflows": _OPT_INT,
        "fp8_amax_ratio": _OPT_NUM,
        "peak_memory_bytes": _OPT_INT,
        "energy_j": _OPT_NUM,
        "energy_source": _OPT_STR,
        "cost_usd": _OPT_NUM,
    },
    "eval": {
        "step": (int,),
        "split": (str,),
        "loss": _OPT_NUM,
        "nll": _OPT_NUM,
        "metrics": (dict,),
    },
    "summary": {
        "completed": (bool,),
        "stop_reason": (str,),
        "steps": (int,),
        "train_time_s": _NUM,
        "wall_time_s": _NUM,
        "step_time_s": _OPT_NUM,
        "flops_per_step": _OPT_NUM,
        "xla_flops_per_step": _OPT_NUM,
        "tflops_per_s": _OPT_NUM,
        "mfu": _OPT_NUM,
        "peak_memory_bytes": _OPT_INT,
        "energy_j": _OPT_NUM,
        "energy_source": _OPT_STR,
        "energy_estimated": (bool,),
        "cost_usd": _OPT_NUM,
        "wall_energy_j": _OPT_NUM,
        "wall_cost_usd": _OPT_NUM,
        "warmup": (dict,),
        "steady": (dict,),
        "startup": (dict,),
        "compilation": (dict,),
        "first_execution": (dict,),
        "evaluation": (dict,),
        "checkpoints": (dict,),
        "final_loss": _OPT_NUM,
        "metrics": (dict,),
        "host_phases": (dict, type(None)),
        "memory": (dict, type(None)),
        "compile_cache": (dict, type(None)),
        "startup_parts": (dict,),
    },
}
_ONE_TIME = {"count": (int,), "time_s": _NUM, "energy_j": _OPT_NUM, "cost_usd": _OPT_NUM}
# The objects inside a record, by record type and key: their own keys (``steady`` adds ``<count>_per_s``).
PARTS: dict[str, dict[str, dict[str, tuple[type, ...]]]] = {
    "summary": {
        "warmup": {"steps": (int,), "time_s": _NUM, "energy_j": _OPT_NUM, "cost_usd": _OPT_NUM},
        "steady": {
            "steps": (int,),
            "time_s": _NUM,
            "step_time_s": _OPT_NUM,
            "tflops_per_s": _OPT_NUM,
            "mfu": _OPT_NUM,
            "energy_j": _OPT_NUM,
            "energy_per_step_j": _OPT_NUM,
            "power_w": _OPT_NUM,
            "cost_usd": _OPT_NUM,
        },
        "startup": _ONE_TIME,
        "compilation": _ONE_TIME,
        "first_execution": _ONE_TIME,
        "evaluation": _ONE_TIME,
        "checkpoints": _ONE_TIME,
    },
}
# The quality metrics logs of schema 1 and 2 held as keys of every eval and summary record (null where the task had
# none); schema 3 holds a task's own in one ``metrics`` object (`upgrade`).
LEGACY_QUALITY_KEYS = ("bleu", "accuracy", "perplexity")
# Keys schema 1 gained after logs were written without them: a reader takes a missing one as null; the writer
# always writes them.
LATER_KEYS: dict[str, frozenset[str]] = {
    "run": frozenset(
        {
            "optimizer_implementation",
            "optimizer_hyperparameters",
            "optimizer_kernels_per_step",
            "implementation",
            "git_dirty",
        }
    ),
    "summary": frozenset({"memory", "host_phases", "compile_cache", "startup", "startup_parts", "first_execution"}),
    "interval": frozenset({"fp8_overflows", "fp8_amax_ratio"}),
}
# Keys schema 2 added: a schema-1 log lacks them.
SCHEMA_2_KEYS: dict[str, frozenset[str]] = {
    "summary": frozenset({"wall_energy_j", "wall_cost_usd", *PARTS["summary"]}),
}


def throughput_keys(record_type: str, counted: Iterable[str]) -> dict[str, tuple[type, ...]]:
    """The task-dependent keys: ``<count>_per_s`` in intervals; ``<count>`` and ``<count>_per_s`` in the summary;
    ``<count>_per_s`` (null without a steady step) in the summary's ``steady`` part (record type
    ``summary.steady``)."""
    keys: dict[str, tuple[type, ...]] = {}
    for name in counted:
        if record_type in ("interval", "summary"):
            keys[f"{name}_per_s"] = _NUM
        if record_type == "summary":
            keys[name] = (int,)
        if record_type == "summary.steady":
            keys[f"{name}_per_s"] = _OPT_NUM
    return keys


_JSON_TYPE_NAMES = {bool: "boolean", int: "integer", float: "number", str: "string", dict: "object"}


@dataclasses.dataclass(eq=False)
class RecordError(ValueError):
    """A record that breaks `SCHEMA`: an unknown ``type`` (``key`` None), a missing key, or a value of another type.

    ``str()`` words it for the writer; `at` words it for a reader, at a place in a file."""

    record: Mapping[str, Any]
    key: str | None = None
    expected: tuple[type, ...] = ()

    @property
    def record_type(self) -> Any:
        return self.record.get("type")

    @property
    def problem(self) -> str:
        """``type`` (not a record type), ``missing`` (the key), ``null`` or ``kind`` (a value of another type)."""
        if self.key is None:
            return "type"
        if self.key not in self.record:
            return "missing"
        return "null" if self.record[self.key] is None else "kind"

    def __str__(self) -> str:
        kind, key = self.record_type, self.key
        if self.problem == "type":
            return f"run-log record type must be one of {sorted(SCHEMA)}, got {kind!r}"
        if self.problem == "missing":
            return f"{kind} record lacks {key!r}"
        value = self.record[key]
        got = "a bool" if isinstance(value, bool) else type(value).__name__
        return f"{kind}.{key} must be {_names(self.expected)}, got {got}"

    def at(self, where: str) -> str:
        """The problem as a reader of ``where`` (file:line) reports it."""
        kind, key = self.record_type, self.key
        json_types = [name for t, name in _JSON_TYPE_NAMES.items() if t in self.expected]
        if "number" in json_types:
            json_types.remove("integer")
        reason = {
            "type": str(self),
            "missing": f"the {kind!r} record has no key {key!r} (see docs/run-log.md)",
            "null": f"{key} is null in the {kind!r} record",
            "kind": f"{key}={self.record.get(key)!r} in the {kind!r} record is not a JSON {' or '.join(json_types)}",
        }[self.problem]
        return f"{where}: {reason}"


def validate(
    record: Mapping[str, Any], counted: Iterable[str] = (), *, schema: int = SCHEMA_VERSION, complete: bool = False
) -> None:
    """Raises RecordError naming the first missing key or wrongly typed value of a run-log record (or of one of
    its `PARTS`) of a log of version ``schema``; a key of `LATER_KEYS` may be missing unless ``complete`` (what a
    writer checks), one of `SCHEMA_2_KEYS` in a schema-1 log. A record of schema 1 or 2 is checked in this version's
    form (`upgrade`); the values of ``metrics`` must be numbers."""
    record = upgrade(dict(record), schema)
    record_type = record.get("type")
    if record_type not in SCHEMA:
        raise RecordError(record)
    counted = tuple(counted)
    may_lack = frozenset() if complete else LATER_KEYS.get(record_type, frozenset())
    if schema < 2:
        may_lack |= SCHEMA_2_KEYS.get(record_type, frozenset())
    _check_keys(record, {**SCHEMA[record_type], **throughput_keys(record_type, counted)}, may_lack)
    for name, value in record.get("metrics", {}).items():
        if isinstance(value, bool) or not isinstance(value, _NUM):
            raise RecordError({**record["metrics"], "type": f"{record_type}.metrics"}, name, _NUM)
    for name, keys in PARTS.get(record_type, {}).items():
        if name in record:
            part_type = f"{record_type}.{name}"
            _check_keys({**record[name], "type": part_type}, {**keys, **throughput_keys(part_type, counted)})


def _check_keys(
    record: Mapping[str, Any], expected: Mapping[str, tuple[type, ...]], may_lack: frozenset[str] = frozenset()
) -> None:
    """Raises RecordError for the first key of ``expected`` that ``record`` lacks (unless in ``may_lack``) or
    holds with another type."""
    for key, types in expected.items():
        if key not in record:
            if key in may_lack:
                continue
            raise RecordError(record, key, types)
        value = record[key]
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            raise RecordError(record, key, types)


def _names(types: tuple[type, ...]) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)


def _finite_or_none(value: Any) -> Any:
    """JSON has no NaN/inf: a non-finite float is logged as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    return value


class RunLog:
    """Appends records to ``run_dir/run.jsonl`` and TensorBoard; only process 0 of a multi-host run writes.

    A run stopped by a full disk must still record why: the log holds ``RESERVE_BYTES`` of disk in a reserve file
    beside it while the run trains and gives that space back to write the summary record when the disk is full.
    A record that cannot be written leaves no partial line behind.

    TensorBoard's events are written on a thread of its own, in the records' order: its writer imports PyTorch
    where that is installed (seconds), which the run's start-up would otherwise wait for. The JSON lines are the
    log of record; events that could not be written are one warning line at `close`.
    """

    def __init__(self, run_dir: Path, counted: Iterable[str], *, enabled: bool = True, tensorboard: bool = True):
        self.path = Path(run_dir) / LOG_FILENAME
        self.counted = tuple(counted)
        self._enabled = enabled
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if enabled else None
        self._reserve = Path(run_dir) / RESERVE_FILENAME
        self._tensorboard: concurrent.futures.ThreadPoolExecutor | None = None
        self._tensorboard_failure: BaseException | None = None
        self._later: concurrent.futures.Future | None = None  # a record `write_later` has yet to write
        if enabled:
            _hold(self._reserve, RESERVE_BYTES)
        if enabled and tensorboard:
            self._tensorboard = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tensorboard")
            self._writer = self._tensorboard.submit(_summary_writer, Path(run_dir) / TENSORBOARD_DIR)

    def write_later(self, make: Callable[[], dict[str, Any]]) -> None:
        """Writes the record ``make()`` returns, made on a thread in the caller's context so that the caller goes on
        meanwhile (the run record waits for the count of an optimizer step's kernels, which compiles on a thread);
        every later `write` and `close` waits for it first, so the records keep their order, and raises what making
        or writing it raised."""
        executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="run-log")
        self._later = executor.submit(contextvars.copy_context().run, lambda: self._write(make()))
        executor.shutdown(wait=False)

    def write(self, record: dict[str, Any]) -> None:
        self._wait_for_later()
        self._write(record)

    def _wait_for_later(self) -> None:
        later, self._later = self._later, None
        if later is not None:
            later.result()

    def _write(self, record: dict[str, Any]) -> None:
        record = _finite_or_none(record)
        validate(record, self.counted, complete=True)
        if not self._enabled:
            return
        line = (json.dumps(record, allow_nan=False) + "\n").encode("utf-8")
        try:
            _append(self._fd, line)
        except OSError as err:
            disk_full = err.errno in (errno.ENOSPC, errno.EDQUOT)
            if record["type"] != "summary" or not disk_full or not self._reserve.exists():
                raise
            self._reserve.unlink()
            _append(self._fd, line)
        if self._tensorboard is not None:
            self._tensorboard.submit(self._write_events, record).add_done_callback(self._note_failure)

    def _write_events(self, record: dict[str, Any]) -> None:
        writer = self._writer.result()
        kind = record["type"]
        if kind == "run":
            writer.add_text("config", "```\n" + json.dumps(record["config"], indent=2) + "\n```")
            return
        step = record["step"] if "step" in record else record["steps"]
        prefix = f"eval_{record['split']}" if kind == "eval" else kind
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("step", "steps"):
                writer.add_scalar(f"{prefix}/{key}", value, step)
        writer.flush()

    def _note_failure(self, done: concurrent.futures.Future) -> None:
        if self._tensorboard_failure is None:
            self._tensorboard_failure = done.exception()

    def close(self) -> None:
        """Closes the log; returns once every record and TensorBoard event is written."""
        try:
            self._wait_for_later()
        finally:
            self._close()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._reserve.unlink(missing_ok=True)
        if self._tensorboard is not None:
            self._tensorboard.submit(lambda: self._writer.result().close()).add_done_callback(self._note_failure)
            self._tensorboard.shutdown(wait=True)
            self._tensorboard = None
            if self._tensorboard_failure is not None:
                print(
                    f"warning: TensorBoard events could not be written: {self._tensorboard_failure}; the run log "
                    f"{self.path} holds every record",
                    file=sys.stderr,
                )


def _summary_writer(directory: Path) -> Any:
    from tensorboardX import SummaryWriter

    return SummaryWriter(str(directory))


def _hold(path: Path, size: int) -> None:
    """Writes ``size`` bytes to ``path`` so the space is the run's; where even that does not fit, holds nothing
    (the run's first checkpoint then stops it with the disk's own error)."""
    try:
        path.write_bytes(bytes(size))
    except OSError:
        path.unlink(missing_ok=True)


def _append(fd: int, data: bytes) -> None:
    """Appends ``data`` whole or not at all: a failed write is cut back to where the file ended before it."""
    end = os.lseek(fd, 0, os.SEEK_END)
    try:
        written = 0
        while written < len(data):
            written += os.write(fd, data[written:])
    except OSError:
        os.ftruncate(fd, end)
        raise


class DamagedRunLog(UsageError, ValueError):
    """A run log that cannot be read back: not UTF-8 text, or a line before its last that is not a record."""


def read_numbered(path: Path) -> tuple[list[tuple[int, dict[str, Any]]], bool]:
    """(line number, record) pairs of a run log as written, and whether its last line was cut short.

    A process killed while writing leaves a partial last line; that line is dropped. Anything else that is not a
    record raises `DamagedRunLog`, naming the line.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DamagedRunLog(f"{path}: not a UTF-8 text file, so not a run log (damaged?)") from None
    lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    records = []
    for position, (number, line) in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if position == len(lines) - 1:
                return records, True
            raise DamagedRunLog(
                f"{path}:{number}: not valid JSON ({err.msg}); the run log is damaged there: repair or delete that line"
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("type"), str):
            raise DamagedRunLog(f"{path}:{number}: a run-log record must be a JSON object with a string 'type'")
        records.append((number, record))
    return records, False


def read(path: Path) -> list[dict[str, Any]]:
    """The records of a run log (a cut-short last line dropped, `read_numbered`), each in this version's form
    (`upgrade`) whichever schema wrote it."""
    records = [record for _, record in read_numbered(path)[0]]
    schema = records[0].get("schema", SCHEMA_VERSION) if records and records[0].get("type") == "run" else SCHEMA_VERSION
    return [upgrade(record, schema) for record in records]


def upgrade(record: dict[str, Any], schema: int) -> dict[str, Any]:
    """``record`` of a log of version ``schema`` in this version's form: an eval or summary record of schema 1 or 2
    has its quality keys (`LEGACY_QUALITY_KEYS`, those not null) moved into ``metrics``; other records, and records
    already upgraded, are returned as they are."""
    if schema >= 3 or record.get("type") not in ("eval", "summary") or "metrics" in record:
        return record
    metrics = {key: record[key] for key in LEGACY_QUALITY_KEYS if record.get(key) is not None}
    return {**{key: value for key, value in record.items() if key not in LEGACY_QUALITY_KEYS}, "metrics": metrics}


def truncate_for_resume(run_dir: Path, step: int) -> dict[str, Any] | None:
    """Rewrites a run log as it was when the checkpoint at ``step`` was written; returns the summary it dropped when
    the run it closed stopped at ``step`` (its work after that checkpoint, which the checkpoint does not hold), else
    None (no summary: the process was killed; another step: the steps after the checkpoint are trained again).

    Drops the summary and every interval/eval record after ``step``, so a resumed run continues one log that
    reads as a single run (the steps after the checkpoint are trained again, identically). The run record takes
    this version's schema, and the records kept this version's form (`read`): the resumed run writes this version's.
    """
    path = Path(run_dir) / LOG_FILENAME
    records = read(path)
    kept = [
        {**r, "schema": SCHEMA_VERSION} if r["type"] == "run" else r
        for r in records
        if r["type"] == "run" or (r["type"] in ("interval", "eval") and r["step"] <= step)
    ]
    # Written beside the log, then renamed over it: a kill or a full disk leaves the old log or the new, whole.
    partial = path.with_name(path.name + ".partial")
    try:
        partial.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in kept), encoding="utf-8")
        os.replace(partial, path)
    except OSError:
        partial.unlink(missing_ok=True)
        raise
    summaries = [r for r in records if r["type"] == "summary"]
    return summaries[-1] if summaries and summaries[-1].get("steps") == step else None


# --------------------------------------------------------------------------------------- run identity


def new_run_id() -> str:
    """UTC time and a short random suffix, e.g. ``20260105T101500Z-3fa2c1``."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(3)


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    import ls_jax

    return {
        "python": platform.python_version(),
        **{name: _version(name) for name in ("jax", "jaxlib", "flax", "optax")},
        "ls_jax": ls_jax.__version__,
    }


def _git(*args: str) -> str | None:
    """Standard output of ``git ARGS`` in the checkout this code runs from, or None where git cannot answer."""
    try:
        result = subprocess.run(
            ["git", *args],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout


def git_commit() -> str | None:
    """``$LS_JAX_GIT_COMMIT`` where set (a copy of the tree on a remote GPU machine, whose git metadata may be
    stale or absent), else HEAD of the checkout this code runs from, else None."""
    if os.environ.get("LS_JAX_GIT_COMMIT"):
        return os.environ["LS_JAX_GIT_COMMIT"]
    head = _git("rev-parse", "HEAD")
    return (head or "").strip() or None


def git_dirty() -> bool | None:
    """Whether tracked files of the checkout differ from its HEAD (the run's code is not `git_commit`'s alone);
    None where unknown: no git, or ``$LS_JAX_GIT_COMMIT`` naming the commit of a copied tree."""
    if os.environ.get("LS_JAX_GIT_COMMIT"):
        return None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status.strip())


def identity(task: str, run_id: str, command: str, started_at: str) -> dict[str, Any]:
    """The fields of a run record that say which run, where and when."""
    return {
        "type": "run",
        "schema": SCHEMA_VERSION,
        "run_id": run_id,
        "task": task,
        "command": command,
        "started_at": started_at,
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
        "versions": versions(),
        "host": socket.gethostname(),
    }


# ------------------------------------------------------------------------------------------------ records


def energy_fields(joules: float | None, source: str | None) -> dict[str, Any]:
    """``energy_j`` and ``energy_source``, both null when the energy is not known (e.g. a segment without it)."""
    return {"energy_j": joules, "energy_source": source if joules is not None else None}


EVAL_KEYS = ("split", "loss", "nll")  # what every eval record holds beside its metrics


def eval_record(step: int, fields: Mapping[str, Any]) -> dict[str, Any]:
    """An ``eval`` record of an evaluation's ``fields`` (split, scores, the task's ``metrics``); ``loss`` and ``nll``
    are null and ``metrics`` empty unless given."""
    return {"type": "eval", "step": step, "loss": None, "nll": None, "metrics": {}, **fields}
