"""ZeRO-1 (ls_jax.optim.shard_optimizer) against the replicated optimizer on 2 and 4 CPU devices.

The checks need several devices, so they run in a fresh interpreter with ``--xla_force_host_platform_device_count``
(the rest of the suite assumes one device): each test below starts one group of checks, ``run_group`` here, and
reports every failing check with its traceback.
"""

from __future__ import annotations

import functools
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ls_jax.optim as lo
from ls_jax import backend
from ls_jax.optim import _shard_layout

NUM_DEVICES = 4
STEPS = 6
F32_RTOL = 1e-6
MAX_NORM = 2.0  # between the task's smallest and largest gradient norms: steps clip and steps do not (asserted)


# ---- the task -----------------------------------------------------------------------------------------------


def _params():
    """Leaves of sizes 35, 7, 21, 3, 1 (scalar), 1 and 697: none a multiple of 2 or 4. NumPy-made (no compiles)."""
    rng = np.random.default_rng(0)
    return {
        "dense": {
            "kernel": np.float32(0.4) * rng.standard_normal((5, 7), np.float32),
            "bias": np.full((7,), 0.1, np.float32),
        },
        "out": {
            "kernel": np.float32(0.4) * rng.standard_normal((7, 3), np.float32),
            "bias": np.zeros((3,), np.float32),
        },
        "scale": np.float32(1.5),
        "gain": np.ones((1,), np.float32),
        "table": np.float32(0.1) * rng.standard_normal((41, 17), np.float32),
    }


def _decay_matrices(params):
    """A callable mask that reads leaf ranks: a row of a matrix is 1-D, so this must see the whole params."""

    return jax.tree.map(lambda p: p.ndim > 1, params)


def _loss(params, batch):

    tokens, features, targets = batch
    embedded = params["table"][tokens]
    hidden = jnp.tanh(
        (features + embedded[:, :5] - embedded[:, 5:10]) @ params["dense"]["kernel"] + params["dense"]["bias"]
    )
    prediction = (hidden @ params["out"]["kernel"] + params["out"]["bias"]) * params["scale"] * params["gain"]
    return jnp.mean((prediction - targets) ** 2)


@functools.cache
def _loss_grad():

    return jax.jit(jax.grad(_loss))


def _batch(step: int, num_devices: int, per_device: int = 4):
    """The global batch of ``step``: ``per_device`` examples for each device, device d's rows d*per_device..."""
    rng = np.random.default_rng(100 + step)
    size = num_devices * per_device
    return (
        rng.integers(0, 41, (size,), np.int32),
        rng.standard_normal((size, 5), np.float32),
        rng.standard_normal((size, 3), np.float32),
    )


def _device_batch(batch, device: int, num_devices: int):
    per_device = batch[0].shape[0] // num_devices
    return tuple(x[device * per_device : (device + 1) * per_device] for x in batch)


@functools.cache
def _optimizers(clip: bool):
    """The optimizers under test, made once so that their jitted steps compile once for both device counts."""

    max_norm = MAX_NORM if clip else None
    return {
        "adan": lo.adan(1e-2, eps_root=1e-8, weight_decay=0.05, mask=_decay_matrices, max_grad_norm=max_norm),
        "adamw": lo.adamw(1e-2, weight_decay=0.05, mask=_decay_matrices, max_grad_norm=max_norm),
        "adam": lo.adam(1e-2, max_grad_norm=max_norm),
    }


@jax.jit
def _global_norm(tree):
    return optax.tree.norm(tree)


@functools.cache
def _replicated_init(tx):

    return jax.jit(tx.init)


# ---- runners ----------------------------------------------------------------------------------------------------


def _mesh(num_devices: int):

    return Mesh(np.array(jax.devices()[:num_devices]), ("data",))


def _replicate(tree, mesh):

    return jax.device_put(tree, NamedSharding(mesh, P()))


def _split(tree, mesh):

    return jax.device_put(tree, NamedSharding(mesh, P("data")))


def _autodiff_step(opt, mesh, check_vma=True):
    """The jitted sharded step: per-device gradients of the loss on the device's rows, then ``opt.apply``. Without
    vma checking, autodiff of the replicated params gives per-device gradients as they are."""

    def step(params, state, batch):
        local = jax.lax.pcast(params, "data", to="varying") if check_vma else params
        return opt.apply(jax.grad(_loss)(local, batch), state, params)

    spec = opt.state_spec()
    return jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), spec, P("data")), out_specs=(P(), spec), check_vma=check_vma)
    )


