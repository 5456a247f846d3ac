"""BERT for ``python -m train.imdb``: the model from a preset or a local Hugging Face checkpoint, as ls_jax's BERT or
the plain Flax one (`Classifier`), the classification loss and the FLOPs of a step."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from ls_jax.layers import LayerConfig
from ls_jax.models import BertConfig, BertForSequenceClassification, hf
from train.costs import metrics
from train.costs.precision import PRECISION_DTYPES, fp8_gemms
from train.errors import UsageError
from train.harness import resume
from train.imdb.config import PRESETS, ImdbConfig
from train.reference import from_ls_jax
from train.reference.zoo import ReferenceBert, ZooConfig


def _layer_overrides(config: ImdbConfig, precision: str) -> dict[str, Any]:
    overrides: dict[str, Any] = {
        "dtype": PRECISION_DTYPES[precision],
        "fp8": fp8_gemms(precision),
        "remat": config.remat,
    }
    if config.dropout is not None:
        overrides.update(hidden_dropout_ratio=config.dropout, attn_prob_dropout_ratio=config.dropout)
    return overrides


def preset_config(name: str, *, vocab_size: int, num_labels: int, **layer_overrides: Any) -> BertConfig:
    """A BertConfig of ``PRESETS[name]`` with the vocabulary, labels and LayerConfig fields given."""
    preset = PRESETS[name]
    layer = LayerConfig.preset(preset["base"], **preset["layer"], **layer_overrides)
    depth = {"num_layers": preset["num_layers"]} if "num_layers" in preset else {}
    return BertConfig.preset(preset["base"], layer=layer, vocab_size=vocab_size, num_labels=num_labels, **depth)


def build_model(
    config: ImdbConfig, vocab_size: int, precision: str, rng: jax.Array
) -> tuple[BertConfig, dict[str, Any] | None]:
    """(model config, pretrained params or None for a random initialization)."""
    overrides = _layer_overrides(config, precision)
    if not config.init_from:
        return preset_config(config.preset, vocab_size=vocab_size, num_labels=config.num_labels or 2, **overrides), None
    try:
        model_cfg, params = hf.load_pretrained(config.init_from, rng=rng, num_labels=config.num_labels, **overrides)
    except ValueError as err:
        raise UsageError(f"--init-from {config.init_from}: {err}") from err
    if not isinstance(model_cfg, BertConfig):
        raise UsageError(f"--init-from {config.init_from} holds a {type(model_cfg).__name__}, not a BERT model")
    if vocab_size > model_cfg.vocab_size:
        raise UsageError(
            f"--init-from {config.init_from}: the tokenizer has {vocab_size} tokens but the model "
            f"only {model_cfg.vocab_size} embeddings"
        )
    return model_cfg, params


@dataclasses.dataclass(frozen=True)
class Classifier:
    """A BERT for sequence classification, ls_jax's or the plain Flax one of `train.reference.zoo` (written as
    Hugging Face's Flax BERT is), called one way on right-padded rows."""

    module: nn.Module
    implementation: str  # "ls_jax" or "flax"
    pad_id: int

    def logits(
        self, variables: Any, input_ids: jax.Array, *, deterministic: bool, rng: jax.Array | None = None
    ) -> jax.Array:
        """input_ids (B, T) int, each row's tokens then ``pad_id`` -> logits (B, num_labels) of the model's Flax
        ``variables``; dropout from ``rng`` unless ``deterministic``."""
        rngs = None if rng is None else {"dropout": rng}
        # Padding as each row's length: cuDNN's attention masks it without a (B, T) bias tensor.
        lengths = jnp.sum(input_ids != self.pad_id, axis=-1, dtype=jnp.int32)
        if self.implementation == "flax":
            return self.module.apply(variables, input_ids, lengths, deterministic, rngs=rngs)
        return self.module.apply(variables, input_ids, lengths=lengths, deterministic=deterministic, rngs=rngs)

    def init(self, key: jax.Array, seq_len: int) -> Any:
        """Random variables (parameters, and an FP8 model's scaling state) for rows of ``seq_len`` tokens."""
        return self.module.init(key, jnp.ones((1, seq_len), jnp.int32), None)


def build_classifier(config: ImdbConfig, model_cfg: BertConfig, pretrained: Any, pad_id: int) -> tuple[Classifier, Any]:
    """The model of ``--implementation`` for ``model_cfg``, and the pretrained parameters (None: random) in its
    layout.

    Raises:
      UsageError: the plain Flax BERT cannot compute this checkpoint's model (another activation, dropout).
    """
    if config.implementation == "ls_jax":
        return Classifier(BertForSequenceClassification(model_cfg), "ls_jax", pad_id), pretrained
    try:
        reference = reference_config(model_cfg)
    except ValueError as err:
        raise UsageError(f"--implementation flax with --init-from {config.init_from}: {err}") from err
    module = ReferenceBert(reference, num_labels=model_cfg.num_labels, type_vocab_size=model_cfg.type_vocab_size)
    params = None if pretrained is None else from_ls_jax.bert_params(pretrained)
    return Classifier(module, "flax", pad_id), params


def reference_config(model_cfg: BertConfig) -> ZooConfig:
    """The plain Flax BERT's configuration for ``model_cfg`` (`train.reference.from_ls_jax.zoo_config`).

    Raises:
      ValueError: the model differs from what the reference fixes, or its classifier dropout differs from the
        hidden dropout (the reference drops the pooled vector by the hidden ratio).
    """
    layer = model_cfg.layer
    if model_cfg.classifier_dropout not in (None, layer.hidden_dropout_ratio):
        raise ValueError(
            f"the plain Flax bert cannot compute this model: classifier dropout "
            f"{model_cfg.classifier_dropout} (the reference's: the hidden dropout)"
        )
    return from_ls_jax.zoo_config(layer, kind="bert", vocab_size=model_cfg.vocab_size, num_layers=model_cfg.num_layers)


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


def make_loss_fn(classifier: Classifier):
    """The loop's loss: summed cross entropy per example, with the training accuracy as a reported sum."""

    def loss_fn(variables, batch, rng):
        logits = classifier.logits(variables, batch["input_ids"], deterministic=False, rng=rng)
        loss_sum, examples, correct = classification_sums(logits, batch["labels"])
        return loss_sum, examples, {"nll": loss_sum, "accuracy": correct}

    return loss_fn


def make_flops_fn(model_cfg: BertConfig):
    """Matmul FLOPs of a step: the encoder as in docs/flops.md, plus the pooler and classifier on [CLS]."""
    layer = model_cfg.layer

    def flops(shapes: Mapping[str, tuple[int, ...]]) -> float:
        grad_accum, rows, length = shapes["input_ids"]
        encoder = metrics.transformer_train_flops(
            batch=rows,
            src_len=length,
            tgt_len=0,
            hidden=layer.hidden_size,
            ffn=layer.intermediate_size,
            encoder_layers=model_cfg.num_layers,
            decoder_layers=0,
            vocab=0,
        )
        head = 3 * 2 * rows * layer.hidden_size * (layer.hidden_size + model_cfg.num_labels)
        return grad_accum * (encoder + head)

    return flops
