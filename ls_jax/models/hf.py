"""Hugging Face weight import and export for BERT (``BertForSequenceClassification``) and GPT-2 (``GPT2LMHeadModel``).

    config, params = load_pretrained("path/to/bert-dir", dtype=jnp.bfloat16)   # config.json + weights
    save_pretrained(config, params, "path/to/out")      # transformers' from_pretrained loads it

No network and no ``transformers`` are needed: config.json is read as JSON and weights come from
model.safetensors (``safetensors``) or pytorch_model.bin (``torch``), sharded or not. Missing or unexpected
weights and shape mismatches raise ValueError listing them. Weights a checkpoint may carry that these models
do not use are skipped: BERT's pre-training heads (``cls.*``) and GPT-2's attention-mask buffers. A BERT
checkpoint without a classifier (a pre-trained encoder) loads when ``rng`` is given to initialize one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.layers import LayerConfig
from ls_jax.layers.config import replace_checked
from ls_jax.models.bert import BertConfig, BertForSequenceClassification
from ls_jax.models.gpt import GPTConfig, GPTLMHeadModel

logger = logging.getLogger("ls_jax.models.hf")

ModelConfig = BertConfig | GPTConfig
Params = dict[str, Any]
ParamPath = tuple[str, ...]

_SAFETENSORS = "model.safetensors"
_TORCH = "pytorch_model.bin"
_INDEX_SUFFIX = ".index.json"
_HF_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
_BERT_EXPORT_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}
_GPT_EXPORT_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new"}


# ---- parameter mapping -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Rule:
    """One ls_jax parameter made of one or more Hugging Face tensors, with the conversions both ways.

    Conversions run on host numpy arrays (no device work, no compilation). ``to_hf`` uses only array
    methods, so it also runs on abstract values to derive the expected checkpoint shapes.
    """

    path: ParamPath
    hf_keys: tuple[str, ...]
    to_hf: Callable[[Any], tuple[Any, ...]]
    to_flax: Callable[[tuple[np.ndarray, ...], tuple[int, ...]], np.ndarray]


def _same(path: ParamPath, key: str) -> _Rule:
    """A tensor stored identically: embeddings, LayerNorm parameters, biases."""
    return _Rule(path, (key,), lambda p: (p,), lambda ws, shape: ws[0])


def _flat(path: ParamPath, key: str) -> _Rule:
    """A vector stored as a multi-axis parameter: GPT-2's fused QKV bias (3H,) -> (3, heads, d)."""
    return _Rule(path, (key,), lambda p: (p.reshape(-1),), lambda ws, shape: ws[0].reshape(shape))


def _conv1d(path: ParamPath, key: str, input_axes: int = 1) -> _Rule:
    """GPT-2's Conv1D weight (in, out) as a Dense kernel whose first ``input_axes`` axes are the input."""
    return _Rule(
        path,
        (key,),
        lambda p: (p.reshape(math.prod(p.shape[:input_axes]), -1),),
        lambda ws, shape: ws[0].reshape(shape),
    )


def _linear(path: ParamPath, key: str, input_axes: int = 1) -> _Rule:
    """A torch Linear weight (out, in) as a Dense kernel whose first ``input_axes`` axes are the input."""
    return _Rule(
        path,
        (key,),
        lambda p: (p.reshape(math.prod(p.shape[:input_axes]), -1).T,),
        lambda ws, shape: ws[0].T.reshape(shape),
    )


def _stacked_linear(path: ParamPath, keys: tuple[str, ...]) -> _Rule:
    """Separate Linear weights (out, in) stacked on kernel axis 1: BERT's query/key/value -> (H, 3, heads, d)."""
    return _Rule(
        path,
        keys,
        lambda p: tuple(p.reshape(p.shape[0], len(keys), -1)[:, index].T for index in range(len(keys))),
        lambda ws, shape: np.stack([w.T for w in ws], axis=1).reshape(shape),
    )


def _stacked_bias(path: ParamPath, keys: tuple[str, ...]) -> _Rule:
    """Separate biases stacked on axis 0: BERT's query/key/value biases -> (3, heads, d)."""
    return _Rule(
        path,
        keys,
        lambda p: tuple(p.reshape(len(keys), -1)[index] for index in range(len(keys))),
        lambda ws, shape: np.stack(ws).reshape(shape),
    )


def _layer_norm(path: ParamPath, prefix: str) -> list[_Rule]:
    return [_same(path + ("scale",), prefix + ".weight"), _same(path + ("bias",), prefix + ".bias")]


