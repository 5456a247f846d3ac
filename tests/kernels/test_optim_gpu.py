"""GPU: the fused multi-tensor optimizer kernel against the XLA implementation, in place and in one launch."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.optim import decay_matrices, mlp_grad, mlp_params, tied_params, warmup_cosine

import ls_jax.optim as lo
from ls_jax import backend
from ls_jax.models.bert import BertConfig, BertForSequenceClassification
from ls_jax.optim import master

pytestmark = pytest.mark.gpu

STEPS = 10
# Relative error per leaf (max |ffi - xla| / max |xla|) after STEPS steps: the two compile the same f32
# expressions, so they differ only by where the compilers contract a * b + c into one FMA.
F32_TOLERANCE = 1e-5
BF16_ULP = 2.0**-7  # a 16-bit result may round to the neighbouring value when the f32 results differ by an ulp

OPTIMIZERS = {
    "adan_decay_mask_clip": lambda: lo.adan(warmup_cosine(), weight_decay=0.05, mask=decay_matrices, max_grad_norm=0.5),
    "adan_proximal_restart": lambda: lo.adan(1e-2, weight_decay=0.1, proximal=True, restart_every=4),
    "adamw_nesterov_clip": lambda: lo.adamw(1e-2, weight_decay=0.05, nesterov=True, max_grad_norm=0.5),
    "adam": lambda: lo.adam(1e-2, eps_root=1e-8),
}


def _update_then_apply(tx):
    def step(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def _run(mode, tx, params, grad_fn, *, fused, steps=STEPS):
    """Params and optimizer state after ``steps`` steps, jitted fresh under kernel mode ``mode``."""
    with backend.use(mode):
        step = jax.jit(functools.partial(lo.fused_apply, tx) if fused else _update_then_apply(tx))
        state = tx.init(params)
        for index in range(steps):
            params, state = step(grad_fn(params, index), state, params)
    return params, state


def _relative_error(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = np.max(np.abs(expected)) if expected.size else 0.0
    return float(np.max(np.abs(actual - expected)) / scale) if scale > 0 else float(np.max(np.abs(actual - expected)))


def _assert_agree(ffi, xla, tolerance):
    assert jax.tree.structure(ffi) == jax.tree.structure(xla)
    for index, (got, want) in enumerate(zip(jax.tree.leaves(ffi), jax.tree.leaves(xla))):
        assert got.shape == want.shape and got.dtype == want.dtype
        got32, want32 = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.all(np.isfinite(got32)), f"leaf {index}: non-finite values"
        error = _relative_error(got32, want32)
        assert error <= tolerance, f"leaf {index} {got.shape}: relative error {error:.3g} > {tolerance}"


def _kernel_calls(tx, grads, state, params):
    with backend.use("ffi"):
        text = jax.jit(functools.partial(lo.fused_apply, tx)).lower(grads, state, params).as_text()
    return re.findall(r"custom_call @(ls_\w+)", text)


@pytest.mark.parametrize("fused", [True, False], ids=["fused_apply", "update"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_kernel_matches_xla_on_the_mlp(name, fused):
    tx = OPTIMIZERS[name]()
    params = mlp_params()
    assert _kernel_calls(tx, mlp_grad(params, 0), tx.init(params), params) == ["ls_optim_step"]
    ffi = _run("ffi", tx, params, mlp_grad, fused=fused)
    xla = _run("xla", tx, params, mlp_grad, fused=fused)
    _assert_agree(ffi, xla, F32_TOLERANCE)


def _tree_grad(params, step):
    return jax.tree.map(lambda x: (jnp.cos(step + x.astype(jnp.float32)) * x).astype(x.dtype), params)


def _odd_tree(dtype):
    """Sizes around the kernel's 8-element vectors and 4096-element chunks, scalars and a multi-chunk leaf."""
    shapes = [(1,), (3,), (), (7,), (8,), (9,), (1023,), (4096,), (4097,), (3, 4099), (64, 1025), (513, 1024)]
    keys = jax.random.split(jax.random.PRNGKey(3), len(shapes))
    return {f"p{i}": jax.random.normal(k, s, jnp.float32).astype(dtype) for i, (k, s) in enumerate(zip(keys, shapes))}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", ["adan_decay_mask_clip", "adamw_nesterov_clip"])
def test_kernel_matches_xla_on_odd_sizes_and_16_bit_storage(name, dtype):
    tx = {
        "adan_decay_mask_clip": lambda: lo.adan(1e-2, weight_decay=0.05, max_grad_norm=5.0),
        "adamw_nesterov_clip": lambda: lo.adamw(1e-2, weight_decay=0.05, nesterov=True, max_grad_norm=5.0),
    }[name]()
    params = _odd_tree(dtype)
    ffi = _run("ffi", tx, params, _tree_grad, fused=True, steps=4)
    xla = _run("xla", tx, params, _tree_grad, fused=True, steps=4)
    _assert_agree(ffi, xla, F32_TOLERANCE if dtype == jnp.float32 else BF16_ULP)


