"""Adan (Xie et al., 2022, https://arxiv.org/abs/2208.06677) with a flat f32 workspace and a fused update.

With optax's conventions (``optax.adan``: each beta weighs the old moment, bias correction on all three
moments), for step t = 1, 2, ... and gradient g_t (after optional global-norm clipping):

    d_t = g_t - g_{t-1}   (0 on the first step)
    m_t = (1 - b1) g_t + b1 m_{t-1}
    v_t = (1 - b2) d_t + b2 v_{t-1}
    n_t = (1 - b3) (g_t + (1 - b2) d_t)^2 + b3 n_{t-1}
    u_t = (m_t / (1 - b1^t) + (1 - b2) v_t / (1 - b2^t)) / (sqrt(n_t / (1 - b3^t) + eps_root) + eps)

and then, with learning rate lr and weight decay wd (both at the step count, 0-based, when schedules):

    decoupled ("no-prox", optax.adan):  p_t = p_{t-1} - lr (u_t + wd p_{t-1})
    proximal (the paper's Algorithm 1): p_t = (p_{t-1} - lr u_t) / (1 + lr wd)

The paper writes the betas the other way round (its beta_1 = 0.02 is 1 - b1 here). Its restart condition
resets the moments and the bias-correction clock so that the step after a restart is again a first step
(m = (1 - b1) g, v = 0, n = (1 - b3) g^2, bias-corrected to g, 0, g^2); ``restart_every=K`` restarts every K
steps. The learning-rate and weight-decay schedules keep counting through restarts.

State: ``AdanState(count, m, v, n, prev_grad)``, each moment a flat f32 workspace (``ls_jax.optim.workspace``),
16 bytes per parameter in total, the same as optax.adan in f32.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ls_jax.optim import _engine
from ls_jax.optim.base import FusedGradientTransformation

# The order the CUDA kernel reads them in (ffi_kernels/csrc/optim.cu).
SCALARS = ("b1", "omb1", "b2", "omb2", "b3", "omb3", "bc1", "bc2", "bc3", "eps", "eps_root", "first")


class AdanState(NamedTuple):
    """Step count (int32 scalar) and the four f32 workspaces: m, v, n and the previous gradient."""

    count: jax.Array
    m: jax.Array
    v: jax.Array
    n: jax.Array
    prev_grad: jax.Array


def _moments(g, moments, s):
    m, v, n, prev_grad = moments
    first = s["first"] > 0
    m, v, n = (jnp.where(first, 0.0, x) for x in (m, v, n))
    diff = jnp.where(first, 0.0, g - prev_grad)
    m = s["omb1"] * g + s["b1"] * m
    v = s["omb2"] * diff + s["b2"] * v
    sq = g + s["omb2"] * diff
    n = s["omb3"] * (sq * sq) + s["b3"] * n
    return m, v, n, g


def _direction(g, moments, s):
    m, v, n, _ = moments
    m_hat = m / s["bc1"]
    v_hat = v / s["bc2"]
    n_hat = n / s["bc3"]
    return (m_hat + s["omb2"] * v_hat) / (jnp.sqrt(n_hat + s["eps_root"]) + s["eps"])


def _scalars(b1, b2, b3, eps, eps_root, restart_every) -> Callable[[jax.Array], dict[str, Any]]:
    def scalars(count):
        since_restart = count if restart_every is None else count % restart_every
        t = optax.safe_increment(since_restart)
        return {
            "b1": b1,
            "omb1": 1 - b1,
            "b2": b2,
            "omb2": 1 - b2,
            "b3": b3,
            "omb3": 1 - b3,
            "bc1": 1 - b1**t,
            "bc2": 1 - b2**t,
            "bc3": 1 - b3**t,
            "eps": eps,
            "eps_root": eps_root,
            "first": since_restart == 0,
        }

    return scalars


def adan(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.98,
    b2: float = 0.92,
    b3: float = 0.99,
    eps: float = 1e-8,
    eps_root: float = 1e-8,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    mask: Any = None,
    *,
    proximal: bool = False,
    restart_every: int | None = None,
    max_grad_norm: float | None = None,
    storage_dtype: Any = None,
    master_weights: bool = False,
) -> FusedGradientTransformation:
    """Adan as an optax transformation with a fused ``apply`` (see ``ls_jax.optim.fused_apply``).

    Every default is ``optax.adan``'s, so with the same arguments (or none) it gives ``optax.adan``'s numbers.

    Args:
      learning_rate: a float >= 0 or an optax schedule of the step count.
      b1, b2, b3: decay rates in [0, 1) of the gradient, gradient-difference and squared-term averages.
      eps: added to the denominator's square root (>= 0).
      eps_root: added inside the square root (>= 0).
      weight_decay: a float >= 0 or a schedule; applied as ``proximal`` says.
      mask: a pytree of booleans (or a prefix of one, or a callable returning one from the params): True
        where weight decay applies. As in ``optax.adan``, None decays every leaf.
      proximal: False for decoupled weight decay (optax.adan, the paper's "no-prox"), True for the paper's
        proximal step ``p = (p - lr u) / (1 + lr wd)``.
      restart_every: restart the moments every this many steps (the paper's restart condition); None never.
      max_grad_norm: clip the gradients to this global L2 norm first (as ``optax.clip_by_global_norm``),
        folded into the same pass; None does not clip.
      storage_dtype: None, or bfloat16/float16 to require every parameter and gradient in that dtype
        (LightSeq's memory-saving mode); the moments and the arithmetic stay f32. See ``ls_jax.optim``.
      master_weights: with ``storage_dtype``, keep f32 master weights in the state (for bf16 params only their
        low halves): the step updates them and writes the 16-bit parameters from them (mixed-precision
        training). See ``ls_jax.optim``.

    Raises:
      ValueError: a hyperparameter out of range (naming it).
    """
    _engine.check_nonnegative("learning_rate", learning_rate, schedule_ok=True)
    for name, value in (("b1", b1), ("b2", b2), ("b3", b3)):
        _engine.check_decay_rate(name, value)
    _engine.check_nonnegative("eps", eps)
    _engine.check_nonnegative("eps_root", eps_root)
    _engine.check_nonnegative("weight_decay", weight_decay, schedule_ok=True)
    _engine.check_positive_int("restart_every", restart_every)
    scalars = _scalars(b1, b2, b3, eps, eps_root, restart_every)
    rule = _engine.Rule("adan", AdanState, SCALARS, scalars, _moments, _direction, replaced=(3,))
    return _engine.workspace_transformation(
        rule,
        learning_rate=learning_rate,
        weight_decay=weight_decay,
        mask=mask,
        proximal=proximal,
        max_grad_norm=max_grad_norm,
        storage_dtype=_engine.check_options(max_grad_norm, storage_dtype, master_weights),
        master_weights=master_weights,
    )
