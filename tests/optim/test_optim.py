"""ls_jax.optim against optax: trajectories, options beyond optax, the workspace layout, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.ops import jaxpr_output_shapes
from helpers.optim import (
    assert_trajectories_close,
    assert_trees_close,
    decay_matrices,
    gradient_norms,
    mlp_grad,
    mlp_loss,
    mlp_params,
    tied_params,
    trajectory,
    warmup_cosine,
)

import ls_jax.optim as lo
from ls_jax import backend
from ls_jax.optim import _engine, master

STEPS_COMPARED = 12
MAX_NORM = 0.5  # the MLP's gradient norm crosses it during the run: both clipped and unclipped steps occur
WEIGHT_DECAY = 0.05

# (ours, optax's): schedule, weight decay with a mask, clipping.
PAIRS = {
    "adan": (
        lambda: lo.adan(
            warmup_cosine(), eps_root=1e-8, weight_decay=WEIGHT_DECAY, mask=decay_matrices, max_grad_norm=MAX_NORM
        ),
        lambda: optax.chain(
            optax.clip_by_global_norm(MAX_NORM),
            optax.adan(warmup_cosine(), eps_root=1e-8, weight_decay=WEIGHT_DECAY, mask=decay_matrices),
        ),
    ),
    "adamw": (
        lambda: lo.adamw(warmup_cosine(), weight_decay=WEIGHT_DECAY, mask=decay_matrices, max_grad_norm=MAX_NORM),
        lambda: optax.chain(
            optax.clip_by_global_norm(MAX_NORM),
            optax.adamw(warmup_cosine(), weight_decay=WEIGHT_DECAY, mask=decay_matrices),
        ),
    ),
    "adamw_nesterov_eps_root": (
        lambda: lo.adamw(1e-2, eps_root=1e-6, weight_decay=WEIGHT_DECAY, nesterov=True),
        lambda: optax.adamw(1e-2, eps_root=1e-6, weight_decay=WEIGHT_DECAY, nesterov=True),
    ),
    "adam": (lambda: lo.adam(1e-2, b1=0.8, b2=0.99, eps=1e-6), lambda: optax.adam(1e-2, b1=0.8, b2=0.99, eps=1e-6)),
    "adan_no_decay": (lambda: lo.adan(1e-2, eps_root=1e-8), lambda: optax.adan(1e-2)),
}


@pytest.fixture(scope="module")
def reference_trajectories():
    return {name: trajectory(make_reference(), mlp_params())[0] for name, (_, make_reference) in PAIRS.items()}


@pytest.mark.parametrize("fused", [False, True], ids=["update", "fused_apply"])
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_trajectory_matches_optax(name, fused, reference_trajectories):
    ours, _ = trajectory(PAIRS[name][0](), mlp_params(), fused=fused)
    assert_trajectories_close(ours, reference_trajectories[name])


def test_clipping_threshold_is_crossed(reference_trajectories):
    """Guards the clipping comparison above: it is only meaningful if some steps clip and some do not."""
    norms = gradient_norms(mlp_params(), reference_trajectories["adan"])
    assert (norms > MAX_NORM).any() and (norms < MAX_NORM).any(), norms


def test_weight_decay_mask_matters():
    """After one step the mask changes exactly the leaves it excludes (so the masked comparisons test it)."""
    masked, _ = trajectory(lo.adamw(1e-2, weight_decay=0.5, mask=decay_matrices), mlp_params(), steps=1)
    unmasked, _ = trajectory(lo.adamw(1e-2, weight_decay=0.5), mlp_params(), steps=1)
    assert not np.allclose(masked[-1]["LayerNorm_0"]["scale"], unmasked[-1]["LayerNorm_0"]["scale"])
    np.testing.assert_allclose(masked[-1]["Dense_0"]["kernel"], unmasked[-1]["Dense_0"]["kernel"], rtol=1e-6)


PREFIX_MASK = {"Dense_0": True, "Dense_1": False, "Dense_2": True, "LayerNorm_0": False}


@pytest.mark.parametrize("mask", [None, decay_matrices, PREFIX_MASK], ids=["none", "callable", "prefix"])
def test_mask_forms(mask):
    """A callable, a prefix tree of booleans and None give what optax gives for the same mask."""
    ours, _ = trajectory(lo.adamw(1e-2, weight_decay=0.3, mask=mask), mlp_params(), steps=5)
    reference, _ = trajectory(optax.adamw(1e-2, weight_decay=0.3, mask=mask), mlp_params(), steps=5)
    assert_trajectories_close(ours, reference)


def test_chain_keeps_fused_apply_and_matches_optax_chain(reference_trajectories):
    adamw = lo.adamw(warmup_cosine(), weight_decay=WEIGHT_DECAY, mask=decay_matrices)
    tx = lo.chain(optax.clip_by_global_norm(MAX_NORM), adamw)
    assert isinstance(tx, lo.FusedGradientTransformation)
    ours, _ = trajectory(tx, mlp_params(), fused=True)
    assert_trajectories_close(ours, reference_trajectories["adamw"])
    plain = lo.chain(optax.clip_by_global_norm(MAX_NORM), optax.scale(-1.0))
    assert not isinstance(plain, lo.FusedGradientTransformation)


def test_fused_apply_falls_back_for_any_optax_transformation():
    tx = optax.chain(optax.clip_by_global_norm(MAX_NORM), lo.adan(1e-2))
    fused, _ = trajectory(tx, mlp_params(), steps=5, fused=True)
    plain, _ = trajectory(tx, mlp_params(), steps=5)
    assert_trajectories_close(fused, plain)


def _scaled_trajectory(tx, params, grad_scale, *, steps=6, grad_fn=mlp_grad):
    """Params after every ``fused_apply_scaled`` step and each step's returned norm."""
    step = jax.jit(lambda g, s, p: lo.fused_apply_scaled(tx, g, s, p, grad_scale))
    state, history, norms = tx.init(params), [], []
    for index in range(steps):
        params, state, norm = step(grad_fn(params, index), state, params)
        history.append(params)
        norms.append(float(norm))
    return history, np.asarray(norms)


