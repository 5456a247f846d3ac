"""ls_jax.optim in the places users put it: orbax checkpoints, inject_hyperparams, Flax TrainState, MultiSteps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax.training import train_state
from helpers.optim import (
    MLP,
    assert_trajectories_close,
    assert_trees_close,
    mlp_grad,
    mlp_params,
    trajectory,
    warmup_cosine,
)

import ls_jax.optim as lo


@pytest.mark.parametrize(
    "make",
    [lambda: lo.adan(warmup_cosine(), weight_decay=0.02, max_grad_norm=1.0), lambda: lo.adamw(1e-2)],
    ids=["adan", "adamw"],
)
def test_orbax_restore_mid_run_continues_identically(make, tmp_path):
    tx = make()
    first_half, state = trajectory(tx, mlp_params(), steps=6, fused=True)
    straight, _ = trajectory(tx, first_half[-1], steps=6, fused=True, state=state, start=6)

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "step6", {"params": first_half[-1], "opt_state": state})
    checkpointer.wait_until_finished()
    abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    target = jax.tree.map(abstract, {"params": first_half[-1], "opt_state": state})
    restored = checkpointer.restore(tmp_path / "step6", target)
    assert type(restored["opt_state"]) is type(state)
    resumed, _ = trajectory(tx, restored["params"], steps=6, fused=True, state=restored["opt_state"], start=6)
    assert_trajectories_close(resumed, straight, rtol=0, atol=0)


def test_inject_hyperparams_matches_optax_and_takes_new_values():
    ours_tx = optax.inject_hyperparams(lo.adan)(learning_rate=1e-2, b1=0.95, weight_decay=0.05, eps_root=1e-8)
    reference_tx = optax.inject_hyperparams(optax.adan)(learning_rate=1e-2, b1=0.95, weight_decay=0.05, eps_root=1e-8)
    ours, ours_state = trajectory(ours_tx, mlp_params(), steps=10)
    reference, reference_state = trajectory(reference_tx, mlp_params(), steps=10)
    assert_trajectories_close(ours, reference)

    ours_state.hyperparams["learning_rate"] = jnp.asarray(0.0)
    frozen, _ = trajectory(ours_tx, ours[-1], steps=2, state=ours_state, start=10)
    assert_trees_close(frozen[-1], ours[-1], rtol=0, atol=0)


def test_train_state_apply_gradients_and_fused_apply():
    tx = lo.adamw(warmup_cosine(), weight_decay=0.05)
    state = train_state.TrainState.create(apply_fn=MLP().apply, params=mlp_params(), tx=tx)
    fused_state = state
    reference, _ = trajectory(optax.adamw(warmup_cosine(), weight_decay=0.05), mlp_params(), steps=10)

    @jax.jit
    def step_update(state, step):
        return state.apply_gradients(grads=mlp_grad(state.params, step))

    @jax.jit
    def step_fused(state, step):
        params, opt_state = lo.fused_apply(state.tx, mlp_grad(state.params, step), state.opt_state, state.params)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state)

    for step in range(10):
        state = step_update(state, step)
        fused_state = step_fused(fused_state, step)
    assert int(state.step) == int(fused_state.step) == 10
    assert_trees_close(state.params, reference[-1])
    assert_trees_close(fused_state.params, reference[-1])


def test_multi_steps_accumulates_like_optax():
    ours, _ = trajectory(optax.MultiSteps(lo.adan(1e-2, eps_root=1e-8), every_k_schedule=3), mlp_params(), steps=9)
    reference, _ = trajectory(optax.MultiSteps(optax.adan(1e-2), every_k_schedule=3), mlp_params(), steps=9)
    assert_trajectories_close(ours, reference)
    assert_trees_close(ours[0], mlp_params(), rtol=0, atol=0)


def test_donated_jitted_step_matches_undonated():
    tx = lo.adan(1e-2, weight_decay=0.02)
    step = jax.jit(lambda g, s, p: lo.fused_apply(tx, g, s, p), donate_argnums=(1, 2))
    params = mlp_params()
    state = tx.init(params)
    expected, _ = trajectory(tx, mlp_params(), steps=3, fused=True)
    for index in range(3):
        params, state = step(mlp_grad(params, index), state, params)
    assert_trees_close(params, expected[-1], rtol=0, atol=0)
    assert np.asarray(state.count) == 3
