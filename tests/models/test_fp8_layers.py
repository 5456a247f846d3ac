"""FP8 GEMMs of the layers (``LayerConfig.fp8``, `ls_jax.layers.fp8`) on a CPU, which emulates them: the products
stay close to bf16's yet are quantized, a training step's scaling state is the gradient of its collection, the
backward quantizes to e5m2, overflows are flagged, data-parallel steps' layer-ordered backward takes the scaling state
too, and devices without FP8 are refused by name."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.linen import fp8_ops as flax_fp8_ops

from ls_jax.layers import Dense, LayerConfig, TransformerEmbedding, TransformerEncoder, TransformerEncoderLayer, fp8
from ls_jax.optim import gradient_sync

E4M3_MAX = 448.0


def _relative_error(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _dense_pair(x, features=48):
    """(fp8 output, bf16 output, fp8 variables) of one Dense with the same parameters."""
    fp8_dense = Dense(features, dtype=jnp.bfloat16, fp8=True)
    variables = fp8_dense.init(jax.random.PRNGKey(1), x)
    plain = Dense(features, dtype=jnp.bfloat16).apply({"params": variables["params"]}, x)
    return fp8_dense.apply(variables, x), plain, variables


def test_an_fp8_dense_is_close_to_bf16_and_quantized():
    x = jax.random.normal(jax.random.PRNGKey(0), (64, 32), jnp.bfloat16)
    y, plain, variables = _dense_pair(x)
    assert y.dtype == jnp.bfloat16 and y.shape == plain.shape
    # e4m3 keeps 3 mantissa bits (relative step 1/16 at most); bf16 keeps 8.
    assert 5e-3 < _relative_error(y, plain) < 0.06
    assert set(variables[fp8.SCALING]["fp8"]) == {
        f"{tensor}_{kind}" for tensor in ("input", "kernel", "output_grad") for kind in ("scale", "amax_history")
    }


def test_the_tied_logits_run_in_fp8():
    cfg = LayerConfig.preset("transformer-base", hidden_size=32, intermediate_size=64, nhead=4, fp8=True)
    embedding = TransformerEmbedding(cfg, vocab_size=50)
    tokens = jnp.arange(2 * 7, dtype=jnp.int32).reshape(2, 7) % 50
    hidden = jax.random.normal(jax.random.PRNGKey(2), (2, 7, 32), jnp.bfloat16)

    def both(module):
        return module(tokens), module.attend(hidden)

    variables = embedding.init(jax.random.PRNGKey(3), method=both)
    _, logits = embedding.apply(variables, method=both)
    plain = TransformerEmbedding(
        LayerConfig.preset("transformer-base", hidden_size=32, intermediate_size=64, nhead=4), vocab_size=50
    )
    _, expected = plain.apply({"params": variables["params"]}, method=both)
    assert logits.shape == (2, 7, 50)
    assert 5e-3 < _relative_error(logits, expected) < 0.06
    assert "logits_fp8" in variables[fp8.SCALING]


def test_a_steps_scaling_state_is_the_gradient_of_its_collection():
    """Delayed scaling: step 1 quantizes with the initial scale (1) and records amax; step 2's scale is
    amax / 448 from that history."""
    x = 3.0 * jax.random.normal(jax.random.PRNGKey(4), (64, 32), jnp.bfloat16)
    dense = Dense(16, dtype=jnp.bfloat16, fp8=True)
    variables = dense.init(jax.random.PRNGKey(5), x)

    def loss(params, scaling):
        y = dense.apply({"params": params, fp8.SCALING: scaling}, x)
        return jnp.sum(jnp.square(y.astype(jnp.float32)))

    params, scaling = variables["params"], variables[fp8.SCALING]
    _, scaling_grad = jax.grad(loss, argnums=(0, 1))(params, scaling)
    after_one = fp8.new_scaling(scaling_grad)["fp8"]
    amax = float(jnp.max(jnp.abs(x.astype(jnp.float32))))
    np.testing.assert_allclose(after_one["input_amax_history"][0], amax, rtol=1e-6)
    assert float(after_one["output_grad_amax_history"][0]) > 0  # the backward's dy was seen
    np.testing.assert_allclose(after_one["input_scale"], 1.0)  # the history was empty: the scale is kept
    _, scaling_grad = jax.grad(loss, argnums=(0, 1))(params, {"fp8": after_one})
    after_two = fp8.new_scaling(scaling_grad)["fp8"]
    np.testing.assert_allclose(after_two["input_scale"], amax / E4M3_MAX, rtol=1e-6)
    # Flax's history: the newest amax first, the one before it rolled to the end.
    history = after_two["input_amax_history"]
    np.testing.assert_allclose([history[0], history[-1]], [amax, amax], rtol=1e-6)


def test_the_backward_quantizes_the_gradient_to_e5m2():
    x = jax.random.normal(jax.random.PRNGKey(6), (16, 32), jnp.bfloat16)
    dense = Dense(8, dtype=jnp.bfloat16, fp8=True)
    variables = dense.init(jax.random.PRNGKey(7), x)

    def loss(variables):
        return jnp.sum(dense.apply(variables, x).astype(jnp.float32))

    hlo = jax.jit(jax.grad(loss)).lower(variables).as_text()
    assert "f8E4M3FN" in hlo and "f8E5M2" in hlo


def test_overflows_name_the_tensors_a_too_small_scale_clipped():
    x = jax.random.normal(jax.random.PRNGKey(8), (32, 16), jnp.bfloat16)
    y, _, variables = _dense_pair(x, features=8)
    scaling = jax.tree.map(lambda leaf: leaf, variables[fp8.SCALING])
    scaling["fp8"]["input_scale"] = jnp.full((1,), 1e-3)  # lets e4m3 hold |x| <= 0.448 only

    def loss(params, scaling):
        return jnp.sum(Dense(8, dtype=jnp.bfloat16, fp8=True).apply({"params": params, fp8.SCALING: scaling}, x))

    _, scaling_grad = jax.grad(loss, argnums=(0, 1))(variables["params"], scaling)
    flags = {name: bool(flag) for name, flag in fp8.overflows(fp8.new_scaling(scaling_grad)).items()}
    assert flags == {"fp8/input": True, "fp8/kernel": False, "fp8/output_grad": False}
    assert bool(jnp.all(jnp.isfinite(y)))


def test_amax_ratios_come_from_one_vector_computation():
    """Each ratio is its tensor's newest amax over fp8_max * scale (e4m3's 448, e5m2's 57344 for gradients), and the
    whole vector is one division however many tensors there are, so a step does not launch one kernel per tensor."""
    scaling = {
        layer: {
            "fp8": {
                "input_scale": jnp.array([0.5 + index]),
                "input_amax_history": jnp.array([448.0, 1.0]),
                "output_grad_scale": jnp.array([2.0]),
                "output_grad_amax_history": jnp.array([57344.0 * 4.0, 0.0]),
            }
        }
        for index, layer in enumerate(["a", "b", "c"])
    }
    names, ratios = fp8.amax_ratio_vector(scaling)
    expected = {
        "a/fp8/input": 1 / 0.5, "b/fp8/input": 1 / 1.5, "c/fp8/input": 1 / 2.5,
        **{f"{layer}/fp8/output_grad": 2.0 for layer in "abc"},
    }  # fmt: skip
    assert sorted(names) == sorted(expected)
    np.testing.assert_allclose(np.asarray(ratios), [expected[name] for name in names], rtol=1e-7)
    assert {name: float(value) for name, value in fp8.amax_ratios(scaling).items()} == pytest.approx(expected)
    jaxpr = jax.make_jaxpr(lambda s: fp8.amax_ratio_vector(s)[1])(scaling)
    assert [eqn.primitive.name for eqn in jaxpr.jaxpr.eqns].count("div") == 1


def test_a_layer_ordered_backward_gives_the_same_gradients_and_next_scaling():
    """Data-parallel steps trace their loss in `gradient_sync.backward_in_layer_order`, where each layer of a stack
    has a VJP of its own: the FP8 scaling state is differentiated there too (it once stayed a closed-over tracer of
    the step and leaked), and the gradients and next scaling state are those of the plain backward."""
    x = jax.random.normal(jax.random.PRNGKey(9), (4, 16, 32), jnp.bfloat16)
    cfg = LayerConfig.preset(
        "transformer-base", hidden_size=32, intermediate_size=64, nhead=4, max_seq_len=16, fp8=True
    )
    stack = TransformerEncoder(cfg, num_layers=2)
    rest, scaling = fp8.split_scaling(stack.init(jax.random.PRNGKey(11), x, None))

    def loss(params, scaling):
        y = stack.apply({"params": params, fp8.SCALING: scaling}, x, None)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    gradients = jax.jit(jax.grad(loss, argnums=(0, 1)))
    plain = gradients(rest["params"], scaling)
    with gradient_sync.backward_in_layer_order():
        ordered = jax.jit(jax.grad(loss, argnums=(0, 1)))(rest["params"], scaling)
    jax.tree.map(np.testing.assert_array_equal, ordered, plain)
    next_history = ordered[1]["layer_1"]["feed_forward"]["fc1"]["fp8"]["input_amax_history"]
    assert float(next_history[0]) > 0  # this step's amax, rolled in


def test_micro_batches_and_replicas_combine_scaling_by_the_maximum():
    a = {"fp8": {"input_scale": jnp.array([0.5]), "input_amax_history": jnp.array([3.0, 1.0])}}
    b = {"fp8": {"input_scale": jnp.array([0.25]), "input_amax_history": jnp.array([4.0, 0.5])}}
    combined = fp8.combine_scaling(a, b)
    np.testing.assert_array_equal(combined["fp8"]["input_scale"], [0.5])
    np.testing.assert_array_equal(combined["fp8"]["input_amax_history"], [4.0, 1.0])
    rest, scaling = fp8.split_scaling({"params": {"w": 1}, fp8.SCALING: a})
    assert rest == {"params": {"w": 1}} and scaling is a


def _device(platform, kind, capability=None):
    return types.SimpleNamespace(platform=platform, device_kind=kind, compute_capability=capability)


def test_devices_without_fp8_are_refused_by_name():
    fp8.check_device(jax.devices("cpu")[0])
    fp8.check_device(_device("gpu", "NVIDIA H200", "9.0"))
    fp8.check_device(_device("gpu", "NVIDIA L4", "8.9"))
    with pytest.raises(ValueError, match=r"^NVIDIA A100-SXM4-80GB \(compute capability 8.0\) has no FP8"):
        fp8.check_device(_device("gpu", "NVIDIA A100-SXM4-80GB", "8.0"))
    with pytest.raises(ValueError, match=r"^TPU v3 has no FP8 matrix products"):
        fp8.check_device(_device("tpu", "TPU v3"))


def test_fp8_steps_compile_without_tritons_gemms_on_a_gpu_unless_xla_flags_say(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=true")
    assert fp8.compiler_options("gpu") == {"xla_gpu_enable_triton_gemm": False}
    assert fp8.compiler_options("cpu") == {}
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
    assert fp8.compiler_options("gpu") == {}


def test_an_fp8_encoder_layer_trains_like_bf16():
    """Thirty Adam steps fitting a fixed target: FP8 ends within 10% of bf16's loss, far below where both began."""
    x = jax.random.normal(jax.random.PRNGKey(9), (4, 16, 32), jnp.bfloat16)
    target = jax.random.normal(jax.random.PRNGKey(10), (4, 16, 32), jnp.float32)

    def train(use_fp8):
        cfg = LayerConfig.preset(
            "transformer-base",
            hidden_size=32,
            intermediate_size=64,
            nhead=4,
            max_seq_len=16,
            hidden_dropout_ratio=0.0,
            attn_prob_dropout_ratio=0.0,
            activation_dropout_ratio=0.0,
            fp8=use_fp8,
        )
        layer = TransformerEncoderLayer(cfg)
        rest, scaling = fp8.split_scaling(layer.init(jax.random.PRNGKey(11), x, None))
        params = rest["params"]
        tx = optax.adam(3e-3)
        opt_state = tx.init(params)

        def loss(params, scaling):
            y = layer.apply({"params": params, fp8.SCALING: scaling}, x, None)
            return jnp.mean(jnp.square(y.astype(jnp.float32) - target))

        @jax.jit
        def step(params, scaling, opt_state):
            value, (grads, scaling_grad) = jax.value_and_grad(loss, argnums=(0, 1))(params, scaling)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), fp8.new_scaling(scaling_grad), opt_state, value

        losses = []
        for _ in range(30):
            params, scaling, opt_state, value = step(params, scaling, opt_state)
            losses.append(float(value))
        return losses, scaling

    fp8_losses, scaling = train(True)
    bf16_losses, _ = train(False)
    assert fp8_losses[-1] < 0.5 * fp8_losses[0]
    assert abs(fp8_losses[-1] - bf16_losses[-1]) < 0.1 * bf16_losses[-1]
    amax = scaling["feed_forward"]["fc1"]["fp8"]["input_amax_history"]
    assert int(jnp.sum(amax > 0)) == 30  # one entry per step


