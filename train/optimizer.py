"""The optimizer of a run: ls_jax.optim's fused AdamW or Adan with decoupled weight decay on matrices, and the
learning-rate schedules the tasks use."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

import ls_jax.optim

OPTIMIZERS = ("adamw", "adan")


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


def decay_mask(params: Any) -> Any:
    """Weight decay on matrices only: no decay for biases and LayerNorm scales (leaves with fewer than 2 axes)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(
    name: str, schedule: optax.Schedule, *, weight_decay: float, clip_norm: float | None, master_dtype: Any = None
) -> optax.GradientTransformation:
    """ls_jax.optim's fused AdamW (betas 0.9, 0.98 as in fairseq's Transformer recipe) or Adan (paper defaults);
    with ``master_dtype`` (bf16 or f16) it keeps f32 master weights and trains params of that dtype."""
    options = dict(weight_decay=weight_decay, mask=decay_mask, max_grad_norm=clip_norm if clip_norm else None,
                   storage_dtype=master_dtype, master_weights=master_dtype is not None)
    if name == "adamw":
        return ls_jax.optim.adamw(schedule, b1=0.9, b2=0.98, **options)
    if name == "adan":
        return ls_jax.optim.adan(schedule, **options)
    raise ValueError(f"unknown optimizer {name!r}; expected one of {', '.join(OPTIMIZERS)}")
