"""Every op under jax.jit, jax.vmap, jax.checkpoint (remat) and data-parallel shard_map / sharded jit.

The sharded tests need several CPU devices, which must be requested before JAX starts, so they run
``sharded_check`` in a fresh interpreter with ``--xla_force_host_platform_device_count``.
"""

import functools
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.ops import F32, apply_vjp, assert_close, normal, random_cotangent, seed_array, value_and_vjp

from ls_jax import ops
from ls_jax.ops._common import vary_together

SEED = seed_array(0)
_TOKENS = jnp.array([[5, 2, 7, 0], [1, 3, 3, 0]], jnp.int32)
_LABELS = jnp.array([[2, 0, 4], [1, 1, 3]], jnp.int32)

# name -> (function of float primals, primals); dropout is on wherever the op has it.
CASES = {
    "layer_norm": (lambda x, g, b: ops.layer_norm(x, g, b), (normal(0, (3, 8)), normal(1, (8,)), normal(2, (8,)))),
    "layer_norm_residual": (
        lambda x, r, g, b: ops.layer_norm(x, g, b, residual=r),
        (normal(0, (3, 8)), normal(3, (3, 8)), normal(1, (8,)), normal(2, (8,))),
    ),
    "bias_dropout_residual_layer_norm": (
        lambda x, b, r, g, be: ops.layer_norm(x, g, be, residual=r, bias=b, dropout_rate=0.3, seed=SEED),
        (normal(0, (3, 8)), normal(15, (8,)), normal(3, (3, 8)), normal(1, (8,)), normal(2, (8,))),
    ),
    "attn_softmax": (
        lambda s, m: ops.attn_softmax(s, m, scale=0.5, causal=True, dropout_rate=0.2, seed=SEED),
        (normal(4, (2, 3, 5)), normal(5, (1, 5))),
    ),
    "dropout": (lambda x: ops.dropout(x, rate=0.3, seed=SEED), (normal(6, (4, 6)),)),
    "bias_dropout_residual": (
        lambda x, b, r: ops.bias_dropout_residual(x, b, r, dropout_rate=0.3, seed=SEED),
        (normal(7, (4, 6)), normal(8, (6,)), normal(9, (4, 6))),
    ),
    "bias_act_dropout": (
        lambda x, b: ops.bias_act_dropout(x, b, activation="gelu_tanh", dropout_rate=0.3, seed=SEED),
        (normal(10, (4, 6)), normal(11, (6,))),
    ),
    "embed": (
        lambda t, p: ops.embed(_TOKENS, t, p, scale=2.0, padding_id=0, dropout_rate=0.3, seed=SEED),
        (normal(12, (8, 6)), normal(13, (4, 6))),
    ),
    "label_smoothed_cross_entropy": (
        lambda z: ops.label_smoothed_cross_entropy(z, _LABELS, epsilon=0.1, pad_id=0)[:2],
        (normal(14, (2, 3, 5)),),
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_remat_matches_plain_vjp(name):
    """jax.checkpoint recomputes the forward (dropout masks included) in the backward: same values and grads.

    Every reference comparison in tests/test_ops_*.py already runs under jax.jit; the other tests call the ops
    eagerly."""
    fn, primals = CASES[name]
    cotangent = random_cotangent(20, jax.eval_shape(fn, *primals))
    assert_close(value_and_vjp(jax.checkpoint(fn), primals, cotangent), value_and_vjp(fn, primals, cotangent), F32)


@pytest.mark.parametrize("name", CASES)
def test_vmap_matches_per_example_calls(name):
    """vmap over a leading axis of every primal (independent problems) equals one call per problem."""
    fn, primals = CASES[name]
    batch = [tuple(p * (1.0 + 0.5 * i) for p in primals) for i in range(3)]
    stacked = tuple(jnp.stack(parts) for parts in zip(*batch))
    cotangents = [random_cotangent(30 + 7 * i, jax.eval_shape(fn, *primals)) for i in range(3)]
    stacked_cotangent = jax.tree.map(lambda *leaves: jnp.stack(leaves), *cotangents)
    vmapped = jax.jit(jax.vmap(functools.partial(apply_vjp, fn)))(stacked, stacked_cotangent)
    singles = [value_and_vjp(fn, p, c) for p, c in zip(batch, cotangents)]
    assert_close(vmapped, jax.tree.map(lambda *leaves: jnp.stack(leaves), *singles), F32)


def test_vmap_over_seeds_gives_each_example_its_own_mask():
    x = jnp.ones((16, 32), F32)
    seeds = jnp.stack([seed_array(i) for i in range(3)])
    drop = jax.jit(lambda seed: ops.dropout(x, rate=0.5, seed=seed))
    vmapped = jax.jit(jax.vmap(drop))(seeds)
    for seed, y in zip(seeds, vmapped):
        np.testing.assert_array_equal(y, drop(seed))
    assert not np.array_equal(vmapped[0], vmapped[1])


def test_grad_of_jit_of_vmap_of_checkpoint():
    """Nested transformations: a per-example remat'd block, vmapped, jitted, differentiated."""
    x, gamma, beta = normal(0, (3, 4, 8)), normal(1, (8,)), normal(2, (8,))

    def block(x, gamma, beta):
        h = ops.layer_norm(x, gamma, beta)
        return jnp.sum(ops.bias_act_dropout(h, beta, activation="gelu", dropout_rate=0.2, seed=SEED) ** 2)

    def loss(gamma, beta, remat):
        inner = jax.checkpoint(block) if remat else block
        return jnp.sum(jax.vmap(inner, in_axes=(0, None, None))(x, gamma, beta))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    assert_close(grads(gamma, beta, True), grads(gamma, beta, False), F32)


# ---- data parallel (several CPU devices, in a subprocess) --------------------------------------------------

NUM_DEVICES = 2


def _op_seed(seed, index):
    """Distinct dropout seeds for the ops of one model from one seed."""
    return seed + jnp.array([index, 0], jnp.uint32)


def _model_loss(params, tokens, labels, seed):
    """A small Transformer-shaped block using every op; returns (loss_sum, num_tokens)."""
    hidden = params["table"].shape[1]
    h = ops.embed(
        tokens,
        params["table"],
        params["pos"],
        scale=math.sqrt(hidden),
        padding_id=0,
        dropout_rate=0.1,
        seed=_op_seed(seed, 0),
    )
    h = ops.layer_norm(h, params["gamma"], params["beta"])
    scores = jnp.einsum("bqh,bkh->bqk", h, h)[:, None]
    probs = ops.attn_softmax(
        scores,
        (tokens != 0)[:, None, None, :],
        scale=1 / math.sqrt(hidden),
        causal=True,
        dropout_rate=0.1,
        seed=_op_seed(seed, 1),
    )
    context = jnp.einsum("bnqk,bkh->bqh", probs, h)
    ffn = ops.bias_act_dropout(context, params["bias1"], activation="gelu", dropout_rate=0.1, seed=_op_seed(seed, 2))
    out = ops.bias_dropout_residual(ffn, params["bias2"], h, dropout_rate=0.1, seed=_op_seed(seed, 3))
    out, _ = ops.layer_norm(out, params["gamma"], params["beta"], residual=h)
    # A second attention whose additive mask is a replicated parameter (a learned relative-position bias).
    scores = jnp.einsum("bqh,bkh->bqk", out, out)[:, None]
    probs = ops.attn_softmax(scores, params["position_bias"], causal=True, dropout_rate=0.1, seed=_op_seed(seed, 4))
    out = out + jnp.einsum("bnqk,bkh->bqh", probs, out)
    out = ops.dropout(out, rate=0.1, seed=_op_seed(seed, 5))
    loss_sum, _, num_tokens = ops.label_smoothed_cross_entropy(out @ params["table"].T, labels, epsilon=0.1, pad_id=0)
    return loss_sum, num_tokens


def _model_inputs(batch):
    vocab, hidden, length = 11, 8, 6
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocab, (batch, length))
    tokens[::2, -2:] = 0
    labels = np.roll(tokens, -1, axis=1)
    params = dict(
        table=normal(1, (vocab, hidden)),
        pos=normal(2, (length, hidden)),
        gamma=1 + normal(3, (hidden,), scale=0.1),
        beta=normal(4, (hidden,), scale=0.1),
        bias1=normal(5, (hidden,)),
        bias2=normal(6, (hidden,)),
        position_bias=normal(7, (length, length)),
    )
    return params, jnp.asarray(tokens, jnp.int32), jnp.asarray(labels, jnp.int32)


def _shard_map():
    if hasattr(jax, "shard_map"):
        return jax.shard_map
    from jax.experimental.shard_map import shard_map

    return shard_map


def sharded_check():
    """shard_map data parallelism (a dropout seed per shard) and sharded jit against single-device runs."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    assert jax.device_count() == NUM_DEVICES, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    params, tokens, labels = _model_inputs(batch=2 * NUM_DEVICES)
    loss_and_grad = jax.jit(jax.value_and_grad(_model_loss, has_aux=True))

    def data_parallel_step(params, tokens, labels):
        shard_seed = SEED.at[1].add(jax.lax.axis_index("data").astype(jnp.uint32))
        (loss, count), grads = loss_and_grad(params, tokens, labels, shard_seed)
        # Gradients of the replicated params arrive already summed over devices (the transpose of replication).
        return jax.lax.psum(loss, "data"), jax.lax.psum(count, "data"), grads

    step = jax.jit(
        _shard_map()(
            data_parallel_step,
            mesh=mesh,
            in_specs=(PartitionSpec(), PartitionSpec("data"), PartitionSpec("data")),
            out_specs=PartitionSpec(),
        )
    )
    loss, count, grads = step(params, tokens, labels)

    shards = zip(jnp.split(tokens, NUM_DEVICES), jnp.split(labels, NUM_DEVICES))
    per_shard = [loss_and_grad(params, t, y, SEED.at[1].add(jnp.uint32(i))) for i, (t, y) in enumerate(shards)]
    expected = jax.tree.map(lambda *leaves: sum(leaves), *per_shard)
    assert_close((loss, count, grads), (expected[0][0], expected[0][1], expected[1]), F32)

    batch_sharding = NamedSharding(mesh, PartitionSpec("data"))
    sharded = loss_and_grad(
        params, jax.device_put(tokens, batch_sharding), jax.device_put(labels, batch_sharding), SEED
    )
    assert_close(sharded, loss_and_grad(params, tokens, labels, SEED), F32)
    print("sharded ok")


def test_vary_together_is_identity_outside_shard_map():
    x, gamma = normal(0, (2, 4)), normal(1, (4,))
    together = vary_together(x, gamma, None)
    assert together[0] is x and together[1] is gamma and together[2] is None


def test_data_parallel_shard_map_and_sharded_jit():
    tests_dir = pathlib.Path(__file__).parent
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={NUM_DEVICES}",
        PYTHONPATH=os.pathsep.join(
            [str(tests_dir.parents[1]), str(tests_dir.parent), str(tests_dir), os.environ.get("PYTHONPATH", "")]
        ),
    )
    result = subprocess.run(
        [sys.executable, "-c", "import test_ops_transforms as t; t.sharded_check()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sharded ok" in result.stdout
