"""BERT and GPT-2 training steps the end-to-end benchmark compares, built several ways on the same batches.

BERT-base fine-tuning for sequence classification (2 labels, rows padded at the end to the sequence length) and
GPT-2 language modelling (full rows, next-token loss); dropout 0.1, AdamW, bf16 compute with f32 params:
  flax        train/reference/zoo.py with the "einsum" attention core, as Flax and Hugging Face Flax write it
              (attention dropout 0.1), optax AdamW, f32 params cast to bf16 for every use;
  flax_cudnn  the same model with ``jax.nn.dot_product_attention(implementation="cudnn")``, the fastest plain JAX
              attention, which has no dropout: this reference drops no attention probabilities;
  ls_jax_xla  ls_jax.models.BertForSequenceClassification / GPTLMHeadModel with ls_jax.optim over f32 master
              weights, every op on its XLA implementation (attention dropout 0.1);
  ls_jax_ffi  the same with the CUDA kernels;
  ls_jax_ffi_fp8  the same with every Dense and the tied logits in FP8 (`ls_jax.layers.fp8`; named in
              ``--implementations`` only);
  torch_compile  Hugging Face transformers' PyTorch model of the same config under ``torch.compile``, bf16
              autocast, fused AdamW (`train.bench.steps.torch_steps` builds it: not a JAX step).
The loss runs under the ``criterion`` name scope and the optimizer under ``optimizer`` (`kernel_trace` reads them).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

from train.bench.steps import token_ids as token_ids_lib
from train.bench.steps.transformer_steps import TrainStep, ls_jax_adamw_step, optax_adamw_step
from train.bench.steps.transformer_steps import kernel_mode as kernel_mode  # the same ls_jax_ffi* rule
from train.reference.zoo import ReferenceBert, ReferenceGPT, ZooConfig

FP8_IMPLEMENTATIONS = ("ls_jax_ffi_fp8",)
TORCH_IMPLEMENTATIONS = ("torch_compile",)
"""Rows of PyTorch steps (`train.bench.steps.torch_steps`): `build_step` builds the others."""
IMPLEMENTATIONS = ("flax", "flax_cudnn", "ls_jax_xla", "ls_jax_ffi", *TORCH_IMPLEMENTATIONS, *FP8_IMPLEMENTATIONS)
JAX_IMPLEMENTATIONS = tuple(i for i in IMPLEMENTATIONS if i not in TORCH_IMPLEMENTATIONS)
REFERENCE = "flax"
"""The implementation the speedups of `train.bench.e2e` are stated against first."""
DROPOUT = 0.1


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """A BERT or GPT-2 shape, its default sequence lengths and batch rows."""

    kind: Literal["bert", "gpt"]
    hidden: int
    intermediate: int
    heads: int
    layers: int
    vocab: int
    max_positions: int
    seq_lens: tuple[int, ...]
    rows: int


MODELS = {
    "bert-base": ZooModel("bert", 768, 3072, 12, 12, 30522, 512, (128, 512), 32),
    "gpt2-small": ZooModel("gpt", 768, 3072, 12, 12, 50257, 1024, (1024,), 8),
    # --quick only: CPU smoke runs of the whole benchmark
    "bert-tiny": ZooModel("bert", 64, 128, 4, 2, 512, 64, (64,), 4),
    "gpt2-tiny": ZooModel("gpt", 64, 128, 4, 2, 512, 64, (64,), 2),
}
QUICK_MODELS = {"bert": "bert-tiny", "gpt": "gpt2-tiny"}


def check_shape(name: str, seq_len: int, rows: int) -> None:
    """Raises ValueError naming the limit when model ``name`` cannot run (rows, seq_len)."""
    model = MODELS[name]
    if not 1 <= seq_len <= model.max_positions:
        raise ValueError(f"{name}: sequence length {seq_len} is outside 1..{model.max_positions}, its positions")
    if rows < 1:
        raise ValueError(f"{name}: the batch needs at least one row, got {rows}")


def make_batch(
    name: str, rows: int, seq_len: int, seed: int, token_ids: str = token_ids_lib.DEFAULT
) -> dict[str, jax.Array]:
    """Random tokens (rows, seq_len) int32, ids drawn from ``token_ids`` (`token_ids.DISTRIBUTIONS`), and labels.

    BERT: ``attention_mask`` (rows, seq_len) with each row's real tokens first (between half and all of the
    length; the last row is full) and a class label (rows,) in {0, 1}. GPT-2: ``labels`` (rows, seq_len), the
    next token of every position."""
    model = MODELS[name]
    rng = np.random.default_rng(seed)
    tokens = token_ids_lib.draw(rng, (rows, seq_len + 1), 1, model.vocab, token_ids)
    if model.kind == "gpt":
        return {"input_ids": jnp.asarray(tokens[:, :-1]), "labels": jnp.asarray(tokens[:, 1:])}
    lengths = rng.integers(seq_len // 2 + 1, seq_len + 1, rows)
    lengths[-1] = seq_len
    mask = (np.arange(seq_len)[None, :] < lengths[:, None]).astype(np.int32)
    return {
        "input_ids": jnp.asarray(tokens[:, :-1] * mask),
        "attention_mask": jnp.asarray(mask),
        "labels": jnp.asarray(rng.integers(0, 2, rows, dtype=np.int32)),
    }


def reference_config(name: str, attention: str) -> ZooConfig:
    """The plain Flax configuration of ``name``; attention dropout only with the "einsum" core."""
    model = MODELS[name]
    return ZooConfig(
        vocab_size=model.vocab,
        hidden_size=model.hidden,
        intermediate_size=model.intermediate,
        num_heads=model.heads,
        num_layers=model.layers,
        max_positions=model.max_positions,
        dropout_rate=DROPOUT,
        attention_dropout_rate=DROPOUT if attention == "einsum" else 0.0,
        attention=attention,
        dtype=jnp.bfloat16,
    )


def ls_jax_config(name: str, fp8_gemms: bool = False):
    """The ls_jax BertConfig or GPTConfig of ``name`` (bf16 compute, dropout 0.1 everywhere the preset has it;
    with ``fp8_gemms`` the Dense GEMMs and tied logits in FP8)."""
    from ls_jax.layers import LayerConfig
    from ls_jax.models.bert import BertConfig
    from ls_jax.models.gpt import GPTConfig

    model = MODELS[name]
    preset = "bert-base" if model.kind == "bert" else "gpt2-small"
    layer = LayerConfig.preset(
        preset,
        hidden_size=model.hidden,
        intermediate_size=model.intermediate,
        nhead=model.heads,
        max_seq_len=model.max_positions,
        dtype=jnp.bfloat16,
        fp8=fp8_gemms,
    )
    if model.kind == "bert":
        return BertConfig(layer=layer, vocab_size=model.vocab, num_layers=model.layers, num_labels=2)
    return GPTConfig(layer=layer, vocab_size=model.vocab, num_layers=model.layers)


def reference_model(name: str, attention: str):
    config = reference_config(name, attention)
    return ReferenceBert(config) if MODELS[name].kind == "bert" else ReferenceGPT(config)


def ls_jax_model(name: str, fp8_gemms: bool = False):
    from ls_jax.models.bert import BertForSequenceClassification
    from ls_jax.models.gpt import GPTLMHeadModel

    config = ls_jax_config(name, fp8_gemms)
    return BertForSequenceClassification(config) if MODELS[name].kind == "bert" else GPTLMHeadModel(config)


def _classification_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels))


def reference_apply(model, variables, batch, deterministic: bool = True, rngs=None) -> jax.Array:
    """Logits of a plain Flax model on a `make_batch` batch."""
    if isinstance(model, ReferenceBert):
        lengths = jnp.sum(batch["attention_mask"], axis=-1, dtype=jnp.int32)
        return model.apply(variables, batch["input_ids"], lengths, deterministic, rngs=rngs)
    return model.apply(variables, batch["input_ids"], deterministic, rngs=rngs)


def ls_jax_apply(model, variables, batch, deterministic: bool = True, rngs=None) -> jax.Array:
    """Logits of an ls_jax model on a `make_batch` batch: BERT's right padding as each row's length."""
    if "attention_mask" in batch:
        lengths = jnp.sum(batch["attention_mask"], axis=-1, dtype=jnp.int32)
        return model.apply(variables, batch["input_ids"], lengths=lengths, deterministic=deterministic, rngs=rngs)
    return model.apply(variables, batch["input_ids"], deterministic=deterministic, rngs=rngs)


def reference_step(name: str, attention: str, batch) -> TrainStep:
    model = reference_model(name, attention)
    variables = jax.jit(lambda key: model.init(key, **_init_args(model, batch)))(jax.random.PRNGKey(0))

    def loss_fn(variables, batch, dropout_rng):
        logits = reference_apply(model, variables, batch, deterministic=False, rngs={"dropout": dropout_rng})
        with jax.named_scope("criterion"):
            if isinstance(model, ReferenceBert):
                return _classification_loss(logits, batch["labels"])
            return _classification_loss(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))

    return optax_adamw_step(loss_fn, variables, batch)


def _init_args(model, batch) -> dict[str, Any]:
    if isinstance(model, ReferenceBert):
        return {"input_ids": batch["input_ids"], "lengths": jnp.sum(batch["attention_mask"], -1, dtype=jnp.int32)}
    return {"input_ids": batch["input_ids"]}


def ls_jax_step(name: str, batch, fp8_gemms: bool = False) -> TrainStep:
    from train.gpt.model import lm_sums

    model = ls_jax_model(name, fp8_gemms)
    variables = jax.jit(lambda key: model.init(key, batch["input_ids"], batch.get("attention_mask")))(
        jax.random.PRNGKey(0)
    )

    def loss_fn(variables, batch, dropout_rng):
        logits = ls_jax_apply(model, variables, batch, deterministic=False, rngs={"dropout": dropout_rng})
        with jax.named_scope("criterion"):
            if MODELS[name].kind == "bert":
                return _classification_loss(logits, batch["labels"])
            nll_sum, count = lm_sums(logits, batch["labels"])
            return nll_sum / count

    return ls_jax_adamw_step(loss_fn, variables, batch)


def build_step(implementation: str, name: str, batch) -> TrainStep:
    """The compiled step of ``implementation`` (one of JAX_IMPLEMENTATIONS) for model ``name`` at ``batch``'s
    shape."""
    if implementation in TORCH_IMPLEMENTATIONS:
        raise ValueError(f"{implementation} is a PyTorch step: train.bench.steps.torch_steps builds it")
    if implementation == "flax":
        return reference_step(name, "einsum", batch)
    if implementation == "flax_cudnn":
        return reference_step(name, "cudnn", batch)
    return ls_jax_step(name, batch, fp8_gemms=implementation in FP8_IMPLEMENTATIONS)


def train_flops(name: str, rows: int, seq_len: int) -> float:
    """Matmul FLOPs of one step (`train.imdb.model` / `train.gpt.model` count them; docs/flops.md)."""
    from train.gpt import model as gpt_model
    from train.imdb import model as imdb_model

    config = ls_jax_config(name)
    flops_fn = imdb_model.make_flops_fn(config) if MODELS[name].kind == "bert" else gpt_model.make_flops_fn(config)
    return float(flops_fn({"input_ids": (1, rows, seq_len)}))
