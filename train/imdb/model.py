"""BERT for ``python -m train.imdb``: the presets, the model from a preset or a local Hugging Face checkpoint, the
classification loss and the FLOPs of a step."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax

from ls_jax.layers import LayerConfig
from ls_jax.models import BertConfig, BertForSequenceClassification, hf
from train.costs import metrics
from train.harness import resume
from train.errors import UsageError
from train.costs.precision import PRECISION_DTYPES
from train.imdb.config import PRESETS, ImdbConfig

def _layer_overrides(config: ImdbConfig, precision: str) -> dict[str, Any]:
    overrides: dict[str, Any] = {"dtype": PRECISION_DTYPES[precision], "remat": config.remat}
    if config.dropout is not None:
        overrides.update(hidden_dropout_ratio=config.dropout, attn_prob_dropout_ratio=config.dropout)
    return overrides


def preset_config(name: str, *, vocab_size: int, num_labels: int, **layer_overrides: Any) -> BertConfig:
    """A BertConfig of ``PRESETS[name]`` with the vocabulary, labels and LayerConfig fields given."""
    preset = PRESETS[name]
    layer = LayerConfig.preset(preset["base"], **preset["layer"], **layer_overrides)
    depth = {"num_layers": preset["num_layers"]} if "num_layers" in preset else {}
    return BertConfig.preset(preset["base"], layer=layer, vocab_size=vocab_size, num_labels=num_labels, **depth)


def build_model(config: ImdbConfig, vocab_size: int, precision: str, rng: jax.Array
                ) -> tuple[BertConfig, dict[str, Any] | None]:
    """(model config, pretrained params or None for a random initialization)."""
    overrides = _layer_overrides(config, precision)
    if not config.init_from:
        return preset_config(config.preset, vocab_size=vocab_size, num_labels=config.num_labels or 2,
                             **overrides), None
    try:
        model_cfg, params = hf.load_pretrained(config.init_from, rng=rng, **overrides)
    except ValueError as err:
        raise UsageError(f"--init-from {config.init_from}: {err}") from err
    if not isinstance(model_cfg, BertConfig):
        raise UsageError(f"--init-from {config.init_from} holds a {type(model_cfg).__name__}, not a BERT model")
    if vocab_size > model_cfg.vocab_size:
        raise UsageError(f"--init-from {config.init_from}: the tokenizer has {vocab_size} tokens but the model "
                         f"only {model_cfg.vocab_size} embeddings")
    return model_cfg, params


def model_signature(config: ImdbConfig, model_cfg: BertConfig) -> dict[str, Any]:
    stack = resume.stack_signature(config, model_cfg.vocab_size, model_cfg.layer, model_cfg.num_layers)
    return {**stack, "num_labels": model_cfg.num_labels}


def classification_sums(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(summed cross entropy, examples, correct predictions) over the rows whose label is >= 0.

    logits (B, num_labels), labels (B,) int with -1 for empty rows; the loss is computed in float32.
    """
    real = labels >= 0
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), jnp.maximum(labels, 0))
    correct = real & (jnp.argmax(logits, axis=-1) == labels)
    return jnp.sum(jnp.where(real, losses, 0.0)), jnp.sum(real), jnp.sum(correct)


def make_loss_fn(model: BertForSequenceClassification, pad_id: int):
    """The loop's loss: summed cross entropy per example, with the training accuracy as a reported sum."""

    def loss_fn(params, batch, rng):
        input_ids = batch["input_ids"]
        logits = model.apply(
            {"params": params}, input_ids, input_ids != pad_id, deterministic=False, rngs={"dropout": rng}
        )
        loss_sum, examples, correct = classification_sums(logits, batch["labels"])
        return loss_sum, examples, {"nll": loss_sum, "accuracy": correct}

    return loss_fn


def make_flops_fn(model_cfg: BertConfig):
    """Matmul FLOPs of a step: the encoder as in docs/flops.md, plus the pooler and classifier on [CLS]."""
    layer = model_cfg.layer

    def flops(shapes: Mapping[str, tuple[int, ...]]) -> float:
        grad_accum, rows, length = shapes["input_ids"]
        encoder = metrics.transformer_train_flops(
            batch=rows, src_len=length, tgt_len=0, hidden=layer.hidden_size, ffn=layer.intermediate_size,
            encoder_layers=model_cfg.num_layers, decoder_layers=0, vocab=0,
        )
        head = 3 * 2 * rows * layer.hidden_size * (layer.hidden_size + model_cfg.num_labels)
        return grad_accum * (encoder + head)

    return flops
