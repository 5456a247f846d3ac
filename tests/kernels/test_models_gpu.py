"""GPU: whole models on the CUDA kernels (mode "ffi") against the same models on XLA, with dropout on.

Both backends draw the same Philox dropout masks from the same seed, so a training step (loss and every
parameter gradient) must agree up to arithmetic differences; decoding must produce the same tokens.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.kernels import kernel_targets, on_backend, relative_error

from ls_jax import backend
from ls_jax.layers import CrossEntropyCriterion, LayerConfig
from ls_jax.models import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    BertConfig,
    BertForSequenceClassification,
    GPTConfig,
    GPTLMHeadModel,
    Transformer,
    TransformerConfig,
)
from ls_jax.models.decoding import beam_search, greedy_decode

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

VOCAB = 96
# Relative error (max |ffi - xla| / max |xla| per leaf) allowed after a whole forward and backward pass.
TOLERANCE = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 5e-2}
# In bf16 the two backends round in different places, and a whole training step amplifies that (a ReLU input
# rounded across zero flips its gradient): XLA's own bf16 step differs from its f32 step by up to ~0.25 on
# some leaves. So a bf16 step is judged against the f32 step, by each leaf's RMS error relative to the leaf's
# RMS: the kernels may be at most this much further from it than XLA's bf16 step is. (The largest element's
# error, one flipped ReLU gradient, exceeded this bound for some dropout keys with either backend's masks.)
BF16_EXCESS_ERROR = 2.0, 2e-2
BF16_DROPOUT_KEYS = (3, 4, 5)


def assert_close(ffi_tree, xla_tree, dtype, label):
    ffi_leaves, xla_leaves = jax.tree.leaves(ffi_tree), jax.tree.leaves(xla_tree)
    assert len(ffi_leaves) == len(xla_leaves)
    for index, (got, want) in enumerate(zip(ffi_leaves, xla_leaves)):
        assert np.all(np.isfinite(np.asarray(got, np.float32))), f"{label} leaf {index}: non-finite"
        error = relative_error(got, want)
        assert error <= TOLERANCE[jnp.dtype(dtype)], f"{label} leaf {index}: relative error {error:.3g}"


def padded_tokens(seed, lengths, width):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(4, VOCAB, (len(lengths), width))
    tokens[np.arange(width)[None, :] >= np.asarray(lengths)[:, None]] = PAD_ID
    return jnp.asarray(tokens, jnp.int32)


def teacher_forcing(seed, lengths, width):
    """[BOS] + target and target + [EOS], PAD-padded to ``width``, for targets of the given lengths."""
    target = padded_tokens(seed, lengths, width - 1)
    tgt_in = jnp.concatenate([jnp.full((len(lengths), 1), BOS_ID, jnp.int32), target], axis=1)
    labels = jnp.concatenate([target, jnp.full((len(lengths), 1), PAD_ID, jnp.int32)], axis=1)
    return tgt_in, labels.at[jnp.arange(len(lengths)), jnp.asarray(lengths)].set(EOS_ID)


def compare_training_step(params, loss_fn, dtype, label):
    """Loss and gradients of ``loss_fn(params, rng)`` on both backends; the ffi lowering must call kernels."""
    step = jax.value_and_grad(loss_fn)
    rng = jax.random.key(3)
    assert kernel_targets(step, params, rng), f"{label}: no ls_* kernel in the ffi lowering"
    assert_close(on_backend("ffi", step, params, rng), on_backend("xla", step, params, rng), dtype, label)


def transformer_loss(dtype, pre_layer_norm):
    """(params, loss_fn) of a tiny Transformer computing in ``dtype``; the params do not depend on it."""
    config = TransformerConfig.preset("transformer-tiny", VOCAB, dtype=dtype, pre_layer_norm=pre_layer_norm)
    model = Transformer(config)
    src = padded_tokens(0, [20, 13, 7, 1], 24)
    tgt_in, labels = teacher_forcing(1, [17, 9, 12, 3], 18)
    params = jax.jit(model.init)(jax.random.key(0), src, tgt_in)["params"]
    criterion = CrossEntropyCriterion(epsilon=0.1, padding_idx=PAD_ID)

    def loss_fn(params, rng):
        logits = model.apply({"params": params}, src, tgt_in, deterministic=False, rngs={"dropout": rng})
        loss, _, tokens = criterion(logits, labels)
        return loss / tokens

    return params, loss_fn


@pytest.mark.parametrize("pre_layer_norm", [True, False])
def test_transformer_training_step_float32(pre_layer_norm):
    params, loss_fn = transformer_loss(jnp.float32, pre_layer_norm)
    compare_training_step(params, loss_fn, jnp.float32, f"transformer float32 pre_ln={pre_layer_norm}")


def rms_relative_error(actual: jax.Array, expected: jax.Array) -> float:
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    scale = np.sqrt(np.mean(expected**2))
    difference = np.sqrt(np.mean((actual - expected) ** 2))
    return float(difference / scale) if scale > 0 else float(difference)


@pytest.mark.parametrize("pre_layer_norm", [True, False])
def test_transformer_training_step_bfloat16_is_no_noisier_than_xla(pre_layer_norm):
    params, loss_fn = transformer_loss(jnp.bfloat16, pre_layer_norm)
    _, reference_loss_fn = transformer_loss(jnp.float32, pre_layer_norm)
    step = jax.value_and_grad(loss_fn)
    assert kernel_targets(step, params, jax.random.key(3)), "no ls_* kernel in the ffi lowering"
    steps = {}
    for mode, fn in (("ffi", step), ("xla", step), ("reference", jax.value_and_grad(reference_loss_fn))):
        with backend.use("xla" if mode == "reference" else mode):
            steps[mode] = jax.jit(fn).lower(params, jax.random.key(0)).compile()
    factor, slack = BF16_EXCESS_ERROR
    for key in BF16_DROPOUT_KEYS:
        ffi, xla, reference = (steps[mode](params, jax.random.key(key)) for mode in ("ffi", "xla", "reference"))
        flat = jax.tree_util.tree_flatten_with_path(reference)[0]
        for (path, want), got, xla_got in zip(flat, jax.tree.leaves(ffi), jax.tree.leaves(xla)):
            label = f"key {key} {jax.tree_util.keystr(path)}"
            assert np.all(np.isfinite(np.asarray(got, np.float32))), f"{label}: non-finite"
            ffi_error, xla_error = rms_relative_error(got, want), rms_relative_error(xla_got, want)
            assert ffi_error <= factor * xla_error + slack, (
                f"{label}: ffi {ffi_error:.3g} vs xla {xla_error:.3g} from f32"
            )


def test_decoding_produces_the_same_tokens():
    config = TransformerConfig.preset("transformer-tiny", VOCAB, dtype=jnp.float32)
    model = Transformer(config)
    src = padded_tokens(2, [20, 13, 7, 1], 24)
    params = jax.jit(model.init)(jax.random.key(0), src, src)["params"]
    outputs = {}
    for mode in ("xla", "ffi"):
        with backend.use(mode):
            jax.clear_caches()
            outputs[mode] = (
                np.asarray(greedy_decode(model, {"params": params}, src, max_len=32)),
                np.asarray(beam_search(model, {"params": params}, src, beam_size=4, max_len=32)),
            )
    jax.clear_caches()
    for ffi, xla in zip(outputs["ffi"], outputs["xla"]):
        np.testing.assert_array_equal(ffi, xla)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bert_and_gpt2_training_steps(dtype):
    input_ids = padded_tokens(4, [30, 17, 64], 64)
    attention_mask = (input_ids != PAD_ID).astype(jnp.int32)

    bert_layer = LayerConfig.preset("bert-base", hidden_size=256, intermediate_size=1024, nhead=4, dtype=dtype)
    bert = BertForSequenceClassification(BertConfig(layer=bert_layer, vocab_size=VOCAB, num_layers=2, num_labels=3))
    bert_params = jax.jit(bert.init)(jax.random.key(0), input_ids, attention_mask)["params"]
    classes = jnp.array([0, 2, 1])

    def bert_loss(params, rng):
        logits = bert.apply({"params": params}, input_ids, attention_mask, deterministic=False, rngs={"dropout": rng})
        return jnp.mean(-jax.nn.log_softmax(logits.astype(jnp.float32))[jnp.arange(3), classes])

    compare_training_step(bert_params, bert_loss, dtype, f"bert {jnp.dtype(dtype)}")

    gpt_layer = LayerConfig.preset("gpt2-small", hidden_size=256, intermediate_size=1024, nhead=4, dtype=dtype)
    gpt = GPTLMHeadModel(GPTConfig(layer=gpt_layer, vocab_size=VOCAB, num_layers=2))
    gpt_params = jax.jit(gpt.init)(jax.random.key(0), input_ids, attention_mask)["params"]
    criterion = CrossEntropyCriterion(epsilon=0.0, padding_idx=PAD_ID)

    def gpt_loss(params, rng):
        logits = gpt.apply({"params": params}, input_ids, attention_mask, deterministic=False, rngs={"dropout": rng})
        loss, _, tokens = criterion(logits[:, :-1], input_ids[:, 1:])
        return loss / tokens

    compare_training_step(gpt_params, gpt_loss, dtype, f"gpt2 {jnp.dtype(dtype)}")
