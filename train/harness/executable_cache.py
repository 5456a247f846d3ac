"""Compiled training steps kept on disk under a key made before tracing, so a re-run loads its step untraced.

XLA's persistent cache (`train.harness.compile_cache`) is keyed by the lowered program: a re-run loads the step's
executable from it only after JAX has traced and lowered the step to compute that key, most of a cached BERT-base
run's compilation window (4.6-5.2 s on an H200; 1.2-1.7 s with the step loaded from here). `StepExecutables` keys the
step by what its program is made of, all of it known before tracing:
- the code: every source file of ``ls_jax``, ``ffi_kernels`` and ``train``, the versions of Python, jax, jaxlib,
  flax and optax;
- the step function as a value (`describe`): its code's name and everything it closes over, down to the model's
  configuration, the loss's constants (a pad id) and the optimizer's hyperparameters and schedule;
- the run: the task, its configuration less the fields only the host reads (`HOST_ONLY_FIELDS`), the step count,
  the model's signature and the kernel backend (`run_description`): what the step might read other than through
  its closure;
- the program's arguments: the state's and the batch's trees, shapes, dtypes and placements;
- the compilation: XLA's options, the ``XLA_*`` and ``LS_JAX_*`` environment, JAX's configuration, the devices.
Anything else that changes the step changes one of these, so a changed flag or an edited source file compiles anew.

An entry holds the executable (`jax.experimental.serialize_executable`), its argument and result trees and XLA's
FLOP count of the step. Entries live in a folder of the compilation cache's directory (``--no-compile-cache`` turns
both off), written whole or not at all (a temporary file renamed). An entry that cannot be loaded, or whose
arguments are not the step's, is one warning and a compilation; a failed write is one warning and the run goes on.
Off a GPU a step that XLA's cache answered is not kept (`keepable`).
Only a run of one process uses it: a step over several processes is compiled by all of them together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pickle
import sys
import types
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import jax
import numpy as np
from jax.experimental import serialize_executable

FOLDER = "ls_jax_steps"  # inside the compilation cache's directory
SOURCE_PACKAGES = ("ls_jax", "ffi_kernels", "train")
SOURCE_SUFFIXES = (".py", ".cu", ".cuh", ".h", ".cc", ".cpp")
VERSIONED = ("jax", "jaxlib", "flax", "optax")
# Fields of `train.harness.config.TrainingConfig` that only the host reads: where the run writes and reports, how
# often it evaluates and saves, what it costs. Every other field, and every field a task adds, is in the key.
HOST_ONLY_FIELDS = frozenset(
    {
        "run_dir",
        "resume",
        "log_every",
        "eval_every",
        "checkpoint_every",
        "keep_checkpoints",
        "progress",
        "tensorboard",
        "compile_cache",
        "verbose",
        "price_per_hour",
        "peer_timeout",
        "profile_steps",
    }
)


@dataclasses.dataclass(frozen=True)
class Entry:
    """A loaded step: its executable (a `jax.stages.Compiled`) and XLA's FLOP count of it (None: not counted)."""

    compiled: Any
    flops: float | None


def run_description(
    task: str, config_record: Mapping[str, Any], steps: int, signature: Mapping[str, Any], kernels: str
) -> dict[str, Any]:
    """What of a run shapes its training step: the task's name, its configuration record (the flags and what the
    task derived from them and the data, such as a schedule) less `HOST_ONLY_FIELDS`, the step count its schedule
    spans, the model's signature and the kernel backend (``"ffi"`` or ``"xla"``)."""
    config = {name: value for name, value in config_record.items() if name not in HOST_ONLY_FIELDS}
    return {"task": task, "config": config, "steps": steps, "signature": dict(signature), "kernels": kernels}


