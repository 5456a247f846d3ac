"""GPU: `ls_jax.optim.GradientSync` on two GPUs: the summed gradient, and where XLA puts the buckets' all-reduces in
the step compiled with the training step's options (`train.bench.schedule`): one a bucket, the first starting
while matrix products of the backward remain."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gradient_sync_checks import AXIS, LAYERS, loss, make_batch
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ls_jax.optim import GradientSync
from train.bench import schedule
from train.harness.parallel import DataParallel

pytestmark = pytest.mark.gpu

# Each weight's gradient (64 MiB) is a bucket of its own, larger than what XLA's all-reduce combiner merges; with
# 1 MiB weights XLA combined every bucket into one all-reduce after the backward.
WIDTH = 4096


def wide_params():
    rng = np.random.default_rng(0)
    params = {
        f"layer_{i}": {"w": rng.standard_normal((WIDTH, WIDTH), np.float32) / np.sqrt(WIDTH), "b": np.zeros(WIDTH)}
        for i in range(LAYERS)
    }
    params["embed"] = rng.standard_normal((7, WIDTH), np.float32)
    params["unused"] = np.ones((3,), np.float32)
    return jax.tree.map(jnp.float32, params)


def test_two_gpus_sum_the_gradient_in_all_reduces_inside_the_backward():
    if jax.device_count() < 2:
        pytest.skip(f"needs 2 GPUs; JAX sees {jax.device_count()}")
    params, batch = wide_params(), make_batch(rows=64)
    sync = GradientSync(AXIS, 2**20)  # a bucket per layer
    mesh = Mesh(np.asarray(jax.devices()[:2]), (AXIS,))
    run = jax.jit(
        jax.shard_map(lambda p, b: sync.grad(loss, p, b)[0], mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P())
    )
    with jax.default_matmul_precision("highest"):
        summed = run(params, batch)
        whole = jax.grad(lambda p: loss(p, batch)[0])(params)
        # Command buffers off: they would move the step's kernels and collectives out of the entry computation.
        options = {**DataParallel(mesh).compiler_options(), "xla_gpu_enable_command_buffer": ""}
        compiled = run.lower(params, batch).compile(options).as_text()
    for got, expected in zip(jax.tree.leaves(summed), jax.tree.leaves(whole)):
        scale = float(np.max(np.abs(expected))) or 1.0  # sums of 64 rows taken in another order: f32 rounding
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=0, atol=1e-5 * scale)

    summary = schedule.summarize(compiled, start="all")
    assert summary["all_reduces"] >= LAYERS and summary["gemms_after_first_all_reduce"] > 0, summary["sequence"]