def _given_grads_step(opt, mesh):
    """The jitted sharded step on given per-device gradients (leaves ``(N, *shape)``, row d device d's)."""

    def step(params, state, grads):
        return opt.apply(jax.tree.map(lambda g: g[0], grads), state, params)

    spec = opt.state_spec()
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), spec, P("data")), out_specs=(P(), spec)))


def _mean_gradients(params, batch, num_devices):
    """The average over devices of each device's gradient: what the replicated optimizer steps with."""
    grads = [_loss_grad()(params, _device_batch(batch, d, num_devices)) for d in range(num_devices)]
    return _mean_over_devices(grads)


@jax.jit
def _mean_over_devices(grads):

    return jax.tree.map(lambda *g: jnp.mean(jnp.stack(g), axis=0), *grads)


def _replicated_run(tx, params, state, steps, num_devices, start=0):
    """(params, state, global gradient norms) after ``steps`` replicated steps on the averaged gradients."""
    apply = _jitted_apply(tx)
    norms = []
    for step in range(start, start + steps):
        grads = _mean_gradients(params, _batch(step, num_devices), num_devices)
        norms.append(float(_global_norm(grads)))
        params, state = apply(grads, state, params)
    return params, state, norms


@functools.cache
def _jitted_apply(tx):

    return jax.jit(tx.apply)


def _sharded_run(opt, params, state, steps, num_devices, start=0, check_vma=True):
    mesh = _mesh(num_devices)
    step_fn = _autodiff_step(opt, mesh, check_vma)
    params, state = _replicate(params, mesh), _split(state, mesh)
    for step in range(start, start + steps):
        params, state = step_fn(params, state, _split(_batch(step, num_devices), mesh))
    return params, state


def _assert_close(actual, expected, rtol=F32_RTOL, what="params"):

    assert jax.tree.structure(actual) == jax.tree.structure(expected), (what, jax.tree.structure(actual))
    for (path, e), a in zip(jax.tree_util.tree_flatten_with_path(expected)[0], jax.tree.leaves(actual)):
        name = jax.tree_util.keystr(path)
        assert a.shape == e.shape and a.dtype == e.dtype, (what, name, a.shape, a.dtype, e.shape, e.dtype)
        a64, e64 = np.asarray(a, np.float64), np.asarray(e, np.float64)
        scale = max(float(np.max(np.abs(e64))), 1e-30)
        error = float(np.max(np.abs(a64 - e64))) / scale
        assert error <= rtol, f"{what} {name}: relative error {error:.3g} > {rtol:g}"


# ---- checks -----------------------------------------------------------------------------------------------------


def check_equals_replicated(name: str, clip: bool, num_devices: int, check_vma: bool = True):

    tx = _optimizers(clip)[name]
    params = _params()
    want_params, want_state, norms = _replicated_run(tx, params, _replicated_init(tx)(params), STEPS, num_devices)
    if clip:
        assert min(norms) < MAX_NORM < max(norms), f"gradient norms {norms} do not cross max_grad_norm {MAX_NORM}"
    opt = lo.shard_optimizer(tx, "data", num_shards=num_devices)
    got_params, got_state = _sharded_run(opt, params, opt.init(params), STEPS, num_devices, check_vma=check_vma)
    _assert_close(got_params, want_params)
    _assert_close(opt.unshard_state(got_state, params), want_state, what="state")


def check_mask_and_clip_matter():
    """Guards the comparisons: the mask and the clipping each change the trajectory."""

    params = _params()
    runs = {
        "masked_clipped": _optimizers(True)["adamw"],
        "unmasked": lo.adamw(1e-2, weight_decay=0.05, max_grad_norm=MAX_NORM),
        "unclipped": _optimizers(False)["adamw"],
    }
    final = {key: _replicated_run(tx, params, _replicated_init(tx)(params), 2, 2)[0] for key, tx in runs.items()}
    for other in ("unmasked", "unclipped"):
        differ = np.abs(
            np.asarray(final[other]["dense"]["bias"]) - np.asarray(final["masked_clipped"]["dense"]["bias"])
        )
        assert differ.max() > 1e-5, f"{other} does not change the run, so the comparison could not catch it"


