"""GPU: the FP8 layers (``LayerConfig.fp8``) compile to cuBLAS's FP8 GEMMs on a device that has them, in the
forward and in both products of the backward, and agree with bf16 as closely as on a CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ls_jax.layers import Dense, fp8

pytestmark = pytest.mark.gpu

FP8_GEMM = "__cublas$lt$matmul$f8"  # XLA's custom call for a cuBLASLt FP8 matrix product


@pytest.fixture(autouse=True)
def _fp8_device():
    device = jax.devices()[0]
    if not fp8.device_has_fp8(device):
        pytest.skip(f"{device.device_kind} has no FP8 GEMMs")


def test_an_fp8_dense_step_runs_three_fp8_gemms_close_to_bf16():
    x = jax.random.normal(jax.random.PRNGKey(0), (256, 512), jnp.bfloat16)
    dense = Dense(1024, dtype=jnp.bfloat16, fp8=True)
    variables = dense.init(jax.random.PRNGKey(1), x)

    def loss(variables, x):
        return jnp.sum(jnp.square(dense.apply(variables, x).astype(jnp.float32)))

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    hlo = step.lower(variables, x).compile().as_text()
    assert hlo.count(f'custom_call_target="{FP8_GEMM}"') == 3, "forward, dx and dW as FP8 GEMMs"
    y = jax.jit(dense.apply)(variables, x)
    plain = Dense(1024, dtype=jnp.bfloat16).apply({"params": variables["params"]}, x)
    error = float(np.linalg.norm(np.asarray(y - plain, np.float32)) / np.linalg.norm(np.asarray(plain, np.float32)))
    assert 5e-3 < error < 0.06
