"""ls_jax.ops.layer_norm against a naive LayerNorm, with and without the fused residual add, and its
bias + dropout + residual form against ops.bias_dropout_residual followed by ops.layer_norm."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.ops import BF16, F32, apply_vjp, assert_close, check_vjp, normal, random_cotangent, seed_array

from ls_jax.ops import bias_dropout_residual, layer_norm

EPS = 1e-5


def reference_layer_norm(x, gamma, beta, eps=EPS):
    """(x - mean) / sqrt(var + eps) * gamma + beta over the last axis."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * gamma + beta


def _inputs(shape, act_dtype, param_dtype):
    hidden = shape[-1]
    x = normal(0, shape, act_dtype, scale=2.0) + jnp.asarray(0.5, act_dtype)
    gamma = (1.0 + normal(1, (hidden,), F32, scale=0.3)).astype(param_dtype)
    beta = normal(2, (hidden,), param_dtype, scale=0.3)
    residual = normal(3, shape, act_dtype)
    return x, gamma, beta, residual


DTYPES = [(F32, F32), (BF16, BF16), (BF16, F32)]  # (activations, params): f32 params with bf16 activations too
SHAPES = [(2, 5, 16), (1, 1, 33), (3, 7, 33)]


@pytest.mark.parametrize("act_dtype, param_dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_matches_reference(shape, act_dtype, param_dtype):
    x, gamma, beta, _ = _inputs(shape, act_dtype, param_dtype)
    y, _ = check_vjp(
        lambda x, g, b: layer_norm(x, g, b, eps=EPS),
        lambda x, g, b: reference_layer_norm(x, g, b),
        (x, gamma, beta),
        act_dtype,
    )
    assert y.dtype == act_dtype and y.shape == shape


@pytest.mark.parametrize("act_dtype, param_dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_residual_layer_norm_matches_reference(shape, act_dtype, param_dtype):
    """Returns (LN(x + r), x + r); the sum's cotangent flows into both x and r."""
    x, gamma, beta, residual = _inputs(shape, act_dtype, param_dtype)
    (y, total), _ = check_vjp(
        lambda x, r, g, b: layer_norm(x, g, b, eps=EPS, residual=r),
        lambda x, r, g, b: (reference_layer_norm(x + r, g, b), x + r),
        (x, residual, gamma, beta),
        act_dtype,
    )
    assert y.dtype == total.dtype == act_dtype


@pytest.mark.parametrize("act_dtype, param_dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_returning_its_input_adds_both_cotangents(shape, act_dtype, param_dtype):
    """Returns (LN(x), x); x's gradient is the LayerNorm path's plus the passed-through copy's cotangent."""
    x, gamma, beta, _ = _inputs(shape, act_dtype, param_dtype)
    (y, same), _ = check_vjp(
        lambda x, g, b: layer_norm(x, g, b, eps=EPS, return_input=True),
        lambda x, g, b: (reference_layer_norm(x, g, b), x),
        (x, gamma, beta),
        act_dtype,
    )
    np.testing.assert_array_equal(np.asarray(same), np.asarray(x))
    assert y.dtype == act_dtype


@pytest.mark.parametrize("rate", [0.0, 0.3])
@pytest.mark.parametrize("act_dtype, param_dtype", DTYPES)
def test_bias_dropout_residual_form_is_the_two_ops_to_the_bit(act_dtype, param_dtype, rate):
    """(LN(s), s) with s = residual + dropout(x + bias): outputs and the gradients of x, bias, residual, gamma and
    beta equal bias_dropout_residual then layer_norm(return_input=True) exactly, both outputs' cotangents used."""
    x, gamma, beta, residual = _inputs((3, 7, 40), act_dtype, param_dtype)
    bias = normal(4, (40,), param_dtype)
    seed = seed_array(5) if rate else None

    def fused(x, b, r, g, be):
        return layer_norm(x, g, be, eps=EPS, residual=r, bias=b, dropout_rate=rate, seed=seed)

    def composed(x, b, r, g, be):
        s = bias_dropout_residual(x, b, r, dropout_rate=rate, seed=seed)
        return layer_norm(s, g, be, eps=EPS, return_input=True)

    primals = (x, bias, residual, gamma, beta)
    cotangent = random_cotangent(6, composed(*primals))
    got, want = apply_vjp(jax.jit(fused), primals, cotangent), apply_vjp(jax.jit(composed), primals, cotangent)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    (_, s), (dx, *_) = got
    if rate:  # dropped elements of x + bias leave s = residual and get no gradient
        dropped = np.asarray(dx) == 0
        assert 0.15 < dropped.mean() < 0.45
        np.testing.assert_array_equal(np.asarray(s)[dropped], np.asarray(residual)[dropped])


def test_dropout_without_a_bias_adds_none():
    x, gamma, beta, residual = _inputs((4, 16), F32, F32)
    seed = seed_array(1)
    _, s = layer_norm(x, gamma, beta, residual=residual, dropout_rate=0.2, seed=seed)
    expected = bias_dropout_residual(x, jnp.zeros(16, F32), residual, dropout_rate=0.2, seed=seed)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(expected))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(bias=jnp.ones(8, F32)), "bias and dropout_rate need a residual"),
        (dict(dropout_rate=0.1, seed=seed_array(0)), "bias and dropout_rate need a residual"),
        (dict(residual=jnp.ones((2, 3, 8), F32), bias=jnp.ones(6, F32)), r"bias must have shape \(8,\)"),
        (dict(residual=jnp.ones((2, 3, 8), BF16), bias=jnp.ones(8, BF16)), "residual has dtype bfloat16"),
        (dict(residual=jnp.ones((2, 3, 8), F32), dropout_rate=0.1), "dropout_rate > 0 needs a seed"),
        (dict(residual=jnp.ones((2, 3, 8), F32), bias=jnp.ones(8, F32), dropout_rate=1.0), r"in \[0, 1\)"),
    ],
)
def test_bad_bias_dropout_residual_arguments_raise(kwargs, message):
    x, gamma, beta, _ = _inputs((2, 3, 8), F32, F32)
    with pytest.raises(ValueError, match=message):
        layer_norm(x, gamma, beta, **kwargs)


