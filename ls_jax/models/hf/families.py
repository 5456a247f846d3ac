"""The supported model families by config class, and the public conversions of params and config, which pick the
family of the config (or of config.json's ``model_type``) here and nowhere else."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from ls_jax.models.bert import BertConfig
from ls_jax.models.gpt import GPTConfig
from ls_jax.models.hf import bert, gpt2
from ls_jax.models.hf.mapping import Family, ModelConfig, Params

FAMILIES: dict[type, Family] = {BertConfig: bert.FAMILY, GPTConfig: gpt2.FAMILY}


def _family(config: ModelConfig) -> Family:
    """The family of ``config``'s class; TypeError for any other config."""
    for config_class, family in FAMILIES.items():
        if isinstance(config, config_class):
            return family
    supported = " and ".join(config_class.__name__ for config_class in FAMILIES)
    raise TypeError(f"unsupported config {type(config).__name__}; supported are {supported}")


def params_to_hf(config: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """ls_jax params -> Hugging Face state dict (key -> float32 numpy array) of BertForSequenceClassification or
    GPT2LMHeadModel. GPT-2's ``lm_head.weight`` is tied to ``transformer.wte.weight`` and left out, as
    transformers saves it.
    """
    return _family(config).params_to_hf(config, params)


def params_from_hf(config: ModelConfig, state_dict: Mapping[str, Any], *, rng: jax.Array | None = None) -> Params:
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
    return _family(config).params_from_hf(config, state_dict, rng=rng)


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """A parsed Hugging Face config.json (model_type "bert" or "gpt2") -> BertConfig or GPTConfig."""
    model_type = hf.get("model_type")
    for family in FAMILIES.values():
        if family.model_type == model_type:
            return family.config_from_hf(hf)
    supported = " and ".join(repr(family.model_type) for family in FAMILIES.values())
    raise ValueError(f"unsupported model_type {model_type!r} in config.json; supported are {supported}")


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """BertConfig or GPTConfig -> Hugging Face config.json contents."""
    return _family(config).config_to_hf(config)
