"""GPU: the dropout, bias_dropout_residual and bias_act_dropout kernels against their XLA implementations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.kernels import assert_backends_agree, keep_rate_bounds, kernel_targets, on_backend, value_and_grads
from helpers.ops import normal, random_cotangent, seed_array

from ls_jax import ops

pytestmark = pytest.mark.gpu

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16

# Odd and aligned widths, a single row, a 3-D tensor, and enough rows that every backward block visits several.
ELEMENTWISE_SHAPES = [(1,), (33,), (1000,), (1023,), (4097,), (8192,), (1, 1024), (3, 5, 7), (64, 4097)]
ROW_SHAPES = [(3, 1), (3, 33), (1, 1000), (5, 1023), (4, 4097), (2, 8192), (2, 3, 64), (4096, 1024)]
# (activation dtype, parameter dtype)
DTYPES = [(F32, F32), (BF16, BF16), (BF16, F32), (F16, F16), (F16, F32)]


def _inputs(shapes, dtype, offset=0):
    return [normal(offset + i, shape, dtype) for i, shape in enumerate(shapes)]


def _zero_pattern_equal(a, b):
    np.testing.assert_array_equal(np.asarray(a == 0), np.asarray(b == 0))


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_dropout_matches_xla_and_drops_the_same_elements(dtype):
    def run(xs, cotangents, seed):
        op = lambda x: ops.dropout(x, rate=0.1, seed=seed)
        return [value_and_grads(op)((x,), ct) for x, ct in zip(xs, cotangents)]

    args = (_inputs(ELEMENTWISE_SHAPES, dtype), _inputs(ELEMENTWISE_SHAPES, dtype, 100), seed_array(0))
    assert kernel_targets(run, *args) == {"ls_dropout"}
    got, want = on_backend("ffi", run, *args), on_backend("xla", run, *args)
    assert_backends_agree(got, want, dtype, "dropout")
    for (y_ffi, (dx_ffi,)), (y_xla, (dx_xla,)) in zip(got, want):
        _zero_pattern_equal(y_ffi, y_xla)
        _zero_pattern_equal(dx_ffi, dx_xla)


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_dropout_keep_rate_scale_and_seed(rate):
    x = jnp.ones((1 << 20,), F32)
    run = lambda x, seed: ops.dropout(x, rate=rate, seed=seed)
    first = np.asarray(on_backend("ffi", run, x, seed_array(1)))
    again = np.asarray(on_backend("ffi", run, x, seed_array(1)))
    other = np.asarray(on_backend("ffi", run, x, seed_array(2)))
    low, high = keep_rate_bounds(rate, x.size)
    assert low <= np.mean(first != 0) <= high
    assert set(np.unique(first).tolist()) == {0.0, float(np.float32(1.0 / (1.0 - rate)))}
    np.testing.assert_array_equal(first, again)
    assert np.mean(first != other) > rate * (1.0 - rate)


@pytest.mark.parametrize(
    "dtype, param_dtype, rate", [(*dtypes, 0.1) for dtypes in DTYPES] + [(F32, F32, 0.0), (BF16, F32, 0.0)]
)
def test_bias_dropout_residual_matches_xla(dtype, param_dtype, rate):
    def run(xs, biases, residuals, cotangents, seed):
        op = lambda x, b, r: ops.bias_dropout_residual(x, b, r, dropout_rate=rate, seed=seed)
        return [value_and_grads(op)(p, ct) for p, ct in zip(zip(xs, biases, residuals), cotangents)]

    args = (
        _inputs(ROW_SHAPES, dtype),
        _inputs([shape[-1:] for shape in ROW_SHAPES], param_dtype, 100),
        _inputs(ROW_SHAPES, dtype, 200),
        _inputs(ROW_SHAPES, dtype, 300),
        seed_array(3),
    )
    assert kernel_targets(run, *args) == {"ls_bias_dropout_residual_fwd", "ls_bias_dropout_residual_bwd"}
    got, want = on_backend("ffi", run, *args), on_backend("xla", run, *args)
    assert_backends_agree(got, want, dtype, "bias_dropout_residual")
    for (_, (dx_ffi, _, _)), (_, (dx_xla, _, _)) in zip(got, want):
        _zero_pattern_equal(dx_ffi, dx_xla)


_ACTIVATION_CASES = [
    (activation, dtype, param_dtype, rate)
    for activation in ops.ACTIVATIONS
    for dtype, param_dtype, rate in [(F32, F32, 0.1), (BF16, F32, 0.1)]
] + [("gelu", BF16, BF16, 0.0), ("relu", F16, F32, 0.1), ("gelu_tanh", F16, F16, 0.0)]


@pytest.mark.parametrize("activation, dtype, param_dtype, rate", _ACTIVATION_CASES)
def test_bias_act_dropout_matches_xla(activation, dtype, param_dtype, rate):
    def run(xs, biases, cotangents, seed):
        op = lambda x, b: ops.bias_act_dropout(x, b, activation=activation, dropout_rate=rate, seed=seed)
        return [value_and_grads(op)(p, ct) for p, ct in zip(zip(xs, biases), cotangents)]

    args = (
        _inputs(ROW_SHAPES, dtype),
        _inputs([shape[-1:] for shape in ROW_SHAPES], param_dtype, 100),
        _inputs(ROW_SHAPES, dtype, 300),
        seed_array(4),
    )
    kind = "relu" if activation == "relu" else "act"
    assert kernel_targets(run, *args) == {f"ls_bias_{kind}_dropout_fwd", f"ls_bias_{kind}_dropout_bwd"}
    got, want = on_backend("ffi", run, *args), on_backend("xla", run, *args)
    assert_backends_agree(got, want, dtype, f"bias_act_dropout[{activation}]")


# Per dtype, an f32 x + b that is positive but rounds to zero when y is stored (below half the smallest subnormal).
_ROUNDS_TO_ZERO = {F32: None, BF16: 2.0**-136, F16: 2.0**-27}


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_relu_saves_the_packed_sign_of_its_output(dtype):
    """The relu forward kernel's residual is one bit per element, y > 0 packed as numpy's packbits (bitorder
    little, zero padding bits): written by the forward kernel's threads for 16-bit rows of whole vectors, by a
    packing kernel otherwise (f32, odd widths). Every fifth column's x + b is positive in f32 but rounds to zero in
    the 16-bit dtypes: its bit is 0 there, like y."""

    def saved_mask(x, bias, seed):
        y, vjp = jax.vjp(lambda x: ops.bias_act_dropout(x, bias, activation="relu", dropout_rate=0.1, seed=seed), x)
        (mask,) = [leaf for leaf in jax.tree.leaves(vjp) if leaf.dtype == jnp.uint8]
        return y, mask

    for index, shape in enumerate(ROW_SHAPES):
        x = normal(index, shape, dtype)
        bias = normal(100 + index, shape[-1:], F32)
        if _ROUNDS_TO_ZERO[dtype] is not None:
            x = x.at[..., ::5].set(0)
            bias = bias.at[::5].set(_ROUNDS_TO_ZERO[dtype])
        args = (x, bias, seed_array(index))
        assert kernel_targets(saved_mask, *args) == {"ls_bias_relu_dropout_fwd"}
        y, mask = on_backend("ffi", saved_mask, *args)
        expected = np.packbits(np.asarray(y.astype(F32)) > 0, axis=-1, bitorder="little")
        assert mask.shape == expected.shape, shape
        np.testing.assert_array_equal(np.asarray(mask), expected, err_msg=str(shape))
        if _ROUNDS_TO_ZERO[dtype] is not None:
            assert not np.any(np.asarray(y)[..., ::5]), shape


def test_relu_backward_rejects_a_mask_of_the_wrong_shape():
    dy = normal(0, (4, 64), BF16)
    outputs = (
        jax.ShapeDtypeStruct(dy.shape, BF16),
        jax.ShapeDtypeStruct((64,), F32),
        jax.ShapeDtypeStruct((8, 1, 64), F32),
    )
    call = jax.ffi.ffi_call("ls_bias_relu_dropout_bwd", outputs)
    backward = jax.jit(lambda dy, mask: call(dy, mask, scale=np.float32(1.0)))
    message = r"relu mask of an activation of shape \(4, 64\) must have shape \(4, 8\) .* got \(4, 64\)"
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        jax.block_until_ready(backward(dy, jnp.zeros((4, 64), jnp.uint8)))


def test_bias_gradient_is_deterministic():
    x = normal(0, (4096, 1024), BF16)
    bias = normal(1, (1024,), F32)
    cotangent = random_cotangent(2, x)
    seed = seed_array(5)
    run = value_and_grads(lambda x, b: ops.bias_act_dropout(x, b, activation="gelu", dropout_rate=0.1, seed=seed))
    first = on_backend("ffi", run, (x, bias), cotangent)
    second = on_backend("ffi", run, (x, bias), cotangent)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_xla_path_on_gpu_rounds_its_bf16_outputs_like_on_cpu():
    """XLA on GPU may skip the rounding between an op's f32 arithmetic and an f32 consumer (excess precision);
    the XLA implementations' 16-bit outputs are stored rounded, so a consumer sees the values a CPU computes."""
    x, residual = normal(0, (512, 1024), BF16), normal(1, (512, 1024), BF16)
    bias = normal(2, (1024,), F32)

    def scaled_sum(x, bias, residual):
        return ops.bias_dropout_residual(x, bias, residual).astype(F32) * 3.0

    gpu = on_backend("xla", scaled_sum, x, bias, residual)
    cpu = jax.jit(scaled_sum)(*jax.device_put((x, bias, residual), jax.devices("cpu")[0]))
    unrounded = (x.astype(F32) + bias + residual.astype(F32)) * 3.0
    assert np.mean(np.asarray(cpu) != np.asarray(unrounded)) > 0.5
    np.testing.assert_array_equal(np.asarray(gpu), np.asarray(cpu))
