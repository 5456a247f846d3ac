"""Transformer models built from ``ls_jax.layers``: the encoder-decoder translation Transformer, BERT for
sequence classification and GPT-2, with decoding (``ls_jax.models.decoding``) and Hugging Face weight import and
export (``ls_jax.models.hf``).

Token conventions (the data pipeline follows them): PAD_ID=0, BOS_ID=1, EOS_ID=2, UNK_ID=3.
"""

from ls_jax.models.bert import BertConfig, BertForSequenceClassification
from ls_jax.models.gpt import GPTConfig, GPTLMHeadModel
from ls_jax.models.tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from ls_jax.models.transformer import PRESETS, Transformer, TransformerConfig

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "PRESETS",
    "UNK_ID",
    "BertConfig",
    "BertForSequenceClassification",
    "GPTConfig",
    "GPTLMHeadModel",
    "Transformer",
    "TransformerConfig",
]
