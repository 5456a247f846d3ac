"""The training step with its gradients summed inside the backward, on 2 and 4 CPU devices (run by
test_overlapped_step.py in its own interpreter): three steps of a toy regression with gradient accumulation, with
buckets per leaf against one bucket after the whole backward, replicated and ZeRO-1, and against one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from ls_jax.layers import Dense, fp8
from ls_jax.optim import adamw, shard_optimizer
from train.harness.parallel import DATA_AXIS, DataParallel, StateLayout
from train.harness.step import TrainState, make_train_step

STEPS = 3
ROWS = 16  # per micro-batch, over all devices
WIDTH = 10


def loss_fn(variables, batch, rng):
    del rng  # no dropout: every split of the batch computes the same sums
    params = variables["params"]
    hidden = jnp.tanh(batch["x"] @ params["in"]["w"] + params["in"]["b"])
    hidden = jnp.tanh(hidden @ params["mid"]["w"] + params["mid"]["b"])
    error = hidden @ params["out"] - batch["y"]
    weight = jnp.float32(batch["x"].shape[0])
    return jnp.sum(error**2), weight, {"abs_error": jnp.sum(jnp.abs(error))}


def make_params():
    rng = np.random.default_rng(0)
    return {
        "in": {"w": 0.5 * rng.standard_normal((6, WIDTH), np.float32), "b": np.zeros((WIDTH,), np.float32)},
        "mid": {"w": 0.5 * rng.standard_normal((WIDTH, WIDTH), np.float32), "b": np.zeros((WIDTH,), np.float32)},
        "out": 0.5 * rng.standard_normal((WIDTH, 2), np.float32),
    }


def make_batches(grad_accum):
    rng = np.random.default_rng(1)
    return [
        {
            "x": rng.standard_normal((grad_accum, ROWS, 6)).astype(np.float32),
            "y": rng.standard_normal((grad_accum, ROWS, 2)).astype(np.float32),
        }
        for _ in range(STEPS)
    ]


def train(devices, grad_accum, *, bucket_bytes=2**30, sharded=False, comm_dtype=None, tx=None):
    """Params and per-step metrics after STEPS steps on the first ``devices`` devices (``tx``: ls_jax's AdamW)."""
    parallel = DataParallel(Mesh(np.asarray(jax.devices()[:devices]), (DATA_AXIS,)))
    tx = tx or adamw(1e-2, weight_decay=0.01, max_grad_norm=1.0)
    sharded_tx = shard_optimizer(tx, DATA_AXIS, num_shards=devices, average_gradients=False) if sharded else None
    layout = StateLayout(parallel, sharded_tx)
    init = None if sharded_tx is None else sharded_tx.init

    def create(params):
        return TrainState.create(params, tx, jax.random.PRNGKey(0), fp16=False, init_optimizer=init)

    params = make_params()
    state = jax.jit(create, out_shardings=layout.shardings(jax.eval_shape(create, params)))(params)
    step_fn = make_train_step(
        loss_fn,
        tx,
        axis_name=DATA_AXIS,
        sharded_optimizer=sharded_tx,
        grad_bucket_bytes=bucket_bytes,
        grad_comm_dtype=comm_dtype,
    )
    step = jax.jit(parallel.shard_step(step_fn, layout.specs(state)))
    metrics = []
    for batch in make_batches(grad_accum):
        state, step_metrics = step(state, jax.device_put(batch, parallel.rows_sharding(1)))
        metrics.append({k: float(v) for k, v in step_metrics.items() if k in ("loss", "weight", "grad_norm")})
    return jax.device_get(state.params), metrics


def assert_close(a, b, rtol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=rtol)


def test_runs_on_four_devices():
    assert jax.device_count() == 4


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "zero1"])
@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("grad_accum", [1, 2, 3])
def test_the_overlapped_step_is_the_step_summed_after_the_backward(devices, grad_accum, sharded):
    overlapped = train(devices, grad_accum, bucket_bytes=1, sharded=sharded)  # a collective per leaf
    after = train(devices, grad_accum, sharded=sharded)  # one bucket: after the whole backward
    assert_close(overlapped, after, rtol=1e-6)
    one_device = train(1, grad_accum)
    assert_close(overlapped, one_device, rtol=1e-5)
    assert [m["weight"] for m in overlapped[1]] == [ROWS * grad_accum] * STEPS