@pytest.mark.parametrize("fused", [True, False], ids=["fused_apply", "update"])
@pytest.mark.parametrize("name", ["adan_decay_mask_clip", "adamw_nesterov_clip"])
def test_kernel_matches_xla_with_master_weights(name, fused):
    options = dict(weight_decay=0.05, max_grad_norm=5.0, storage_dtype=jnp.bfloat16, master_weights=True)
    tx = {
        "adan_decay_mask_clip": lambda: lo.adan(1e-2, **options),
        "adamw_nesterov_clip": lambda: lo.adamw(1e-2, nesterov=True, **options),
    }[name]()
    params = _odd_tree(jnp.bfloat16)
    ffi_params, ffi_state = _run("ffi", tx, params, _tree_grad, fused=fused, steps=4)
    xla_params, xla_state = _run("xla", tx, params, _tree_grad, fused=fused, steps=4)
    assert {leaf.dtype for leaf in jax.tree.leaves(ffi_state.master)} == {jnp.dtype(jnp.int16)}
    ffi_master, xla_master = lo.master_params(ffi_state, ffi_params), lo.master_params(xla_state, xla_params)
    _assert_agree(ffi_state.inner, xla_state.inner, F32_TOLERANCE)
    _assert_agree(ffi_master, xla_master, F32_TOLERANCE)
    _assert_agree(ffi_params, xla_params, BF16_ULP)
    for param, master_leaf in zip(jax.tree.leaves(ffi_params), jax.tree.leaves(ffi_master)):
        np.testing.assert_array_equal(np.asarray(param), np.asarray(master.round_to_bf16(master_leaf)))


def test_kernel_keeps_the_split_master_exact():
    """At lr 0 a step rewrites every bf16 master value unchanged: the kernel joins and splits the halves bit for
    bit as ls_jax.optim.master does (ties rounded away from zero, the largest finite values, infinities, signed
    zeros), and a low half from other params (zero params, a negative low half) neither crosses zero nor makes NaN."""
    special = np.array(
        [
            0x3F808000,
            0xBF808000,
            0x3F818000,
            0x7F7FFFFF,
            0xFF7FFFFF,
            0x7F800000,
            0xFF800000,
            0x00000000,
            0x80000000,
            0x3F807FFF,
        ],
        np.uint32,
    )
    values = {**tied_params(), "special": jax.lax.bitcast_convert_type(jnp.asarray(special), jnp.float32)}
    params = jax.tree.map(master.round_to_bf16, values)
    lows = jax.tree.map(lambda v, p: master.low_half(v, p), values, params)
    params["stale"], lows["stale"] = jnp.zeros((16,), jnp.bfloat16), jnp.full((16,), -5, jnp.int16)
    tx = lo.adam(0.0, storage_dtype=jnp.bfloat16, master_weights=True)
    state = lo.MasterWeightsState(tx.init(params).inner, lows)
    grads = jax.tree.map(lambda p: jnp.ones_like(p), params)
    expected = {**values, "stale": jnp.zeros((16,), jnp.float32)}
    for mode in ("ffi", "xla"):
        with backend.use(mode):
            new_params, new_state = jax.jit(functools.partial(lo.fused_apply, tx))(grads, state, params)
        new_master = jax.tree.leaves(lo.master_params(new_state, new_params))
        for index, (got, got_param, want) in enumerate(
            zip(new_master, jax.tree.leaves(new_params), jax.tree.leaves(expected))
        ):
            np.testing.assert_array_equal(
                np.asarray(got).view(np.uint32),
                np.asarray(want).view(np.uint32),
                err_msg=f"{mode}: master leaf {index}",
            )
            np.testing.assert_array_equal(
                np.asarray(got_param).view(np.uint16),
                np.asarray(master.round_to_bf16(want)).view(np.uint16),
                err_msg=f"{mode}: params leaf {index}",
            )


def test_mixed_dtypes_f32_params_with_bf16_grads():
    tx = lo.adamw(1e-2, weight_decay=0.05, max_grad_norm=1.0)
    params = _odd_tree(jnp.float32)
    bf16_grad = lambda p, step: jax.tree.map(lambda g: g.astype(jnp.bfloat16), _tree_grad(p, step))  # noqa: E731
    ffi = _run("ffi", tx, params, bf16_grad, fused=True, steps=4)
    _assert_agree(ffi, _run("xla", tx, params, bf16_grad, fused=True, steps=4), F32_TOLERANCE)


@pytest.mark.slow  # 600 leaves compile for about a minute
def test_more_leaves_than_one_launch_takes():
    """600 leaves: two launches of the 448-leaf table, with the clipping norm shared across them."""
    keys = jax.random.split(jax.random.PRNGKey(5), 600)
    params = {f"leaf{i:04d}": jax.random.normal(k, (1 + i % 37,)) for i, k in enumerate(keys)}
    tx = lo.adan(1e-2, weight_decay=0.05, max_grad_norm=2.0)
    ffi = _run("ffi", tx, params, _tree_grad, fused=True, steps=3)
    _assert_agree(ffi, _run("xla", tx, params, _tree_grad, fused=True, steps=3), F32_TOLERANCE)


