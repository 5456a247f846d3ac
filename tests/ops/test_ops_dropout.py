"""ls_jax.ops dropout, bias_dropout_residual and bias_act_dropout against naive references and their masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.ops import BF16, F32, check_vjp, normal, seed_array

from ls_jax.ops import ACTIVATIONS, bias_act_dropout, bias_dropout_residual, dropout
from ls_jax.ops.random import keep_mask


def reference_dropout(x, keep, rate):
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def reference_activation(z, activation):
    if activation == "relu":
        return jnp.where(z > 0, z, 0.0)
    return jax.nn.gelu(z, approximate=activation == "gelu_tanh")


# (shape, activation dtype, bias dtype, dropout rate): odd hidden sizes, batch 1, f32 bias with bf16 activations.
CASES = [
    ((2, 5, 16), F32, F32, 0.0),
    ((3, 7, 33), F32, F32, 0.25),
    ((1, 1, 33), BF16, BF16, 0.25),
    ((3, 7, 33), BF16, F32, 0.1),
    ((2, 5, 16), BF16, F32, 0.0),
]


def _keep(shape, rate, seed):
    return jnp.ones(shape, bool) if rate == 0.0 else keep_mask(seed, shape, rate)


@pytest.mark.parametrize("shape, dtype, rate", [(shape, dtype, rate) for shape, dtype, _, rate in CASES])
def test_dropout_matches_reference(shape, dtype, rate):
    seed = seed_array(1) if rate else None
    keep = _keep(shape, rate, seed)
    check_vjp(
        lambda x: dropout(x, rate=rate, seed=seed),
        lambda x: reference_dropout(x, keep, rate),
        (normal(0, shape, dtype),),
        dtype,
    )


@pytest.mark.parametrize("shape, dtype, bias_dtype, rate", CASES)
def test_bias_dropout_residual_matches_reference(shape, dtype, bias_dtype, rate):
    seed = seed_array(2) if rate else None
    keep = _keep(shape, rate, seed)
    x, bias, residual = normal(0, shape, dtype), normal(1, shape[-1:], bias_dtype), normal(2, shape, dtype)
    check_vjp(
        lambda x, b, r: bias_dropout_residual(x, b, r, dropout_rate=rate, seed=seed),
        lambda x, b, r: r + reference_dropout(x + b, keep, rate),
        (x, bias, residual),
        dtype,
    )


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape, dtype, bias_dtype, rate", CASES)
def test_bias_act_dropout_matches_reference(shape, dtype, bias_dtype, rate, activation):
    seed = seed_array(3) if rate else None
    keep = _keep(shape, rate, seed)
    x, bias = normal(0, shape, dtype, scale=2.0), normal(1, shape[-1:], bias_dtype)
    check_vjp(
        lambda x, b: bias_act_dropout(x, b, activation=activation, dropout_rate=rate, seed=seed),
        lambda x, b: reference_dropout(reference_activation(x + b, activation), keep, rate),
        (x, bias),
        dtype,
    )


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_relu_backward_keeps_only_a_bit_mask_of_the_output(activation):
    """relu's VJP closes over one bit per element, the packed mask of y > 0 (neither x nor y); the other
    activations keep x."""
    x, bias, seed = normal(0, (4, 21), BF16), normal(1, (21,), F32), seed_array(6)
    y, vjp = jax.vjp(lambda x: bias_act_dropout(x, bias, activation=activation, dropout_rate=0.2, seed=seed), x)
    leaves = [leaf for leaf in jax.tree.leaves(vjp) if hasattr(leaf, "shape")]
    activations = [leaf for leaf in leaves if leaf.shape == x.shape]
    masks = [leaf for leaf in leaves if leaf.dtype == jnp.uint8]
    assert any(jnp.array_equal(leaf, x) for leaf in activations) == (activation != "relu")
    assert not any(jnp.array_equal(leaf, y) for leaf in activations)
    if activation == "relu":
        (mask,) = masks
        assert mask.shape == (4, 3)
        np.testing.assert_array_equal(mask, np.packbits(np.asarray(y) > 0, axis=-1, bitorder="little"))
    else:
        assert masks == []


def test_zero_rate_is_identity():
    x = normal(0, (4, 5))
    assert dropout(x, rate=0.0) is x


def test_keep_rate_within_three_sigma_and_kept_values_scaled():
    rate, size = 0.15, 1 << 20
    y = np.asarray(dropout(jnp.ones((size // 512, 512), F32), rate=rate, seed=seed_array(4)))
    kept = y != 0
    assert abs(kept.sum() - size * (1 - rate)) < 3 * np.sqrt(size * rate * (1 - rate))
    np.testing.assert_array_equal(y[kept], np.float32(1 / (1 - rate)))


def test_same_seed_same_mask_different_seed_different_mask():
    x = normal(0, (16, 64))
    first = dropout(x, rate=0.3, seed=seed_array(5))
    np.testing.assert_array_equal(first, dropout(x, rate=0.3, seed=seed_array(5)))
    differs = np.asarray(first != dropout(x, rate=0.3, seed=seed_array(6)))
    assert differs.mean() > 0.2


@pytest.mark.parametrize(
    "op",
    [
        lambda x, seed: dropout(x, rate=0.4, seed=seed),
        lambda x, seed: bias_dropout_residual(x, jnp.full((40,), 0.5), jnp.zeros_like(x), dropout_rate=0.4, seed=seed),
        lambda x, seed: bias_act_dropout(x, jnp.full((40,), 0.5), activation="gelu", dropout_rate=0.4, seed=seed),
    ],
    ids=["dropout", "bias_dropout_residual", "bias_act_dropout"],
)
def test_backward_uses_the_forward_mask(op):
    """The input gradient is zero exactly where the forward dropped the element."""
    x = jnp.abs(normal(0, (8, 40))) + 0.1  # positive everywhere, so the output is zero only where dropped
    seed = seed_array(7)
    y, vjp = jax.vjp(lambda x: op(x, seed), x)
    (dx,) = vjp(normal(9, x.shape))
    dropped = np.asarray(y == 0)
    assert 0.2 < dropped.mean() < 0.6
    np.testing.assert_array_equal(np.asarray(dx == 0), dropped)


def _valid():
    return dict(x=normal(0, (2, 3, 8)), bias=normal(1, (8,)), residual=normal(2, (2, 3, 8)))


BAD_ELEMENTWISE = [
    (dict(x=jnp.ones((2, 8), jnp.int32)), "x must be float32, bfloat16 or float16, got int32"),
    (dict(x=np.ones((2, 8), np.float64)), "x must be float32, bfloat16 or float16, got float64"),
    (dict(dropout_rate=1.0, seed=seed_array(0)), r"dropout_rate must be in \[0, 1\), got 1.0"),
    (dict(dropout_rate=-0.5, seed=seed_array(0)), r"dropout_rate must be in \[0, 1\)"),
    (dict(dropout_rate=0.1), "dropout_rate > 0 needs a seed"),
    (dict(dropout_rate=0.1, seed=jnp.zeros(2, F32)), r"seed must be a uint32\[2\] array, got float32\[2\]"),
    (dict(dropout_rate=0.1, seed=jnp.zeros((1, 2), jnp.uint32)), r"seed must be a uint32\[2\] array"),
]
BAD_BIAS = [
    (dict(bias=normal(1, (7,))), r"bias must have shape \(8,\), got \(7,\)"),
    (dict(bias=jnp.ones(8, jnp.float16)), "bias must be float32, got float16"),
    (dict(x=jnp.ones((2, 3, 8), BF16), bias=jnp.ones(8, jnp.float16)), "bias must be float32 or bfloat16, got float16"),
]


@pytest.mark.parametrize("change, message", BAD_ELEMENTWISE)
def test_dropout_bad_inputs(change, message):
    args = _valid() | change
    with pytest.raises(ValueError, match=message):
        dropout(args["x"], rate=args.get("dropout_rate", 0.0), seed=args.get("seed"))


@pytest.mark.parametrize(
    "change, message",
    BAD_ELEMENTWISE
    + BAD_BIAS
    + [
        (dict(residual=normal(2, (2, 8))), r"residual has shape \(2, 8\) but x has \(2, 3, 8\)"),
        (dict(residual=jnp.ones((2, 3, 8), BF16)), "residual has dtype bfloat16 but x has float32"),
    ],
)
def test_bias_dropout_residual_bad_inputs(change, message):
    args = _valid() | change
    with pytest.raises(ValueError, match=message):
        bias_dropout_residual(
            args["x"], args["bias"], args["residual"], dropout_rate=args.get("dropout_rate", 0.0), seed=args.get("seed")
        )


@pytest.mark.parametrize(
    "change, message",
    BAD_ELEMENTWISE + BAD_BIAS + [(dict(activation="swish"), "activation must be one of relu, gelu, gelu_tanh")],
)
def test_bias_act_dropout_bad_inputs(change, message):
    args = _valid() | change
    with pytest.raises(ValueError, match=message):
        bias_act_dropout(
            args["x"],
            args["bias"],
            activation=args.get("activation", "relu"),
            dropout_rate=args.get("dropout_rate", 0.0),
            seed=args.get("seed"),
        )
