"""The dtype data-parallel gradients travel in: the flag when given, bf16 in a bf16 run, else the params'."""

import jax.numpy as jnp
import pytest

from train.costs.precision import gradient_comm_dtype


@pytest.mark.parametrize(
    "choice, precision, expected",
    [
        (None, "bf16", jnp.bfloat16),
        (None, "fp16", None),
        (None, "fp32", None),
        ("fp32", "bf16", jnp.float32),
        ("bf16", "fp32", jnp.bfloat16),
    ],
)
def test_the_flag_wins_else_a_bf16_run_sends_bf16(choice, precision, expected):
    assert gradient_comm_dtype(choice, precision) == expected
