"""ls_jax.layers against plain Flax reference layers (nn.MultiHeadDotProductAttention, nn.LayerNorm, nn.Dense)
with the same parameters and dropout off: outputs and gradients; plus configs, embedding, criterion, dropout."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.layers import normal, random_params

from ls_jax.layers import (
    CrossEntropyCriterion,
    DeferredResidual,
    LayerConfig,
    MultiHeadAttention,
    TransformerDecoder,
    TransformerEmbedding,
    TransformerEncoder,
    TransformerEncoderLayer,
    sinusoidal_positions,
)

HIDDEN, HEADS, FFN = 32, 4, 48
ACTIVATIONS = {
    "relu": nn.relu,
    "gelu": functools.partial(nn.gelu, approximate=False),
    "gelu_tanh": functools.partial(nn.gelu, approximate=True),
}


def layer_config(pre_layer_norm=True, activation="relu", **overrides):
    fields = dict(
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        nhead=HEADS,
        max_seq_len=16,
        pre_layer_norm=pre_layer_norm,
        activation_fn=activation,
        dtype=jnp.float32,
        layer_norm_eps=1e-6,
    )
    return LayerConfig(**{**fields, **overrides})


# ---- plain Flax reference ----------------------------------------------------------------------------------


def residual(cfg, x, block, norm_name):
    """x + f(LN(x)) (pre-LN) or LN(x + f(x)) (post-LN), inside the caller's compact scope."""
    norm = nn.LayerNorm(epsilon=cfg.layer_norm_eps, name=norm_name)
    return x + block(norm(x)) if cfg.pre_layer_norm else norm(x + block(x))


class RefFeedForward(nn.Module):
    cfg: LayerConfig

    @nn.compact
    def __call__(self, h):
        h = ACTIVATIONS[self.cfg.activation_fn](nn.Dense(self.cfg.intermediate_size, name="fc1")(h))
        return nn.Dense(self.cfg.hidden_size, name="fc2")(h)


def ref_attention(cfg, name):
    return nn.MultiHeadDotProductAttention(
        num_heads=cfg.nhead, qkv_features=cfg.hidden_size, out_features=cfg.hidden_size, deterministic=True, name=name
    )


class RefEncoder(nn.Module):
    cfg: LayerConfig
    num_layers: int

    @nn.compact
    def __call__(self, x, key_mask):
        mask = nn.make_attention_mask(jnp.ones(x.shape[:2], bool), key_mask)
        for index in range(self.num_layers):
            attention = ref_attention(self.cfg, f"attention_{index}")
            x = residual(self.cfg, x, lambda h: attention(h, mask=mask), f"attention_norm_{index}")
            x = residual(self.cfg, x, RefFeedForward(self.cfg, name=f"ffn_{index}"), f"ffn_norm_{index}")
        if self.cfg.pre_layer_norm:
            x = nn.LayerNorm(epsilon=self.cfg.layer_norm_eps, name="final_norm")(x)
        return x


class RefDecoder(nn.Module):
    """Each layer projects its own cross-attention K/V from the encoder output (no layer batching)."""

    cfg: LayerConfig
    num_layers: int

    @nn.compact
    def __call__(self, x, encoded, src_mask):
        causal = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        cross_mask = nn.make_attention_mask(jnp.ones(x.shape[:2], bool), src_mask)
        for index in range(self.num_layers):
            self_attention = ref_attention(self.cfg, f"self_attention_{index}")
            cross_attention = ref_attention(self.cfg, f"cross_attention_{index}")
            x = residual(self.cfg, x, lambda h: self_attention(h, mask=causal), f"self_norm_{index}")
            x = residual(self.cfg, x, lambda h: cross_attention(h, encoded, mask=cross_mask), f"cross_norm_{index}")
            x = residual(self.cfg, x, RefFeedForward(self.cfg, name=f"ffn_{index}"), f"ffn_norm_{index}")
        if self.cfg.pre_layer_norm:
            x = nn.LayerNorm(epsilon=self.cfg.layer_norm_eps, name="final_norm")(x)
        return x


def ref_layer_norm(ours):
    return dict(ours["layer_norm"])


def ref_ffn(ours):
    ffn = ours["feed_forward"]
    return ref_layer_norm(ffn), {
        "fc1": {"kernel": ffn["fc1"]["kernel"], "bias": ffn["fc1_bias"]},
        "fc2": {"kernel": ffn["fc2"]["kernel"], "bias": ffn["fc2_bias"]},
    }


