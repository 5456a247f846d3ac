"""BERT <-> Hugging Face ``BertForSequenceClassification``: parameter rules, checkpoint key names and config.json."""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ls_jax.layers import LayerConfig
from ls_jax.models.bert import BertConfig, BertForSequenceClassification
from ls_jax.models.hf.mapping import Family, ParamPath, Rule, activation_from_hf, layer_norm, require, same

_EXPORT_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}


def _linear(path: ParamPath, key: str, input_axes: int = 1) -> Rule:
    """A torch Linear weight (out, in) as a Dense kernel whose first ``input_axes`` axes are the input."""
    return Rule(
        path,
        (key,),
        lambda p: (p.reshape(math.prod(p.shape[:input_axes]), -1).T,),
        lambda ws, shape: ws[0].T.reshape(shape),
    )


def _stacked_linear(path: ParamPath, keys: tuple[str, ...]) -> Rule:
    """Separate Linear weights (out, in) stacked on kernel axis 1: query/key/value -> (H, 3, heads, d)."""
    return Rule(
        path,
        keys,
        lambda p: tuple(p.reshape(p.shape[0], len(keys), -1)[:, index].T for index in range(len(keys))),
        lambda ws, shape: np.stack([w.T for w in ws], axis=1).reshape(shape),
    )


def _stacked_bias(path: ParamPath, keys: tuple[str, ...]) -> Rule:
    """Separate biases stacked on axis 0: query/key/value biases -> (3, heads, d)."""
    return Rule(
        path,
        keys,
        lambda p: tuple(p.reshape(len(keys), -1)[index] for index in range(len(keys))),
        lambda ws, shape: np.stack(ws).reshape(shape),
    )


def _rules(config: BertConfig) -> list[Rule]:
    """BertForSequenceClassification's parameters <-> the tensors of transformers' model of the same name."""
    rules = [
        same(("embeddings", "word_embedding"), "bert.embeddings.word_embeddings.weight"),
        same(("embeddings", "position_embedding"), "bert.embeddings.position_embeddings.weight"),
        same(("embeddings", "token_type_embedding"), "bert.embeddings.token_type_embeddings.weight"),
        *layer_norm(("embeddings", "layer_norm"), "bert.embeddings.LayerNorm"),
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
            same(attention + ("out_bias",), hf + "attention.output.dense.bias"),
            *layer_norm(attention + ("layer_norm",), hf + "attention.output.LayerNorm"),
            _linear(ffn + ("fc1", "kernel"), hf + "intermediate.dense.weight"),
            same(ffn + ("fc1_bias",), hf + "intermediate.dense.bias"),
            _linear(ffn + ("fc2", "kernel"), hf + "output.dense.weight"),
            same(ffn + ("fc2_bias",), hf + "output.dense.bias"),
            *layer_norm(ffn + ("layer_norm",), hf + "output.LayerNorm"),
        ]
    return rules + [
        _linear(("pooler", "kernel"), "bert.pooler.dense.weight"),
        same(("pooler", "bias"), "bert.pooler.dense.bias"),
        _linear(("classifier", "kernel"), "classifier.weight"),
        same(("classifier", "bias"), "classifier.bias"),
    ]


def _canonical_key(key: str) -> str | None:
    """A checkpoint key -> BertForSequenceClassification's name for it (``bert.`` prefix, LayerNorm ``weight`` and
    ``bias`` for old checkpoints' ``gamma`` and ``beta``), or None for the pre-training heads (``cls.*``) and
    ``position_ids`` buffers, which are skipped."""
    if key.startswith("cls.") or key.endswith("position_ids"):
        return None
    if key.endswith(".gamma") or key.endswith(".beta"):
        key = key.rsplit(".", 1)[0] + (".weight" if key.endswith(".gamma") else ".bias")
    return key if key.startswith(("bert.", "classifier.")) else "bert." + key


def _config_from_hf(hf: Mapping[str, Any]) -> BertConfig:
    """A parsed BERT config.json -> BertConfig (post-LN); relative positions or a decoder raise ValueError."""
    require(hf, "position_embedding_type", "absolute", "absolute")
    require(hf, "is_decoder", False, False)
    num_labels = len(hf["id2label"]) if "id2label" in hf else hf.get("num_labels", 2)
    layer = LayerConfig.preset(
        "bert-base",
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        nhead=hf["num_attention_heads"],
        max_seq_len=hf["max_position_embeddings"],
        attn_prob_dropout_ratio=hf.get("attention_probs_dropout_prob", 0.1),
        hidden_dropout_ratio=hf.get("hidden_dropout_prob", 0.1),
        activation_fn=activation_from_hf(hf.get("hidden_act", "gelu")),
        layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
        initializer_range=hf.get("initializer_range", 0.02),
    )
    return BertConfig(
        layer=layer,
        vocab_size=hf["vocab_size"],
        num_layers=hf["num_hidden_layers"],
        type_vocab_size=hf.get("type_vocab_size", 2),
        num_labels=num_labels,
        classifier_dropout=hf.get("classifier_dropout"),
    )


def _config_to_hf(config: BertConfig) -> dict[str, Any]:
    """BertConfig -> the config.json of a BertForSequenceClassification; a pre-LN config raises ValueError."""
    layer = config.layer
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
        "hidden_act": _EXPORT_ACTIVATIONS[layer.activation_fn],
        "hidden_dropout_prob": layer.hidden_dropout_ratio,
        "attention_probs_dropout_prob": layer.attn_prob_dropout_ratio,
        "max_position_embeddings": layer.max_seq_len,
        "type_vocab_size": config.type_vocab_size,
        "layer_norm_eps": layer.layer_norm_eps,
        "classifier_dropout": config.classifier_dropout,
        "position_embedding_type": "absolute",
        "initializer_range": layer.initializer_range or 0.02,
        "pad_token_id": 0,
        "id2label": {str(index): f"LABEL_{index}" for index in range(config.num_labels)},
        "label2id": {f"LABEL_{index}": index for index in range(config.num_labels)},
    }


FAMILY = Family(
    model_type="bert",
    model=BertForSequenceClassification,
    rules=_rules,
    canonical_key=_canonical_key,
    config_from_hf=_config_from_hf,
    config_to_hf=_config_to_hf,
    optional_head=("classifier.",),
)