def check_bf16_master_weights(num_devices: int):
    """bf16 params and gradients, f32 master (low halves) sharded; gradients on a grid whose sums are exact in bf16,
    so both sides step with the same averaged gradients, and max_grad_norm at their median norm clips half the steps."""

    master = _params()
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), master)
    rng = np.random.default_rng(0)
    per_device = [
        jax.tree.map(lambda p: rng.integers(-63, 64, (num_devices, *p.shape)) * 2.0**-10, params) for _ in range(STEPS)
    ]
    means = [jax.tree.map(lambda g: np.sum(g, 0) / num_devices, grads) for grads in per_device]
    max_norm = float(np.median([math.sqrt(sum(np.sum(g**2) for g in jax.tree.leaves(m))) for m in means]))
    per_device, means = jax.tree.map(lambda g: np.asarray(g, jnp.bfloat16), (per_device, means))
    tx = lo.adamw(
        1e-2,
        weight_decay=0.05,
        mask=_decay_matrices,
        max_grad_norm=max_norm,
        storage_dtype=jnp.bfloat16,
        master_weights=True,
    )
    opt = lo.shard_optimizer(tx, "data", num_shards=num_devices)
    mesh = _mesh(num_devices)
    step_fn = _given_grads_step(opt, mesh)
    want_params, want_state = params, _replicated_init(tx)(master)
    got_params, got_state = _replicate(params, mesh), _split(opt.init(master), mesh)
    for grads, mean in zip(per_device, means):
        want_params, want_state = _jitted_apply(tx)(mean, want_state, want_params)
        got_params, got_state = step_fn(got_params, got_state, _split(grads, mesh))
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(got_params))
    # The f32 masters agree to f32 rounding (the norm sums in another order); a bf16 param may then round to the
    # neighbouring value, one bf16 spacing.
    master_params = jax.jit(lo.master_params)
    got_master = master_params(opt.unshard_state(got_state, master), got_params)
    _assert_close(got_master, master_params(want_state, want_params), what="f32 master")
    _assert_close(got_params, want_params, rtol=2.0**-7, what="bf16 params")


