"""GPU: the plain Flax BERT and GPT-2 of the e2e benchmark's "flax_cudnn" rows (cuDNN's fused attention through
``jax.nn.dot_product_attention``) compute what the same model does with XLA's attention, and one benchmarked step
of each BERT-base / GPT-2 small implementation trains (finite, falling loss)."""

import dataclasses

import jax
import numpy as np
import pytest

from train.bench.steps import zoo_steps

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["bert-base", "gpt2-small"])
def test_cudnn_attention_reference_matches_its_xla_attention(name):
    """bf16, no dropout, 512 tokens, 2 of the model's layers (bf16 rounding grows with depth): padding as key
    lengths (BERT rows of 257 to 512 real tokens) or causal."""
    batch = zoo_steps.make_batch(name, 4, 512, seed=3)
    model = zoo_steps.reference_model(name, "cudnn")
    cudnn = type(model)(dataclasses.replace(model.config, num_layers=2))
    xla = type(model)(dataclasses.replace(cudnn.config, attention="xla"))
    params = jax.jit(lambda key: cudnn.init(key, **zoo_steps._init_args(cudnn, batch))["params"])(jax.random.key(0))
    got = np.asarray(jax.jit(lambda p: zoo_steps.reference_apply(cudnn, {"params": p}, batch))(params), np.float32)
    expected = np.asarray(jax.jit(lambda p: zoo_steps.reference_apply(xla, {"params": p}, batch))(params), np.float32)
    scale = np.abs(expected).max()
    assert np.abs(got - expected).max() <= 0.03 * scale


@pytest.mark.slow  # a whole model step per implementation
@pytest.mark.parametrize("implementation", zoo_steps.JAX_IMPLEMENTATIONS)
def test_each_zoo_step_trains(implementation):
    from ls_jax import backend

    batch = zoo_steps.make_batch("bert-base", 8, 128, seed=0)
    with backend.use(zoo_steps.kernel_mode(implementation)):
        step = zoo_steps.build_step(implementation, "bert-base", batch)
        losses = [float(step.run(batch)) for _ in range(8)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
