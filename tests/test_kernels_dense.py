"""GPU: relu_dropout_dense, whose backward GEMM applies relu's mask and sums the bias gradient in its cuBLASLt
epilogue (ls_dense_relu_grad), against its XLA implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ffi_kernels
from ls_jax import ops
from test_kernels_support import assert_backends_agree, kernel_targets, on_backend, value_and_grads
from test_ops_support import normal, random_cotangent, seed_array

pytestmark = pytest.mark.gpu

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
FUSED = {"ls_bias_relu_dropout_fwd", "ls_dense_relu_grad"}
APART = {"ls_bias_relu_dropout_fwd", "ls_bias_relu_dropout_bwd"}


def _run(rate, seed):
    return value_and_grads(lambda x, c, k: ops.relu_dropout_dense(x, c, k, dropout_rate=rate, seed=seed))


def _inputs(x_shape, n, dtype, param_dtype):
    hidden = x_shape[-1]
    x = normal(0, x_shape, dtype)
    primals = (x, normal(1, (hidden,), param_dtype, 0.5), normal(2, (hidden, n), param_dtype, hidden**-0.5))
    return primals, random_cotangent(3, jax.ShapeDtypeStruct((*x_shape[:-1], n), dtype))


@pytest.mark.parametrize("dtype, param_dtype", [(BF16, F32), (BF16, BF16), (F16, F16)])
@pytest.mark.parametrize("rate", [0.0, 0.1])
@pytest.mark.parametrize("x_shape, n", [((4, 64, 1024), 256), ((3, 128), 64), ((2048, 4096), 1024)])
def test_epilogue_gemm_matches_xla(dtype, param_dtype, rate, x_shape, n):
    """dx is zero exactly where the forward's mask is, and dx, the bias and kernel gradients match XLA's: a mask
    read in the wrong bit order or row layout would move the zeros."""
    primals, cotangent = _inputs(x_shape, n, dtype, param_dtype)
    args = (primals, cotangent)
    run = _run(rate, seed_array(4) if rate else None)
    assert kernel_targets(run, *args) == FUSED
    got, want = on_backend("ffi", run, *args), on_backend("xla", run, *args)
    assert_backends_agree(got, want, dtype, f"{x_shape} {rate}")
    (_, (dx_ffi, *_)), (_, (dx_xla, *_)) = got, want
    np.testing.assert_array_equal(np.asarray(dx_ffi == 0), np.asarray(dx_xla == 0))
    assert 0.3 < float(jnp.mean(dx_ffi == 0)) < 0.7


@pytest.mark.parametrize("dtype, hidden", [(F32, 256), (BF16, 96)])
def test_shapes_the_epilogue_does_not_take_run_the_gemm_and_relu_kernel_apart(dtype, hidden):
    primals, cotangent = _inputs((5, 7, hidden), 32, dtype, F32)
    run = _run(0.1, seed_array(5))
    assert kernel_targets(run, primals, cotangent) == APART
    assert_backends_agree(on_backend("ffi", run, primals, cotangent), on_backend("xla", run, primals, cotangent),
                          dtype, f"{dtype} {hidden}")


def test_epilogue_gemm_is_deterministic():
    primals, cotangent = _inputs((8192, 4096), 1024, BF16, BF16)
    run = _run(0.1, seed_array(6))
    first, second = on_backend("ffi", run, primals, cotangent), on_backend("ffi", run, primals, cotangent)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _call_epilogue_gemm(dy, kernel, mask):
    ffi_kernels.load()
    rows, hidden = dy.shape[0], kernel.shape[0]
    outputs = (jax.ShapeDtypeStruct((rows, hidden), dy.dtype), jax.ShapeDtypeStruct((hidden,), dy.dtype),
               jax.ShapeDtypeStruct((1 << 20,), jnp.uint8))
    call = jax.ffi.ffi_call("ls_dense_relu_grad", outputs)
    return jax.block_until_ready(jax.jit(lambda *a: call(*a, scale=np.float32(1.0)))(dy, kernel, mask))


@pytest.mark.parametrize(
    "kernel_shape, mask_shape, message",
    [
        ((256, 64), (4, 16), r"positive must have shape \(4, 32\), got \(4, 16\)"),
        ((96, 64), (4, 12), r"F = 96 must be a multiple of 128"),
        ((256, 32), (4, 32), r"kernel has shape \(256, 32\) but dy has \(4, 64\)"),
    ],
)
def test_epilogue_gemm_rejects_bad_shapes(kernel_shape, mask_shape, message):
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        _call_epilogue_gemm(normal(0, (4, 64), BF16), normal(1, kernel_shape, BF16), jnp.zeros(mask_shape, jnp.uint8))