def _bert_rules(config: BertConfig) -> list[_Rule]:
    rules = [
        _same(("embeddings", "word_embedding"), "bert.embeddings.word_embeddings.weight"),
        _same(("embeddings", "position_embedding"), "bert.embeddings.position_embeddings.weight"),
        _same(("embeddings", "token_type_embedding"), "bert.embeddings.token_type_embeddings.weight"),
        *_layer_norm(("embeddings", "layer_norm"), "bert.embeddings.LayerNorm"),
    ]
    for index in range(config.num_layers):
        hf = f"bert.encoder.layer.{index}."
        attention = ("encoder", f"layer_{index}", "self_attention")
        ffn = ("encoder", f"layer_{index}", "feed_forward")
        qkv = tuple(hf + f"attention.self.{name}" for name in ("query", "key", "value"))
        rules += [
            _stacked_linear(attention + ("qkv", "kernel"), tuple(key + ".weight" for key in qkv)),
            _stacked_bias(attention + ("qkv_bias",), tuple(key + ".bias" for key in qkv)),
            _linear(attention + ("out", "kernel"), hf + "attention.output.dense.weight", input_axes=2),
            _same(attention + ("out_bias",), hf + "attention.output.dense.bias"),
            *_layer_norm(attention + ("layer_norm",), hf + "attention.output.LayerNorm"),
            _linear(ffn + ("fc1", "kernel"), hf + "intermediate.dense.weight"),
            _same(ffn + ("fc1_bias",), hf + "intermediate.dense.bias"),
            _linear(ffn + ("fc2", "kernel"), hf + "output.dense.weight"),
            _same(ffn + ("fc2_bias",), hf + "output.dense.bias"),
            *_layer_norm(ffn + ("layer_norm",), hf + "output.LayerNorm"),
        ]
    return rules + [
        _linear(("pooler", "kernel"), "bert.pooler.dense.weight"),
        _same(("pooler", "bias"), "bert.pooler.dense.bias"),
        _linear(("classifier", "kernel"), "classifier.weight"),
        _same(("classifier", "bias"), "classifier.bias"),
    ]


def _gpt_rules(config: GPTConfig) -> list[_Rule]:
    rules = [
        _same(("embedding", "embedding"), "transformer.wte.weight"),
        _same(("embedding", "position_embedding"), "transformer.wpe.weight"),
    ]
    for index in range(config.num_layers):
        hf = f"transformer.h.{index}."
        attention = ("decoder", f"layer_{index}", "self_attention")
        ffn = ("decoder", f"layer_{index}", "feed_forward")
        rules += [
            *_layer_norm(attention + ("layer_norm",), hf + "ln_1"),
            _conv1d(attention + ("qkv", "kernel"), hf + "attn.c_attn.weight"),
            _flat(attention + ("qkv_bias",), hf + "attn.c_attn.bias"),
            _conv1d(attention + ("out", "kernel"), hf + "attn.c_proj.weight", input_axes=2),
            _same(attention + ("out_bias",), hf + "attn.c_proj.bias"),
            *_layer_norm(ffn + ("layer_norm",), hf + "ln_2"),
            _conv1d(ffn + ("fc1", "kernel"), hf + "mlp.c_fc.weight"),
            _same(ffn + ("fc1_bias",), hf + "mlp.c_fc.bias"),
            _conv1d(ffn + ("fc2", "kernel"), hf + "mlp.c_proj.weight"),
            _same(ffn + ("fc2_bias",), hf + "mlp.c_proj.bias"),
        ]
    return rules + _layer_norm(("decoder", "final_layer_norm"), "transformer.ln_f")


def _rules(config: ModelConfig) -> list[_Rule]:
    return _bert_rules(config) if isinstance(config, BertConfig) else _gpt_rules(config)


def _model(config: ModelConfig) -> nn.Module:
    return BertForSequenceClassification(config) if isinstance(config, BertConfig) else GPTLMHeadModel(config)


def _init_params(config: ModelConfig, rng: jax.Array) -> Params:
    return jax.jit(_model(config).init)(rng, jnp.zeros((1, 1), jnp.int32))["params"]


def _abstract_params(config: ModelConfig) -> Params:
    return jax.eval_shape(lambda: _init_params(config, jax.random.key(0)))