@pytest.mark.parametrize("name", ["adan", "adamw"])
def test_fused_apply_scaled_is_optax_on_the_scaled_gradient(name, reference_trajectories):
    """Gradients 4x too large scaled by 0.25 inside the step follow optax's trajectory on the true gradients (with
    clipping, which sees the scaled norm), and the norm returned is the true gradient's before clipping."""
    scaled_up = lambda params, step: jax.tree.map(lambda g: 4.0 * g, mlp_grad(params, step))  # noqa: E731
    ours, norms = _scaled_trajectory(PAIRS[name][0](), mlp_params(), 0.25, steps=STEPS_COMPARED, grad_fn=scaled_up)
    reference = reference_trajectories[name][:STEPS_COMPARED]
    assert_trajectories_close(ours, reference)
    expected = gradient_norms(mlp_params(), reference)
    np.testing.assert_allclose(norms, expected, rtol=1e-6)
    assert (norms > MAX_NORM).any() and (norms < MAX_NORM).any(), norms


def test_fused_apply_scaled_falls_back_for_any_optax_transformation():
    tx = optax.adamw(1e-2, weight_decay=0.1)
    ours, norms = _scaled_trajectory(tx, mlp_params(), 0.5)
    halved = lambda params, step: jax.tree.map(lambda g: 0.5 * g, mlp_grad(params, step))  # noqa: E731
    expected, _ = trajectory(tx, mlp_params(), steps=6, grad_fn=halved)
    assert_trajectories_close(ours, expected, rtol=0, atol=0)
    np.testing.assert_allclose(norms, gradient_norms(mlp_params(), expected, grad_fn=halved), rtol=1e-6)


def test_master_weights_take_f32_gradients():
    """bf16 params with f32 gradients step as with the same gradients in bf16 when those are exact in bf16."""
    tx = lo.adamw(1e-2, weight_decay=0.1, storage_dtype=jnp.bfloat16, master_weights=True)
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), mlp_params())
    state = tx.init(params)
    from_bf16, _ = lo.fused_apply(tx, _bf16_grads(params, 0), state, params)
    f32_grads = jax.tree.map(lambda g: g.astype(jnp.float32), _bf16_grads(params, 0))
    from_f32, _, _ = lo.fused_apply_scaled(tx, f32_grads, state, params, 1.0)
    assert_trees_close(from_f32, from_bf16, rtol=0, atol=0)


def test_inside_optax_multi_transform():
    """Each ls_jax optimizer sees only its partition's leaves (optax.masked nodes elsewhere)."""
    labels = jax.tree.map(lambda decayed: "decay" if decayed else "plain", decay_matrices(mlp_params()))
    ours = optax.multi_transform({"decay": lo.adamw(1e-2, weight_decay=0.1), "plain": lo.adam(1e-2)}, labels)
    reference = optax.multi_transform({"decay": optax.adamw(1e-2, weight_decay=0.1), "plain": optax.adam(1e-2)}, labels)
    ours, _ = trajectory(ours, mlp_params(), steps=20)
    reference, _ = trajectory(reference, mlp_params(), steps=20)
    assert_trajectories_close(ours, reference)


def test_update_without_params():
    tx = lo.adam(1e-2)
    params = mlp_params()
    grads = mlp_grad(params, 0)
    updates, _ = tx.update(grads, tx.init(params))
    expected, _ = optax.adam(1e-2).update(grads, optax.adam(1e-2).init(params))
    assert_trees_close(updates, expected)
    with pytest.raises(ValueError, match="weight decay needs the params"):
        lo.adamw(1e-2).update(grads, tx.init(params))


# ---- Adan options beyond optax ------------------------------------------------------------------------------


def _adan_by_hand(params, *, steps, lr, weight_decay, restart_every=None, proximal=False):
    """optax.scale_by_adan's direction, re-initialized every ``restart_every`` steps, then the weight decay."""
    scale = optax.scale_by_adan(eps_root=1e-8)  # optax.adan's default, and ours
    state, history = scale.init(params), []
    for step in range(steps):
        if restart_every and step % restart_every == 0:
            state = scale.init(params)
        u, state = scale.update(mlp_grad(params, step), state)
        if proximal:
            params = jax.tree.map(lambda p, u: (p - lr * u) / (1 + lr * weight_decay), params, u)
        else:
            params = jax.tree.map(lambda p, u: p - lr * (u + weight_decay * p), params, u)
        history.append(params)
    return history


