"""BERT and GPT-2 against Hugging Face transformers (tiny random models built here, torch CPU float32): import,
export round trip, and checkpoints that do not fit."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from ls_jax.layers import LayerConfig  # noqa: E402
from ls_jax.models import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    GPTConfig,
    GPTLMHeadModel,
    hf,  # noqa: E402
)

TOLERANCE = 1e-5


def tiny_bert(**overrides):
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=24,
        type_vocab_size=3,
        num_labels=3,
        **overrides,
    )
    return transformers.BertForSequenceClassification(config).eval()


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=60, n_embd=32, n_layer=2, n_head=4, n_positions=24)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bert")
    model = tiny_bert()
    model.save_pretrained(directory)
    return directory, model


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt2")
    model = tiny_gpt2()
    model.save_pretrained(directory)
    return directory, model


def bert_inputs():
    rng = np.random.default_rng(0)
    input_ids = rng.integers(0, 50, (3, 9))
    attention_mask = np.ones((3, 9), np.int64)
    attention_mask[0, 6:] = 0
    attention_mask[2, 2:] = 0
    token_type_ids = np.zeros((3, 9), np.int64)
    token_type_ids[1, 4:] = 1
    token_type_ids[2, 1:] = 2
    return input_ids, attention_mask, token_type_ids


def torch_logits(model, input_ids, **arrays):
    with torch.no_grad():
        tensors = {name: torch.tensor(array) for name, array in arrays.items()}
        return model(torch.tensor(input_ids), **tensors).logits.numpy()


def ours_logits(module, params, *arrays):
    return np.asarray(jax.jit(module.apply)({"params": params}, *(jnp.asarray(array) for array in arrays)))


def test_bert_import_matches_transformers(bert_dir):
    directory, reference = bert_dir
    config, params = hf.load_pretrained(directory, dtype=jnp.float32)
    assert isinstance(config, BertConfig) and config.num_labels == 3 and config.type_vocab_size == 3
    input_ids, attention_mask, token_type_ids = bert_inputs()
    model = BertForSequenceClassification(config)
    padded = ours_logits(model, params, input_ids, attention_mask, token_type_ids)
    expected = torch_logits(reference, input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
    np.testing.assert_allclose(padded, expected, atol=TOLERANCE)
    unpadded = ours_logits(model, params, input_ids)
    np.testing.assert_allclose(unpadded, torch_logits(reference, input_ids), atol=TOLERANCE)
    assert not np.allclose(padded, unpadded)


def test_gpt2_import_matches_transformers(gpt2_dir):
    directory, reference = gpt2_dir
    config, params = hf.load_pretrained(directory, dtype=jnp.float32)
    assert isinstance(config, GPTConfig) and config.layer.activation_fn == "gelu_tanh"
    input_ids = np.random.default_rng(1).integers(0, 60, (2, 10))
    attention_mask = np.ones((2, 10), np.int64)
    attention_mask[0, 7:] = 0
    model = GPTLMHeadModel(config)
    padded = ours_logits(model, params, input_ids, attention_mask)
    expected = torch_logits(reference, input_ids, attention_mask=attention_mask)
    np.testing.assert_allclose(padded, expected, atol=TOLERANCE)
    unpadded = ours_logits(model, params, input_ids)
    np.testing.assert_allclose(unpadded, torch_logits(reference, input_ids), atol=TOLERANCE)


def test_bert_export_round_trip_loads_in_transformers(bert_dir, tmp_path):
    directory, reference = bert_dir
    config, params = hf.load_pretrained(directory, dtype=jnp.float32)
    params = jax.tree.map(lambda leaf: leaf * 1.01, params)
    hf.save_pretrained(config, params, tmp_path)
    exported = transformers.BertForSequenceClassification.from_pretrained(tmp_path).eval()
    input_ids, attention_mask, token_type_ids = bert_inputs()
    expected = ours_logits(BertForSequenceClassification(config), params, input_ids, attention_mask, token_type_ids)
    actual = torch_logits(exported, input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
    np.testing.assert_allclose(actual, expected, atol=TOLERANCE)
    reloaded_config, reloaded = hf.load_pretrained(tmp_path, dtype=jnp.float32)
    assert reloaded_config == config
    jax.tree.map(np.testing.assert_array_equal, reloaded, params)


def test_gpt2_export_round_trip_loads_in_transformers(gpt2_dir, tmp_path):
    directory, _ = gpt2_dir
    config, params = hf.load_pretrained(directory, dtype=jnp.float32)
    params = jax.tree.map(lambda leaf: leaf * 1.01, params)
    hf.save_pretrained(config, params, tmp_path)
    exported = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    input_ids = np.random.default_rng(2).integers(0, 60, (2, 7))
    expected = ours_logits(GPTLMHeadModel(config), params, input_ids)
    np.testing.assert_allclose(torch_logits(exported, input_ids), expected, atol=TOLERANCE)


def test_pytorch_bin_and_unprefixed_base_model_checkpoints(tmp_path):
    """pytorch_model.bin (torch.save) of a bare BertModel: keys without "bert.", no classifier, pretraining heads."""
    reference = tiny_bert()
    (tmp_path / "config.json").write_text(json.dumps(reference.config.to_dict()))
    state_dict = {key: value for key, value in reference.bert.state_dict().items()}
    state_dict["cls.predictions.bias"] = torch.zeros(50)
    torch.save(state_dict, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"missing keys \['classifier.bias', 'classifier.weight'\]"):
        hf.load_pretrained(tmp_path, dtype=jnp.float32)
    config, params = hf.load_pretrained(tmp_path, rng=jax.random.key(0), dtype=jnp.float32)
    encoder_params = hf.params_from_hf(config, reference.state_dict())
    for name in ("embeddings", "encoder", "pooler"):
        jax.tree.map(np.testing.assert_array_equal, params[name], encoder_params[name])
    assert params["classifier"]["kernel"].shape == (32, 3)


def test_sharded_safetensors_checkpoint(gpt2_dir, tmp_path):
    directory, reference = gpt2_dir
    state_dict = {key: value.contiguous() for key, value in reference.state_dict().items() if key != "lm_head.weight"}
    keys = sorted(state_dict)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, shard_keys in shards.items():
        safetensors_torch.save_file({key: state_dict[key] for key in shard_keys}, tmp_path / name)
    weight_map = {key: name for name, shard_keys in shards.items() for key in shard_keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    _, params = hf.load_pretrained(tmp_path, dtype=jnp.float32)
    _, expected = hf.load_pretrained(directory, dtype=jnp.float32)
    jax.tree.map(np.testing.assert_array_equal, params, expected)


def test_mismatched_checkpoints_list_every_problem(bert_dir):
    directory, reference = bert_dir
    config, _ = hf.load_pretrained(directory, dtype=jnp.float32)
    state_dict = dict(reference.state_dict())
    del state_dict["bert.encoder.layer.1.output.dense.bias"]
    state_dict["bert.encoder.layer.0.attention.self.query.weight"] = torch.zeros(32, 16)
    state_dict["bert.encoder.layer.2.output.dense.bias"] = torch.zeros(32)
    with pytest.raises(ValueError) as error:
        hf.params_from_hf(config, state_dict)
    message = str(error.value)
    assert "missing keys ['bert.encoder.layer.1.output.dense.bias']" in message
    assert "unexpected keys ['bert.encoder.layer.2.output.dense.bias']" in message
    assert "bert.encoder.layer.0.attention.self.query.weight: checkpoint (32, 16), model (32, 32)" in message


def test_gpt2_untied_head_is_rejected(gpt2_dir):
    directory, reference = gpt2_dir
    config, _ = hf.load_pretrained(directory, dtype=jnp.float32)
    state_dict = dict(reference.state_dict())
    state_dict["lm_head.weight"] = state_dict["lm_head.weight"] + 1.0
    with pytest.raises(ValueError, match="lm_head.weight differs from transformer.wte.weight"):
        hf.params_from_hf(config, state_dict)


def test_missing_files_and_unsupported_configs(tmp_path, bert_dir):
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        hf.load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ValueError, match="unsupported model_type 't5'"):
        hf.load_pretrained(tmp_path)
    directory, reference = bert_dir
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no weights in .*: expected model.safetensors, pytorch_model.bin"):
        hf.load_pretrained(tmp_path)
    hf_config = reference.config.to_dict()
    with pytest.raises(ValueError, match="position_embedding_type='relative_key'; only 'absolute' is supported"):
        hf.config_from_hf({**hf_config, "position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="unsupported activation 'silu'"):
        hf.config_from_hf({**hf_config, "hidden_act": "silu"})
    with pytest.raises(ValueError, match=r"unknown LayerConfig fields \['dropout'\]"):
        hf.load_pretrained(directory, dropout=0.0)


def test_bert_and_gpt_input_errors(bert_dir):
    directory, _ = bert_dir
    config, params = hf.load_pretrained(directory, dtype=jnp.float32)
    model = BertForSequenceClassification(config)
    ids = jnp.ones((2, 5), jnp.int32)
    with pytest.raises(ValueError, match=r"input_ids must be an integer array of shape \(batch, length\), got float32"):
        model.apply({"params": params}, ids.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 4\) but input_ids has \(2, 5\)"):
        model.apply({"params": params}, ids, jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="sequence length 30 exceeds"):
        model.apply({"params": params}, jnp.ones((1, 30), jnp.int32))
    layer = LayerConfig.preset("gpt2-small", hidden_size=32, intermediate_size=64, nhead=4, max_seq_len=8)
    gpt = GPTLMHeadModel(GPTConfig(layer=layer, vocab_size=10, num_layers=1))
    with pytest.raises(ValueError, match="input_ids must be an integer array"):
        gpt.init(jax.random.key(0), jnp.ones((1, 3)))
    with pytest.raises(ValueError, match="layer.padding_idx must be None for GPT-2"):
        GPTConfig(layer=LayerConfig.preset("gpt2-small", padding_idx=0))
    with pytest.raises(ValueError, match="layer.padding_idx must be None for BERT"):
        BertConfig(layer=LayerConfig.preset("bert-base", padding_idx=0))


def test_the_initializer_range_travels_both_ways(tmp_path):
    tiny_bert(initializer_range=0.05).save_pretrained(tmp_path / "in")
    config, params = hf.load_pretrained(tmp_path / "in", dtype=jnp.float32)
    assert config.layer.initializer_range == 0.05
    hf.save_pretrained(config, params, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["initializer_range"] == 0.05
