"""Whether a training step fits in memory, asked before anything is compiled or allocated.

A step holds, on each device, the train state (parameters and optimizer state), the gradients (twice with
gradient accumulation: the sum and one micro-batch's), the batch, and what the backward keeps from the forward of
one micro-batch: the residuals of ``jax.vjp`` of the loss, found by tracing alone (``jax.eval_shape``). The
backward then makes gradients of those residuals, counted here as one more of the largest. This counts every
residual apart, before XLA fuses chains of element-wise operations (for ``tanh(x @ w) ** 2`` it counts 2.6 times
XLA's buffers), while XLA adds workspace of its own (gpt2-small at 8 x 1024 tokens: 15.5 GiB estimated,
about 24 GB resident on a CPU host): an estimate of the peak, not a bound.

The memory it is held against: ``$LS_JAX_MEMORY_LIMIT`` when set (bytes, or with a unit: ``512MiB``, ``16GB``);
else, on a CPU, the host's MemAvailable (/proc/meminfo), since a step that outgrows it gets the process killed or
the host swapping. An accelerator's runtime reports its own out-of-memory error, after fusion, so there the check
runs only when the variable is set.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import numpy as np

from train.errors import UsageError

ENV_VAR = "LS_JAX_MEMORY_LIMIT"
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
MEMINFO = Path("/proc/meminfo")


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Bytes one device needs for a training step, by part."""

    state: int  # parameters and optimizer state
    gradients: int
    activations: int  # the residuals the backward keeps, and the gradient of the largest
    batch: int

    @property
    def total(self) -> int:
        return self.state + self.gradients + self.activations + self.batch

    def describe(self) -> str:
        return (
            f"{size(self.total)} (parameters and optimizer {size(self.state)}, gradients "
            f"{size(self.gradients)}, activations kept for the backward {size(self.activations)})"
        )


def size(value: float) -> str:
    """Bytes in the largest binary unit they fill: ``512 B``, ``3.2 MiB``, ``14.40 GiB``."""
    for factor, unit, digits in ((2**30, "GiB", 2), (2**20, "MiB", 1), (2**10, "KiB", 1)):
        if value >= factor:
            return f"{value / factor:,.{digits}f} {unit}"
    return f"{value:.0f} B"


def _bytes(tree: Any) -> int:
    return int(sum(np.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)))


def residual_sizes(loss_fn: Callable, params: Any, micro_batch: Mapping[str, jax.ShapeDtypeStruct]) -> list[int]:
    """Bytes of each array the backward of ``loss_fn(params, micro_batch, rng)``'s summed loss keeps from the
    forward, by tracing the forward only."""
    rng = jax.ShapeDtypeStruct((2,), np.uint32)

    def backward(params, batch, key):
        return jax.vjp(lambda p: loss_fn(p, batch, key)[0], params)[1]

    residuals = jax.eval_shape(backward, params, dict(micro_batch), rng)
    return [int(np.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize) for leaf in jax.tree.leaves(residuals)]


def estimate(
    loss_fn: Callable,
    params: Any,
    opt_state: Any,
    micro_batch: Mapping[str, jax.ShapeDtypeStruct],
    *,
    accumulated: bool,
    optimizer_shards: int = 1,
) -> StepMemory:
    """`StepMemory` of one device: ``params`` and ``opt_state`` as it holds them (abstract arrays are fine; a
    sharded optimizer state counts 1/``optimizer_shards``), ``micro_batch`` its rows of one micro-batch."""
    residuals = residual_sizes(loss_fn, params, micro_batch)
    gradients = _bytes(jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, np.float32), params))
    return StepMemory(
        state=_bytes(params) + _bytes(opt_state) // optimizer_shards,
        gradients=gradients * (2 if accumulated else 1),
        activations=sum(residuals) + max(residuals, default=0),
        batch=_bytes(micro_batch),
    )


def parse_bytes(text: str) -> int:
    """``1073741824``, ``512MiB``, ``16 GB`` ... as a number of bytes.

    Raises:
      UsageError: not a positive amount with one of the units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise UsageError(
            f"${ENV_VAR}={text!r} is not an amount of memory; give bytes, or a number with a unit "
            "such as 512MiB or 16GB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def host_available(meminfo: Path = MEMINFO) -> int | None:
    """The kernel's estimate of the memory a new program can use without swapping (MemAvailable), in bytes."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    match = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def available(device: Any) -> tuple[int, str] | None:
    """(bytes, where that figure comes from) a step on ``device`` may use, or None: not checked (module docstring)."""
    if os.environ.get(ENV_VAR, "").strip():
        return parse_bytes(os.environ[ENV_VAR]), f"set by ${ENV_VAR}"
    if device.platform != "cpu":
        return None
    free = host_available()
    return None if free is None else (free, "available on this host (MemAvailable)")


def check(need: StepMemory, limit: tuple[int, str] | None, advice: str) -> None:
    """Raises UsageError, one line with the estimate, the limit and ``advice``, when ``need`` exceeds ``limit``."""
    if limit is None or need.total <= limit[0]:
        return
    raise UsageError(
        f"a training step needs about {need.describe()}, more than the {size(limit[0])} {limit[1]}; "
        f"{advice} (${ENV_VAR}=BYTES sets the limit this is checked against)"
    )
