"""ls_jax.optim's transformations default-constructed give optax's numbers: swapping ``optax.adan`` for
``ls_jax.optim.adan`` (adam, adamw alike) changes nothing but the speed."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ls_jax.optim as lo

LEARNING_RATE = 1e-2
STEPS = 8
NAMES = ("adan", "adam", "adamw")
# Gradient scales per leaf: at 1e-6 the second moment (~1e-12) sits far below eps_root = 1e-8, so a different
# eps_root default moves that leaf by about the learning rate per step; at 1 the eps terms are invisible.
GRADIENT_SCALES = {"tiny": 1e-6, "small": 1e-3, "unit": 1.0}
# Parameters are O(1) and each step moves them by at most about the learning rate; f32 rounding of the
# moments and bias corrections stays far below these.
TOLERANCE = {"rtol": 1e-6, "atol": 1e-6}


def _params():
    keys = jax.random.split(jax.random.PRNGKey(0), len(GRADIENT_SCALES))
    return {name: jax.random.normal(key, (3, 5)) for name, key in zip(GRADIENT_SCALES, keys)}


def _grads(params, step):
    """A gradient that changes every step (so Adan's gradient difference is nonzero), scaled per leaf."""
    return {name: GRADIENT_SCALES[name] * jnp.cos(p + 0.7 * step) for name, p in params.items()}


def _trajectory(tx, *, fused=False):
    params = _params()
    state = tx.init(params)
    history = []
    for step in range(STEPS):
        grads = _grads(params, step)
        if fused:
            params, state = lo.fused_apply(tx, grads, state, params)
        else:
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        history.append(params)
    return history


def _max_difference(ours, reference):
    return max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for step_ours, step_reference in zip(ours, reference)
        for a, b in zip(jax.tree.leaves(step_ours), jax.tree.leaves(step_reference))
    )


def _assert_same_trajectory(ours, reference):
    for step, (a, b) in enumerate(zip(ours, reference)):
        for name in GRADIENT_SCALES:
            np.testing.assert_allclose(a[name], b[name], **TOLERANCE, err_msg=f"step {step}, leaf {name}")


@pytest.mark.parametrize("fused", [False, True], ids=["update", "fused_apply"])
@pytest.mark.parametrize("name", NAMES)
def test_default_constructed_matches_optax(name, fused):
    ours = _trajectory(getattr(lo, name)(LEARNING_RATE), fused=fused)
    reference = _trajectory(getattr(optax, name)(LEARNING_RATE))
    _assert_same_trajectory(ours, reference)


def test_eps_root_default_is_visible_to_the_comparison():
    """Adan with eps_root 0 (the value before it followed optax) leaves the tolerance far behind: the tiny-gradient
    leaf makes the comparison above sensitive to that default."""
    reference = _trajectory(optax.adan(LEARNING_RATE))
    without_eps_root = _trajectory(lo.adan(LEARNING_RATE, eps_root=0.0))
    assert _max_difference(without_eps_root, reference) > 100 * TOLERANCE["atol"]


@pytest.mark.parametrize("name", NAMES)
def test_signature_follows_optax(name):
    """optax's positional parameters, in optax's order and with optax's defaults; ours add keyword-only options."""
    ours = inspect.signature(getattr(lo, name)).parameters
    theirs = inspect.signature(getattr(optax, name)).parameters
    positional = [p for p in ours.values() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in positional] == [
        p.name for p in theirs.values() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]
    for parameter in theirs.values():
        assert parameter.name in ours, f"{name} lacks optax's {parameter.name}"
        assert ours[parameter.name].default == parameter.default, (
            f"{name}({parameter.name}=...) defaults to {ours[parameter.name].default}, optax to {parameter.default}"
        )


def test_mu_dtype_other_than_float32_is_refused():
    assert lo.adamw(LEARNING_RATE, mu_dtype=jnp.float32) is not None
    with pytest.raises(ValueError, match="mu_dtype must be None or float32"):
        lo.adam(LEARNING_RATE, mu_dtype=jnp.bfloat16)
