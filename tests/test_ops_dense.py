"""ls_jax.ops.dense and ls_jax.layers.Dense: the GEMM, its f32 weight gradient, layouts and parameters; and
ls_jax.ops.relu_dropout_dense, the feed-forward block's relu, dropout and second GEMM as one op."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ls_jax import ops
from ls_jax.layers import DeferredReluDropout, Dense
from ls_jax.ops.random import keep_mask
from test_ops_support import BF16, F32, assert_close, check_vjp, normal, seed_array, value_and_vjp


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_dense_matches_the_einsum_with_bias(dtype):
    x, kernel, bias = normal(0, (2, 5, 3, 4), dtype), normal(1, (3, 4, 2, 6), F32), normal(2, (2, 6), F32)
    op = lambda x, kernel, bias: ops.dense(x, kernel, bias, input_axes=2, dtype=dtype)
    ref = lambda x, kernel, bias: jnp.einsum("blij,ijhd->blhd", x, kernel) + bias
    check_vjp(op, ref, (x, kernel, bias), dtype)


def test_transposed_kernel_equals_the_kernel_transposed():
    x, table = normal(3, (2, 3, 8), BF16), normal(4, (11, 8), F32)
    cotangent = normal(5, (2, 3, 11), BF16)
    tied, tied_vjp = jax.vjp(lambda t: ops.dense(x, t, transposed_kernel=True), table)
    plain, plain_vjp = jax.vjp(lambda k: ops.dense(x, k), table.T)
    np.testing.assert_array_equal(np.asarray(tied, np.float32), np.asarray(plain, np.float32))
    np.testing.assert_array_equal(np.asarray(tied_vjp(cotangent)[0]), np.asarray(plain_vjp(cotangent)[0]).T)


def _backward_jaxpr(transposed: bool) -> jax.extend.core.ClosedJaxpr:
    x, cotangent = normal(0, (4, 8), BF16), normal(1, (4, 16), BF16)
    kernel = normal(2, (16, 8) if transposed else (8, 16), F32)
    backward = lambda x, k, g: jax.vjp(lambda x, k: ops.dense(x, k, transposed_kernel=transposed), x, k)[1](g)
    return jax.make_jaxpr(backward)(x, kernel, cotangent)


def test_tied_projection_releases_dx_together_with_the_table_gradient():
    """Both gradients of a tied output projection leave its backward through one barrier, so XLA cannot hold
    dy, the (tokens, V) logits gradient, until the table's other gradient is ready; other kernels need none."""
    tied = _backward_jaxpr(transposed=True).jaxpr
    [barrier] = [eqn for eqn in tied.eqns if eqn.primitive.name == "optimization_barrier"]
    assert list(barrier.outvars) == list(tied.outvars)
    plain = _backward_jaxpr(transposed=False).jaxpr
    assert all(eqn.primitive.name != "optimization_barrier" for eqn in plain.eqns)


def test_the_kernel_gradient_is_accumulated_in_f32_not_rounded_to_bf16():
    """dW of bf16 activations in f32: the exact sum of bf16 products to f32 precision, where autodiff of the
    bf16 einsum rounds it to bf16 (relative error ~2**-9)."""
    x, kernel = normal(6, (64, 32), BF16), normal(7, (32, 16), F32)
    dy = normal(8, (64, 16), BF16)
    _, vjp = jax.vjp(lambda k: ops.dense(x, k, dtype=BF16), kernel)
    (d_kernel,) = vjp(dy)
    exact = np.asarray(x, np.float64).T @ np.asarray(dy, np.float64)
    assert d_kernel.dtype == F32
    np.testing.assert_allclose(np.asarray(d_kernel), exact, rtol=1e-5, atol=1e-5)
    _, autodiff_vjp = jax.vjp(lambda k: x @ k.astype(BF16), kernel)
    rounded_error = np.max(np.abs(np.asarray(autodiff_vjp(dy)[0]) - exact))
    assert rounded_error > 10 * np.max(np.abs(np.asarray(d_kernel) - exact))


def test_dense_module_has_dense_generals_parameters():
    x = normal(9, (2, 3, 4, 5), F32)
    ours = Dense((6, 7), input_axes=2, dtype=BF16).init(jax.random.key(0), x)["params"]
    flax = nn.DenseGeneral((6, 7), axis=(-2, -1), param_dtype=F32).init(jax.random.key(0), x)["params"]
    assert jax.tree.structure(ours) == jax.tree.structure(flax)
    for got, want in zip(jax.tree.leaves(ours), jax.tree.leaves(flax)):
        assert (got.shape, got.dtype) == (want.shape, want.dtype)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    y = Dense((6, 7), input_axes=2, dtype=BF16).apply({"params": ours}, x)
    assert (y.shape, y.dtype) == ((2, 3, 6, 7), BF16)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(x=jnp.zeros((2, 5))), r"x's last 1 axes \(5,\) must be the kernel's \(4,\)"),
        (dict(bias=jnp.zeros((3,))), r"bias must have shape \(6,\), got \(3,\)"),
        (dict(input_axes=2), r"input_axes must be in \[1, kernel.ndim\)"),
        (dict(dtype=jnp.int32), "dtype must be float32, bfloat16 or float16, got int32"),
        (dict(x=jnp.zeros((2, 4), jnp.int32)), "x must be float32, bfloat16 or float16, got int32"),
    ],
)
def test_bad_inputs_raise_value_error(kwargs, message):
    args = dict(x=jnp.zeros((2, 4)), kernel=jnp.zeros((4, 6)), bias=None) | kwargs
    x, kernel, bias = args.pop("x"), args.pop("kernel"), args.pop("bias")
    with pytest.raises(ValueError, match=message):
        ops.dense(x, kernel, bias, **args)


