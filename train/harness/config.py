"""Typed configuration. `TrainingConfig` holds the flags every task shares; each task subclasses it with its own
fields (`train.wmt.config.WmtConfig`, ...), so a flag such as ``--max-tokens`` is the attribute
``config.max_tokens`` from argparse to where it is used. `resolve` combines, in rising precedence, the dataclass
defaults, the defaults of the data source, a resumed run's saved configuration, the environment and the flags given
now; the result is checked once by the task and the harness, saved to config.json and read back on ``--resume``.

`Run` is what a task's setup starts from: the configuration, which flags this invocation gave, and the run
directory.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any, Mapping, TypeVar

from ls_jax import backend as backend_lib
from train.errors import UsageError
from train.harness.startup import StartupClock


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """The flags `train.harness.cli.add_training_arguments` adds to every task; None means "the task decides"
    (e.g. the optimizer's own betas)."""

    steps: int | None = 1000
    optimizer: str = "adamw"
    b1: float | None = None
    b2: float | None = None
    b3: float | None = None
    eps: float | None = None
    lr: float = 5e-4
    warmup_steps: int | None = 4000
    weight_decay: float = 1e-4
    clip_norm: float = 0.0
    grad_accum: int = 1
    precision: str = "auto"
    master_weights: bool = False
    remat: str = "none"
    backend: str = "auto"
    seed: int = 0
    run_dir: str | None = None
    resume: str | None = None
    log_every: int = 100
    eval_every: int | None = 0
    checkpoint_every: int | None = 1000
    keep_checkpoints: int = 3
    progress: bool = True
    tensorboard: bool = True
    compile_cache: bool = True
    verbose: bool = False
    price_per_hour: float | None = None
    device_name: str | None = None
    shard_optimizer: bool = False
    grad_bucket_mb: float = 25.0
    grad_comm_dtype: str | None = None
    distributed: bool = False
    peer_timeout: int = 60
    profile_steps: list[int] | None = None  # [first, last]: steps traced with jax.profiler into RUN_DIR/profile
    # Not a flag: set on --resume when --steps changed the schedule, the (step, rate) the rate moves on from
    # (train.harness.optimizer.continued); kept in config.json so a later resume follows the same schedule.
    lr_transition: list[float] | None = None

    def replace(self: C, **changes: Any) -> C:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON values: config.json and the run record's ``config``."""
        return dataclasses.asdict(self)


C = TypeVar("C", bound=TrainingConfig)


def field_names(config_type: type[TrainingConfig]) -> frozenset[str]:
    return frozenset(field.name for field in dataclasses.fields(config_type))


def defaults(config_type: type[TrainingConfig]) -> dict[str, Any]:
    """Every field's default, by name (the ``--help`` epilog)."""
    return {field.name: field.default for field in dataclasses.fields(config_type)}


def resolve(
    config_type: type[C], given: Mapping[str, Any], saved: Mapping[str, Any] | None, by_data: Mapping[str, Any]
) -> C:
    """``config_type``'s defaults < ``by_data`` (the data source's defaults) < ``saved`` (a resumed run's
    config.json; keys it holds that are no field, such as ``run_id``, are left out) < the environment
    (`environment`) < ``given`` (this command line's flags, every one a field).

    Raises:
      UsageError: an environment variable of `environment` names no value its field takes.
    """
    names = field_names(config_type)
    unknown = sorted(set(given) - names)
    if unknown:  # a parser flag without a field is a programming error, not the user's
        raise TypeError(f"{config_type.__name__} has no field for {', '.join(unknown)}")
    kept = {key: value for key, value in (saved or {}).items() if key in names}
    return config_type(**{**by_data, **kept, **environment(), **given})


def environment() -> dict[str, Any]:
    """The fields set by environment variables: ``$LS_JAX_KERNELS`` (`ls_jax.backend`) sets ``backend``.

    Raises:
      UsageError: a variable that names no value its field takes.
    """
    if not os.environ.get(backend_lib.ENV_VAR, "").strip():
        return {}
    try:
        return {"backend": backend_lib.requested_mode()}
    except ValueError as err:
        raise UsageError(f"{err}; set it to one of them or pass --backend") from None


def flag(name: str) -> str:
    """The command-line flag of a field: ``max_tokens`` -> ``--max-tokens``."""
    return "--" + name.replace("_", "-")


def check_saved(
    config_type: type[TrainingConfig], saved: Mapping[str, Any], path: Path, given: Mapping[str, Any]
) -> None:
    """Raises UsageError naming ``path`` for a saved configuration (a resumed run's config.json, perhaps edited by
    hand) that holds a value of another type than its field takes, unless the flag given now replaces it."""
    hints = typing.get_type_hints(config_type)
    for name, value in saved.items():
        if name in hints and given.get(name) is None and not _has_type(value, hints[name]):
            raise UsageError(
                f"{path}: {name} is {value!r}, not {_type_name(hints[name])}; correct it there, or give {flag(name)}"
            )


def where_refused_value_came_from(
    err: UsageError,
    config_type: type[TrainingConfig],
    given: Mapping[str, Any],
    saved: Mapping[str, Any] | None,
    path: Path | None,
) -> UsageError:
    """``err`` (a check refused a value; its message names the flag first) saying where the value came from when not
    from the command line: the saved configuration at ``path``, or the flag's default."""
    message = f"{err} "
    named = [(message.find(f"{flag(name)} "), name) for name in field_names(config_type)]
    named = sorted((at, name) for at, name in named if at >= 0)
    if not named or given.get(named[0][1]) is not None:
        return err
    name = named[0][1]
    if saved is not None and name in saved:
        return UsageError(f"{path}: {err} (saved there; correct it, or give {flag(name)})")
    if str(err).startswith(flag(name)):
        return UsageError(f"the default {err}")
    return err


def _has_type(value: Any, hint: Any) -> bool:
    """Whether the JSON ``value`` is of the field type ``hint`` (int | None, float, list[float] | None, ...)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, arm) for arm in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_has_type(v, item) for v in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint) and not isinstance(value, bool)


def _type_name(hint: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arm) for arm in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        return f"a list of {_type_name(typing.get_args(hint)[0]).removeprefix('a ').removeprefix('an ')}s"
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def check_task(saved: Mapping[str, Any] | None, task: str, resume: str | None) -> None:
    """Raises UsageError when ``--resume`` names the run directory of another task."""
    if saved is not None and saved.get("task", task) != task:
        other = saved["task"]
        article = "an" if other[0] in "aeiou" else "a"
        raise UsageError(
            f"--resume {resume}: that is {article} {other} run; resume it with "
            f"python -m train.{other} --resume {resume}"
        )


@dataclasses.dataclass(frozen=True)
class Run:
    """What a task's training starts from."""

    config: Any  # the task's TrainingConfig subclass, resolved and checked
    given: frozenset[str]  # the fields whose flags this command line gave
    changed: tuple[str, ...]  # on --resume: ``--flag NEW (was OLD)`` for each flag that changes the saved run
    run_id: str
    run_dir: Path
    command: str  # the command line, for the run record
    startup: StartupClock  # from the start: wall_time_s, and the start-up's parts
    started_utc: str