def _apply_to_hf(config: ModelConfig, params: Params) -> dict[str, Any]:
    flat = flax.traverse_util.flatten_dict(params)
    state_dict = {}
    for rule in _rules(config):
        state_dict.update(zip(rule.hf_keys, rule.to_hf(flat[rule.path])))
    return state_dict


def params_to_hf(config: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """ls_jax params -> Hugging Face state dict (key -> float32 numpy array) of BertForSequenceClassification or
    GPT2LMHeadModel. GPT-2's ``lm_head.weight`` is tied to ``transformer.wte.weight`` and left out, as
    transformers saves it.
    """
    return _apply_to_hf(config, jax.tree.map(lambda leaf: np.asarray(leaf, np.float32), params))


def _hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    abstract = jax.eval_shape(lambda params: _apply_to_hf(config, params), _abstract_params(config))
    return {key: tuple(value.shape) for key, value in abstract.items()}


def _canonical_key(config: ModelConfig, key: str) -> str | None:
    """The key as BertForSequenceClassification / GPT2LMHeadModel names it, or None for a tensor to skip."""
    if isinstance(config, BertConfig):
        if key.startswith("cls.") or key.endswith("position_ids"):
            return None
        if key.endswith(".gamma") or key.endswith(".beta"):
            key = key.rsplit(".", 1)[0] + (".weight" if key.endswith(".gamma") else ".bias")
        return key if key.startswith(("bert.", "classifier.")) else "bert." + key
    if key.endswith((".attn.bias", ".attn.masked_bias")):
        return None
    return key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key


def _mismatch_report(missing: list[str], unexpected: list[str], wrong_shapes: list[str]) -> str:
    parts = []
    if missing:
        parts.append(f"missing keys {missing}")
    if unexpected:
        parts.append(f"unexpected keys {unexpected}")
    if wrong_shapes:
        parts.append(f"shape mismatches {wrong_shapes}")
    return "; ".join(parts)


def params_from_hf(
    config: ModelConfig, state_dict: Mapping[str, Any], *, rng: jax.Array | None = None
) -> Params:
    """Hugging Face state dict -> ls_jax params (float32), checked key by key and shape by shape.

    Args:
      config: the model configuration the weights must fit.
      state_dict: tensor name -> array (numpy, jax or anything ``np.asarray`` takes), with or without the
        ``bert.`` / ``transformer.`` prefix.
      rng: initializes a BERT classifier the checkpoint lacks (a pre-trained encoder); without it a missing
        classifier is an error like any other missing key.

    Raises:
      ValueError: listing missing keys, unexpected keys and shape mismatches.
    """
    tensors: dict[str, Any] = {}
    for key, value in state_dict.items():
        canonical = _canonical_key(config, key)
        if canonical is not None:
            tensors[canonical] = value
    if isinstance(config, GPTConfig) and "lm_head.weight" in tensors:
        lm_head = np.asarray(tensors.pop("lm_head.weight"), np.float32)
        if "transformer.wte.weight" in tensors and not np.array_equal(
            lm_head, np.asarray(tensors["transformer.wte.weight"], np.float32)
        ):
            raise ValueError("lm_head.weight differs from transformer.wte.weight; only tied GPT-2 heads are supported")
    expected = _hf_shapes(config)
    missing = sorted(set(expected) - set(tensors))
    fresh_head = [key for key in missing if key.startswith("classifier.")] if rng is not None else []
    missing = [key for key in missing if key not in fresh_head]
    unexpected = sorted(set(tensors) - set(expected))
    wrong_shapes = [
        f"{key}: checkpoint {tuple(np.shape(tensors[key]))}, model {expected[key]}"
        for key in sorted(set(expected) & set(tensors))
        if tuple(np.shape(tensors[key])) != expected[key]
    ]
    if missing or unexpected or wrong_shapes:
        report = _mismatch_report(missing, unexpected, wrong_shapes)
        raise ValueError(f"checkpoint does not match {type(config).__name__}: {report}")

    abstract = flax.traverse_util.flatten_dict(_abstract_params(config))
    fresh = flax.traverse_util.flatten_dict(_init_params(config, rng)) if fresh_head else {}
    if fresh_head:
        logger.warning("initialized %s from rng: the checkpoint has no classifier", fresh_head)
    flat = {}
    for rule in _rules(config):
        if rule.hf_keys[0] in fresh_head:
            flat[rule.path] = fresh[rule.path]
            continue
        parts = tuple(np.asarray(tensors[key], np.float32) for key in rule.hf_keys)
        flat[rule.path] = jnp.asarray(rule.to_flax(parts, abstract[rule.path].shape))
    return flax.traverse_util.unflatten_dict(flat)


# ---- configuration -----------------------------------------------------------------------------------------


def _activation(name: str) -> str:
    if name not in _HF_ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported are {sorted(_HF_ACTIVATIONS)}")
    return _HF_ACTIVATIONS[name]


def _require(hf: Mapping[str, Any], key: str, expected: Any, default: Any) -> None:
    if hf.get(key, default) != expected:
        raise ValueError(f"config.json has {key}={hf.get(key)!r}; only {expected!r} is supported")


def _bert_config_from_hf(hf: Mapping[str, Any]) -> BertConfig:
    _require(hf, "position_embedding_type", "absolute", "absolute")
    _require(hf, "is_decoder", False, False)
    num_labels = len(hf["id2label"]) if "id2label" in hf else hf.get("num_labels", 2)
    layer = LayerConfig.preset(
        "bert-base",
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        nhead=hf["num_attention_heads"],
        max_seq_len=hf["max_position_embeddings"],
        attn_prob_dropout_ratio=hf.get("attention_probs_dropout_prob", 0.1),
        hidden_dropout_ratio=hf.get("hidden_dropout_prob", 0.1),
        activation_fn=_activation(hf.get("hidden_act", "gelu")),
        layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
    )
    return BertConfig(
        layer=layer,
        vocab_size=hf["vocab_size"],
        num_layers=hf["num_hidden_layers"],
        type_vocab_size=hf.get("type_vocab_size", 2),
        num_labels=num_labels,
        classifier_dropout=hf.get("classifier_dropout"),
    )


def _gpt_config_from_hf(hf: Mapping[str, Any]) -> GPTConfig:
    _require(hf, "scale_attn_weights", True, True)
    _require(hf, "scale_attn_by_inverse_layer_idx", False, False)
    _require(hf, "add_cross_attention", False, False)
    _require(hf, "tie_word_embeddings", True, True)
    hidden = hf["n_embd"]
    layer = LayerConfig.preset(
        "gpt2-small",
        hidden_size=hidden,
        intermediate_size=hf.get("n_inner") or 4 * hidden,
        nhead=hf["n_head"],
        max_seq_len=hf["n_positions"],
        attn_prob_dropout_ratio=hf.get("attn_pdrop", 0.1),
        hidden_dropout_ratio=hf.get("resid_pdrop", 0.1),
        activation_fn=_activation(hf.get("activation_function", "gelu_new")),
        layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
    )
    return GPTConfig(
        layer=layer, vocab_size=hf["vocab_size"], num_layers=hf["n_layer"], embedding_dropout=hf.get("embd_pdrop", 0.1)
    )


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """A parsed Hugging Face config.json (model_type "bert" or "gpt2") -> BertConfig or GPTConfig."""
    model_type = hf.get("model_type")
    if model_type == "bert":
        return _bert_config_from_hf(hf)
    if model_type == "gpt2":
        return _gpt_config_from_hf(hf)
    raise ValueError(f"unsupported model_type {model_type!r} in config.json; supported are 'bert' and 'gpt2'")


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """BertConfig or GPTConfig -> Hugging Face config.json contents."""
    layer = config.layer
    if isinstance(config, BertConfig):
        if layer.pre_layer_norm:
            raise ValueError("Hugging Face BERT is post-LN; a pre_layer_norm=True BertConfig cannot be exported")
        return {
            "architectures": ["BertForSequenceClassification"],
            "model_type": "bert",
            "vocab_size": config.vocab_size,
            "hidden_size": layer.hidden_size,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": layer.nhead,
            "intermediate_size": layer.intermediate_size,
            "hidden_act": _BERT_EXPORT_ACTIVATIONS[layer.activation_fn],
            "hidden_dropout_prob": layer.hidden_dropout_ratio,
            "attention_probs_dropout_prob": layer.attn_prob_dropout_ratio,
            "max_position_embeddings": layer.max_seq_len,
            "type_vocab_size": config.type_vocab_size,
            "layer_norm_eps": layer.layer_norm_eps,
            "classifier_dropout": config.classifier_dropout,
            "position_embedding_type": "absolute",
            "initializer_range": 0.02,
            "pad_token_id": 0,
            "id2label": {str(index): f"LABEL_{index}" for index in range(config.num_labels)},
            "label2id": {f"LABEL_{index}": index for index in range(config.num_labels)},
        }
    if not layer.pre_layer_norm:
        raise ValueError("GPT-2 is pre-LN; a pre_layer_norm=False GPTConfig cannot be exported")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": layer.max_seq_len,
        "n_embd": layer.hidden_size,
        "n_layer": config.num_layers,
        "n_head": layer.nhead,
        "n_inner": layer.intermediate_size,
        "activation_function": _GPT_EXPORT_ACTIVATIONS[layer.activation_fn],
        "resid_pdrop": layer.hidden_dropout_ratio,
        "embd_pdrop": layer.hidden_dropout_ratio if config.embedding_dropout is None else config.embedding_dropout,
        "attn_pdrop": layer.attn_prob_dropout_ratio,
        "layer_norm_epsilon": layer.layer_norm_eps,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
    }