def ref_projections(attention, key_kernel, key_bias, value_kernel, value_bias, query_kernel, query_bias):
    return {
        "query": {"kernel": query_kernel, "bias": query_bias},
        "key": {"kernel": key_kernel, "bias": key_bias},
        "value": {"kernel": value_kernel, "bias": value_bias},
        "out": {"kernel": attention["out"]["kernel"], "bias": attention["out_bias"]},
    }


def ref_self_attention(attention):
    kernel, bias = attention["qkv"]["kernel"], attention["qkv_bias"]
    return ref_projections(attention, kernel[:, 1], bias[1], kernel[:, 2], bias[2], kernel[:, 0], bias[0])


def encoder_to_ref(params, num_layers, pre_layer_norm):
    ref = {}
    for index in range(num_layers):
        layer = params[f"layer_{index}"]
        ref[f"attention_{index}"] = ref_self_attention(layer["self_attention"])
        ref[f"attention_norm_{index}"] = ref_layer_norm(layer["self_attention"])
        ref[f"ffn_norm_{index}"], ref[f"ffn_{index}"] = ref_ffn(layer)
    if pre_layer_norm:
        ref["final_norm"] = dict(params["final_layer_norm"])
    return ref


def decoder_to_ref(params, num_layers, pre_layer_norm):
    kv_kernel, kv_bias = params["cross_attention_kv"]["kernel"], params["cross_attention_kv"]["bias"]
    ref = {}
    for index in range(num_layers):
        layer = params[f"layer_{index}"]
        cross = layer["cross_attention"]
        ref[f"self_attention_{index}"] = ref_self_attention(layer["self_attention"])
        ref[f"self_norm_{index}"] = ref_layer_norm(layer["self_attention"])
        ref[f"cross_attention_{index}"] = ref_projections(
            cross,
            kv_kernel[:, index, 0],
            kv_bias[index, 0],
            kv_kernel[:, index, 1],
            kv_bias[index, 1],
            cross["query"]["kernel"],
            cross["query_bias"],
        )
        ref[f"cross_norm_{index}"] = ref_layer_norm(cross)
        ref[f"ffn_norm_{index}"], ref[f"ffn_{index}"] = ref_ffn(layer)
    if pre_layer_norm:
        ref["final_norm"] = dict(params["final_layer_norm"])
    return ref


def assert_trees_close(actual, expected, **tolerance):
    flat_actual = jax.tree_util.tree_flatten_with_path(actual)[0]
    flat_expected = dict(jax.tree_util.tree_flatten_with_path(expected)[0])
    assert len(flat_actual) == len(flat_expected)
    for path, value in flat_actual:
        np.testing.assert_allclose(value, flat_expected[path], err_msg=jax.tree_util.keystr(path), **tolerance)


@functools.partial(jax.jit, static_argnums=0)
def output_and_grads(model, params, cotangent, x, *args):
    """model(x, *args) and the gradients of sum(output * cotangent) w.r.t. params, x and the float args
    (which come before the boolean masks in ``args``)."""
    float_args = tuple(arg for arg in args if jnp.issubdtype(arg.dtype, jnp.floating))
    other_args = tuple(arg for arg in args if not jnp.issubdtype(arg.dtype, jnp.floating))

    def loss(params, x, *float_args):
        y = model.apply({"params": params}, x, *float_args, *other_args)
        return jnp.sum(y * cotangent), y

    argnums = tuple(range(2 + len(float_args)))
    grads, y = jax.grad(loss, argnums=argnums, has_aux=True)(params, x, *float_args)
    return y, grads


def key_mask_for(lengths, length):
    return jnp.arange(length)[None, :] < jnp.asarray(lengths)[:, None]