def check_state_bytes_per_device():
    """Per device, the sharded state holds 1/N of the replicated state's bytes up to the padding."""

    params = {**_params(), "big": jnp.zeros((999, 101))}  # so that the padding is small beside the state
    sizes = [leaf.size for leaf in jax.tree.leaves(params)]
    for tx, moments, master_bytes in (
        (_optimizers(True)["adan"], 4, 0),
        (lo.adamw(1e-3, storage_dtype=jnp.bfloat16, master_weights=True), 2, 2),
    ):
        replicated = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(jax.eval_shape(tx.init, params)))
        for n in (2, 4):
            opt = lo.shard_optimizer(tx, "data", num_shards=n)
            state = opt.init(params, out_sharding=opt.state_sharding(_mesh(n)))
            per_device = [
                sum(leaf.addressable_shards[d].data.nbytes for leaf in jax.tree.leaves(state)) for d in range(n)
            ]
            rows = [-(-size // n) for size in sizes]
            expected = 4 + moments * 4 * sum(-(-c // 4) * 4 for c in rows) + master_bytes * sum(rows)
            assert per_device == [expected] * n, (n, per_device, expected)
            padding = moments * 4 * (n - 1 + 3) * len(sizes) + master_bytes * (n - 1) * len(sizes)
            assert replicated / n - 4 <= expected <= replicated / n + padding, (n, replicated, expected)
            assert expected < 1.01 * replicated / n, (n, replicated, expected)


def check_resume_on_another_device_count():
    """4 shards -> replicated (the exact replicated state) -> 2 shards continues as the replicated run does."""

    tx = _optimizers(True)["adan"]
    params = _params()
    four, two = (lo.shard_optimizer(tx, "data", num_shards=n) for n in (4, 2))
    mid_params, mid_state, _ = _replicated_run(tx, params, _replicated_init(tx)(params), 3, 4)
    got_params, got_state = _sharded_run(four, params, four.init(params), 3, 4)
    replicated = four.unshard_state(got_state, params)
    _assert_close(replicated, mid_state, what="unsharded state")
    round_trip = four.shard_state(replicated, params)
    for a, b in zip(jax.tree.leaves(round_trip), jax.tree.leaves(got_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    got_params = jax.device_get(got_params)
    want_params, want_state, _ = _replicated_run(tx, mid_params, mid_state, 3, 2, start=3)
    resumed_params, resumed_state = _sharded_run(two, got_params, two.shard_state(replicated, params), 3, 2, start=3)
    _assert_close(resumed_params, want_params)
    _assert_close(two.unshard_state(resumed_state, params), want_state, what="state")


def check_cuda_lowering_calls_the_kernel_once():
    """With the kernels enabled, the sharded step lowered for CUDA runs one ls_optim_step on the rows, clipping done
    before it with the norm all-reduced over the axis, one reduce-scatter and one all-gather per bucket."""

    params = _params()
    mesh = _mesh(2)
    enabled = backend.kernels_enabled
    backend.kernels_enabled = lambda: True
    try:
        for bucket_bytes, tx in ((2**20, _optimizers(True)["adan"]), (256, _optimizers(True)["adamw"])):
            opt = lo.shard_optimizer(tx, "data", num_shards=2, bucket_bytes=bucket_bytes)
            args = (
                _replicate(params, mesh),
                opt.init(params, out_sharding=opt.state_sharding(mesh)),
                _split(_batch(0, 2), mesh),
            )
            unchecked = [jax.export.DisabledSafetyCheck.custom_call("ls_optim_step")]
            text = jax.export.export(_autodiff_step(opt, mesh), platforms=["cuda"], disabled_checks=unchecked)(
                *args
            ).mlir_module()
            leaves = jax.tree.leaves(params)
            rows = [-(-leaf.size // 2) for leaf in leaves]
            buckets = _shard_layout.buckets([jnp.float32] * len(leaves), [2 * 4 * c for c in rows], bucket_bytes)
            assert (len(buckets) == 1) == (bucket_bytes == 2**20), buckets
            assert text.count("stablehlo.custom_call @ls_optim_step") == 1
            assert re.findall(r"clip = \w+", text) == ["clip = false"]
            assert text.count("stablehlo.all_reduce") == 1  # the squared norm
            assert text.count("stablehlo.reduce_scatter") == len(buckets)
            assert text.count("stablehlo.all_gather") == len(buckets)
    finally:
        backend.kernels_enabled = enabled


def _raises(fn, *fragments):
    try:
        fn()
    except ValueError as err:
        message = str(err)
        assert "\n" not in message.strip() or "tree structure" in message, message
        for fragment in fragments:
            assert fragment in message, f"{fragment!r} not in: {message}"
        return
    raise AssertionError(f"no ValueError (expected one naming {fragments})")


def check_bad_inputs():

    tx = _optimizers(True)["adamw"]
    params = _params()
    two_mesh = _mesh(2)
    four = lo.shard_optimizer(tx, "data", num_shards=4)
    two = lo.shard_optimizer(tx, "data", num_shards=2)
    batch = _split(_batch(0, 2), two_mesh)
    rep = _replicate(params, two_mesh)

    _raises(lambda: four.state_sharding(two_mesh), "num_shards=4", "'data' has 2 devices")
    # The state placed by hand on the 2-device mesh: apply itself names the mismatch.
    _raises(
        lambda: _autodiff_step(four, two_mesh)(rep, _split(four.init(params), two_mesh), batch),
        "num_shards=4",
        "'data' has 2 devices",
    )
    other = {key: value for key, value in params.items() if key != "gain"}
    _raises(
        lambda: _autodiff_step(two, two_mesh)(rep, _split(two.init(other), two_mesh), batch),
        ".mu is float32[1, ",
        "made by init for these params with num_shards=2",
    )
    chained = lo.shard_optimizer(lo.chain(optax.scale(1.0), tx), "data", num_shards=2)
    _raises(lambda: _autodiff_step(two, two_mesh)(rep, _split(chained.init(params), two_mesh), batch), "tree structure")
    _raises(
        lambda: _autodiff_step(two, two_mesh)(rep, _split(four.init(params), two_mesh), batch),
        "int32[2]",
        "int32[1]",
        "num_shards=2",
    )
    _raises(lambda: two.unshard_state(four.init(params), params), "num_shards=2")
    _raises(lambda: two.unshard_state(two.init(other), params), ".mu is float32[2, ", "num_shards=2")
    _raises(lambda: two.unshard_state(chained.init(params), params), "tree structure")
    _raises(
        lambda: two.shard_state(jax.eval_shape(tx.init, other), params),
        ".mu is float32[",
        "made by this optimizer's init",
    )
    _raises(
        lambda: two.shard_state(jax.eval_shape(lo.chain(optax.scale(1.0), tx).init, params), params), "tree structure"
    )
    _raises(lambda: two.apply(params, two.init(params), params), "inside jax.shard_map", "'data'")
    _raises(lambda: lo.shard_optimizer(optax.adam(1e-3), num_shards=2), "ls_jax.optim optimizer")
    _raises(lambda: lo.shard_optimizer(tx, num_shards=0), "num_shards must be a positive integer")

    def summed_step(params, state, batch):  # gradients of the replicated params: autodiff sums them over 'data'
        return two.apply(jax.grad(_loss)(params, batch), state, params)

    spec = two.state_spec()
    summed = jax.jit(jax.shard_map(summed_step, mesh=two_mesh, in_specs=(P(), spec, P("data")), out_specs=(P(), spec)))
    _raises(lambda: summed(rep, _split(two.init(params), two_mesh), batch), "already summed", "pcast")

    def misshapen_step(params, state, batch):
        grads = jax.grad(_loss)(jax.lax.pcast(params, "data", to="varying"), batch)
        grads["gain"] = jnp.zeros((1, 1))
        return two.apply(grads, state, params)

    misshapen = jax.jit(
        jax.shard_map(misshapen_step, mesh=two_mesh, in_specs=(P(), spec, P("data")), out_specs=(P(), spec))
    )
    _raises(lambda: misshapen(rep, _split(two.init(params), two_mesh), batch), "['gain']", "(1, 1)")


GROUPS = {
    "adan": [functools.partial(check_equals_replicated, "adan", clip, n) for clip in (False, True) for n in (2, 4)],
    "adamw": [functools.partial(check_equals_replicated, "adamw", clip, n) for clip in (False, True) for n in (2, 4)]
    + [functools.partial(check_equals_replicated, "adamw", True, 4, False)],
    "adam": [functools.partial(check_equals_replicated, "adam", clip, n) for clip in (False, True) for n in (2, 4)],
    "bf16_master": [
        check_mask_and_clip_matter,
        functools.partial(check_bf16_master_weights, 2),
        functools.partial(check_bf16_master_weights, 4),
    ],
    "memory_resume_errors": [
        check_state_bytes_per_device,
        check_resume_on_another_device_count,
        check_bad_inputs,
        check_cuda_lowering_calls_the_kernel_once,
    ],
}


def _describe(check) -> str:
    if isinstance(check, functools.partial):
        return f"{check.func.__name__}{check.args}"
    return check.__name__


def run_group(name: str) -> None:
    """Runs one group's checks (in a process with NUM_DEVICES CPU devices) and prints a JSON of their failures."""

    assert jax.device_count() == NUM_DEVICES, jax.devices()
    failures = {}
    for check in GROUPS[name]:
        try:
            check()
        except Exception:  # every failure is reported, with its traceback
            failures[_describe(check)] = traceback.format_exc()
    print("RESULT " + json.dumps({"ran": [_describe(c) for c in GROUPS[name]], "failures": failures}))


# ---- the tests --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_sharded_optimizer(group):
    tests_dir = pathlib.Path(__file__).parent
    env = dict(
        os.environ,
        XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={NUM_DEVICES}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(tests_dir.parent), str(tests_dir), os.environ.get("PYTHONPATH", "")]),
    )
    result = subprocess.run(
        [sys.executable, "-c", f"import test_optim_sharded as t; t.run_group({group!r})"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stdout + result.stderr
    report = json.loads(lines[-1][len("RESULT ") :])
    assert report["ran"] == [_describe(check) for check in GROUPS[group]]
    assert not report["failures"], "\n\n".join(f"{name}:\n{tb}" for name, tb in report["failures"].items())