@pytest.mark.parametrize("restart_every, proximal", [(None, True), (7, False), (7, True)])
def test_adan_restart_and_proximal(restart_every, proximal):
    tx = lo.adan(1e-2, weight_decay=0.1, proximal=proximal, restart_every=restart_every)
    ours, _ = trajectory(tx, mlp_params(), steps=20, fused=True)
    expected = _adan_by_hand(
        mlp_params(), steps=20, lr=1e-2, weight_decay=0.1, restart_every=restart_every, proximal=proximal
    )
    assert_trajectories_close(ours, expected)


def test_restart_changes_the_trajectory():
    restarted, _ = trajectory(lo.adan(1e-2, restart_every=5), mlp_params(), steps=8)
    plain, _ = trajectory(lo.adan(1e-2), mlp_params(), steps=8)
    assert_trajectories_close(restarted[:5], plain[:5], rtol=0, atol=0)
    assert not np.allclose(restarted[5]["Dense_0"]["kernel"], plain[5]["Dense_0"]["kernel"])


# ---- many and odd leaves ------------------------------------------------------------------------------------


@jax.jit
def _leaf_grad(x, step):
    """Gradient of sum(sin(step + x) * x^2)."""
    return jnp.cos(step + x) * x * x + 2 * x * jnp.sin(step + x)


def _tree_grad(params, step):
    return jax.tree.map(lambda x: _leaf_grad(x, step), params)


def _many_leaves(count):
    keys = jax.random.split(jax.random.PRNGKey(7), count)
    shapes = [(1,), (3,), (2, 3), (5,), (4, 4), (7, 1), (2, 2, 2), ()]
    return {f"leaf{i}": jax.random.normal(k, shapes[i % len(shapes)]) for i, k in enumerate(keys)}


ODD_SIZES = {"one": jnp.full((1,), 0.5), "three": jnp.arange(3.0) - 1, "odd": jnp.linspace(-2, 2, 1023).reshape(3, 341)}
TREE_OPTIMIZERS = {
    "adan": (lambda: lo.adan(1e-2, eps_root=1e-8, weight_decay=0.1), lambda: optax.adan(1e-2, weight_decay=0.1)),
    "adamw": (lambda: lo.adamw(1e-2, weight_decay=0.1), lambda: optax.adamw(1e-2, weight_decay=0.1)),
}


def _check_tree(name, params, *, steps, jit_reference=True):
    make_ours, make_reference = TREE_OPTIMIZERS[name]
    ours, state = trajectory(make_ours(), params, steps=steps, fused=True, grad_fn=_tree_grad)
    reference, _ = trajectory(make_reference(), params, steps=steps, grad_fn=_tree_grad, jit=jit_reference)
    assert_trajectories_close(ours, reference)
    layout = lo.WorkspaceLayout.of(params)
    padding = np.ones(layout.total, bool)
    for offset, size in zip(layout.offsets, layout.sizes):
        padding[offset : offset + size] = False
    for moment in state[1:]:
        assert moment.shape == (layout.total,) and moment.dtype == jnp.float32
        assert not np.asarray(moment)[padding].any(), "workspace padding must stay zero"


@pytest.mark.parametrize("name", sorted(TREE_OPTIMIZERS))
def test_odd_leaf_sizes_match_optax(name):
    _check_tree(name, ODD_SIZES, steps=5)


