"""Shared fixtures for the optimizer tests: a small Flax model, its data, and trajectory runners."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import ls_jax.optim as lo

STEPS = 50


class MLP(nn.Module):
    """Dense -> LayerNorm -> gelu -> Dense -> Dense: matrices, biases and LayerNorm scales to mask."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16)(x)
        x = nn.gelu(nn.LayerNorm()(x))
        x = nn.Dense(8)(x)
        return nn.Dense(3)(x)


def mlp_params(seed: int = 0):
    return MLP().init(jax.random.PRNGKey(seed), jnp.zeros((1, 6)))["params"]


def tied_params():
    """The MLP's params with a bf16 rounding tie (low half 0x8000, even high half) as every leaf's first element."""

    def plant_tie(p):
        bits = jax.lax.bitcast_convert_type(p, jnp.uint32).reshape(-1)
        return jax.lax.bitcast_convert_type(bits.at[0].set(0x3D4C8000).reshape(p.shape), jnp.float32)  # 0.04993

    return jax.tree.map(plant_tie, mlp_params())


def batch(step: int):
    """A fixed regression batch for each step."""
    key = jax.random.PRNGKey(1000 + step)
    x = jax.random.normal(key, (32, 6))
    y = jnp.stack([jnp.sin(x[:, 0]), x[:, 1] * x[:, 2], jnp.cos(x[:, 3] + x[:, 4])], axis=-1)
    return x, y


def mlp_loss(params, step: int):
    x, y = batch(step)
    prediction = MLP().apply({"params": params}, x)
    return jnp.mean((prediction.astype(jnp.float32) - y) ** 2)


mlp_grad = jax.jit(jax.grad(mlp_loss))


def decay_matrices(params):
    """Weight-decay mask: matrices only (no biases, no LayerNorm scales)."""
    return jax.tree.map(lambda p: p.ndim > 1, params)


def warmup_cosine():
    return optax.warmup_cosine_decay_schedule(0.0, 3e-2, warmup_steps=10, decay_steps=STEPS, end_value=1e-3)


def trajectory(tx, params, *, steps=STEPS, fused=False, grad_fn=mlp_grad, state=None, start=0, jit=True):
    """Parameters after every step of ``tx`` (jitted, or op by op) on the MLP task, and the final state."""
    state = tx.init(params) if state is None else state
    compile_ = jax.jit if jit else (lambda f: f)
    update = compile_(tx.update)
    apply = compile_(lambda g, s, p: lo.fused_apply(tx, g, s, p))
    apply_updates = compile_(optax.apply_updates)
    history = []
    for step in range(start, start + steps):
        grads = grad_fn(params, step)
        if fused:
            params, state = apply(grads, state, params)
        else:
            updates, state = update(grads, state, params)
            params = apply_updates(params, updates)
        history.append(params)
    return history, state


def assert_trees_close(actual, expected, *, rtol=1e-6, atol=1e-6):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, a.dtype, e.shape, e.dtype)
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32), rtol=rtol, atol=atol)


def assert_trajectories_close(actual, expected, **tolerance):
    assert len(actual) == len(expected)
    for step, (a, e) in enumerate(zip(actual, expected)):
        try:
            assert_trees_close(a, e, **tolerance)
        except AssertionError as err:
            raise AssertionError(f"trajectories differ at step {step}: {err}") from None


def gradient_norms(initial, history, grad_fn=mlp_grad):
    """The global norm of the gradient each step of a trajectory (``history`` from ``trajectory``) saw."""
    before_each_step = [initial, *history[:-1]]
    return np.array([float(optax.tree.norm(grad_fn(p, step))) for step, p in enumerate(before_each_step)])
