"""GPT-2 <-> Hugging Face ``GPT2LMHeadModel``: parameter rules, checkpoint key names and config.json."""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ls_jax.layers import LayerConfig
from ls_jax.models.gpt import GPTConfig, GPTLMHeadModel
from ls_jax.models.hf.mapping import Family, ParamPath, Rule, activation_from_hf, layer_norm, require, same

_EXPORT_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new"}


def _flat(path: ParamPath, key: str) -> Rule:
    """A vector stored as a multi-axis parameter: the fused QKV bias (3H,) -> (3, heads, d)."""
    return Rule(path, (key,), lambda p: (p.reshape(-1),), lambda ws, shape: ws[0].reshape(shape))


def _conv1d(path: ParamPath, key: str, input_axes: int = 1) -> Rule:
    """A Conv1D weight (in, out) as a Dense kernel whose first ``input_axes`` axes are the input."""
    return Rule(
        path,
        (key,),
        lambda p: (p.reshape(math.prod(p.shape[:input_axes]), -1),),
        lambda ws, shape: ws[0].reshape(shape),
    )


def _rules(config: GPTConfig) -> list[Rule]:
    """GPTLMHeadModel's parameters <-> the tensors of transformers' GPT2LMHeadModel (``lm_head`` tied, left out)."""
    rules = [
        same(("embedding", "embedding"), "transformer.wte.weight"),
        same(("embedding", "position_embedding"), "transformer.wpe.weight"),
    ]
    for index in range(config.num_layers):
        hf = f"transformer.h.{index}."
        attention = ("decoder", f"layer_{index}", "self_attention")
        ffn = ("decoder", f"layer_{index}", "feed_forward")
        rules += [
            *layer_norm(attention + ("layer_norm",), hf + "ln_1"),
            _conv1d(attention + ("qkv", "kernel"), hf + "attn.c_attn.weight"),
            _flat(attention + ("qkv_bias",), hf + "attn.c_attn.bias"),
            _conv1d(attention + ("out", "kernel"), hf + "attn.c_proj.weight", input_axes=2),
            same(attention + ("out_bias",), hf + "attn.c_proj.bias"),
            *layer_norm(ffn + ("layer_norm",), hf + "ln_2"),
            _conv1d(ffn + ("fc1", "kernel"), hf + "mlp.c_fc.weight"),
            same(ffn + ("fc1_bias",), hf + "mlp.c_fc.bias"),
            _conv1d(ffn + ("fc2", "kernel"), hf + "mlp.c_proj.weight"),
            same(ffn + ("fc2_bias",), hf + "mlp.c_proj.bias"),
        ]
    return rules + layer_norm(("decoder", "final_layer_norm"), "transformer.ln_f")


def _canonical_key(key: str) -> str | None:
    """A checkpoint key -> GPT2LMHeadModel's name for it (``transformer.`` prefix), or None for the attention-mask
    buffers (``attn.bias``, ``attn.masked_bias``), which are skipped."""
    if key.endswith((".attn.bias", ".attn.masked_bias")):
        return None
    return key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key


def _drop_tied_head(tensors: dict[str, Any]) -> None:
    """Removes ``lm_head.weight``, which must equal the token embedding it is tied to."""
    if "lm_head.weight" not in tensors:
        return
    lm_head = np.asarray(tensors.pop("lm_head.weight"), np.float32)
    if "transformer.wte.weight" in tensors and not np.array_equal(
        lm_head, np.asarray(tensors["transformer.wte.weight"], np.float32)
    ):
        raise ValueError("lm_head.weight differs from transformer.wte.weight; only tied GPT-2 heads are supported")


def _config_from_hf(hf: Mapping[str, Any]) -> GPTConfig:
    """A parsed GPT-2 config.json -> GPTConfig (pre-LN, tied embeddings); other attention variants raise ValueError."""
    require(hf, "scale_attn_weights", True, True)
    require(hf, "scale_attn_by_inverse_layer_idx", False, False)
    require(hf, "add_cross_attention", False, False)
    require(hf, "tie_word_embeddings", True, True)
    hidden = hf["n_embd"]
    layer = LayerConfig.preset(
        "gpt2-small",
        hidden_size=hidden,
        intermediate_size=hf.get("n_inner") or 4 * hidden,
        nhead=hf["n_head"],
        max_seq_len=hf["n_positions"],
        attn_prob_dropout_ratio=hf.get("attn_pdrop", 0.1),
        hidden_dropout_ratio=hf.get("resid_pdrop", 0.1),
        initializer_range=hf.get("initializer_range", 0.02),
        activation_fn=activation_from_hf(hf.get("activation_function", "gelu_new")),
        layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
    )
    return GPTConfig(
        layer=layer, vocab_size=hf["vocab_size"], num_layers=hf["n_layer"], embedding_dropout=hf.get("embd_pdrop", 0.1)
    )


def _config_to_hf(config: GPTConfig) -> dict[str, Any]:
    """GPTConfig -> the config.json of a GPT2LMHeadModel; a post-LN config raises ValueError."""
    layer = config.layer
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
        "activation_function": _EXPORT_ACTIVATIONS[layer.activation_fn],
        "resid_pdrop": layer.hidden_dropout_ratio,
        "embd_pdrop": layer.hidden_dropout_ratio if config.embedding_dropout is None else config.embedding_dropout,
        "attn_pdrop": layer.attn_prob_dropout_ratio,
        "layer_norm_epsilon": layer.layer_norm_eps,
        "initializer_range": layer.initializer_range or 0.02,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
    }


FAMILY = Family(
    model_type="gpt2",
    model=GPTLMHeadModel,
    rules=_rules,
    canonical_key=_canonical_key,
    config_from_hf=_config_from_hf,
    config_to_hf=_config_to_hf,
    drop_tied_weights=_drop_tied_head,
)