def _mixed_sizes():
    """Leaves on both sides of the XLA step's small-leaf threshold, odd sizes among them (padded workspaces)."""
    small = _engine.SMALL_LEAF_ELEMENTS
    shapes = {
        "a_large_odd": (small + 1,),
        "b_small": (3,),
        "c_threshold": (small // 256, 256),
        "d_below": (small - 1,),
        "e_large": (2, small // 2 + 2),
        "f_scalar": (),
    }
    keys = jax.random.split(jax.random.PRNGKey(3), len(shapes))
    return {name: jax.random.normal(key, shape) for (name, shape), key in zip(shapes.items(), keys)}


@pytest.mark.parametrize("name", sorted(TREE_OPTIMIZERS))
def test_small_and_large_leaves_match_optax(name):
    with backend.use("xla"):
        _check_tree(name, _mixed_sizes(), steps=3)


def test_xla_step_updates_large_leaves_in_place_without_a_workspace_concatenation():
    """Each large leaf's moments are written into the workspaces with dynamic_update_slice (in place under
    donation), the small leaves' with one scatter; nothing concatenates a workspace-sized gradient."""
    params = _mixed_sizes()
    layout = lo.WorkspaceLayout.of(params)
    large = sum(size >= _engine.SMALL_LEAF_ELEMENTS for size in layout.sizes)
    tx = lo.adamw(1e-2, max_grad_norm=1.0)
    with backend.use("xla"):
        jaxpr = jax.make_jaxpr(lambda g, s, p: lo.fused_apply(tx, g, s, p))(params, tx.init(params), params).jaxpr
    assert jaxpr_output_shapes(jaxpr, "dynamic_update_slice") == [(layout.total,)] * (2 * large)
    assert jaxpr_output_shapes(jaxpr, "scatter") == [(layout.total,)] * 2
    assert (layout.total,) not in jaxpr_output_shapes(jaxpr, "concatenate")


def _abstract_step_jaxpr(shapes):
    """The XLA step's jaxpr for f32 leaves of ``shapes``, traced on abstract values (no memory allocated)."""
    params = {f"leaf{i}": jax.ShapeDtypeStruct(shape, jnp.float32) for i, shape in enumerate(shapes)}
    tx = lo.adamw(1e-2)
    with backend.use("xla"):
        return jax.make_jaxpr(lambda g, s, p: lo.fused_apply(tx, g, s, p))(
            params, jax.eval_shape(tx.init, params), params
        )


def _index_dtypes(closed) -> set[tuple[str, np.dtype]]:
    """(primitive, dtype of its offsets or indices) of every dynamic_update_slice, scatter and gather of ``closed``."""
    return {
        (
            eqn.primitive.name,
            eqn.invars[-1].aval.dtype if eqn.primitive.name == "dynamic_update_slice" else eqn.invars[1].aval.dtype,
        )
        for eqn in closed.jaxpr.eqns
        if eqn.primitive.name in ("dynamic_update_slice", "scatter", "gather")
    }


def test_xla_step_offsets_past_int32_keep_their_value():
    """A workspace of more than 2**31 elements: the offsets and indices the step writes through are unsigned
    32-bit and exact (int32 would wrap them negative)."""
    shapes = [(2**31 + 8,), (3,), (_engine.SMALL_LEAF_ELEMENTS + 4,)]
    layout = lo.WorkspaceLayout.from_shapes(shapes)
    assert layout.offsets[2] > 2**31
    closed = _abstract_step_jaxpr(shapes)
    constants = [np.asarray(c) for c in closed.consts]
    assert any(c.dtype == np.uint32 and list(c) == list(layout.offsets) for c in constants)
    assert any(
        c.dtype == np.uint32 and list(c) == list(range(layout.offsets[1], layout.offsets[1] + 3)) for c in constants
    )
    assert _index_dtypes(closed) == {
        (name, np.dtype(np.uint32)) for name in ("dynamic_update_slice", "scatter", "gather")
    }


def test_xla_step_offsets_are_int32_where_they_fit():
    """Below 2**31 elements the offsets are int32, with which XLA on GPU updates every leaf in place."""
    shapes = [(3,), (_engine.SMALL_LEAF_ELEMENTS + 4,)]
    closed = _abstract_step_jaxpr(shapes)
    assert {dtype for _, dtype in _index_dtypes(closed)} == {np.dtype(np.int32)}


def test_xla_step_names_its_workspace_limit():
    with pytest.raises(ValueError, match="32-bit unsigned offsets .* these parameters need 4294967300"):
        _abstract_step_jaxpr([(2**32 - 4,), (8,)])


@pytest.mark.slow
def test_520_leaves_match_optax():
    """The reference runs op by op: compiling optax for 520 distinct leaves takes XLA on CPU ~20 s."""
    _check_tree("adan", _many_leaves(520), steps=3, jit_reference=False)


def test_workspace_layout_aligns_every_leaf():
    layout = lo.WorkspaceLayout.from_shapes([(1,), (3,), (3, 341), (), (4,), (2, 3)])
    assert layout.sizes == (1, 3, 1023, 1, 4, 6)
    assert layout.offsets == (0, 4, 8, 1032, 1036, 1040)
    assert layout.total == 1048
    assert all(offset % 4 == 0 for offset in layout.offsets)


def test_workspace_views_invert_flatten():
    leaves = [jnp.arange(3.0), jnp.arange(10.0).reshape(2, 5), jnp.ones((), jnp.bfloat16)]
    layout = lo.WorkspaceLayout.of(leaves)
    flat = layout.flatten(leaves)
    assert flat.shape == (layout.total,) and flat.dtype == jnp.float32
    for view, leaf in zip(layout.views(flat), leaves):
        np.testing.assert_array_equal(view, np.asarray(leaf, np.float32))


# ---- 16-bit storage ----------------------------------------------------------------------------------------

# bf16 storage over the 50-step MLP run at lr 1e-2, against the same run with f32 params from the same start:
# the parameters stay within 10% of the distance the f32 run travels, and the loss within 1% of its loss.
BF16_PARAM_TOLERANCE = 0.10
BF16_LOSS_TOLERANCE = 0.01


def _flat(tree):
    return np.concatenate([np.asarray(leaf, np.float32).ravel() for leaf in jax.tree.leaves(tree)])


def test_bf16_storage_tracks_f32():
    bf16_params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), mlp_params())
    f32_params = jax.tree.map(lambda p: p.astype(jnp.float32), bf16_params)
    make = lambda dtype: lo.adan(1e-2, weight_decay=0.01, max_grad_norm=1.0, storage_dtype=dtype)  # noqa: E731
    ours, state = trajectory(make(jnp.bfloat16), bf16_params, fused=True)
    exact, _ = trajectory(make(None), f32_params, fused=True)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(ours[-1]))
    assert state.m.dtype == jnp.float32
    travelled = np.linalg.norm(_flat(exact[-1]) - _flat(f32_params))
    assert np.linalg.norm(_flat(ours[-1]) - _flat(exact[-1])) <= BF16_PARAM_TOLERANCE * travelled
    loss, exact_loss, initial_loss = (float(mlp_loss(p, 0)) for p in (ours[-1], exact[-1], f32_params))
    assert abs(loss - exact_loss) <= BF16_LOSS_TOLERANCE * exact_loss
    assert exact_loss < 0.6 * initial_loss, "the run must train for the comparison to mean anything"