def test_bias_of_another_dtype_than_gamma_is_rejected():
    x, _, _, residual = _inputs((2, 3, 8), BF16, BF16)
    gamma, beta = jnp.ones(8, BF16), jnp.zeros(8, BF16)
    with pytest.raises(ValueError, match="bias has dtype float32 but gamma has bfloat16"):
        layer_norm(x, gamma, beta, residual=residual, bias=jnp.ones(8, F32))


def test_return_input_with_a_residual_is_rejected():
    x, gamma, beta, residual = _inputs((2, 3, 8), F32, F32)
    with pytest.raises(ValueError, match="return_input applies without a residual"):
        layer_norm(x, gamma, beta, residual=residual, return_input=True)


def test_hidden_above_kernel_limit_runs():
    """8193 > the kernels' 8192 limit: not an error, the XLA implementation runs."""
    x, gamma, beta, _ = _inputs((2, 8193), F32, F32)
    check_vjp(
        lambda x, g, b: layer_norm(x, g, b),
        lambda x, g, b: reference_layer_norm(x, g, b),
        (x, gamma, beta),
        F32,
    )


def test_constant_rows_normalize_to_beta():
    """Zero variance: rstd = 1/sqrt(eps) stays finite and the output is exactly beta."""
    x = jnp.full((3, 8), 4.0, F32)
    gamma, beta = jnp.ones(8, F32), jnp.arange(8, dtype=F32)
    np.testing.assert_array_equal(layer_norm(x, gamma, beta), jnp.broadcast_to(beta, (3, 8)))


def test_eps_is_used():
    x, gamma, beta, _ = _inputs((4, 6), F32, F32)
    assert_close(layer_norm(x, gamma, beta, eps=0.5), reference_layer_norm(x, gamma, beta, eps=0.5), F32)


def _valid():
    x, gamma, beta, residual = _inputs((2, 3, 8), F32, F32)
    return dict(x=x, gamma=gamma, beta=beta, residual=residual)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(x=jnp.ones((2, 8), jnp.int32)), "x must be float32, bfloat16 or float16, got int32"),
        (dict(x=np.ones((2, 8), np.float64)), "x must be float32, bfloat16 or float16, got float64"),
        (dict(gamma=jnp.ones(7, F32)), r"gamma must have shape \(8,\), got \(7,\)"),
        (dict(beta=jnp.ones((1, 8), F32)), r"beta must have shape \(8,\)"),
        (dict(gamma=jnp.ones(8, jnp.float16)), "gamma must be float32, got float16"),
        (
            dict(x=jnp.ones((2, 3, 8), BF16), residual=jnp.ones((2, 3, 8), BF16), gamma=jnp.ones(8, BF16)),
            "beta has dtype float32 but gamma has bfloat16",
        ),
        (dict(residual=jnp.ones((2, 8), F32)), r"residual has shape \(2, 8\) but x has \(2, 3, 8\)"),
        (dict(residual=jnp.ones((2, 3, 8), BF16)), "residual has dtype bfloat16 but x has float32"),
        (dict(eps=0.0), "eps must be positive"),
    ],
)
def test_bad_inputs_raise_value_error(change, message):
    args = _valid() | change
    eps = args.pop("eps", EPS)
    with pytest.raises(ValueError, match=message):
        layer_norm(args["x"], args["gamma"], args["beta"], eps=eps, residual=args["residual"])


def test_rank_zero_input_is_rejected():
    with pytest.raises(ValueError, match="rank >= 1"):
        layer_norm(jnp.float32(1.0), jnp.ones(()), jnp.ones(()))