# ---- files -------------------------------------------------------------------------------------------------


def _weight_files(directory: Path) -> list[Path]:
    """The checkpoint's weight files: one file or the shards its index lists; safetensors preferred."""
    for name in (_SAFETENSORS, _TORCH):
        if (directory / name).is_file():
            return [directory / name]
        index = directory / (name + _INDEX_SUFFIX)
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            absent = [shard for shard in shards if not (directory / shard).is_file()]
            if absent:
                raise FileNotFoundError(f"{index} lists shards that do not exist: {absent}")
            return [directory / shard for shard in shards]
    raise FileNotFoundError(
        f"no weights in {directory}: expected {_SAFETENSORS}, {_TORCH} or a sharded {_SAFETENSORS}{_INDEX_SUFFIX}"
    )


def _read_safetensors(path: Path) -> dict[str, jax.Array]:
    try:
        from safetensors import safe_open
    except ImportError as err:
        raise ImportError(f"reading {path.name} needs the safetensors package: pip install safetensors") from err
    with safe_open(str(path), framework="flax") as file:
        return {key: file.get_tensor(key) for key in file.keys()}


def _read_torch(path: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError as err:
        raise ImportError(f"reading {path.name} needs torch: pip install torch (or convert it to safetensors)") from err
    state_dict = torch.load(path, map_location="cpu", weights_only=True)
    return {
        key: tensor.float().numpy() if tensor.is_floating_point() else tensor.numpy()
        for key, tensor in state_dict.items()
    }


def read_state_dict(directory: str | os.PathLike) -> dict[str, Any]:
    """All tensors of a Hugging Face checkpoint directory, by name."""
    state_dict: dict[str, Any] = {}
    for path in _weight_files(Path(directory)):
        state_dict.update(_read_safetensors(path) if path.suffix == ".safetensors" else _read_torch(path))
    return state_dict


def load_pretrained(
    directory: str | os.PathLike, *, rng: jax.Array | None = None, **layer_overrides: Any
) -> tuple[ModelConfig, Params]:
    """Loads a local Hugging Face BERT or GPT-2 directory into (BertConfig | GPTConfig, params).

    Args:
      directory: holds config.json and model.safetensors or pytorch_model.bin (or their sharded index).
      rng: initializes a BERT classifier the checkpoint lacks (fine-tuning from a pre-trained encoder).
      layer_overrides: LayerConfig fields to replace, e.g. ``dtype=jnp.bfloat16`` or dropout ratios.

    Raises:
      FileNotFoundError: the directory, config.json or the weights are missing.
      ValueError: an unsupported configuration, or weights that do not fit it (listing every mismatch).
    """
    directory = Path(directory)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: a Hugging Face model directory needs config.json")
    config = config_from_hf(json.loads(config_file.read_text()))
    config = dataclasses.replace(config, layer=replace_checked(config.layer, layer_overrides))
    return config, params_from_hf(config, read_state_dict(directory), rng=rng)


def save_pretrained(config: ModelConfig, params: Params, directory: str | os.PathLike) -> Path:
    """Writes config.json and model.safetensors that ``transformers``' ``from_pretrained`` loads; returns the path."""
    try:
        from safetensors.numpy import save_file
    except ImportError as err:
        raise ImportError("saving model.safetensors needs the safetensors package: pip install safetensors") from err
    directory = Path(directory)
    hf_config = config_to_hf(config)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    tensors = {key: np.ascontiguousarray(value, np.float32) for key, value in params_to_hf(config, params).items()}
    save_file(tensors, str(directory / _SAFETENSORS), metadata={"format": "pt"})
    return directory