@pytest.mark.parametrize("lr, changed", [(1e-3, lambda f: f > 0.9), (1e-5, lambda f: f < 0.1)])
def test_bf16_storage_loses_updates_below_its_spacing(lr, changed):
    """The documented trade-off: weights of magnitude 0.05 take lr 1e-3 steps but lose nearly all lr 1e-5 ones."""
    params = {"w": (0.05 * jnp.sign(jax.random.normal(jax.random.PRNGKey(0), (4096,)))).astype(jnp.bfloat16)}
    grads = {"w": jax.random.normal(jax.random.PRNGKey(1), (4096,)).astype(jnp.bfloat16)}
    tx = lo.adan(lr, storage_dtype=jnp.bfloat16)
    new_params, _ = lo.fused_apply(tx, grads, tx.init(params), params)
    assert changed(float(jnp.mean(new_params["w"] != params["w"])))


def test_fused_apply_rounds_bf16_once():
    """In bf16 storage, fused_apply rounds the f32 result once; update + apply_updates rounds twice."""
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), mlp_params())
    tx = lo.adan(3e-3, storage_dtype=jnp.bfloat16)
    grads = mlp_grad(params, 0)
    fused, _ = lo.fused_apply(tx, grads, tx.init(params), params)
    updates, _ = tx.update(grads, tx.init(params), params)
    to_f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)  # noqa: E731
    f32_updates, _ = lo.adan(3e-3).update(to_f32(grads), tx.init(params), to_f32(params))
    once = jax.tree.map(lambda p, u: (p.astype(jnp.float32) + u).astype(jnp.bfloat16), params, f32_updates)
    assert_trees_close(fused, once, rtol=0, atol=0)
    assert all(u.dtype == jnp.bfloat16 for u in jax.tree.leaves(updates))


def test_storage_dtype_is_enforced():
    tx = lo.adamw(1e-3, storage_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="storage_dtype=bfloat16 needs every param leaf in bfloat16"):
        tx.init(mlp_params())
    with pytest.raises(ValueError, match="storage_dtype must be bfloat16, float16 or None"):
        lo.adan(1e-3, storage_dtype=jnp.float32)


# ---- master weights -----------------------------------------------------------------------------------------


def _bf16_grads(params, step):
    """Gradients that do not depend on the params, exactly representable in bf16: the same values reach an f32
    run and a master-weights run."""
    grads = mlp_grad(jax.tree.map(lambda p: p.astype(jnp.float32), mlp_params()), step)
    return jax.tree.map(lambda g: g.astype(jnp.bfloat16), grads)


