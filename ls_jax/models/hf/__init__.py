"""Hugging Face weight import and export for BERT (``BertForSequenceClassification``) and GPT-2 (``GPT2LMHeadModel``).

    config, params = load_pretrained("path/to/bert-dir", dtype=jnp.bfloat16)   # config.json + weights
    save_pretrained(config, params, "path/to/out")      # transformers' from_pretrained loads it

No network and no ``transformers`` are needed: config.json is read as JSON and weights come from
model.safetensors (``safetensors``) or pytorch_model.bin (``torch``), sharded or not. Missing or unexpected
weights and shape mismatches raise ValueError listing them. Weights a checkpoint may carry that these models
do not use are skipped: BERT's pre-training heads (``cls.*``) and GPT-2's attention-mask buffers. A BERT
checkpoint without a classifier (a pre-trained encoder) loads when ``rng`` is given to initialize one.

Modules: ``checkpoint`` (files), ``families`` (the conversions, by config class), ``bert`` and ``gpt2`` (each
family's parameter rules and config.json), ``mapping`` (the rules' machinery both families share).
"""

from ls_jax.models.hf.checkpoint import load_pretrained, read_state_dict, save_pretrained
from ls_jax.models.hf.families import config_from_hf, config_to_hf, params_from_hf, params_to_hf
from ls_jax.models.hf.mapping import ModelConfig, Params

__all__ = [
    "ModelConfig",
    "Params",
    "config_from_hf",
    "config_to_hf",
    "load_pretrained",
    "params_from_hf",
    "params_to_hf",
    "read_state_dict",
    "save_pretrained",
]