@pytest.mark.parametrize("contract", [0, 1], ids=["kernel (K, N)", "table (N, K)"])
def test_the_product_is_as_close_as_flaxs_with_the_same_next_scaling_state(contract):
    """`fp8.Fp8Dot` against Flax's Fp8DirectDotGeneralOp from the same variables, with a history of earlier
    amaxes: the next scales and histories are equal but for the kernel's newest amax, which ours takes of the f32
    kernel it quantizes and Flax's of the bf16 copy it is given; y, dx and the kernel's gradient are as close to the
    exact products as Flax's (the two differ where a rounding to bf16 first moves an FP8 rounding)."""
    rows, k, n = 64, 96, 80
    key = jax.random.PRNGKey(3)
    x = jax.random.normal(key, (rows, k), jnp.bfloat16) * 3
    kernel = jax.random.normal(jax.random.PRNGKey(4), (k, n) if contract == 0 else (n, k), jnp.float32) * 0.1
    dy = jax.random.normal(jax.random.PRNGKey(5), (rows, n), jnp.bfloat16)
    ours, flax_op = fp8.Fp8Dot(), flax_fp8_ops.Fp8DirectDotGeneralOp()
    scaling = ours.init(key, x, kernel, contract)
    scaling = jax.tree.map(lambda v: v.at[:3].set(jnp.asarray([12.0, 1.0, 3.0])[: v.shape[0]]), scaling)
    dims = (((1,), (contract,)), ((), ()))

    def product_and_grads(apply):
        def loss(x, kernel, scaling):
            y = apply(scaling, x, kernel)
            return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(x, kernel, scaling)

    (ours_dx, ours_dw, ours_next), ours_y = product_and_grads(lambda v, x, w: ours.apply(v, x, w, contract))
    (flax_dx, flax_dw, flax_next), flax_y = product_and_grads(
        lambda v, x, w: flax_op.apply(v, x, w.astype(x.dtype), dims)
    )
    ours_state, flax_state = dict(ours_next[fp8.SCALING]), dict(flax_next[fp8.SCALING])
    newest_kernel_amax = ours_state["kernel_amax_history"][0]
    assert float(newest_kernel_amax) == float(jnp.max(jnp.abs(kernel)))
    assert float(flax_state["kernel_amax_history"][0]) == float(jnp.max(jnp.abs(kernel.astype(x.dtype))))
    flax_state["kernel_amax_history"] = flax_state["kernel_amax_history"].at[0].set(newest_kernel_amax)
    jax.tree.map(np.testing.assert_array_equal, ours_state, flax_state)
    assert ours_dw.dtype == kernel.dtype  # from the GEMM in the kernel's dtype
    exact_y, exact_vjp = jax.vjp(lambda x, w: jax.lax.dot_general(x, w, dims), x.astype(jnp.float32), kernel)
    exact_dx, exact_dw = exact_vjp(dy.astype(jnp.float32))
    for got, flax_value, exact in (
        (ours_y, flax_y, exact_y),
        (ours_dx, flax_dx, exact_dx),
        (ours_dw, flax_dw, exact_dw),
    ):
        assert got.shape == exact.shape
        assert _relative_error(got, exact) < 1.1 * _relative_error(flax_value, exact)
        assert _relative_error(got, flax_value) < 0.05