@pytest.mark.parametrize("storage", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("fused", [False, True], ids=["update", "fused_apply"])
def test_master_weights_follow_the_f32_run(fused, storage):
    """The master is the f32 run's params, bit for bit (same gradients, 20 steps); the 16-bit params are the master
    rounded to nearest. bf16 params carry the master's high halves and the state its int16 low halves; f16 params
    keep an f32 master."""
    f32_params = mlp_params()
    tx = lo.adamw(
        warmup_cosine(),
        weight_decay=WEIGHT_DECAY,
        mask=decay_matrices,
        max_grad_norm=MAX_NORM,
        storage_dtype=storage,
        master_weights=True,
    )
    grads = lambda params, step: jax.tree.map(lambda g: g.astype(storage), _bf16_grads(params, step))  # noqa: E731
    as_f32 = lambda params, step: jax.tree.map(lambda g: g.astype(jnp.float32), grads(params, step))  # noqa: E731
    exact, _ = trajectory(
        lo.adamw(warmup_cosine(), weight_decay=WEIGHT_DECAY, mask=decay_matrices, max_grad_norm=MAX_NORM),
        f32_params,
        steps=20,
        fused=True,
        grad_fn=as_f32,
    )
    start = jax.tree.map(lambda p: p.astype(storage), f32_params)
    ours, state = trajectory(tx, start, steps=20, fused=fused, grad_fn=grads, state=tx.init(f32_params))
    assert isinstance(state, lo.MasterWeightsState)
    expected_master_dtype = jnp.int16 if storage == jnp.bfloat16 else jnp.float32
    assert {leaf.dtype for leaf in jax.tree.leaves(state.master)} == {jnp.dtype(expected_master_dtype)}
    assert_trees_close(lo.master_params(state, ours[-1]), exact[-1], rtol=0, atol=0)
    rounded = master.round_to_bf16 if storage == jnp.bfloat16 else (lambda p: p.astype(storage))
    assert_trees_close(ours[-1], jax.tree.map(rounded, exact[-1]), rtol=0, atol=0)


def test_bf16_master_halves_are_exact_through_ties():
    """A step keeps every master value exact, ties included: its bf16 params round them to nearest with ties away
    from zero, which differs from astype's ties to even exactly where the low half is 0x8000 and the high half
    even. ``init`` splits against astype (how users cast their params) and saturates at those ties, one f32 unit
    in the last place below the value."""
    params = tied_params()
    tx = lo.adam(0.0, storage_dtype=jnp.bfloat16, master_weights=True)  # lr 0: the master keeps its values
    state = tx.init(params)
    start = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    for p, p16, low in zip(jax.tree.leaves(params), jax.tree.leaves(start), jax.tree.leaves(state.master)):
        bits = np.asarray(jax.lax.bitcast_convert_type(p, jnp.uint32)).reshape(-1)
        joined = np.asarray(jax.lax.bitcast_convert_type(master.join_halves(p16, low), jnp.uint32)).reshape(-1)
        np.testing.assert_array_equal(joined[1:], bits[1:])
        assert joined[0] == bits[0] - 1, "init saturates at astype's tie"
    exact_state = lo.MasterWeightsState(
        state.inner, jax.tree.map(lambda p: master.low_half(p, master.round_to_bf16(p)), params)
    )
    exact_start = jax.tree.map(master.round_to_bf16, params)
    new_params, new_state = lo.fused_apply(tx, _bf16_grads(start, 0), exact_state, exact_start)
    assert_trees_close(lo.master_params(new_state, new_params), params, rtol=0, atol=0)
    for new, p in zip(jax.tree.leaves(new_params), jax.tree.leaves(params)):
        differs = np.asarray(new != p.astype(jnp.bfloat16)).reshape(-1)
        assert differs[0] and not differs[1:].any(), "only the ties round away from astype's even neighbour"
        assert np.asarray(jnp.abs(new.astype(jnp.float32) - p) == jnp.abs(p.astype(jnp.bfloat16) - p)).all()


def test_bf16_master_halves_of_special_values():
    """Splitting and joining is the identity on every f32 bit pattern class: signed zeros, subnormals, halfway
    cases both ways, the largest finite values (whose high half rounds to infinity), infinities; NaN stays NaN."""
    patterns = np.array(
        [
            0x00000000,
            0x80000000,
            0x00000001,
            0x807FFFFF,
            0x3F808000,
            0x3F818000,
            0xBF808000,
            0x3F807FFF,
            0x3F80FFFF,
            0x7F7FFFFF,
            0xFF7FFFFF,
            0x7F800000,
            0xFF800000,
        ],
        np.uint32,
    )
    x = jax.lax.bitcast_convert_type(jnp.asarray(patterns), jnp.float32)
    high = master.round_to_bf16(x)
    joined = master.join_halves(high, master.low_half(x, high))
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(joined, jnp.uint32)), patterns)
    np.testing.assert_array_equal(  # nearest, ties away from zero: 1.00390625 (0x3F808000) rounds up, not to even
        np.asarray(high[4:9], np.float32), np.array([1.0078125, 1.015625, -1.0078125, 1.0, 1.0078125], np.float32)
    )
    assert np.isinf(np.asarray(high[9], np.float32)) and np.isinf(np.asarray(high[10], np.float32))
    stale = master.join_halves(
        jnp.asarray([0.0, -0.0, np.inf, -np.inf, 1.0], jnp.bfloat16), jnp.asarray([-5, -5, 5, 5, -5], jnp.int16)
    )
    np.testing.assert_array_equal(  # a low half from other params: never across zero, never NaN
        np.asarray(jax.lax.bitcast_convert_type(stale, jnp.uint32)),
        np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x3F800000 - 5], np.uint32),
    )
    nans = jax.lax.bitcast_convert_type(jnp.asarray([0x7F800001, 0xFFFFFFFF, 0x7FC00000], jnp.uint32), jnp.float32)
    nan_high = master.round_to_bf16(nans)
    assert np.isnan(np.asarray(nan_high, np.float32)).all()
    assert np.isnan(np.asarray(master.join_halves(nan_high, master.low_half(nans, nan_high)))).all()


def test_master_weights_keep_updates_bf16_storage_loses():
    """lr 1e-5 on weights of magnitude 0.05: each step is below half a bf16 spacing (1.2e-4). Plain bf16 storage
    never moves them; the master copy accumulates the steps and the bf16 params follow it."""
    params = {"w": (0.05 * jnp.sign(jax.random.normal(jax.random.PRNGKey(0), (4096,)))).astype(jnp.bfloat16)}
    grads = {"w": jax.random.normal(jax.random.PRNGKey(1), (4096,)).astype(jnp.bfloat16)}
    changed = {}
    for master_weights in (False, True):
        tx = lo.adam(1e-5, storage_dtype=jnp.bfloat16, master_weights=master_weights)
        new_params, _ = trajectory(tx, params, steps=40, fused=True, grad_fn=lambda p, step: grads)
        changed[master_weights] = float(jnp.mean(new_params[-1]["w"] != params["w"]))
    assert changed[False] < 0.1 and changed[True] > 0.9


