"""The optimizer of a run: ls_jax.optim's fused AdamW or Adan, or optax's unfused ones as the baseline they are
measured against, with decoupled weight decay on matrices; and the learning-rate schedules the tasks use."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax

import ls_jax.optim

FUSED = ("adamw", "adan")
UNFUSED = ("optax-adamw", "optax-adan")
OPTIMIZERS = FUSED + UNFUSED
HYPERPARAMETERS = ("b1", "b2", "b3", "eps")
# AdamW with fairseq's Transformer betas; Adan with its paper's (optax.adan's) defaults. Only Adan has b3.
DEFAULT_HYPERPARAMETERS: dict[str, dict[str, float]] = {
    "adamw": {"b1": 0.9, "b2": 0.98, "eps": 1e-8},
    "adan": {"b1": 0.98, "b2": 0.92, "b3": 0.99, "eps": 1e-8},
}


def algorithm(name: str) -> str:
    """The update rule of an optimizer name: ``adamw`` or ``adan`` (``optax-adan`` is Adan)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {', '.join(OPTIMIZERS)}")
    return name.removeprefix("optax-")


def hyperparameters(name: str, given: Mapping[str, float | None]) -> dict[str, float]:
    """The optimizer's defaults overridden by the ``given`` values that are not None.

    Raises:
      ValueError: ``b3`` given for AdamW, or a beta outside [0, 1) or eps <= 0.
    """
    values = dict(DEFAULT_HYPERPARAMETERS[algorithm(name)])
    for key, value in given.items():
        if value is None:
            continue
        if key not in values:
            raise ValueError(f"--{key} is an Adan hyperparameter; {name} has only {', '.join(values)}")
        values[key] = float(value)
    for key, value in values.items():
        valid = value > 0 if key == "eps" else 0.0 <= value < 1.0
        if not valid:
            raise ValueError(
                f"--{key} {value:g} is out of range: " + ("eps must be > 0" if key == "eps" else "betas lie in [0, 1)")
            )
    return values


def implementation(name: str, backend: str) -> str:
    """What runs one optimizer step: optax's per-leaf XLA ops, or ls_jax.optim's multi-tensor update through the
    CUDA kernel (``backend`` ffi) or its XLA form."""
    if name in UNFUSED:
        return f"optax.{algorithm(name)} (unfused, per-leaf XLA ops)"
    form = "CUDA kernel" if backend == "ffi" else "XLA"
    return f"ls_jax.optim.{name} (fused multi-tensor, {form})"


