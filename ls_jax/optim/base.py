"""Fused gradient transformations: an optax transformation that can also write the new parameters itself.

``tx.update`` returns updates for ``optax.apply_updates`` as any optax transformation does. ``tx.apply``
returns the new parameters directly, computed in the same pass over memory as the optimizer state (one
kernel launch on CUDA), so parameters are read and written once per step instead of being read once more by
``apply_updates``; in 16-bit storage it also rounds the new parameters once instead of twice.

    new_params, new_state = fused_apply(tx, grads, opt_state, params)

works for every optax transformation: it calls ``tx.apply`` when ``tx`` is a ``FusedGradientTransformation``
(an ls_jax optimizer, or ``ls_jax.optim.chain(...)`` ending in one) and otherwise falls back to ``tx.update``
followed by ``optax.apply_updates``. Both paths give the same parameters and the same state, so a training
loop can use ``fused_apply`` unconditionally, e.g. with a Flax ``TrainState``:

    params, opt_state = fused_apply(state.tx, grads, state.opt_state, state.params)
    state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)

A training loop that sums gradients over tokens and reports their norm (``train.harness.step``) calls

    new_params, new_state, grad_norm = fused_apply_scaled(tx, summed_grads, opt_state, params, 1.0 / num_tokens)

which steps on ``summed_grads / num_tokens`` and returns that gradient's global norm: for an ls_jax optimizer both
inside its own pass over the gradients, for any other transformation by scaling, ``optax.tree.norm`` and
``fused_apply``.

Jit the step with the parameters and optimizer state donated (``donate_argnums``) so the update is in place.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import optax


class FusedApplyFn(Protocol):
    def __call__(
        self, grads: optax.Updates, state: optax.OptState, params: optax.Params, **extra_args: Any
    ) -> tuple[optax.Params, optax.OptState]:
        """Returns ``(new_params, new_state)``; equals ``update`` followed by ``optax.apply_updates``."""


class FusedApplyScaledFn(Protocol):
    def __call__(
        self, grads: optax.Updates, state: optax.OptState, params: optax.Params, grad_scale: Any
    ) -> tuple[optax.Params, optax.OptState, jax.Array]:
        """Returns ``(new_params, new_state, ||grad_scale * grads||)``: ``apply`` on ``grad_scale * grads``."""


class FusedGradientTransformation(NamedTuple):
    """An optax-compatible transformation with an extra ``apply`` that returns new parameters.

    ``init`` and ``update`` follow ``optax.GradientTransformationExtraArgs`` (extra keyword arguments are
    accepted and ignored), so the object works wherever optax expects a transformation: ``optax.chain``,
    ``optax.masked``, ``optax.inject_hyperparams``, ``optax.MultiSteps``, Flax ``TrainState``. ``apply_scaled``,
    where present, scales the gradients and measures their norm in the same pass (``fused_apply_scaled``).
    """

    init: optax.TransformInitFn
    update: optax.TransformUpdateExtraArgsFn
    apply: FusedApplyFn
    apply_scaled: FusedApplyScaledFn | None = None


def fused_apply(
    tx: Any, grads: optax.Updates, opt_state: optax.OptState, params: optax.Params, **extra_args: Any
) -> tuple[optax.Params, optax.OptState]:
    """One optimizer step returning ``(new_params, new_opt_state)``.

    Fused (``tx.apply``) when ``tx`` is a ``FusedGradientTransformation``, else ``tx.update`` then
    ``optax.apply_updates``; both give the same result.
    """
    if isinstance(tx, FusedGradientTransformation):
        return tx.apply(grads, opt_state, params, **extra_args)
    updates, new_state = tx.update(grads, opt_state, params, **extra_args)
    return optax.apply_updates(params, updates), new_state


def fused_apply_scaled(
    tx: Any, grads: optax.Updates, opt_state: optax.OptState, params: optax.Params, grad_scale: Any
) -> tuple[optax.Params, optax.OptState, jax.Array]:
    """One optimizer step on ``g = grad_scale * grads``, returning ``(new_params, new_opt_state, ||g||)``: ``||g||``
    the global L2 norm over every leaf, before any clipping; ``grad_scale`` an f32 scalar, possibly traced.

    ``tx.apply_scaled`` when ``tx`` has one (the ls_jax optimizers: the scaling and the norm in the step's own pass;
    gradients may be f32 where the params are 16-bit), else ``g`` in each param's dtype, ``optax.tree.norm(g)`` and
    ``fused_apply``.
    """
    if isinstance(tx, FusedGradientTransformation) and tx.apply_scaled is not None:
        return tx.apply_scaled(grads, opt_state, params, grad_scale)
    scaled = jax.tree.map(lambda g, p: (g * grad_scale).astype(p.dtype), grads, params)
    new_params, new_state = fused_apply(tx, scaled, opt_state, params)
    return new_params, new_state, optax.tree.norm(scaled)


def chain(*transforms: Any) -> Any:
    """``optax.chain(*transforms)``, keeping the fused ``apply`` when the last transform has one.

    The state is exactly ``optax.chain``'s (a tuple with one state per transform), so checkpoints are
    interchangeable. ``apply`` runs the leading transforms' ``update`` and then the last one's ``apply``.
    Without a fused last transform this returns ``optax.chain(*transforms)`` itself.
    """
    chained = optax.chain(*transforms)
    if not transforms or not isinstance(transforms[-1], FusedGradientTransformation):
        return chained
    leading = [optax.with_extra_args_support(t) for t in transforms[:-1]]
    last = transforms[-1]

    def apply(grads, state, params, **extra_args):
        *leading_states, last_state = state
        new_states = []
        for transform, transform_state in zip(leading, leading_states):
            grads, transform_state = transform.update(grads, transform_state, params, **extra_args)
            new_states.append(transform_state)
        new_params, last_state = last.apply(grads, last_state, params, **extra_args)
        return new_params, (*new_states, last_state)

    return FusedGradientTransformation(chained.init, chained.update, apply)
