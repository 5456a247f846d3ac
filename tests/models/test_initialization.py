"""How the layers draw their matmul kernels: at ``LayerConfig.initializer_range`` (BERT's and GPT-2's 0.02), or from
LeCun's normal when it is None."""

import jax
import jax.numpy as jnp
import pytest

from ls_jax.layers import LayerConfig
from ls_jax.models import BertConfig, BertForSequenceClassification, GPTConfig, GPTLMHeadModel


def _encoder_params(**layer_overrides):
    layer = LayerConfig.preset("bert-base", hidden_size=256, intermediate_size=1024, nhead=4, **layer_overrides)
    model = BertForSequenceClassification(BertConfig(layer=layer, vocab_size=512, num_layers=2))
    return model.init(jax.random.PRNGKey(0), jnp.ones((1, 16), jnp.int32))["params"]["encoder"]["layer_0"]


def test_bert_layers_draw_their_kernels_at_bert_s_initializer_range():
    layer = _encoder_params()
    attention, feed_forward = layer["self_attention"], layer["feed_forward"]
    for kernel in (attention["qkv"]["kernel"], attention["out"]["kernel"], feed_forward["fc2"]["kernel"]):
        assert abs(float(jnp.std(kernel)) - 0.02) < 0.001


def test_gpt2_layers_draw_their_kernels_at_gpt2_s_initializer_range():
    layer = LayerConfig.preset("gpt2-small", hidden_size=256, intermediate_size=1024, nhead=4, max_seq_len=16)
    config = GPTConfig(layer=layer, vocab_size=512, num_layers=1)
    params = GPTLMHeadModel(config).init(jax.random.PRNGKey(0), jnp.ones((1, 16), jnp.int32))["params"]
    kernels = [
        leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params) if "kernel" in jax.tree_util.keystr(path)
    ]
    assert len(kernels) >= 4 and all(abs(float(jnp.std(kernel)) - 0.02) < 0.001 for kernel in kernels)


def test_without_a_range_the_kernels_come_from_lecun_s_normal():
    fc2 = _encoder_params(initializer_range=None)["feed_forward"]["fc2"]["kernel"]  # fan-in 1024
    assert abs(float(jnp.std(fc2)) - 1024**-0.5) < 0.002


def test_a_layer_config_refuses_a_non_positive_initializer_range():
    with pytest.raises(ValueError, match="initializer_range must be positive or None, got 0.0"):
        LayerConfig.preset("bert-base", initializer_range=0.0)
