"""The command line every training entry point shares: the common flags and their defaults, the ``--help``
epilog, range checks of the values, and the exit codes.

Exit codes (`train.errors`): 0 finished (or nothing left to train); 2 bad flags; 3 unusable data; 4 the
loss or state became non-finite (the last good checkpoint is kept); 5 a checkpoint or the run log could not be
written; 6 another process of a multi-process run was lost; 128 + the signal number when SIGINT/SIGTERM stopped the
run (after writing a checkpoint). Each but 0
prints one line naming the cause and what to do.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import math
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from ls_jax import backend as backend_lib
from ls_jax.layers.config import REMAT_MODES
from ls_jax.ops import attention as attention_ops
from ls_jax.optim import registry
from train.costs import devices as device_table
from train.costs import memory_budget
from train.costs.precision import PRECISION_DTYPES
from train.errors import (
    EXIT_DATA,
    EXIT_FINISHED,
    EXIT_IO,
    EXIT_NUMERICS,
    EXIT_SIGNAL_BASE,
    EXIT_USAGE,
    DataError,
    Interrupted,
    UsageError,
)
from train.harness import config as config_lib
from train.harness import optimizer as optimizer_lib
from train.harness.config import TrainingConfig, flag
from train.harness.loop import TrainResult
from train.records.checkpoints import Checkpoints

IMPLEMENTATIONS = ("flax", "ls_jax")
"""What ``--implementation`` chooses: the plain Flax baseline of train/reference/ (written as Hugging Face's Flax
models are, compiled by XLA) or the ls_jax model, whose non-GEMM work runs in the fused ops."""


def add_implementation_argument(group: argparse._ArgumentGroup, baseline: str) -> None:
    """``--implementation`` in a task's model group; ``baseline`` names the task's plain Flax model."""
    group.add_argument(
        "--implementation",
        choices=IMPLEMENTATIONS,
        help=f"ls_jax: the ls_jax model (fused ops: CUDA kernels or XLA, see --backend); flax: "
        f"{baseline}, plain Flax compiled by XLA; the same harness, optimizer, data, checkpoints "
        "and evaluation (default ls_jax)",
    )


def check_implementation(implementation: str, remat: str) -> None:
    """Raises UsageError for what the plain Flax baseline cannot do: gradient checkpointing (``--remat``)."""
    if implementation == "flax" and remat != "none":
        raise UsageError(
            f"--remat {remat} needs --implementation ls_jax: the plain Flax baseline has no gradient checkpointing"
        )


SEED_LIMIT = 2**32
GRAD_BUCKET_MB = (2.0**-20, 2.0**20)  # one byte to 1 TiB


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags every training entry point shares (task flags are added by the task)."""
    group = parser.add_argument_group("training")
    group.add_argument("--steps", type=int, help="optimizer steps to train for")
    group.add_argument(
        "--optimizer",
        choices=optimizer_lib.OPTIMIZERS,
        help=f"{', '.join(optimizer_lib.FUSED)}: ls_jax.optim's fused multi-tensor update; "
        f"{', '.join(optimizer_lib.UNFUSED)}: optax's unfused baselines (default adamw)",
    )
    for name in optimizer_lib.HYPERPARAMETERS:
        group.add_argument(
            f"--{name}", type=float, help=f"optimizer {registry.meaning(name)} (default: the optimizer's own)"
        )
    group.add_argument("--lr", type=float, help="peak learning rate")
    group.add_argument("--warmup-steps", type=int, help="linear warmup steps of the learning-rate schedule")
    group.add_argument("--weight-decay", type=float, help="decoupled weight decay on matrices")
    group.add_argument("--clip-norm", type=float, help="clip gradients to this global L2 norm (0: no clipping)")
    group.add_argument("--grad-accum", type=int, help="micro-batches accumulated per optimizer step")
    group.add_argument(
        "--precision",
        choices=("auto", *PRECISION_DTYPES),
        help="compute dtype; auto = fp32 on CPU, bf16 on TPU and GPUs (fp16 on GPUs without bf16); "
        "fp16 uses dynamic loss scaling; fp8 is bf16 with the Dense and logits GEMMs in FP8 (delayed scaling; GPUs "
        "of compute capability 8.9+, emulated on a CPU)",
    )
    group.add_argument(
        "--master-weights",
        action="store_const",
        const=True,
        help="bf16/fp16 params trained from f32 master weights kept by the optimizer (mixed precision "
        "as in Apex O2): the model computes with the optimizer's 16-bit copies, no per-step cast",
    )
    group.add_argument(
        "--remat",
        choices=REMAT_MODES,
        help="gradient checkpointing of each Transformer layer: none; layer (keep each layer's input, "
        "recompute the layer in the backward); gemm-outputs (keep the matmul outputs, recompute "
        "the rest)",
    )
    group.add_argument(
        "--backend",
        choices=backend_lib.MODES,
        help="fused-op implementation: CUDA kernels (ffi), plain XLA, or auto-detect; when not "
        f"given, ${backend_lib.ENV_VAR} if set, else auto",
    )
    group.add_argument("--seed", type=int, help="seed of initialization, dropout and data order")

    group = parser.add_argument_group("logging and checkpoints")
    group.add_argument("--run-dir", help="run directory (default runs/<run_id>)")
    group.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its latest checkpoint, exactly; flags given now "
        "override its saved configuration (e.g. --steps to train longer)",
    )
    group.add_argument("--log-every", type=int, help="steps per interval record (the last step closes one too)")
    group.add_argument("--eval-every", type=int, help="steps between evaluations (0: only at the end)")
    group.add_argument(
        "--checkpoint-every", type=int, help="steps between checkpoints (one is always written at the end)"
    )
    group.add_argument("--keep-checkpoints", type=int, help="how many recent checkpoints to keep")
    group.add_argument(
        "--no-progress",
        dest="progress",
        action="store_const",
        const=False,
        help="no progress bar (without a terminal on stderr: no per-interval progress lines)",
    )
    group.add_argument(
        "--no-tensorboard", dest="tensorboard", action="store_const", const=False, help="no TensorBoard event files"
    )
    group.add_argument(
        "--no-compile-cache",
        dest="compile_cache",
        action="store_const",
        const=False,
        help="compile every program again instead of loading it from XLA's persistent compilation cache "
        "($JAX_COMPILATION_CACHE_DIR, else ~/.cache/ls_jax/xla)",
    )
    group.add_argument(
        "--verbose",
        action="store_const",
        const=True,
        help="also print what the libraries log (orbax, absl, asyncio); by default only the harness's own lines",
    )

    group.add_argument(
        "--profile-steps",
        type=step_range,
        metavar="FIRST:LAST",
        help="trace training steps FIRST to LAST with jax.profiler into RUN_DIR/profile (view it in Perfetto or "
        "TensorBoard; python -m train.bench timeline RUN_DIR/profile says where each device's time went)",
    )

    group = parser.add_argument_group("cost and hardware")
    group.add_argument(
        "--price-per-hour", type=float, help="USD per device-hour for the cost estimate (overrides the built-in table)"
    )
    group.add_argument(
        "--device-name",
        choices=device_table.DEVICE_NAMES,
        help="use this entry of the device table (peak FLOP/s, price, power) instead of matching JAX's device_kind",
    )
    group.add_argument(
        "--shard-optimizer",
        action="store_const",
        const=True,
        help="ZeRO-1: split the optimizer state over the data-parallel devices (ls_jax.optim.shard_optimizer)",
    )
    group.add_argument(
        "--grad-bucket-mb",
        type=float,
        help="several devices only: the gradients are summed over the devices in buckets of this many MiB, each "
        "sent as soon as the backward has computed it, while the backward goes on; smaller buckets start sending "
        "sooner, larger ones send fewer messages; one above the model's size sends once after the backward "
        "(default 25, PyTorch DDP's)",
    )
    group.add_argument(
        "--grad-comm-dtype",
        choices=("fp32", "bf16"),
        help="several devices only: the dtype gradients are sent and summed in (default: bf16 in a bf16 run, else "
        "the params'); bf16 halves the traffic of f32 params at bf16's precision",
    )
    group.add_argument(
        "--distributed",
        action="store_const",
        const=True,
        help="call jax.distributed.initialize() first (multi-host GPU clusters, TPU pod slices)",
    )
    group.add_argument(
        "--peer-timeout",
        type=int,
        metavar="SECONDS",
        help="with --distributed: stop (exit code 6) when another process shows no sign of life for "
        "this long (train.harness.peers)",
    )


