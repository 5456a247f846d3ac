"""ls_jax.ops.dense and ls_jax.layers.Dense: the GEMM, its f32 weight gradient, layouts and parameters."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.ops import BF16, F32, check_vjp, normal

from ls_jax import ops
from ls_jax.layers import Dense


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
    # The table gradient sums over tokens: the two layouts may add in another order (1 ulp apart on some CPUs).
    np.testing.assert_allclose(
        np.asarray(tied_vjp(cotangent)[0]), np.asarray(plain_vjp(cotangent)[0]).T, rtol=1e-6, atol=1e-6
    )


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
