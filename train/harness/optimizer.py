"""The optimizer of a run: ls_jax.optim's fused AdamW or Adan, or optax's unfused ones as the baseline they are
measured against, with decoupled weight decay on matrices; and the learning-rate schedules the tasks use."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax

from ls_jax.optim import registry

OPTIMIZERS = registry.names()
FUSED = registry.names(fused=True)
UNFUSED = registry.names(fused=False)
HYPERPARAMETERS = registry.hyperparameter_names()


def hyperparameters(name: str, given: Mapping[str, float | None]) -> dict[str, float]:
    """The optimizer's defaults overridden by the ``given`` values that are not None.

    Raises:
      ValueError: an unknown optimizer, a hyperparameter it does not take, or a value out of range.
    """
    return registry.get(name).hyperparameters(given)


def implementation(name: str, backend: str) -> str:
    """What runs one optimizer step: optax's per-leaf XLA ops, or ls_jax.optim's multi-tensor update through the
    CUDA kernel (``backend`` ffi) or its XLA form."""
    spec = registry.get(name)
    if not spec.fused:
        return f"optax.{spec.rule.lower()} (unfused, per-leaf XLA ops)"
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
    """The optimizer ``name`` (`ls_jax.optim.registry`) with the hyperparameters given (the rest its defaults),
    decoupled weight decay on matrices; with ``master_dtype`` (bf16 or f16) a fused one keeps f32 master weights
    and trains params of that dtype.

    Raises:
      ValueError: an unknown name or bad hyperparameter, or ``master_dtype`` with an unfused optimizer (optax
        keeps no master weights).
    """
    spec = registry.get(name)
    values = spec.hyperparameters({"b1": b1, "b2": b2, "b3": b3, "eps": eps})
    return spec.build(
        schedule,
        values,
        weight_decay=weight_decay,
        mask=decay_mask,
        max_grad_norm=clip_norm or None,
        storage_dtype=master_dtype,
        master_weights=master_dtype is not None,
    )
