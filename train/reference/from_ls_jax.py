"""ls_jax's models as the plain Flax references: the reference configuration of an ls_jax model's shape, dropout and
compute dtype, and ls_jax's BERT and GPT-2 parameters in the references' layout (so weights loaded for the ls_jax
model, e.g. from Hugging Face, start the reference too).

The parameter layouts hold the same arrays; ls_jax fuses the query, key and value projections of a layer into one
kernel (H, 3, heads, d) and bias (3, heads, d), keeps biases beside their kernels and each LayerNorm inside the
sublayer it closes. ls_jax's configurations are read by attribute and its trees as nested dicts: no ls_jax code.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

from train.reference.transformer import ReferenceConfig
from train.reference.zoo import ZooConfig

Params = Mapping[str, Any]
PROJECTIONS = ("query", "key", "value")  # the order of the fused QKV kernel's axis 1
# What the references of train/reference/zoo.py fix, as ls_jax LayerConfig fields: BERT's post-LN layer with exact
# GELU and GPT-2's pre-LN layer with tanh GELU, neither with dropout after the feed-forward activation.
FIXED_LAYER_FIELDS: dict[str, dict[str, Any]] = {
    "bert": {
        "pre_layer_norm": False,
        "activation_fn": "gelu",
        "layer_norm_eps": 1e-12,
        "activation_dropout_ratio": 0.0,
    },
    "gpt": {
        "pre_layer_norm": True,
        "activation_fn": "gelu_tanh",
        "layer_norm_eps": 1e-5,
        "activation_dropout_ratio": 0.0,
    },
}


def zoo_config(layer: Any, *, kind: Literal["bert", "gpt"], vocab_size: int, num_layers: int) -> ZooConfig:
    """The plain Flax BERT or GPT-2 (``kind``) of an ls_jax model with ``layer`` (a LayerConfig): its shape,
    positions (``layer.max_seq_len``), dropout ratios and compute dtype, with the "einsum" attention core (Hugging
    Face Flax's).

    Raises:
      ValueError: naming the fields of ``layer`` that differ from what the reference fixes.
    """
    differ = [
        f"{name} {getattr(layer, name)!r} (the reference's: {value!r})"
        for name, value in FIXED_LAYER_FIELDS[kind].items()
        if getattr(layer, name) != value
    ]
    if differ:
        raise ValueError(f"the plain Flax {kind} cannot compute this model: {', '.join(differ)}")
    return ZooConfig(
        vocab_size=vocab_size,
        hidden_size=layer.hidden_size,
        intermediate_size=layer.intermediate_size,
        num_heads=layer.nhead,
        num_layers=num_layers,
        max_positions=layer.max_seq_len,
        dropout_rate=layer.hidden_dropout_ratio,
        attention_dropout_rate=layer.attn_prob_dropout_ratio,
        attention="einsum",
        dtype=layer.dtype,
        fp8=layer.fp8,
    )


def transformer_config(model_cfg: Any) -> ReferenceConfig:
    """The plain Flax Transformer of an ls_jax ``TransformerConfig`` (pre-LN, ReLU, sinusoids, one shared and tied
    embedding): its shape, positions, dropout and compute dtype.

    Raises:
      ValueError: the model differs from what the reference fixes, or its dropout ratios differ (the reference has
        one).
    """
    layer = model_cfg.layer
    fixed = {
        "pre_layer_norm": (layer.pre_layer_norm, True),
        "activation_fn": (layer.activation_fn, "relu"),
        "share_embeddings": (model_cfg.share_embeddings, True),
        "tie_output": (model_cfg.tie_output, True),
        "learned_positions": (model_cfg.learned_positions, False),
        "scale_embedding": (model_cfg.scale_embedding, True),
    }
    differ = [f"{name} {got!r} (the reference's: {want!r})" for name, (got, want) in fixed.items() if got != want]
    ratios = {layer.hidden_dropout_ratio, layer.attn_prob_dropout_ratio, layer.activation_dropout_ratio}
    if len(ratios) > 1:
        differ.append(f"dropout ratios {sorted(ratios)} (the reference has one)")
    if differ:
        raise ValueError(f"the plain Flax Transformer cannot compute this model: {', '.join(differ)}")
    return ReferenceConfig(
        vocab_size=model_cfg.vocab_size,
        hidden_size=layer.hidden_size,
        intermediate_size=layer.intermediate_size,
        num_heads=layer.nhead,
        num_encoder_layers=model_cfg.num_encoder_layers,
        num_decoder_layers=model_cfg.num_decoder_layers,
        dropout_rate=layer.hidden_dropout_ratio,
        max_len=layer.max_seq_len,
        dtype=layer.dtype,
        fp8=layer.fp8,
    )


def _attention(attention: Params) -> dict[str, Any]:
    """An ls_jax ``self_attention`` block -> the reference's query, key, value and out projections."""
    kernel, bias = attention["qkv"]["kernel"], attention["qkv_bias"]
    projections = {name: {"kernel": kernel[:, index], "bias": bias[index]} for index, name in enumerate(PROJECTIONS)}
    return {**projections, "out": {"kernel": attention["out"]["kernel"], "bias": attention["out_bias"]}}


def _layer(layer: Params) -> dict[str, Any]:
    """One ls_jax encoder or decoder layer -> the reference's (BertLayer or GPTBlock)."""
    attention, feed_forward = layer["self_attention"], layer["feed_forward"]
    return {
        "self_attention": _attention(attention),
        "attention_layer_norm": attention["layer_norm"],
        "feed_forward": {
            name: {"kernel": feed_forward[name]["kernel"], "bias": feed_forward[f"{name}_bias"]}
            for name in ("fc1", "fc2")
        },
        "output_layer_norm": feed_forward["layer_norm"],
    }


def bert_params(params: Params) -> dict[str, Any]:
    """``ls_jax.models.BertForSequenceClassification`` params -> ``ReferenceBert`` params."""
    embeddings = params["embeddings"]
    return {
        "word_embedding": {"embedding": embeddings["word_embedding"]},
        "position_embedding": {"embedding": embeddings["position_embedding"]},
        "token_type_embedding": {"embedding": embeddings["token_type_embedding"]},
        "embedding_layer_norm": embeddings["layer_norm"],
        **{name: _layer(layer) for name, layer in params["encoder"].items()},
        "pooler": params["pooler"],
        "classifier": params["classifier"],
    }


def gpt_params(params: Params) -> dict[str, Any]:
    """``ls_jax.models.GPTLMHeadModel`` params -> ``ReferenceGPT`` params."""
    decoder = params["decoder"]
    return {
        "token_embedding": {"embedding": params["embedding"]["embedding"]},
        "position_embedding": {"embedding": params["embedding"]["position_embedding"]},
        **{name: _layer(layer) for name, layer in decoder.items() if name != "final_layer_norm"},
        "final_layer_norm": decoder["final_layer_norm"],
    }