@pytest.mark.parametrize(
    "pre_layer_norm, activation, lengths",
    [
        pytest.param(True, "relu", (5, 3), id="pre-ln-padded"),
        pytest.param(False, "gelu", (5, 2), id="post-ln-padded"),
        pytest.param(True, "gelu_tanh", (4,), id="pre-ln-batch1"),
    ],
)
def test_encoder_matches_flax_reference(pre_layer_norm, activation, lengths):
    cfg = layer_config(pre_layer_norm, activation)
    length, num_layers = max(lengths), 1
    x = normal(0, (len(lengths), length, HIDDEN))
    key_mask = key_mask_for(lengths, length)
    model = TransformerEncoder(cfg, num_layers)
    params = random_params(model, x, key_mask)
    ref_params = encoder_to_ref(params, num_layers, pre_layer_norm)
    cotangent = normal(3, x.shape) * key_mask[..., None]

    y, (grads, dx) = output_and_grads(model, params, cotangent, x, key_mask)
    y_ref, (ref_grads, dx_ref) = output_and_grads(RefEncoder(cfg, num_layers), ref_params, cotangent, x, key_mask)
    np.testing.assert_allclose(y * key_mask[..., None], y_ref * key_mask[..., None], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-5)
    assert_trees_close(encoder_to_ref(grads, num_layers, pre_layer_norm), ref_grads, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "pre_layer_norm, activation, lengths",
    [pytest.param(True, "relu", (5, 3), id="pre-ln-padded"), pytest.param(False, "gelu", (4,), id="post-ln-batch1")],
)
def test_decoder_matches_flax_reference_with_per_layer_cross_attention(pre_layer_norm, activation, lengths):
    """The decoder's one cross-K/V GEMM for all layers equals each layer projecting its own K/V."""
    cfg = layer_config(pre_layer_norm, activation)
    num_layers, target_length = 2, 4
    batch, source_length = len(lengths), max(lengths)
    x = normal(0, (batch, target_length, HIDDEN))
    encoded = normal(1, (batch, source_length, HIDDEN))
    src_mask = key_mask_for(lengths, source_length)
    model = TransformerDecoder(cfg, num_layers)
    params = random_params(model, x, encoded, src_mask)
    ref_params = decoder_to_ref(params, num_layers, pre_layer_norm)
    ref_model = RefDecoder(cfg, num_layers)
    cotangent = normal(4, x.shape)

    y, (grads, dx, dencoded) = output_and_grads(model, params, cotangent, x, encoded, src_mask)
    y_ref, (ref_grads, dx_ref, dencoded_ref) = output_and_grads(ref_model, ref_params, cotangent, x, encoded, src_mask)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dencoded, dencoded_ref, rtol=1e-5, atol=1e-5)
    assert_trees_close(decoder_to_ref(grads, num_layers, pre_layer_norm), ref_grads, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("remat", ["none", "layer"])
def test_stacks_take_key_lengths_as_the_prefix_mask(remat):
    """Key lengths give the encoder's and the decoder's outputs and gradients of the mask they stand for, a row of
    length 0 included, plain and checkpointed (the lengths travel positionally through nn.remat)."""
    cfg = layer_config(True, "relu", remat=remat)
    lengths = jnp.array([5, 0, 3])
    x, encoded = normal(0, (3, 5, HIDDEN)), normal(1, (3, 5, HIDDEN))
    key_mask = key_mask_for(lengths, 5)
    encoder, decoder = TransformerEncoder(cfg, 2), TransformerDecoder(cfg, 2)
    encoder_params = random_params(encoder, x, key_mask)
    decoder_params = random_params(decoder, x, encoded, key_mask)

    @jax.jit
    def run(masks):
        def outputs(encoder_params, decoder_params, x, encoded):
            y = encoder.apply({"params": encoder_params}, x, **masks["encoder"])
            z = decoder.apply({"params": decoder_params}, x, encoded, **masks["decoder"])
            return jnp.sum(y * y) + jnp.sum(z * z), (y, z)

        return jax.grad(outputs, argnums=(0, 1, 2, 3), has_aux=True)(encoder_params, decoder_params, x, encoded)

    with_mask = run({"encoder": {"key_mask": key_mask}, "decoder": {"src_mask": key_mask}})
    with_lengths = run({"encoder": {"key_lengths": lengths}, "decoder": {"src_lengths": lengths}})
    for got, want in zip(jax.tree.leaves(with_lengths), jax.tree.leaves(with_mask)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_bf16_encoder_close_to_f32_reference():
    cfg = layer_config(True, "relu")
    x = normal(0, (2, 6, HIDDEN))
    key_mask = key_mask_for((6, 4), 6)
    params = random_params(TransformerEncoder(cfg, 1), x, key_mask)
    cotangent = jnp.ones(x.shape) * key_mask[..., None]
    expected, _ = output_and_grads(RefEncoder(cfg, 1), encoder_to_ref(params, 1, True), cotangent, x, key_mask)
    bf16_model = TransformerEncoder(layer_config(True, "relu", dtype=jnp.bfloat16), 1)
    y, (grads, _) = output_and_grads(bf16_model, params, cotangent, x.astype(jnp.bfloat16), key_mask)
    assert y.dtype == jnp.bfloat16
    assert all(leaf.dtype == jnp.float32 and np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(grads))
    mask = key_mask[..., None]
    np.testing.assert_allclose(np.asarray(y, np.float32) * mask, expected * mask, rtol=5e-2, atol=5e-2)


def test_causal_encoder_layer_ignores_future_tokens():
    cfg = layer_config(True, "gelu_tanh")
    x = normal(0, (1, 6, HIDDEN))
    layer = TransformerEncoderLayer(cfg, causal=True)
    params = random_params(layer, x)
    changed_future = x.at[:, 4:].set(normal(2, (1, 2, HIDDEN)))
    apply = jax.jit(layer.apply)
    y, y_changed = apply({"params": params}, x), apply({"params": params}, changed_future)
    np.testing.assert_allclose(y[:, :4], y_changed[:, :4], rtol=1e-6, atol=1e-6)
    assert not np.allclose(y[:, 4:], y_changed[:, 4:])


def test_attention_argument_errors():
    cfg = layer_config()
    x = jnp.ones((1, 3, HIDDEN))
    with pytest.raises(ValueError, match="key_value is required for cross-attention"):
        MultiHeadAttention(cfg, self_attention=False).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="decode .KV cache. applies only to causal self-attention"):
        MultiHeadAttention(cfg).init(jax.random.key(0), x, decode=True)
    with pytest.raises(ValueError, match=r"key_mask must have shape \(batch, keys\)"):
        MultiHeadAttention(cfg).init(jax.random.key(0), x, key_mask=jnp.ones((1, 1, 3), bool))


# ---- embedding ---------------------------------------------------------------------------------------------


def test_sinusoidal_positions_formula():
    table = np.asarray(sinusoidal_positions(7, 10))
    half = 5
    for position in range(7):
        for i in range(half):
            angle = position / 10000.0 ** (i / (half - 1))
            np.testing.assert_allclose(table[position, i], math.sin(angle), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(table[position, half + i], math.cos(angle), rtol=1e-5, atol=1e-6)
    assert sinusoidal_positions(3, 9).shape == (3, 9)
    np.testing.assert_array_equal(sinusoidal_positions(3, 9)[:, 8], 0.0)


@pytest.mark.parametrize("learned_positions", [False, True])
def test_embedding_scales_adds_positions_and_zeroes_padding(learned_positions):
    cfg = layer_config(hidden_dropout_ratio=0.0)
    tokens = jnp.array([[5, 6, 7, 0], [8, 0, 0, 0]], jnp.int32)
    embedding = TransformerEmbedding(cfg, vocab_size=11, learned_positions=learned_positions)
    params = random_params(embedding, tokens)
    y = embedding.apply({"params": params}, tokens)
    positions = params["position_embedding"] if learned_positions else sinusoidal_positions(16, HIDDEN)
    expected = params["embedding"][tokens] * math.sqrt(HIDDEN) + positions[:4][None]
    expected = expected * (tokens != 0)[..., None]
    np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6)
    logits = embedding.apply({"params": params}, y, method="attend")
    np.testing.assert_allclose(logits, y @ params["embedding"].T, rtol=1e-5, atol=1e-5)


def test_embedding_rejects_sequence_longer_than_max_seq_len():
    cfg = layer_config(max_seq_len=8)
    with pytest.raises(ValueError, match="sequence length 9 exceeds max_seq_len 8"):
        TransformerEmbedding(cfg, vocab_size=11).init(jax.random.key(0), jnp.ones((1, 9), jnp.int32))


# ---- dropout -----------------------------------------------------------------------------------------------


def test_dropout_depends_on_the_rng_only_when_not_deterministic():
    cfg = layer_config(attn_prob_dropout_ratio=0.2, activation_dropout_ratio=0.2, hidden_dropout_ratio=0.2)
    x = normal(0, (2, 5, HIDDEN))
    layer = TransformerEncoderLayer(cfg)
    params = random_params(layer, x)
    apply = jax.jit(layer.apply, static_argnames="deterministic")

    def run(seed, deterministic=False):
        return apply({"params": params}, x, deterministic=deterministic, rngs={"dropout": jax.random.key(seed)})

    np.testing.assert_array_equal(run(3), run(3))
    assert not np.allclose(run(3), run(4))
    np.testing.assert_array_equal(run(3, deterministic=True), run(4, deterministic=True))
    np.testing.assert_array_equal(run(3, deterministic=True), apply({"params": params}, x, deterministic=True))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_deferred_residual_chains_layers_like_formed_outputs(dtype):
    """A pre-LN layer with defer_residual=True returns its output unformed; it resolves to the plain output, and
    the next layer's LayerNorm, forming it in one op, gives the plain chain's output and gradients, with dropout."""
    cfg = layer_config(dtype=dtype, attn_prob_dropout_ratio=0.2, activation_dropout_ratio=0.2, hidden_dropout_ratio=0.2)
    x = normal(0, (2, 5, HIDDEN))
    layer = TransformerEncoderLayer(cfg)
    first, second = random_params(layer, x, seed=1), random_params(layer, x, seed=2)
    rngs = lambda seed: {"dropout": jax.random.key(seed)}

    def chain(params, defer):
        middle = layer.apply({"params": params[0]}, x, deterministic=False, rngs=rngs(3), defer_residual=defer)
        assert isinstance(middle, DeferredResidual) == defer
        return layer.apply({"params": params[1]}, middle, deterministic=False, rngs=rngs(4))

    deferred = layer.apply({"params": first}, x, deterministic=False, rngs=rngs(3), defer_residual=True)
    formed = layer.apply({"params": first}, x, deterministic=False, rngs=rngs(3))
    np.testing.assert_array_equal(np.asarray(deferred.resolve()), np.asarray(formed))

    loss = lambda params, defer: jnp.sum(chain(params, defer).astype(jnp.float32) ** 2)
    (value, grads), (want_value, want_grads) = (
        jax.jit(jax.value_and_grad(loss), static_argnums=1)((first, second), defer) for defer in (True, False)
    )
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


# ---- configuration -----------------------------------------------------------------------------------------


def test_layer_config_presets():
    base = LayerConfig.preset("transformer-base")
    assert (base.hidden_size, base.intermediate_size, base.nhead, base.pre_layer_norm) == (512, 2048, 8, True)
    assert base.hidden_dropout_ratio == base.attn_prob_dropout_ratio == 0.1 and base.activation_fn == "relu"
    big = LayerConfig.preset("transformer-big")
    assert (big.hidden_size, big.intermediate_size, big.nhead) == (1024, 4096, 16)
    bert = LayerConfig.preset("bert-base")
    assert (bert.hidden_size, bert.nhead, bert.pre_layer_norm, bert.activation_fn) == (768, 12, False, "gelu")
    assert (bert.layer_norm_eps, bert.max_seq_len) == (1e-12, 512)
    assert LayerConfig.preset("bert-large").hidden_size == 1024
    gpt = LayerConfig.preset("gpt2-small")
    assert (gpt.pre_layer_norm, gpt.activation_fn, gpt.max_seq_len) == (True, "gelu_tanh", 1024)
    assert base.dtype == jnp.bfloat16 and base.head_dim == 64
    assert LayerConfig.preset("transformer-base", dtype=jnp.float32).dtype == jnp.float32


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(nhead=5), "hidden_size 32 is not divisible by nhead 5"),
        (dict(activation_fn="swish"), "activation_fn must be one of relu, gelu, gelu_tanh, got 'swish'"),
        (dict(hidden_dropout_ratio=1.0), r"hidden_dropout_ratio must be in \[0, 1\), got 1.0"),
        (dict(attn_prob_dropout_ratio=-0.1), r"attn_prob_dropout_ratio must be in \[0, 1\)"),
        (dict(dtype=jnp.int32), "dtype must be float32, bfloat16 or float16, got int32"),
        (dict(max_seq_len=0), "max_seq_len must be a positive integer"),
    ],
)
def test_layer_config_rejects_bad_values(overrides, message):
    with pytest.raises(ValueError, match=message):
        layer_config(**overrides)