def test_kernel_is_deterministic():
    tx = lo.adan(1e-2, weight_decay=0.05, max_grad_norm=0.5)
    params = _odd_tree(jnp.float32)
    first = _run("ffi", tx, params, _tree_grad, fused=True, steps=3)
    second = _run("ffi", tx, params, _tree_grad, fused=True, steps=3)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_update_is_in_place_under_donation():
    """The donated step aliases every param and moment to its output: no copies, and no temporary buffer as
    large as a moment."""
    tx = lo.adan(1e-3, weight_decay=0.01, max_grad_norm=1.0)
    params = _odd_tree(jnp.float32)
    state = tx.init(params)
    grads = _tree_grad(params, 0)
    with backend.use("ffi"):
        step = jax.jit(functools.partial(lo.fused_apply, tx), donate_argnums=(1, 2))
        compiled = step.lower(grads, state, params).compile()
    text = compiled.as_text()
    assert text.count('custom_call_target="ls_optim_step"') == 1
    assert "output_to_operand_aliasing" in text
    assert " conditional(" not in text, "XLA must have inlined the single-platform dispatch"
    copies = [line for line in text.splitlines() if re.search(r"= f32\[\d+(,\d+)*\]\S* copy\(", line)]
    assert not copies, copies
    workspace_bytes = state.m.size * 4
    memory = compiled.memory_analysis()
    param_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params))
    assert memory.alias_size_in_bytes >= param_bytes + 4 * workspace_bytes
    assert memory.temp_size_in_bytes < workspace_bytes


@pytest.mark.parametrize("name", ["adan", "adamw"])
def test_xla_step_updates_the_workspaces_in_place(name):
    """The XLA implementation under donation on BERT-base's parameters: no copy of a whole workspace. Adan's
    previous-gradient buffer was copied before each leaf's write there (45 copies, 18 GiB of temporaries) until it
    was written after the other moments' updates. A tree of the same leaves at a quarter of the width compiled
    without those copies, so the test keeps the real shapes (compiled only, nothing is allocated)."""
    model = BertForSequenceClassification(BertConfig.preset("bert-base", vocab_size=30522, num_labels=2))
    params = jax.eval_shape(lambda key: model.init(key, jnp.ones((1, 64), jnp.int32))["params"], jax.random.key(0))
    tx = {"adan": lo.adan, "adamw": lo.adamw}[name](1e-4, weight_decay=0.01, max_grad_norm=1.0)
    state = jax.eval_shape(tx.init, params)
    with backend.use("xla"):
        compiled = jax.jit(_update_then_apply(tx), donate_argnums=(1, 2)).lower(params, state, params).compile()
    size = jax.tree.leaves(state)[1].size  # (count, first moment, ...): every moment is one workspace
    workspace = f"f32[{size}]"
    copies = [
        line.strip()[:120] for line in compiled.as_text().splitlines() if f"= {workspace}" in line and " copy(" in line
    ]
    assert not copies, copies
    assert compiled.memory_analysis().temp_size_in_bytes < 2 * size * 4


def _run_scaled(mode, tx, params, grad_fn, *, steps, grad_scale=0.25):
    """Params, state and each step's norm after ``steps`` steps of ``fused_apply_scaled`` under kernel ``mode``."""
    with backend.use(mode):
        step = jax.jit(functools.partial(lo.fused_apply_scaled, tx))
        state, norms = tx.init(params), []
        for index in range(steps):
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grad_fn(params, index))
            params, state, norm = step(grads, state, params, jnp.float32(grad_scale))
            norms.append(norm)
    return params, state, np.asarray(norms)


@pytest.mark.parametrize("storage", [None, jnp.bfloat16], ids=["f32", "bf16_master"])
def test_scaled_step_and_its_norm_match_xla(storage):
    """f32 gradients scaled inside the step and clipped by their scaled norm, the norm written out: one launch pair."""
    options = dict(weight_decay=0.05, max_grad_norm=5.0, storage_dtype=storage, master_weights=storage is not None)
    tx = lo.adamw(1e-2, **options)
    params = _odd_tree(jnp.float32 if storage is None else storage)
    with backend.use("ffi"):
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), _tree_grad(params, 0))
        text = jax.jit(functools.partial(lo.fused_apply_scaled, tx)).lower(grads, tx.init(params), params, 0.5)
    assert re.findall(r"custom_call @(ls_\w+)", text.as_text()) == ["ls_optim_step"]
    ffi_params, ffi_state, ffi_norms = _run_scaled("ffi", tx, params, _tree_grad, steps=4)
    xla_params, xla_state, xla_norms = _run_scaled("xla", tx, params, _tree_grad, steps=4)
    np.testing.assert_allclose(ffi_norms, xla_norms, rtol=1e-5)
    assert np.all(ffi_norms > 5.0)  # every step clipped
    if storage is not None:
        ffi_params, xla_params = lo.master_params(ffi_state, ffi_params), lo.master_params(xla_state, xla_params)
        ffi_state, xla_state = ffi_state.inner, xla_state.inner
    _assert_agree(ffi_state, xla_state, F32_TOLERANCE)
    _assert_agree(ffi_params, xla_params, F32_TOLERANCE)
