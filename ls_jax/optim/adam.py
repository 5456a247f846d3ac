"""Adam and AdamW (Kingma & Ba, 2015; Loshchilov & Hutter, 2019) with a flat f32 workspace and a fused update.

Exactly ``optax.adam`` / ``optax.adamw`` in f32: for step t = 1, 2, ... and gradient g_t (after optional
global-norm clipping),

    mu_t = (1 - b1) g_t + b1 mu_{t-1}
    nu_t = (1 - b2) g_t^2 + b2 nu_{t-1}
    mu^_t = mu_t / (1 - b1^t),  or with nesterov  b1 mu_t / (1 - b1^(t+1)) + (1 - b1) g_t / (1 - b1^t)
    u_t  = mu^_t / (sqrt(nu_t / (1 - b2^t) + eps_root) + eps)
    p_t  = p_{t-1} - lr (u_t + wd p_{t-1})            (wd = 0 for adam and for leaves the mask excludes)

State: ``AdamState(count, mu, nu)``, each moment a flat f32 workspace (``ls_jax.optim.workspace``), whatever
the parameter dtype. The signatures and defaults are optax's, so a call written for ``optax.adam(w)`` means the
same here; its ``mu_dtype`` may only be None or float32, as the workspace is always f32.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ls_jax.optim import _engine
from ls_jax.optim.base import FusedGradientTransformation

# The order the CUDA kernel reads them in (ffi_kernels/csrc/optim.cu).
SCALARS = ("b1", "omb1", "b2", "omb2", "bc1", "bc1_next", "bc2", "eps", "eps_root")


class AdamState(NamedTuple):
    """Step count (int32 scalar) and the two f32 workspaces: first and second moments."""

    count: jax.Array
    mu: jax.Array
    nu: jax.Array


def _moments(g, moments, s):
    mu, nu = moments
    mu = s["omb1"] * g + s["b1"] * mu
    nu = s["omb2"] * (g * g) + s["b2"] * nu
    return mu, nu


def _denominator(nu, s):
    return jnp.sqrt(nu / s["bc2"] + s["eps_root"]) + s["eps"]


def _direction(g, moments, s):
    mu, nu = moments
    return (mu / s["bc1"]) / _denominator(nu, s)


def _nesterov_direction(g, moments, s):
    mu, nu = moments
    mu_hat = s["b1"] * (mu / s["bc1_next"]) + s["omb1"] * (g / s["bc1"])
    return mu_hat / _denominator(nu, s)


def _check_mu_dtype(mu_dtype: Any) -> None:
    """Accepts optax's ``mu_dtype`` where it describes the f32 workspace (None or float32) and nothing else."""
    if mu_dtype is not None and jnp.dtype(mu_dtype) != jnp.float32:
        raise ValueError(f"mu_dtype must be None or float32 (the moments live in an f32 workspace), got {mu_dtype}")


def _scalars(b1, b2, eps, eps_root) -> Callable[[jax.Array], dict[str, Any]]:
    def scalars(count):
        t = optax.safe_increment(count)
        return {
            "b1": b1,
            "omb1": 1 - b1,
            "b2": b2,
            "omb2": 1 - b2,
            "bc1": 1 - b1**t,
            "bc1_next": 1 - b1 ** optax.safe_increment(t),
            "bc2": 1 - b2**t,
            "eps": eps,
            "eps_root": eps_root,
        }

    return scalars


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    weight_decay: optax.ScalarOrSchedule = 1e-4,
    mask: Any = None,
    *,
    nesterov: bool = False,
    max_grad_norm: float | None = None,
    storage_dtype: Any = None,
    master_weights: bool = False,
) -> FusedGradientTransformation:
    """AdamW as an optax transformation with a fused ``apply`` (see ``ls_jax.optim.fused_apply``).

    Args:
      learning_rate: a float >= 0 or an optax schedule of the step count.
      b1, b2: decay rates in [0, 1) of the first and second moments.
      eps: added to the denominator's square root (>= 0).
      eps_root: added inside the square root (>= 0).
      mu_dtype: None or float32, the dtype of the first moment (optax's argument; the workspace is f32).
      weight_decay: decoupled weight decay, a float >= 0 or a schedule.
      mask: a pytree of booleans (or a prefix of one, or a callable returning one from the params): True
        where weight decay applies; None decays every leaf.
      nesterov: use Nesterov momentum (NAdam, as ``optax.adam(nesterov=True)``).
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
    _engine.check_decay_rate("b1", b1)
    _engine.check_decay_rate("b2", b2)
    _engine.check_nonnegative("eps", eps)
    _engine.check_nonnegative("eps_root", eps_root)
    _check_mu_dtype(mu_dtype)
    _engine.check_nonnegative("weight_decay", weight_decay, schedule_ok=True)
    rule = _engine.Rule(
        "adam_nesterov" if nesterov else "adam",
        AdamState,
        SCALARS,
        _scalars(b1, b2, eps, eps_root),
        _moments,
        _nesterov_direction if nesterov else _direction,
    )
    return _engine.workspace_transformation(
        rule,
        learning_rate=learning_rate,
        weight_decay=weight_decay,
        mask=mask,
        proximal=False,
        max_grad_norm=max_grad_norm,
        storage_dtype=_engine.check_options(max_grad_norm, storage_dtype, master_weights),
        master_weights=master_weights,
    )


def adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    *,
    nesterov: bool = False,
    max_grad_norm: float | None = None,
    storage_dtype: Any = None,
    master_weights: bool = False,
) -> FusedGradientTransformation:
    """Adam: ``adamw`` without weight decay (``optax.adam``); the arguments are ``adamw``'s."""
    return adamw(
        learning_rate,
        b1,
        b2,
        eps,
        eps_root,
        mu_dtype,
        weight_decay=0.0,
        nesterov=nesterov,
        max_grad_norm=max_grad_norm,
        storage_dtype=storage_dtype,
        master_weights=master_weights,
    )