def test_master_weights_bad_use_raises():
    with pytest.raises(ValueError, match="master_weights keeps an f32 copy of 16-bit params: it needs storage_dtype"):
        lo.adan(1e-3, master_weights=True)
    tx = lo.adan(1e-3, storage_dtype=jnp.bfloat16, master_weights=True)
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), mlp_params())
    grads = _bf16_grads(params, 0)
    with pytest.raises(ValueError, match="with master_weights the step needs the params"):
        tx.update(grads, tx.init(params))
    with pytest.raises(TypeError, match="expected a MasterWeightsState from this optimizer's init, got AdanState"):
        tx.update(grads, lo.adan(1e-3).init(params), params)
    with pytest.raises(ValueError, match="storage_dtype=bfloat16 needs every gradient leaf in bfloat16 or float32"):
        tx.update(jax.tree.map(lambda g: g.astype(jnp.float16), grads), tx.init(params), params)
    f32_master = lo.MasterWeightsState(tx.init(params).inner, jax.tree.map(lambda p: p.astype(jnp.float32), params))
    with pytest.raises(ValueError, match=r"with bfloat16 params the master weights are int16 leaves .* found float32"):
        tx.update(grads, f32_master, params)
    with pytest.raises(ValueError, match=r"low halves int16\[16\] need bfloat16 params of their shape, got float32"):
        lo.master_params(tx.init(params), jax.tree.map(lambda p: p.astype(jnp.float32), params))


# ---- bad input ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "factory, kwargs, message",
    [
        (lo.adan, {"learning_rate": -1e-3}, "learning_rate must be >= 0"),
        (lo.adamw, {"learning_rate": float("nan")}, "learning_rate must be >= 0"),
        (lo.adan, {"learning_rate": 1e-3, "b1": 1.0}, r"b1 must be in \[0, 1\)"),
        (lo.adan, {"learning_rate": 1e-3, "b3": -0.1}, r"b3 must be in \[0, 1\)"),
        (lo.adamw, {"learning_rate": 1e-3, "b2": 1.5}, r"b2 must be in \[0, 1\)"),
        (lo.adam, {"learning_rate": 1e-3, "eps": -1e-8}, "eps must be >= 0"),
        (lo.adan, {"learning_rate": 1e-3, "eps_root": -1.0}, "eps_root must be >= 0"),
        (lo.adamw, {"learning_rate": 1e-3, "weight_decay": -0.1}, "weight_decay must be >= 0"),
        (lo.adan, {"learning_rate": 1e-3, "max_grad_norm": 0.0}, "max_grad_norm must be > 0"),
        (lo.adan, {"learning_rate": 1e-3, "restart_every": 0}, "restart_every must be a positive integer"),
        (lo.adan, {"learning_rate": "fast"}, "learning_rate must be a real number"),
        (lo.adam, {"learning_rate": 1e-3, "eps": lambda count: 1e-8}, "eps must be a number, not a schedule"),
    ],
)
def test_bad_hyperparameters_raise(factory, kwargs, message):
    with pytest.raises(ValueError, match=message):
        factory(**kwargs)


def test_bad_trees_raise():
    params = mlp_params()
    tx = lo.adan(1e-3)
    state = tx.init(params)
    grads = mlp_grad(params, 0)
    with pytest.raises(ValueError, match="was the state initialized for other parameters"):
        tx.update({"w": jnp.ones((3,))}, state, {"w": jnp.ones((3,))})
    with pytest.raises(ValueError, match="gradient leaf .* has dtype int32"):
        tx.update(jax.tree.map(lambda g: g.astype(jnp.int32), grads), state, params)
    with pytest.raises(ValueError, match="different tree structures"):
        tx.update(grads, state, {"other": params})
    with pytest.raises(ValueError, match="mask must be a pytree of booleans"):
        adamw = lo.adamw(1e-3, mask={"nope": True})
        adamw.update(grads, adamw.init(params), params)
    with pytest.raises(TypeError, match="expected a AdamState from this optimizer's init, got AdanState"):
        lo.adam(1e-3).update(grads, state, params)


def test_forcing_kernels_without_cuda_is_a_clear_error():
    if backend.cuda_visible():
        pytest.skip("a CUDA device is visible: the kernels may load here")
    tx = lo.adan(1e-3)
    params = mlp_params()
    with backend.use("ffi"), pytest.raises(backend.KernelsUnavailableError, match="requires the CUDA kernels"):
        tx.update(mlp_grad(params, 0), tx.init(params), params)


# ---- the CUDA path, lowered on CPU ----------------------------------------------------------------------


def _cuda_lowering(tx, grads, params) -> str:
    """The MLIR of a donated, jitted ``fused_apply`` step exported for CUDA (the kernel call is not run)."""
    step = jax.jit(lambda g, s, p: lo.fused_apply(tx, g, s, p), donate_argnums=(1, 2))
    unchecked = [jax.export.DisabledSafetyCheck.custom_call("ls_optim_step")]
    exported = jax.export.export(step, platforms=["cuda"], disabled_checks=unchecked)(grads, tx.init(params), params)
    return exported.mlir_module()