# ---- relu_dropout_dense ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, param_dtype", [(F32, F32), (BF16, F32), (BF16, BF16)])
@pytest.mark.parametrize("rate", [0.0, 0.25])
def test_relu_dropout_dense_matches_the_reference(dtype, param_dtype, rate):
    seed = seed_array(3)
    x, act_bias, kernel = normal(0, (2, 5, 16), dtype), normal(1, (16,), param_dtype), normal(2, (16, 8), param_dtype)
    op = lambda x, c, k: ops.relu_dropout_dense(x, c, k, dropout_rate=rate, seed=seed if rate else None)

    def reference(x, c, k):
        hidden = jnp.maximum(x + c, 0.0)
        if rate:
            hidden = hidden * keep_mask(seed, hidden.shape, rate) / (1.0 - rate)
        # The op's GEMM reads the hidden layer in x's dtype, as the layers' Dense does.
        return hidden.astype(dtype).astype(F32) @ k

    check_vjp(op, reference, (x, act_bias, kernel), dtype)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_relu_dropout_dense_equals_bias_act_dropout_then_dense(dtype):
    """The fused op is the two ops it replaces, forward and backward (the XLA path): bit for bit in f32; in bf16
    XLA may keep the relu gradient's GEMM output in f32 (excess precision) in one and not the other."""
    seed = seed_array(4)
    x, act_bias, kernel = normal(5, (4, 3, 32), dtype), normal(6, (32,), F32), normal(7, (32, 24), F32)
    cotangent = normal(8, (4, 3, 24), dtype)
    fused = lambda x, c, k: ops.relu_dropout_dense(x, c, k, dropout_rate=0.1, seed=seed)
    apart = lambda x, c, k: ops.dense(ops.bias_act_dropout(x, c, activation="relu", dropout_rate=0.1, seed=seed), k)
    got = value_and_vjp(fused, (x, act_bias, kernel), cotangent)
    want = value_and_vjp(apart, (x, act_bias, kernel), cotangent)
    assert [leaf.dtype for leaf in jax.tree.leaves(got)] == [leaf.dtype for leaf in jax.tree.leaves(want)]
    if dtype == F32:
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    else:
        assert_close(got, want, dtype)


def test_feed_forward_with_relu_hands_fc2_its_hidden_layer_unformed():
    """The relu feed-forward's fc2 forms dropout(relu(.)) in its own op; gelu's keeps bias_act_dropout. The
    parameter tree is the same either way (fc2 has a kernel, no bias)."""
    from ls_jax.layers import FeedForward, LayerConfig

    x = normal(9, (2, 4, 32), F32)
    for activation, fused in (("relu", True), ("gelu", False)):
        cfg = LayerConfig(hidden_size=32, intermediate_size=64, nhead=4, max_seq_len=8, activation_fn=activation,
                          dtype=F32)
        layer = FeedForward(cfg)
        params = layer.init(jax.random.key(0), x)["params"]
        assert set(params["fc2"]) == {"kernel"}
        text = str(jax.make_jaxpr(lambda p: layer.apply({"params": p}, x))(params))
        assert ("_relu_dropout_gemm" in text) == fused, activation


def test_relu_dropout_dense_bad_inputs():
    x, act_bias, kernel = normal(0, (4, 16), BF16), normal(1, (16,), F32), normal(2, (16, 8), F32)
    with pytest.raises(ValueError, match=r"kernel must have shape \(16, N\) for x of shape \(4, 16\), got \(8, 16\)"):
        ops.relu_dropout_dense(x, act_bias, kernel.T)
    with pytest.raises(ValueError, match="act_bias must have shape"):
        ops.relu_dropout_dense(x, act_bias[:8], kernel)
    with pytest.raises(ValueError, match="kernel must be float32 or bfloat16, got float16"):
        ops.relu_dropout_dense(x, act_bias, kernel.astype(jnp.float16))
    with pytest.raises(ValueError, match="needs a seed"):
        ops.relu_dropout_dense(x, act_bias, kernel, dropout_rate=0.1)
    deferred = DeferredReluDropout(x, act_bias, None, 0.0)
    with pytest.raises(ValueError, match="no bias"):
        Dense(8).init(jax.random.key(0), deferred)
