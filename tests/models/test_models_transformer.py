"""The encoder-decoder Transformer: configs, KV-cache decoding against the full forward, greedy and beam search
on a model trained to reverse sequences, dropout, and bad inputs."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.layers import random_params
from helpers.ops import jaxpr_output_shapes

from ls_jax.layers import CrossEntropyCriterion
from ls_jax.models import BOS_ID, EOS_ID, PAD_ID, PRESETS, Transformer, TransformerConfig
from ls_jax.models.decoding import beam_search, greedy_decode

VOCAB = 16
MAX_LEN = 8


def tiny_config(**overrides):
    fields = dict(
        dtype=jnp.float32,
        hidden_size=32,
        intermediate_size=64,
        nhead=4,
        max_seq_len=MAX_LEN + 2,
        num_encoder_layers=1,
        num_decoder_layers=2,
        attn_prob_dropout_ratio=0.0,
        activation_dropout_ratio=0.0,
        hidden_dropout_ratio=0.0,
    )
    return TransformerConfig.preset("transformer-tiny", VOCAB, **{**fields, **overrides})


def reversal_batch():
    """Sources of different lengths (PAD-padded) and their reversals as teacher-forcing inputs and labels."""
    sources = [[4, 5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 4, 9], [6, 6, 13]]
    src = np.full((len(sources), 6), PAD_ID, np.int32)
    tgt_in = np.full((len(sources), MAX_LEN), PAD_ID, np.int32)
    labels = np.full((len(sources), MAX_LEN), PAD_ID, np.int32)
    for row, tokens in enumerate(sources):
        target = tokens[::-1]
        src[row, : len(tokens)] = tokens
        tgt_in[row, : len(target) + 1] = [BOS_ID] + target
        labels[row, : len(target) + 1] = target + [EOS_ID]
    return jnp.asarray(src), jnp.asarray(tgt_in), jnp.asarray(labels)


def loss_fn(model, params, src, tgt_in, labels, rng=None):
    rngs = None if rng is None else {"dropout": rng}
    logits = model.apply({"params": params}, src, tgt_in, deterministic=rng is None, rngs=rngs)
    loss, _, count = CrossEntropyCriterion(epsilon=0.1, padding_idx=PAD_ID)(logits, labels)
    return loss / count


@pytest.fixture(scope="module")
def trained():
    """A tiny Transformer trained to reverse ``reversal_batch``: (model, params, src, labels)."""
    model = Transformer(tiny_config())
    src, tgt_in, labels = reversal_batch()
    params = random_params(model, src, tgt_in)
    optimizer = optax.adam(1e-2)

    @jax.jit
    def train(params):
        def step(carry, _):
            params, state = carry
            grads = jax.grad(functools.partial(loss_fn, model))(params, src, tgt_in, labels)
            updates, state = optimizer.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), None

        (params, _), _ = jax.lax.scan(step, (params, optimizer.init(params)), None, length=150)
        return params

    params = train(params)
    logits = jax.jit(model.apply)({"params": params}, src, tgt_in)
    valid = labels != PAD_ID
    assert np.all((jnp.argmax(logits, -1) == labels) | ~valid), "the reversal task did not train"
    return model, params, src, labels


def test_greedy_decoding_reproduces_the_trained_reversal_with_eos_then_pad(trained):
    model, params, src, labels = trained
    output = greedy_decode(model, {"params": params}, src, max_len=MAX_LEN)
    assert output.dtype == jnp.int32 and output.shape == (src.shape[0], MAX_LEN)
    np.testing.assert_array_equal(output, labels)


def test_beam_search_reproduces_the_trained_reversal(trained):
    model, params, src, labels = trained
    np.testing.assert_array_equal(beam_search(model, {"params": params}, src, beam_size=3, max_len=MAX_LEN), labels)


def test_decoding_stops_at_max_len_without_eos(trained):
    model, params, src, labels = trained
    np.testing.assert_array_equal(greedy_decode(model, {"params": params}, src, max_len=3), labels[:, :3])


def test_beam_size_one_equals_greedy(trained):
    model, trained_params, src, _ = trained
    for params in (trained_params, random_params(model, src, src, seed=2), random_params(model, src, src, seed=5)):
        greedy = greedy_decode(model, {"params": params}, src, max_len=MAX_LEN)
        np.testing.assert_array_equal(beam_search(model, {"params": params}, src, beam_size=1, max_len=MAX_LEN), greedy)


def test_decoders_never_emit_pad_or_bos_before_eos(trained):
    model, _, src, _ = trained
    outputs = []
    for seed in (2, 3):
        params = random_params(model, src, src, seed=seed)
        outputs += [greedy_decode(model, {"params": params}, src, max_len=MAX_LEN)]
        outputs += [beam_search(model, {"params": params}, src, beam_size=4, max_len=MAX_LEN)]
    outputs = np.stack(outputs)
    is_eos = outputs == EOS_ID
    before_eos = np.cumsum(is_eos, axis=-1) - is_eos == 0
    assert np.any(is_eos[..., 1:]) and np.any(~is_eos.any(-1)), "cover rows with a later EOS and rows without"
    assert not np.any(np.isin(outputs, [PAD_ID, BOS_ID]) & before_eos)
    np.testing.assert_array_equal(outputs == PAD_ID, ~before_eos & ~is_eos)


@functools.partial(jax.jit, static_argnums=(0, 4))
def incremental_logits(model, params, src, tgt_in, chunk):
    """Logits of ``tgt_in`` fed through the KV cache ``chunk`` tokens per decode call."""
    variables = {"params": params}
    encoded, src_mask = model.apply(variables, src, method="encode")
    _, state = model.apply(variables, encoded, src_mask, tgt_in.shape[1], method="init_cache", mutable=["cache"])

    def step(cache, tokens):
        logits, state = model.apply({**variables, "cache": cache}, tokens, method="decode", mutable=["cache"])
        return state["cache"], logits

    chunks = tgt_in.reshape(tgt_in.shape[0], -1, chunk).transpose(1, 0, 2)
    _, logits = jax.lax.scan(step, state["cache"], chunks)
    return logits.transpose(1, 0, 2, 3).reshape(tgt_in.shape + (-1,))


@pytest.mark.parametrize(
    "overrides, chunk",
    [
        pytest.param(dict(), 1, id="pre-ln-shared-tied-one-token-per-step"),
        pytest.param(
            dict(pre_layer_norm=False, share_embeddings=False, tie_output=False, learned_positions=True),
            4,
            id="post-ln-separate-untied-learned-four-tokens-per-step",
        ),
    ],
)
def test_kv_cache_decoding_matches_the_full_forward(overrides, chunk):
    model = Transformer(tiny_config(**overrides))
    src, tgt_in, _ = reversal_batch()
    params = random_params(model, src, tgt_in)
    full = jax.jit(model.apply)({"params": params}, src, tgt_in)
    np.testing.assert_allclose(incremental_logits(model, params, src, tgt_in, chunk), full, rtol=1e-5, atol=1e-5)


def test_train_step_with_dropout_is_finite_and_depends_on_the_rng():
    model = Transformer(tiny_config(num_decoder_layers=1, hidden_dropout_ratio=0.1))
    src, tgt_in, labels = reversal_batch()
    params = random_params(model, src, tgt_in)
    value_and_grad = jax.jit(jax.value_and_grad(functools.partial(loss_fn, model)))
    loss, grads = value_and_grad(params, src, tgt_in, labels, jax.random.key(1))
    loss_again, grads_again = value_and_grad(params, src, tgt_in, labels, jax.random.key(1))
    other_loss, _ = value_and_grad(params, src, tgt_in, labels, jax.random.key(2))
    assert np.isfinite(loss) and loss == loss_again and loss != other_loss
    for leaf, again in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_again)):
        assert np.all(np.isfinite(leaf)) and np.any(leaf != 0)
        np.testing.assert_array_equal(leaf, again)


def test_cross_attention_key_value_gradient_is_one_concatenation_not_a_sum_of_padded_slices():
    layers = 3
    model = Transformer(tiny_config(num_decoder_layers=layers))
    src, tgt_in, labels = reversal_batch()
    params = random_params(model, src, tgt_in)
    jaxpr = jax.make_jaxpr(jax.grad(functools.partial(loss_fn, model)))(params, src, tgt_in, labels).jaxpr
    key_value_shape = (*src.shape, layers, 2, model.config.layer.nhead, model.config.layer.head_dim)
    assert key_value_shape not in jaxpr_output_shapes(jaxpr, "pad")
    assert key_value_shape in jaxpr_output_shapes(jaxpr, "concatenate")


def test_default_dtype_is_bfloat16_with_float32_params():
    config = TransformerConfig.preset("transformer-tiny", VOCAB, hidden_size=32, num_encoder_layers=1)
    assert config.layer.dtype == jnp.bfloat16
    model = Transformer(config)
    src, tgt_in, _ = reversal_batch()
    params = random_params(model, src, tgt_in)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))
    logits = jax.jit(model.apply)({"params": params}, src, tgt_in)
    assert logits.dtype == jnp.bfloat16 and logits.shape == tgt_in.shape + (VOCAB,)
    assert np.all(np.isfinite(np.asarray(logits, np.float32)))
    output = greedy_decode(model, {"params": params}, src, max_len=MAX_LEN)
    assert output.dtype == jnp.int32 and output.shape == (src.shape[0], MAX_LEN)
    np.testing.assert_array_equal(output[:, 0], jnp.argmax(logits[:, 0].at[:, :2].set(-jnp.inf), axis=-1))


def test_presets():
    shapes = {name: TransformerConfig.preset(name, 1000) for name in PRESETS}
    assert set(PRESETS) == {
        "transformer-tiny",
        "transformer-base",
        "transformer-big",
        "transformer-big-12e12d",
        "transformer-big-24e24d",
    }
    base, big = shapes["transformer-base"], shapes["transformer-big-24e24d"]
    assert (base.layer.hidden_size, base.num_encoder_layers, base.num_decoder_layers) == (512, 6, 6)
    assert (big.layer.hidden_size, big.layer.nhead) == (1024, 16)
    assert (big.num_encoder_layers, big.num_decoder_layers) == (24, 24)
    assert shapes["transformer-big-12e12d"].num_encoder_layers == 12
    assert shapes["transformer-tiny"].layer.max_seq_len == 64 and shapes["transformer-tiny"].share_embeddings
    custom = TransformerConfig.preset("transformer-base", 1000, dtype=jnp.float32, tie_output=False, max_seq_len=128)
    assert custom.layer.dtype == jnp.float32 and not custom.tie_output and custom.layer.max_seq_len == 128


def test_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown Transformer preset 'transformer-huge'; valid presets are"):
        TransformerConfig.preset("transformer-huge", 100)
    with pytest.raises(ValueError, match=r"unknown overrides \['layers'\]"):
        TransformerConfig.preset("transformer-tiny", 100, layers=3)
    with pytest.raises(ValueError, match="hidden_size 100 is not divisible by nhead 8"):
        TransformerConfig.preset("transformer-base", 100, hidden_size=100)
    with pytest.raises(ValueError, match="layer.padding_idx must be PAD_ID=0"):
        TransformerConfig.preset("transformer-tiny", 100, padding_idx=5)
    with pytest.raises(ValueError, match="vocab_size must cover the 4 special tokens"):
        TransformerConfig.preset("transformer-tiny", 3)


def test_bad_inputs_name_the_problem(trained):
    model, params, src, _ = trained
    with pytest.raises(ValueError, match=r"src_tokens must be an integer array of shape \(batch, length\), got float"):
        model.apply({"params": params}, src.astype(jnp.float32), src)
    with pytest.raises(ValueError, match=r"tgt_in_tokens must be an integer array of shape .*, got int32\[6\]"):
        model.apply({"params": params}, src, src[0])
    too_long = jnp.ones((1, MAX_LEN + 3), jnp.int32)
    with pytest.raises(ValueError, match=f"sequence length {MAX_LEN + 3} exceeds max_seq_len {MAX_LEN + 2}"):
        model.apply({"params": params}, too_long, src[:1])
    with pytest.raises(ValueError, match=rf"max_len must be in \[1, max_seq_len={MAX_LEN + 2}\], got {MAX_LEN + 3}"):
        greedy_decode(model, {"params": params}, src, max_len=MAX_LEN + 3)
    with pytest.raises(ValueError, match="max_len must be in"):
        beam_search(model, {"params": params}, src, beam_size=2, max_len=MAX_LEN + 3)
    bare = r"variables must be Flax variables with a 'params' collection .*, got decoder, encoder, source_embedding"
    with pytest.raises(ValueError, match=bare):
        greedy_decode(model, params, src, max_len=MAX_LEN)
    with pytest.raises(ValueError, match=bare):
        beam_search(model, params, src, beam_size=2, max_len=MAX_LEN)
    with pytest.raises(ValueError, match="beam_size must be at least 1, got 0"):
        beam_search(model, {"params": params}, src, beam_size=0, max_len=MAX_LEN)
    with pytest.raises(ValueError, match="src_tokens must be an integer array"):
        greedy_decode(model, {"params": params}, src.astype(jnp.float32), max_len=MAX_LEN)
    decode = jax.jit(functools.partial(model.apply, method="decode", mutable=["cache"]))
    with pytest.raises(ValueError, match="tgt_tokens must be an integer array"):
        decode({"params": params}, src.astype(jnp.float32))
    with pytest.raises(ValueError, match="encoded .the encoder output. is required"):
        decode({"params": params}, src)


def test_config_is_hashable_and_static_for_jit():
    config = tiny_config()
    assert hash(config) == hash(dataclasses.replace(config))
    assert Transformer(config) == Transformer(tiny_config())
    assert hash(Transformer(config)) == hash(Transformer(tiny_config()))