def test_layer_config_preset_errors_name_the_choices():
    with pytest.raises(ValueError, match="unknown layer preset 'bert-huge'; valid presets are transformer-base"):
        LayerConfig.preset("bert-huge")
    with pytest.raises(ValueError, match=r"unknown LayerConfig fields \['hiden_size'\]"):
        LayerConfig.preset("bert-base", hiden_size=3)


# ---- criterion ---------------------------------------------------------------------------------------------


def test_cross_entropy_criterion_matches_optax_with_smoothed_targets():
    epsilon, vocab = 0.1, 7
    logits = normal(0, (2, 5, vocab))
    labels = jnp.array([[3, 4, 5, 0, 0], [1, 2, 6, 6, 0]], jnp.int32)
    loss, nll, count = CrossEntropyCriterion(epsilon=epsilon, padding_idx=0)(logits, labels)
    onehot = jax.nn.one_hot(labels, vocab)
    smoothed = onehot * (1 - epsilon) + (1 - onehot) * epsilon / (vocab - 1)
    valid = labels != 0
    np.testing.assert_allclose(loss, jnp.sum(optax.softmax_cross_entropy(logits, smoothed) * valid), rtol=1e-5)
    expected_nll = jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, labels) * valid)
    np.testing.assert_allclose(nll, expected_nll, rtol=1e-5)
    assert int(count) == 7
    with pytest.raises(ValueError, match=r"epsilon must be in \[0, 1\)"):
        CrossEntropyCriterion(epsilon=1.0)