def step_range(text: str) -> list[int]:
    """``FIRST:LAST`` as [FIRST, LAST]: steps from 1, LAST >= FIRST (argparse's ``type`` of ``--profile-steps``)."""
    first, sep, last = text.partition(":")
    try:
        steps = [int(first), int(last)] if sep else [int(first)] * 2
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not FIRST:LAST, two step numbers such as 100:104") from None
    if not 1 <= steps[0] <= steps[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: steps count from 1 and LAST must be >= FIRST")
    return steps


def defaults_epilog(config_type: type[TrainingConfig], real_data: Mapping[str, Any], notes: str = "") -> str:
    """The ``--help`` epilog of an entry point: its defaults, those that ``real_data`` replaces, then ``notes``."""

    def line(values: Mapping[str, Any]) -> str:
        return ", ".join(f"{flag(k)} {v}" for k, v in values.items() if v is not None and not isinstance(v, bool))

    defaults = config_lib.defaults(config_type)
    return (
        f"defaults: {line({k: v for k, v in defaults.items() if k not in real_data})}\n"
        f"with --data synthetic: {line({k: defaults[k] for k in real_data})}\n"
        f"with real data: {line(real_data)}\n"
        f"{notes}on --resume RUN_DIR the saved configuration replaces the defaults\n"
        f"before compiling, a step's memory is estimated and, on a CPU, held against the host's available memory "
        f"(${memory_budget.ENV_VAR} sets the limit on any device): a step that cannot fit stops the start"
    )


def check_ranges(
    config: TrainingConfig,
    *,
    at_least_one: Iterable[str] = (),
    non_negative: Iterable[str] = (),
    fractions: Iterable[str] = (),
) -> None:
    """Raises UsageError naming the flag when a set field is < 1, < 0, or outside [0, 1); every task's ``lr`` must
    be > 0, ``seed`` in [0, 2**32) and ``price_per_hour`` >= 0."""
    for name, ok, rule in [
        *((name, lambda v: v >= 1, ">= 1") for name in at_least_one),
        *((name, lambda v: v >= 0, ">= 0") for name in non_negative),
        *((name, lambda v: 0.0 <= v < 1.0, "in [0, 1)") for name in fractions),
    ]:
        value = getattr(config, name)
        if value is not None and not ok(value):
            raise UsageError(f"{flag(name)} must be {rule}, got {value}")
    if not (math.isfinite(config.lr) and config.lr > 0):
        raise UsageError(f"--lr must be a finite number > 0, got {config.lr}")
    if not 0 <= config.seed < SEED_LIMIT:  # a JAX key holds 32 bits of a seed: larger ones would repeat others
        raise UsageError(f"--seed must be an integer in [0, {SEED_LIMIT}), got {config.seed}")
    if not GRAD_BUCKET_MB[0] <= config.grad_bucket_mb <= GRAD_BUCKET_MB[1]:  # also refuses nan
        raise UsageError(
            f"--grad-bucket-mb must be from {GRAD_BUCKET_MB[0]:g} (one byte) to {GRAD_BUCKET_MB[1]:g} (1 TiB, one "
            f"bucket for any model), got {config.grad_bucket_mb:g}"
        )
    price = config.price_per_hour
    if price is not None and not (math.isfinite(price) and price >= 0):
        raise UsageError(f"--price-per-hour must be a finite number >= 0, got {price}")


def check_choice(config: TrainingConfig, name: str, choices: Iterable[str]) -> None:
    """Raises UsageError, one line listing ``choices``, when the set field ``name`` is not one of them."""
    choices = tuple(choices)
    value = getattr(config, name)
    if value is not None and value not in choices:
        raise UsageError(f"{flag(name)} {value}: unknown; choose from {', '.join(choices)}")


def check_init_from(directory: str | None, model: str) -> None:
    """Raises UsageError when ``--init-from`` names no directory: a local Hugging Face ``model`` directory."""
    if directory is not None and not Path(directory).is_dir():
        raise UsageError(
            f"--init-from {directory}: no such directory; give a local Hugging Face {model} directory "
            "(config.json, the weights, the tokenizer)"
        )


def hyperparameters(config: TrainingConfig) -> dict[str, float | None]:
    """The optimizer's hyperparameter flags (``--b1`` ...), by name."""
    return {name: getattr(config, name) for name in optimizer_lib.HYPERPARAMETERS}


def check_optimizer(config: TrainingConfig) -> None:
    """Raises UsageError for optimizer hyperparameters out of range or not of the optimizer, and for what an
    unfused (optax) optimizer cannot do: master weights, a sharded (ZeRO-1) state."""
    try:
        optimizer_lib.hyperparameters(config.optimizer, hyperparameters(config))
    except ValueError as err:
        raise UsageError(f"--optimizer {config.optimizer}: {err}") from None
    if config.optimizer in optimizer_lib.UNFUSED:
        for name in ("master_weights", "shard_optimizer"):
            if getattr(config, name):
                raise UsageError(
                    f"{flag(name)} needs a fused optimizer ({', '.join(optimizer_lib.FUSED)}); "
                    f"{config.optimizer} is optax's own"
                )


def check_environment() -> None:
    """Raises UsageError for a ``$LS_JAX_CUDNN_ATTENTION`` other than 0 or 1, which is read when attention is traced,
    too late for one line (``$LS_JAX_KERNELS`` is a source of the configuration, `config.resolve`)."""
    try:
        attention_ops.cudnn_enabled()
    except ValueError as err:
        raise UsageError(str(err)) from None


def exit_code(result: TrainResult, checkpoints: Checkpoints, resume_command: str) -> int:
    """The exit code of `train.errors` for how the run ended, with one line saying what happened and what to do.

    Every command offered works: ``--resume`` of a run stopped before its first checkpoint starts it again from
    step 0 (`train.records.rundir`)."""
    saved = checkpoints.all_steps()
    kept = f"checkpoint {saved[-1]} in {checkpoints.directory}" if saved else None
    if result.stop_reason == "nan":
        fix = "lower --lr, or raise --warmup-steps or --clip-norm"
        where = (
            f"the last good checkpoint is {kept} ({fix}, and start again from it)"
            if kept
            else f"no checkpoint was written before it ({fix}, and start the run again)"
        )
        print(
            f"error: the loss or the parameters became non-finite after step {result.steps}; {where}", file=sys.stderr
        )
        return EXIT_NUMERICS
    if result.stop_reason == "io_error":
        print(
            f"error: {result.error}; stopped after step {result.steps}, the newest checkpoint is {kept or 'none'}",
            file=sys.stderr,
        )
        return EXIT_IO
    if result.stop_reason == "signal":
        name = signal.Signals(result.signal_number).name
        then = (
            f"the newest checkpoint is {kept}; continue with: {resume_command}"
            if kept
            else f"no checkpoint was written yet; start it again from step 0 with: {resume_command}"
        )
        print(f"stopped by {name} after step {result.steps}; {then}", file=sys.stderr)
        return EXIT_SIGNAL_BASE + int(result.signal_number)
    return EXIT_FINISHED


LIBRARY_LOGGERS = ("absl", "asyncio")  # orbax logs through absl


def quiet_libraries(verbose: bool) -> None:
    """Unless ``verbose``: the records of `LIBRARY_LOGGERS` below CRITICAL and the exceptions Python reports as
    ignored in coroutines (orbax's readers and writers, left behind by a failed read or write) are not printed. The
    harness says what went wrong in one line of its own (a damaged checkpoint names its file and the error)."""
    if verbose:
        return
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    previous = sys.unraisablehook
    if getattr(previous, "_ls_jax_coroutines_quiet", False):
        return

    def hook(unraisable: Any) -> None:
        if not inspect.iscoroutine(unraisable.object):
            previous(unraisable)

    hook._ls_jax_coroutines_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


USER_ERRORS = (UsageError, DataError, FileNotFoundError, ImportError, backend_lib.KernelsUnavailableError)
"""Bad input: reported as one ``error:`` line with exit code 2 (3 for the data)."""


def run_command(run: Callable[[list[str]], int], argv: Sequence[str] | None) -> int:
    """Runs an entry point; bad input is one ``error:`` line and exit code 2 (flags, files they name, a missing
    optional package or kernel library) or 3 (the data), a signal before training started 128 + its number."""
    try:
        return run(list(sys.argv[1:] if argv is None else argv))
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_DATA
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except Interrupted as err:
        print(f"stopped by {signal.Signals(err.signum).name} before training started; nothing to save", file=sys.stderr)
        return EXIT_SIGNAL_BASE + err.signum