def test_fused_apply_lowers_to_one_in_place_kernel_call_for_cuda(monkeypatch):
    """With kernels enabled, a CUDA lowering holds one ls_optim_step call whose params and moments are aliased."""
    monkeypatch.setattr(backend, "kernels_enabled", lambda: True)
    tx = lo.adan(1e-3, weight_decay=0.1, mask=decay_matrices, max_grad_norm=1.0)
    params = mlp_params()
    text = _cuda_lowering(tx, mlp_grad(params, 0), params)
    assert text.count("stablehlo.custom_call @ls_optim_step") == 1
    num_leaves = len(jax.tree.leaves(params))
    assert text.count("#stablehlo.output_operand_alias") == num_leaves + 4
    flags = ", ".join(str(int(flag)) for flag in jax.tree.leaves(decay_matrices(params)))
    assert f"decay = dense<[{flags}]> : tensor<{num_leaves}xi32>" in text


def test_master_weights_lower_to_one_kernel_call_updating_master_and_moments_in_place(monkeypatch):
    """The bf16 params and the master's low halves go in aliased to their new values (the copies and the outputs)."""
    monkeypatch.setattr(backend, "kernels_enabled", lambda: True)
    tx = lo.adan(1e-3, weight_decay=0.1, max_grad_norm=1.0, storage_dtype=jnp.bfloat16, master_weights=True)
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), mlp_params())
    text = _cuda_lowering(tx, _bf16_grads(params, 0), params)
    assert text.count("stablehlo.custom_call @ls_optim_step") == 1
    assert "write_copies = true" in text and "split_master = true" in text
    num_leaves = len(jax.tree.leaves(params))
    assert text.count("#stablehlo.output_operand_alias") == 2 * num_leaves + 4  # params, low halves, Adan's moments


def test_fused_apply_scaled_lowers_to_the_kernel_call_alone(monkeypatch):
    """The scaling and the norm add no XLA operation over the gradients: the call takes them as they come, writes
    the norm, and the step's only reductions are the kernel's (no reduce in the module)."""
    monkeypatch.setattr(backend, "kernels_enabled", lambda: True)
    tx = lo.adamw(1e-3, weight_decay=0.1, storage_dtype=jnp.bfloat16, master_weights=True)
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), mlp_params())
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), _bf16_grads(params, 0))
    step = jax.jit(lambda g, s, p, c: lo.fused_apply_scaled(tx, g, s, p, c), donate_argnums=(1, 2))
    unchecked = [jax.export.DisabledSafetyCheck.custom_call("ls_optim_step")]
    exported = jax.export.export(step, platforms=["cuda"], disabled_checks=unchecked)
    text = exported(grads, tx.init(params), params, jnp.float32(0.5)).mlir_module()
    assert text.count("stablehlo.custom_call @ls_optim_step") == 1
    assert "write_norm = true" in text and "clip = false" in text
    assert "stablehlo.reduce" not in text and "stablehlo.multiply" not in text


def test_kernel_declines_leaves_beyond_its_limit():
    from ls_jax.optim import _engine, _kernel

    layout = lo.WorkspaceLayout.from_shapes([(2**31,)])
    config = _engine.StepConfig("adan", (), layout, (False,), False, False, "params", (jnp.dtype(jnp.bfloat16),))
    assert "exceeds the kernel's limit" in _kernel.unsupported(config, [None], [None])


def test_with_kernels_enabled_cpu_lowering_still_runs_xla(monkeypatch):
    """platform_dependent picks the XLA branch when the computation is lowered for CPU."""
    tx = lo.adan(1e-2, weight_decay=0.1, max_grad_norm=1.0)
    expected, _ = trajectory(tx, mlp_params(), steps=2, fused=True)
    monkeypatch.setattr(backend, "kernels_enabled", lambda: True)
    ours, _ = trajectory(tx, mlp_params(), steps=2, fused=True)
    assert_trajectories_close(ours, expected, rtol=0, atol=0)


def test_unsupported_shapes_fall_back_to_xla_with_one_log(monkeypatch, caplog):
    from ls_jax.optim import _engine, _kernel

    monkeypatch.setattr(backend, "kernels_enabled", lambda: True)
    monkeypatch.setattr(_kernel, "unsupported", lambda config, grads, params: "a test reason")
    _engine._log_fallback_once.cache_clear()
    tx = lo.adamw(1e-2)
    expected, _ = trajectory(tx, mlp_params(), steps=2)
    with caplog.at_level("WARNING", logger="ls_jax.optim"):
        ours, _ = trajectory(tx, mlp_params(), steps=2)
        trajectory(tx, mlp_params(), steps=1, fused=True)
    assert_trajectories_close(ours, expected, rtol=0, atol=0)
    expected_log = "ls_jax.optim: running the XLA implementation on CUDA: a test reason"
    assert [record.getMessage() for record in caplog.records] == [expected_log]