def source_digest(roots: Iterable[Path]) -> str:
    """SHA-256 over every source file under ``roots`` (`SOURCE_SUFFIXES`): each file's path relative to its root
    and its bytes, in sorted order."""
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()):
            digest.update(str(path.relative_to(root.parent)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def code_fingerprint() -> dict[str, Any]:
    """The installed code the step is traced from: `source_digest` of `SOURCE_PACKAGES` and the versions of
    Python and `VERSIONED`."""
    roots = [Path(importlib.util.find_spec(name).origin).parent for name in SOURCE_PACKAGES]
    return {
        "sources": source_digest(roots),
        "python": sys.version,
        **{name: importlib.metadata.version(name) for name in VERSIONED},
    }


def describe(value: Any, path: frozenset[int] = frozenset()) -> Any:
    """``value`` as plain JSON data that two processes building the same value write alike: a function as its module,
    name, defaults and the values it closes over; a dataclass (a Flax module, a config) as its type and fields; an
    array as its shape, dtype and a digest of its bytes; containers item by item. An object of no known kind is its
    ``repr``: where that names a memory address the description differs in every process, so a step closing over
    such an object is never found, and compiled again, rather than found wrongly. ``path`` holds the objects being
    described around this one (a cycle is described as such)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (type, enum.Enum, np.dtype)):
        return ["constant", repr(value)]
    if id(value) in path:
        return ["cycle"]
    path = path | {id(value)}
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        array = np.asarray(value)
        return ["array", list(array.shape), str(array.dtype), hashlib.sha256(array.tobytes()).hexdigest()]
    if isinstance(value, (list, tuple)):
        return [type(value).__qualname__, *(describe(item, path) for item in value)]
    if isinstance(value, (set, frozenset)):
        return [type(value).__qualname__, *sorted(json.dumps(describe(item, path)) for item in value)]
    if isinstance(value, dict):
        return ["dict", *sorted([repr(key), describe(item, path)] for key, item in value.items())]
    if isinstance(value, types.FunctionType):
        closure = [_cell_contents(cell) for cell in value.__closure__ or ()]
        defaults = [value.__defaults__, value.__kwdefaults__, closure]
        return ["function", value.__module__, value.__qualname__, describe(defaults, path)]
    if isinstance(value, functools.partial):
        return ["partial", describe([value.func, value.args, value.keywords], path)]
    if isinstance(value, types.MethodType):
        return ["method", value.__func__.__qualname__, describe(value.__self__, path)]
    if isinstance(value, (types.BuiltinFunctionType, types.ModuleType)):
        return ["named", getattr(value, "__module__", None), getattr(value, "__qualname__", value.__name__)]
    if dataclasses.is_dataclass(value):
        fields = [[f.name, describe(getattr(value, f.name, None), path)] for f in dataclasses.fields(value)]
        return ["dataclass", repr(type(value)), fields]
    if hasattr(value, "__dict__"):
        return ["object", repr(type(value)), describe(vars(value), path)]
    try:
        return ["repr", repr(value)]
    except Exception:  # noqa: BLE001 - an object that cannot say what it is makes a key no later run finds
        return ["unrepresentable", id(value)]


def _cell_contents(cell: types.CellType) -> Any:
    """A closure cell's value; an empty one (a name bound after the function, or never) as a marker."""
    try:
        return cell.cell_contents
    except ValueError:
        return ["empty cell"]


def _arguments(tree: Any, shardings: Any) -> dict[str, Any]:
    """The tree structure, each leaf's shape, dtype and weak type, and the placements of ``tree``."""
    leaves, structure = jax.tree.flatten(tree)
    return {
        "tree": str(structure),
        "leaves": [[list(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False))] for x in leaves],
        "shardings": [str(s) for s in jax.tree.leaves(shardings)],
    }


def keepable(platform: str, from_xla_cache: bool) -> bool:
    """Whether a step compiled on ``platform`` can be kept: XLA:CPU serializes a program it loaded from its own cache
    without the program's functions (such an entry fails at its first run, "Function ... not found"), so off a GPU
    only a program XLA compiled in this process is kept; a GPU's keeps its kernels either way."""
    return platform == "gpu" or not from_xla_cache


class StepExecutables:
    """The training steps of runs described as ``run`` (`run_description`), in ``directory`` / `FOLDER`."""

    def __init__(self, directory: Path, run: Mapping[str, Any]):
        self.folder = Path(directory) / FOLDER
        self._run = run

    def key(
        self,
        step_fn: Callable,
        state: Any,
        state_shardings: Any,
        batch: Mapping[str, Any],
        batch_sharding: Any,
        options: Mapping[str, Any],
        devices: Iterable[Any],
    ) -> str:
        """The entry's name for ``step_fn`` over ``state`` and ``batch`` (arrays or ShapeDtypeStructs) placed as
        given, compiled with ``options`` for ``devices``."""
        parts = {
            "code": code_fingerprint(),
            "step": describe(step_fn),
            "run": self._run,
            "state": _arguments(state, state_shardings),
            "batch": _arguments(dict(batch), jax.tree.map(lambda _: batch_sharding, dict(batch))),
            "options": sorted((str(name), str(value)) for name, value in options.items()),
            "devices": [[d.id, d.platform, d.device_kind, d.process_index] for d in devices],
            "processes": jax.process_count(),
            "environment": sorted((k, v) for k, v in os.environ.items() if k.startswith(("XLA_", "LS_JAX_"))),
            "jax_config": sorted((name, repr(value)) for name, value in jax.config.values.items()),
        }
        text = json.dumps(parts, sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()[:40]

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.pkl"

    def load(self, key: str, arguments: tuple[Any, ...], devices: list[Any]) -> Entry | None:
        """The entry ``key`` loaded onto ``devices``, or None when there is none; one warning, and None, when it
        cannot be loaded or its arguments are not ``arguments``' (trees, shapes and dtypes)."""
        path = self.path(key)
        if not path.exists():
            return None
        try:
            with open(path, "rb") as file:
                saved = pickle.load(file)
            compiled = serialize_executable.deserialize_and_load(
                saved["executable"],
                saved["in_tree"],
                saved["out_tree"],
                backend=devices[0].client,
                execution_devices=devices,
            )
            expected = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), (arguments, {}))
            found = jax.tree.map(lambda info: (tuple(info.shape), str(info.dtype)), compiled.args_info)
            if found != expected:
                raise ValueError("its arguments' shapes or dtypes are not this step's")
        except Exception as err:  # noqa: BLE001 - any unreadable entry is compiled again, never trusted
            print(
                f"warning: {path}: the cached training step could not be loaded ({type(err).__name__}: {err}); "
                "compiling it",
                file=sys.stderr,
            )
            return None
        return Entry(compiled, saved["flops"])

    def store(self, key: str, compiled: Any, flops: float | None) -> None:
        """Writes ``compiled`` and its FLOP count as the entry ``key``: whole, or (one warning) not at all."""
        path = self.path(key)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            executable, in_tree, out_tree = serialize_executable.serialize(compiled)
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(partial, "wb") as file:
                pickle.dump({"executable": executable, "in_tree": in_tree, "out_tree": out_tree, "flops": flops}, file)
            os.replace(partial, path)
        except Exception as err:  # noqa: BLE001 - written on a thread: every failure is reported, none stops the run
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            print(
                f"warning: {path}: the training step was not kept for later runs ({type(err).__name__}: {err})",
                file=sys.stderr,
            )
