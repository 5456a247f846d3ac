"""The models `train.bench.scaling` trains, with one device's synthetic batch and the layers whose backward the
overlap estimate (`train.bench.steps.overlap`) is built from.

``big-6e6d``: Transformer-big, 6 + 6 layers, 64-token sentences over a 32,768-piece vocabulary unless told
otherwise (``tiny-2e2d``: the same shape of step, small enough for a CPU). ``bert-base``: sequence classification
(``bert-tiny``: for a CPU). All bf16 activations.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.layers.transformer import TransformerDecoderLayer, TransformerEncoderLayer
from ls_jax.models import BertForSequenceClassification, Transformer
from train.bench.steps import transformer_steps, zoo_steps
from train.imdb import model as imdb_model
from train.wmt import model as wmt_model
from train.wmt.config import WmtConfig

BERT_VOCAB = zoo_steps.MODELS["bert-base"].vocab
TRANSFORMER_PRESETS = {"big-6e6d": "transformer-big", "tiny-2e2d": "transformer-tiny"}
BERT_PRESETS = {"bert-base": "bert-base", "bert-tiny": "bert-tiny"}
MODELS = (*TRANSFORMER_PRESETS, *BERT_PRESETS)


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """One kind of repeated layer: its module, how many the model has, where their params sit, and example
    inputs of one device's batch (the first is the activation the layer's backward also differentiates)."""

    name: str
    module: Any
    count: int
    param_path: Callable[[int], tuple[str, ...]]  # layer index -> keys of its params in the model's tree
    inputs: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class BenchModel:
    """A model of the benchmark on one device's batch (leading grad-accumulation axis of 1)."""

    name: str
    module: Any
    loss_fn: Callable
    batch: dict[str, np.ndarray]
    tokens_per_device: int
    layers: tuple[LayerKind, ...]  # in backward order: the last kind's layers finish their backward last

    def init_params(self) -> Any:
        keys = ("src", "tgt_in") if "src" in self.batch else ("input_ids",)
        inputs = [jnp.asarray(self.batch[key][0, :1]) for key in keys]
        return jax.jit(self.module.init)(jax.random.PRNGKey(0), *inputs)["params"]


def rows_and_length(
    name: str,
    tokens_per_device: int,
    bert_batch: int,
    bert_length: int,
    sentence_length: int = transformer_steps.SEQ_LEN,
) -> tuple[int, int]:
    """One device's (rows, tokens per row) of model ``name``: a Transformer's ``tokens_per_device`` in sentences of
    ``sentence_length``."""
    if name in TRANSFORMER_PRESETS:
        return tokens_per_device // sentence_length, sentence_length
    return bert_batch, bert_length


def build(name: str, rows: int, length: int, vocab: int = transformer_steps.VOCAB) -> BenchModel:
    """Model ``name`` (a key of MODELS) with random tokens for one device: ``rows`` rows of ``length``; a
    Transformer's vocabulary has ``vocab`` pieces."""
    if name in TRANSFORMER_PRESETS:
        return _transformer(name, rows, length, vocab)
    if name in BERT_PRESETS:
        return _bert(name, rows, length)
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def _transformer(name: str, rows: int, length: int, vocab: int) -> BenchModel:
    rng = np.random.default_rng(0)
    config = wmt_model.model_config(
        WmtConfig(preset=TRANSFORMER_PRESETS[name], dropout=0.1, remat="none"), vocab, "bf16"
    )
    module = Transformer(config)
    tokens = rng.integers(4, vocab, size=(1, rows, length), dtype=np.int32)
    batch = {"src": tokens, "tgt_in": tokens, "labels": np.roll(tokens, -1, axis=-1)}
    layer = config.layer
    x = jnp.zeros((rows, length, layer.hidden_size), jnp.bfloat16)
    mask = jnp.ones((rows, length), bool)
    key_value = jnp.zeros((rows, length, 2, layer.nhead, layer.head_dim), jnp.bfloat16)
    layers = (
        LayerKind(
            "decoder layer",
            TransformerDecoderLayer(layer),
            config.num_decoder_layers,
            lambda i: ("decoder", f"layer_{i}"),
            (x, key_value, mask),
        ),
        LayerKind(
            "encoder layer",
            TransformerEncoderLayer(layer),
            config.num_encoder_layers,
            lambda i: ("encoder", f"layer_{i}"),
            (x, mask),
        ),
    )
    return BenchModel(
        name,
        module,
        wmt_model.make_loss_fn(module, wmt_model.make_criterion("ls_jax", 0.1)),
        batch,
        rows * length,
        layers,
    )


def _bert(name: str, rows: int, length: int) -> BenchModel:
    rng = np.random.default_rng(0)
    config = imdb_model.preset_config(BERT_PRESETS[name], vocab_size=BERT_VOCAB, num_labels=2, dtype=jnp.bfloat16)
    module = BertForSequenceClassification(config)
    batch = {
        "input_ids": rng.integers(5, BERT_VOCAB, size=(1, rows, length), dtype=np.int32),
        "labels": rng.integers(0, 2, size=(1, rows), dtype=np.int32),
    }
    x = jnp.zeros((rows, length, config.layer.hidden_size), jnp.bfloat16)
    layers = (
        LayerKind(
            "encoder layer",
            TransformerEncoderLayer(config.layer),
            config.num_layers,
            lambda i: ("encoder", f"layer_{i}"),
            (x, jnp.ones((rows, length), bool)),
        ),
    )
    return BenchModel(
        name,
        module,
        imdb_model.make_loss_fn(imdb_model.Classifier(module, "ls_jax", pad_id=0)),
        batch,
        rows * length,
        layers,
    )


def subtree(params: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        params = params[key]
    return params


def layer_params(model: BenchModel, params: Any) -> tuple[dict[str, Any], Any]:
    """({layer kind: the params of its first layer}, every param that belongs to no repeated layer)."""
    first = {kind.name: subtree(params, kind.param_path(0)) for kind in model.layers}
    in_layers = {kind.param_path(i) for kind in model.layers for i in range(kind.count)}

    def rest(tree: Any, prefix: tuple[str, ...]) -> Any:
        if prefix in in_layers:
            return None
        if not isinstance(tree, dict):
            return tree
        kept = {key: rest(value, (*prefix, key)) for key, value in tree.items()}
        return {key: value for key, value in kept.items() if value is not None} or None

    return first, rest(params, ()) or {}


def tree_bytes(tree: Any) -> int:
    return int(sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)))
