"""GPU: the LayerNorm kernels (plain, with the fused residual add, and with bias + dropout + residual before it)
against the XLA implementation."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.kernels import assert_backends_agree, kernel_targets, on_backend, relative_error, value_and_grads
from helpers.ops import normal, random_cotangent, seed_array

from ls_jax import ops
from ls_jax.ops import _common
from ls_jax.ops.layer_norm import MAX_KERNEL_HIDDEN

pytestmark = pytest.mark.gpu

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16

# Hidden sizes 1 .. 8192 (vector and scalar paths), a single row, a 3-D input, and many rows per backward block.
SHAPES = [(4, 1), (3, 33), (2, 1000), (5, 1023), (2, 4097), (3, 8192), (1, 1024), (2, 3, 64), (4096, 1024)]
DTYPES = [(F32, F32), (BF16, BF16), (BF16, F32), (F16, F16), (F16, F32)]


def _params(seed, hidden, dtype):
    gamma = 1.0 + 0.1 * normal(seed, (hidden,), F32)
    return gamma.astype(dtype), (0.1 * normal(seed + 1, (hidden,), F32)).astype(dtype)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype, param_dtype", DTYPES)
def test_layer_norm_matches_xla(dtype, param_dtype, with_residual):
    def run(primal_sets, cotangents):
        if with_residual:
            op = lambda x, r, g, b: ops.layer_norm(x, g, b, residual=r)
        else:
            op = lambda x, g, b: ops.layer_norm(x, g, b)
        return [value_and_grads(op)(p, ct) for p, ct in zip(primal_sets, cotangents)]

    primal_sets, cotangents = [], []
    for i, shape in enumerate(SHAPES):
        x = normal(i, shape, dtype, scale=3.0) + 0.5
        residual = (normal(50 + i, shape, dtype),) if with_residual else ()
        primal_sets.append((x, *residual, *_params(100 + 2 * i, shape[-1], param_dtype)))
        outputs = (x, x) if with_residual else x
        cotangents.append(random_cotangent(200 + i, outputs))

    prefix = "ls_layer_norm_add" if with_residual else "ls_layer_norm"
    targets = {f"{prefix}_fwd", f"{prefix}_bwd"}
    assert kernel_targets(run, primal_sets, cotangents) == targets
    got, want = on_backend("ffi", run, primal_sets, cotangents), on_backend("xla", run, primal_sets, cotangents)
    for shape, got_case, want_case in zip(SHAPES, got, want):
        assert_backends_agree(got_case, want_case, dtype, f"layer_norm{shape}")


# dbias from f32 column sums added in another order than bias_dropout_residual's kernel adds them: a last-bit
# difference of the f32 sums may round a 16-bit element one unit the other way.
DBIAS_TOLERANCE = {jnp.dtype(F32): 1e-5, jnp.dtype(BF16): 2.0**-7, jnp.dtype(F16): 2.0**-10}

# Vector and scalar paths, one and many rows per backward block, 1024-thread row groups (4097, 8192).
BDR_SHAPES = [(3, 33), (2, 1000), (4096, 1024), (2, 3, 512), (2, 4097), (3, 8192)]


def _bdr_case(index, shape, dtype, param_dtype):
    """Primals (x, bias, residual, gamma, beta) and a cotangent of both outputs (y, s)."""
    x = normal(index, shape, dtype, scale=2.0)
    bias = (0.5 * normal(300 + index, shape[-1:], F32)).astype(param_dtype)
    primals = (x, bias, normal(50 + index, shape, dtype), *_params(100 + 2 * index, shape[-1], param_dtype))
    return primals, random_cotangent(200 + index, (x, x))


@pytest.mark.parametrize("rate", [0.0, 0.1])
@pytest.mark.parametrize("dtype, param_dtype", DTYPES)
def test_bias_dropout_residual_layer_norm_matches_xla_and_the_two_kernels(dtype, param_dtype, rate):
    """The fused kernels against XLA (tolerance), and against bias_dropout_residual's kernels then the
    LayerNorm kernels: y, s, dx, dresidual, dgamma and dbeta to the bit; dbias within one unit of its dtype."""
    seed = seed_array(7)
    fused = lambda x, b, r, g, be: ops.layer_norm(x, g, be, residual=r, bias=b, dropout_rate=rate, seed=seed)

    def composed(x, b, r, g, be):
        s = ops.bias_dropout_residual(x, b, r, dropout_rate=rate, seed=seed)
        return ops.layer_norm(s, g, be, return_input=True)

    cases = [_bdr_case(i, shape, dtype, param_dtype) for i, shape in enumerate(BDR_SHAPES)]
    run = lambda op: lambda cases: [value_and_grads(op)(primals, ct) for primals, ct in cases]
    assert kernel_targets(run(fused), cases) == {
        "ls_bias_dropout_residual_layer_norm_fwd",
        "ls_bias_dropout_residual_layer_norm_bwd",
    }
    got, two_ops = on_backend("ffi", run(fused), cases), on_backend("ffi", run(composed), cases)
    want = on_backend("xla", run(fused), cases)
    for shape, got_case, two_ops_case, want_case in zip(BDR_SHAPES, got, two_ops, want):
        assert_backends_agree(got_case, want_case, dtype, f"bdr_layer_norm{shape}")
        (y, s), (dx, dbias, dresidual, dgamma, dbeta) = got_case
        (y2, s2), (dx2, dbias2, dresidual2, dgamma2, dbeta2) = two_ops_case
        for a, b in [(y, y2), (s, s2), (dx, dx2), (dresidual, dresidual2), (dgamma, dgamma2), (dbeta, dbeta2)]:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{shape}")
        assert relative_error(dbias, dbias2) <= DBIAS_TOLERANCE[jnp.dtype(param_dtype)], shape


def test_layer_norm_statistics_of_a_large_offset_row():
    # A mean of 1000 with unit spread: one-pass sum-of-squares statistics would lose the variance to
    # cancellation (errors of order 1e-1). Both backends round the f32 mean in their own summation order
    # (about 1e-4 absolute here), so the kernel is held to a float64 reference, not to XLA's rounding.
    x = 1000.0 + normal(0, (8, 4096), F32)
    gamma, beta = _params(1, 4096, F32)
    run = lambda x, g, b: ops.layer_norm(x, g, b)
    x64 = np.asarray(x, np.float64)
    centered = x64 - x64.mean(axis=-1, keepdims=True)
    xhat = centered / np.sqrt((centered**2).mean(axis=-1, keepdims=True) + 1e-5)
    expected = xhat * np.asarray(gamma, np.float64) + np.asarray(beta, np.float64)
    assert relative_error(on_backend("ffi", run, x, gamma, beta), expected) <= 1e-4


def test_layer_norm_backward_is_deterministic():
    x = normal(0, (4096, 1024), BF16)
    gamma, beta = _params(1, 1024, F32)
    cotangent = random_cotangent(2, x)
    run = value_and_grads(lambda x, g, b: ops.layer_norm(x, g, b))
    first = on_backend("ffi", run, (x, gamma, beta), cotangent)
    second = on_backend("ffi", run, (x, gamma, beta), cotangent)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_hidden_above_the_kernel_limit_runs_xla_and_logs_once(caplog):
    hidden = MAX_KERNEL_HIDDEN + 1
    x = normal(0, (2, hidden), F32)
    gamma, beta = _params(1, hidden, F32)
    run = lambda x, g, b: ops.layer_norm(x, g, b)
    _common.log_fallback_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="ls_jax.ops"):
        assert kernel_targets(run, x, gamma, beta) == set()
        got = on_backend("ffi", run, x, gamma, beta)
    messages = [r.getMessage() for r in caplog.records if str(hidden) in r.getMessage()]
    assert len(messages) == 1 and "kernel limit" in messages[0]
    assert_backends_agree(got, on_backend("xla", run, x, gamma, beta), F32)
