"""GPU: the FP8 layers (``LayerConfig.fp8``) compile to cuBLAS's FP8 GEMMs on a device that has them (all three
products of a step; at small sizes and with its Triton GEMMs allowed, XLA may pick Triton for the backward's) and
agree with bf16 as closely as on a CPU."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ls_jax.layers import Dense, fp8

pytestmark = pytest.mark.gpu

FP8_GEMM = 'custom_call_target="__cublas$lt$matmul$f8"'  # XLA's cuBLASLt FP8 matrix product


@pytest.fixture(autouse=True)
def _fp8_device():
    device = jax.devices()[0]
    if not fp8.device_has_fp8(device):
        pytest.skip(f"{device.device_kind} has no FP8 GEMMs")


def _dense_and_input():
    """A feed-forward GEMM of transformer-big at 8192 tokens: at small sizes XLA's autotuner may pick its Triton
    GEMM (on upcast operands) over cuBLAS's FP8 one."""
    x = jax.random.normal(jax.random.PRNGKey(0), (8192, 1024), jnp.bfloat16)
    dense = Dense(4096, dtype=jnp.bfloat16, fp8=True)
    return dense, dense.init(jax.random.PRNGKey(1), x), x


def test_the_forward_is_an_fp8_gemm_close_to_bf16():
    dense, variables, x = _dense_and_input()
    forward = jax.jit(dense.apply)
    assert forward.lower(variables, x).compile().as_text().count(FP8_GEMM) == 1
    y = forward(variables, x)
    plain = Dense(4096, dtype=jnp.bfloat16).apply({"params": variables["params"]}, x)
    error = float(np.linalg.norm(np.asarray(y - plain, np.float32)) / np.linalg.norm(np.asarray(plain, np.float32)))
    assert 5e-3 < error < 0.06  # 0.039 on a CPU: e4m3 keeps 3 mantissa bits


def test_a_dense_step_runs_three_fp8_gemms():
    dense, variables, x = _dense_and_input()

    def loss(variables, x):
        return jnp.sum(jnp.square(dense.apply(variables, x).astype(jnp.float32)))

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(variables, x)
    hlo = lowered.compile(fp8.compiler_options("gpu")).as_text()  # as the CLIs compile: cuBLAS only
    assert hlo.count(FP8_GEMM) == 3  # forward, dx, dW (f32 params: dW's product dequantizes in f32)


def test_a_step_that_donates_the_scaling_state_updates_it_in_place():
    """fp8_quantize writes each scale and history over its input: compiled with the state donated, as the training
    CLIs compile their steps, the step copies none of the three scales and histories (it did copy each when the
    kernel wrote them to buffers of their own)."""
    dense, variables, x = _dense_and_input()
    rest, scaling = fp8.split_scaling(variables)

    def step(scaling, rest, x):
        def loss(scaling):
            y = dense.apply(fp8.with_scaling(rest, scaling), x)
            return jnp.sum(jnp.square(y.astype(jnp.float32)))

        return fp8.new_scaling(jax.grad(loss)(scaling))

    lowered = jax.jit(step, donate_argnums=0).lower(scaling, rest, x)
    hlo = lowered.compile(fp8.compiler_options("gpu")).as_text()
    assert hlo.count('custom_call_target="ls_fp8_quantize"') == 3
    assert re.findall(r"= f32\[\d*\]\{0\} copy\(", hlo) == []


@pytest.mark.slow  # a whole model step
def test_the_fp8_transformer_step_multiplies_in_fp8():
    """transformer-big at 8192 target tokens, one layer each side, compiled as the training CLIs compile an FP8
    step (`fp8.compiler_options`: cuBLAS only): each FP8 op's three products (forward, input and kernel
    gradients) are FP8 GEMMs."""
    from ls_jax import backend
    from train.bench.steps import transformer_steps

    batch = transformer_steps.make_batch(128, seed=0)
    with backend.use("ffi"):
        step = transformer_steps.ls_jax_step("big-6e6d", batch, layers_each=1, fp8_gemms=True)
    assert step.compiler_options == fp8.GPU_COMPILER_OPTIONS
    ops = {"/".join(str(k.key) for k in path[:-1]) for path, _ in jax.tree_util.tree_leaves_with_path(step.state[3])}
    assert len(ops) == 4 + 7 + 1  # encoder qkv/out/2 FFN; decoder self qkv/out, cross q/kv/out, 2 FFN; logits
    assert step.compiled.as_text().count(FP8_GEMM) == 3 * len(ops)
