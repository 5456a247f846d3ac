"""GPU: the causal-LM loss (packed rows, masked tail) and KV-cache sampling of train.gpt.model on the CUDA kernels
(mode "ffi") against the same functions on XLA."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.kernels import kernel_targets, on_backend, relative_error

from ls_jax.models.gpt import GPTLMHeadModel
from train.gpt import data as gpt_data
from train.gpt import model as gpt_model

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

VOCAB, SEQ_LEN = 96, 64


def model_and_params(dtype, dropout=0.0):
    # head_dim 64: the fused attention kernels' shape, as in GPT-2.
    config = gpt_model.preset_config(
        "gpt2-tiny",
        vocab_size=VOCAB,
        dtype=dtype,
        max_seq_len=SEQ_LEN,
        hidden_size=256,
        intermediate_size=1024,
        nhead=4,
        hidden_dropout_ratio=dropout,
        attn_prob_dropout_ratio=dropout,
    )
    model = GPTLMHeadModel(dataclasses.replace(config, num_layers=2))
    params = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, SEQ_LEN), jnp.int32))["params"]
    return model, params


def packed_batch():
    """Four rows of a packed stream, the last one cut short (its tail masked with IGNORE_LABEL)."""
    rng = np.random.default_rng(0)
    documents = [list(rng.integers(4, VOCAB, size=rng.integers(5, 40))) for _ in range(8)]
    stream = gpt_data.pack(documents, eod_id=2)[: 3 * SEQ_LEN + 20]
    batch = gpt_data.PackedRows(stream, SEQ_LEN, 2).batch(np.arange(4))
    assert (batch["labels"] == gpt_data.IGNORE_LABEL).any()
    return {name: jnp.asarray(value) for name, value in batch.items()}


def loss_and_grads(model, params, batch):
    def loss(params):
        loss_sum, weight, sums = gpt_model.make_loss_fn(model)({"params": params}, batch, jax.random.key(7))
        return loss_sum, (weight, sums["nll"])

    (loss_sum, (weight, nll)), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return loss_sum, weight, nll, grads


def test_lm_loss_and_gradients_agree_between_backends_f32_with_dropout():
    model, params = model_and_params(jnp.float32, dropout=0.1)
    batch = packed_batch()
    step = lambda params: loss_and_grads(model, params, batch)  # noqa: E731
    assert {"ls_cross_entropy_fwd", "ls_cross_entropy_bwd"} <= kernel_targets(step, params)
    ffi, xla = (on_backend(mode, step, params) for mode in ("ffi", "xla"))
    assert int(ffi[1]) == int(xla[1]) == int((batch["labels"] != gpt_data.IGNORE_LABEL).sum())
    assert relative_error(ffi[0], xla[0]) < 1e-4 and float(ffi[2]) == float(ffi[0])
    for (path, got), expected in zip(jax.tree_util.tree_leaves_with_path(ffi[3]), jax.tree.leaves(xla[3])):
        assert relative_error(got, expected) < 1e-4, jax.tree_util.keystr(path)


def test_lm_loss_agrees_between_backends_bf16():
    model, params = model_and_params(jnp.bfloat16)
    batch = packed_batch()
    loss = lambda params: gpt_model.make_loss_fn(model)({"params": params}, batch, jax.random.key(7))[:2]  # noqa: E731
    (ffi_loss, ffi_weight), (xla_loss, xla_weight) = (on_backend(mode, loss, params) for mode in ("ffi", "xla"))
    assert int(ffi_weight) == int(xla_weight) and relative_error(ffi_loss, xla_loss) < 1e-2


def test_kv_cache_sampling_agrees_between_backends():
    model, params = model_and_params(jnp.float32)
    prompt = jnp.asarray([[2, 10, 11, 12], [2, 40, 41, 42]], jnp.int32)
    for temperature in (0.0, 1.0):

        def sample(params):
            return gpt_model.generate(
                model,
                {"params": params},
                prompt,
                max_new_tokens=24,
                rng=jax.random.key(3),
                temperature=temperature,
                top_k=20,
            )

        ffi, xla = (np.asarray(on_backend(mode, sample, params)) for mode in ("ffi", "xla"))
        np.testing.assert_array_equal(ffi, xla)