def test_bf16_gradient_communication_trains_close_to_f32():
    f32_params, f32_metrics = train(4, 2, bucket_bytes=400)
    bf16_params, bf16_metrics = train(4, 2, bucket_bytes=400, comm_dtype=jnp.bfloat16)
    assert_close(bf16_params, f32_params, rtol=2e-2)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(bf16_params), jax.tree.leaves(f32_params)))
    norms = np.array([[m["grad_norm"] for m in ms] for ms in (f32_metrics, bf16_metrics)])
    np.testing.assert_allclose(norms[1], norms[0], rtol=1e-2)


def test_an_optax_optimizer_takes_the_summed_gradients_too():
    overlapped = train(4, 2, bucket_bytes=1, tx=optax.adamw(1e-2, weight_decay=0.01))
    after = train(4, 2, tx=optax.adamw(1e-2, weight_decay=0.01))
    assert_close(overlapped, after, rtol=1e-6)
    assert_close(overlapped, train(1, 2, tx=optax.adamw(1e-2, weight_decay=0.01)), rtol=1e-5)


FP8_DENSE = Dense(2, dtype=jnp.bfloat16, fp8=True)


def fp8_loss(variables, batch, rng):
    del rng
    error = FP8_DENSE.apply(variables, batch["x"]).astype(jnp.float32) - batch["y"]
    return jnp.sum(error**2), jnp.float32(batch["x"].shape[0]), {}


def fp8_batch(grad_accum):
    """Rows of growing amplitude, larger in later micro-batches: the largest |x| sits in the last micro-batch's
    last rows, on the last device. bf16 values, so the FP8 op's amax of its bf16 input is exactly their maximum."""
    rng = np.random.default_rng(2)
    amplitude = (1 + np.arange(ROWS))[None, :, None] * (1 + np.arange(grad_accum))[:, None, None]
    x = jnp.asarray(rng.standard_normal((grad_accum, ROWS, 6)) * amplitude, jnp.bfloat16).astype(jnp.float32)
    return {"x": np.asarray(x), "y": rng.standard_normal((grad_accum, ROWS, 2)).astype(np.float32)}


def train_fp8(devices, grad_accum, bucket_bytes=2**30):
    """(params, scaling state on each device) after one step of the FP8 Dense on ``devices`` devices."""
    parallel = DataParallel(Mesh(np.asarray(jax.devices()[:devices]), (DATA_AXIS,)))
    layout = StateLayout(parallel)
    tx = adamw(1e-2)
    batch = fp8_batch(grad_accum)
    variables, scaling = fp8.split_scaling(FP8_DENSE.init(jax.random.PRNGKey(0), batch["x"][0, :1]))

    def create(params):
        return TrainState.create(params, tx, jax.random.PRNGKey(0), fp16=False, scaling=scaling)

    state = jax.jit(create, out_shardings=layout.shardings(jax.eval_shape(create, variables["params"])))(
        variables["params"]
    )
    step_fn = make_train_step(fp8_loss, tx, axis_name=DATA_AXIS, grad_bucket_bytes=bucket_bytes)
    step = jax.jit(parallel.shard_step(step_fn, layout.specs(state)))
    state, metrics = step(state, jax.device_put(batch, parallel.rows_sharding(1)))
    per_device = [
        jax.tree.map(lambda leaf, i=i: np.asarray(leaf.addressable_shards[i].data), state.scaling)
        for i in range(devices)
    ]
    return jax.device_get(state.params), per_device, metrics, batch


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_fp8_scaling_is_the_maximum_over_micro_batches_and_devices(grad_accum):
    params, per_device, metrics, batch = train_fp8(4, grad_accum, bucket_bytes=1)
    input_amax = [scaling["fp8"]["input_amax_history"][0] for scaling in per_device]
    assert input_amax == [np.abs(batch["x"]).max()] * 4  # the last device's last micro-batch, on every replica
    for scaling in per_device[1:]:
        assert_close(scaling, per_device[0], rtol=0)
    one_params, one_device, _, _ = train_fp8(1, grad_accum)
    assert_close(per_device[0], one_device[0], rtol=1e-6)
    assert_close(params, one_params, rtol=1e-5)
    # The first step quantizes at scale 1, which holds every value here (|x| < 448): nothing clipped.
    assert int(metrics["fp8_overflows"]) == 0 and 0.0 < float(metrics["fp8_amax_ratio"]) < 1.0