def inverse_sqrt_schedule(peak_lr: float, warmup_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to ``peak_lr`` over ``warmup_steps``, then ``peak_lr * sqrt(warmup_steps / step)``."""
    if warmup_steps < 1:
        raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps}")
    # join_schedules evaluates both pieces everywhere (then selects), so keep the decay finite before warmup ends.
    decay = lambda count: peak_lr * jnp.sqrt(warmup_steps / jnp.maximum(count + warmup_steps, warmup_steps))  # noqa: E731
    return optax.join_schedules([optax.linear_schedule(0.0, peak_lr, warmup_steps), decay], [warmup_steps])


def linear_warmup_decay(peak_lr: float, warmup_steps: int, total_steps: int) -> optax.Schedule:
    """``peak_lr * n / W`` for the first W = ``warmup_steps`` steps, then linear decay to 0 at ``total_steps``."""
    decay = optax.linear_schedule(peak_lr, 0.0, total_steps - warmup_steps)
    if warmup_steps == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak_lr, warmup_steps), decay], [warmup_steps])


TRANSITION_FRACTION = 0.1  # of the steps left, over which a resumed run's rate moves to its new schedule


def continued(schedule: optax.Schedule, transition: tuple[int, float] | None, total_steps: int) -> optax.Schedule:
    """``schedule`` as a run resumed with another ``--steps`` follows it, without a jump in the rate.

    ``transition`` = (step, rate): the step the run resumed at and the rate its schedule had there. From that step
    the rate moves linearly to ``schedule`` over a tenth of the steps left (at least one), then follows it; before
    that step it is ``schedule``'s. So a linear decay extended by a longer --steps goes on from where it was (0, for
    a run that finished its decay) up to the longer decay's rate, then decays to 0 at the new --steps.
    """
    if transition is None:
        return schedule
    start, rate = int(transition[0]), float(transition[1])
    end = min(total_steps, start + max(1, round(TRANSITION_FRACTION * (total_steps - start))))

    def moved(count):
        target = schedule(end)
        blend = jnp.clip((count - start) / max(end - start, 1), 0.0, 1.0)
        during = rate + (target - rate) * blend
        return jnp.where((count >= start) & (count < end), during, schedule(count))

    return moved


def on_host(schedule: optax.Schedule) -> Callable[[int], float]:
    """The schedule's value at a step, computed on the host's CPU for the run log, compiled once here.

    Evaluated eagerly, each of the schedule's ops compiles on its first use: on a GPU about half a second of host
    time that also waits behind the training steps queued on the device's stream; on the CPU a quarter of a
    second, charged to the steps of the second logged interval. Compiled now, at setup, it costs a few
    microseconds per call. The CPU is this process's own: in a job of several CPU processes
    ``jax.devices("cpu")[0]`` is process 0's, whose values no other process can read."""
    cpu = jax.local_devices(backend="cpu")[0]
    with jax.default_device(cpu):
        rate = jax.jit(schedule)
        rate(0)

    def value(step: int) -> float:
        with jax.default_device(cpu):
            return float(rate(step))

    return value


def decay_mask(params: Any) -> Any:
    """Weight decay on matrices only: no decay for biases and LayerNorm scales (leaves with fewer than 2 axes)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def _unfused(
    name: str, schedule: optax.Schedule, values: Mapping[str, float], *, weight_decay: float, clip_norm: float | None
) -> optax.GradientTransformation:
    """optax's own AdamW or Adan, after optax's global-norm clipping when ``clip_norm`` is set."""
    if name == "optax-adamw":
        update = optax.adamw(schedule, **values, weight_decay=weight_decay, mask=decay_mask)
    else:
        update = optax.adan(schedule, **values, weight_decay=weight_decay, mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(clip_norm), update) if clip_norm else update


def make_optimizer(
    name: str,
    schedule: optax.Schedule,
    *,
    weight_decay: float,
    clip_norm: float | None,
    master_dtype: Any = None,
    b1: float | None = None,
    b2: float | None = None,
    b3: float | None = None,
    eps: float | None = None,
) -> optax.GradientTransformation:
    """The optimizer ``name`` (`OPTIMIZERS`) with the hyperparameters given (the rest from
    `DEFAULT_HYPERPARAMETERS`); with ``master_dtype`` (bf16 or f16) a fused one keeps f32 master weights and trains
    params of that dtype.

    Raises:
      ValueError: an unknown name or bad hyperparameter, or ``master_dtype`` with an unfused optimizer (optax
        keeps no master weights).
    """
    values = hyperparameters(name, {"b1": b1, "b2": b2, "b3": b3, "eps": eps})
    if name in UNFUSED:
        if master_dtype is not None:
            raise ValueError(
                f"--master-weights needs a fused optimizer ({', '.join(FUSED)}); {name} keeps no master weights"
            )
        return _unfused(name, schedule, values, weight_decay=weight_decay, clip_norm=clip_norm)
    options = dict(
        weight_decay=weight_decay,
        mask=decay_mask,
        max_grad_norm=clip_norm if clip_norm else None,
        storage_dtype=master_dtype,
        master_weights=master_dtype is not None,
    )
    if name == "adamw":
        return ls_jax.optim.adamw(schedule, **values, **options)
    return ls_jax.optim.adan(schedule, **values, **options)
