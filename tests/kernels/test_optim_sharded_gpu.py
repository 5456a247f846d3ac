"""GPU: ZeRO-1 (ls_jax.optim.shard_optimizer) on the fused kernel against the replicated optimizer's kernel.

Runs on one GPU (one shard: the degenerate case, every collective over a single device) and, where JAX sees two
or more, on two. Each device's gradients are given, so the averaged gradients both sides step with are the same
bits (two addends sum the same in either order); what differs is only the order of the clipping norm's sum.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ls_jax.optim as lo
from ls_jax import backend

pytestmark = pytest.mark.gpu

STEPS = 5  # odd, so that the median gradient norm lies strictly between the others
F32_TOLERANCE = 1e-6
BF16_ULP = 2.0**-7

OPTIMIZERS = {  # from the clipping threshold
    "adan_mask_clip": lambda clip: lo.adan(
        1e-2, eps_root=1e-8, weight_decay=0.05, mask=_decay_matrices, max_grad_norm=clip
    ),
    "adamw_mask_clip": lambda clip: lo.adamw(1e-2, weight_decay=0.05, mask=_decay_matrices, max_grad_norm=clip),
    "adam": lambda clip: lo.adam(1e-2),
    "adamw_bf16_master_clip": lambda clip: lo.adamw(
        1e-2,
        weight_decay=0.05,
        mask=_decay_matrices,
        max_grad_norm=clip,
        storage_dtype=jnp.bfloat16,
        master_weights=True,
    ),
}


def _decay_matrices(params):
    return jax.tree.map(lambda p: p.ndim > 1, params)


def _odd_tree():
    """Sizes around the kernel's 8-element vectors and 4096-element chunks, a scalar and multi-chunk leaves: none a
    multiple of 2 except the (8,) and (4096,) leaves."""
    shapes = [(1,), (3,), (), (7,), (8,), (1023,), (4096,), (4097,), (3, 4099), (513, 1025)]
    rng = np.random.default_rng(3)
    return {f"p{i}": rng.standard_normal(shape).astype(np.float32) for i, shape in enumerate(shapes)}


def _device_grads(params, step, num_devices, dtype):
    """Per-device gradients (leading dimension ``num_devices``) on a 2^-8 grid, so that sums are exact in bf16."""
    rng = np.random.default_rng(1000 + step)
    return jax.tree.map(lambda p: (rng.integers(-63, 64, (num_devices, *np.shape(p))) * 2.0**-8).astype(dtype), params)


def _relative_error(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / max(float(np.max(np.abs(expected))), 1e-30))


def _assert_agree(got, want, tolerance, what):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, w), g in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got)):
        name = jax.tree_util.keystr(path)
        assert g.shape == w.shape and g.dtype == w.dtype, (what, name, g.shape, g.dtype, w.shape, w.dtype)
        assert np.all(np.isfinite(np.asarray(g, np.float32))), f"{what} {name}: non-finite values"
        error = _relative_error(g, w)
        assert error <= tolerance, f"{what} {name}: relative error {error:.3g} > {tolerance}"


def _sharded_step(opt, mesh):
    def step(params, state, grads):
        return opt.apply(jax.tree.map(lambda g: g[0], grads), state, params)

    spec = opt.state_spec()
    mapped = jax.shard_map(step, mesh=mesh, in_specs=(P(), spec, P("data")), out_specs=(P(), spec))
    return jax.jit(mapped, donate_argnums=(1,))


@pytest.mark.parametrize("num_devices", [1, 2])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sharded_kernel_matches_replicated_kernel(name, num_devices):
    if jax.device_count() < num_devices:
        pytest.skip(f"needs {num_devices} GPUs; JAX sees {jax.device_count()}")
    master = _odd_tree()
    bf16 = "bf16" in name
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    params = jax.tree.map(lambda p: jnp.asarray(p, dtype), master)
    device_grads = [_device_grads(params, step, num_devices, dtype) for step in range(STEPS)]
    means = [
        jax.tree.map(lambda g: jnp.mean(jnp.asarray(g, jnp.float32), axis=0).astype(dtype), grads)
        for grads in device_grads
    ]
    norms = [
        float(jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(m)))) for m in means
    ]
    clip = float(np.median(norms))  # half the steps clip
    assert min(norms) < clip < max(norms), norms
    tx = OPTIMIZERS[name](clip)
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("data",))
    opt = lo.shard_optimizer(tx, "data", num_shards=num_devices)

    with backend.use("ffi"):
        step = _sharded_step(opt, mesh)
        replicated_step = jax.jit(functools.partial(lo.fused_apply, tx))
        state = opt.init(master, out_sharding=opt.state_sharding(mesh))
        got_params = jax.device_put(params, NamedSharding(mesh, P()))
        grads0 = jax.device_put(device_grads[0], NamedSharding(mesh, P("data")))
        text = step.lower(got_params, state, grads0).as_text()
        assert re.findall(r"custom_call @(ls_\w+)", text) == ["ls_optim_step"], "the sharded step must run the kernel"
        want_params, want_state = params, tx.init(master)
        for grads, mean in zip(device_grads, means):
            got_params, state = step(got_params, state, jax.device_put(grads, NamedSharding(mesh, P("data"))))
            want_params, want_state = replicated_step(mean, want_state, want_params)
        got_state = opt.unshard_state(state, master)

    if bf16:
        _assert_agree(got_state.inner, want_state.inner, F32_TOLERANCE, "moments")
        got_master, want_master = lo.master_params(got_state, got_params), lo.master_params(want_state, want_params)
        _assert_agree(got_master, want_master, F32_TOLERANCE, "f32 master")
        _assert_agree(got_params, want_params, BF16_ULP, "bf16 params")
    else:
        _assert_agree(got_state, want_state, F32_TOLERANCE, "state")
        _assert_agree(got_params, want_params, F32_TOLERANCE, "params")
