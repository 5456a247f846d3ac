"""The Transformer of ``python -m train.wmt``: its configuration from a preset and the flags, the model of
``--implementation`` (ls_jax's Transformer or the plain Flax one of `train.reference.transformer`), the
label-smoothed loss and the FLOPs of a step."""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from ls_jax.models import PAD_ID, Transformer, TransformerConfig
from ls_jax.ops import label_smoothed_cross_entropy
from train.costs import metrics
from train.costs.precision import PRECISION_DTYPES, fp8_gemms
from train.harness import resume
from train.reference import from_ls_jax
from train.reference.losses import label_smoothed_sums
from train.reference.transformer import ReferenceTransformer
from train.wmt.config import WmtConfig

Criterion = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]
"""``criterion(logits (B, T, V), labels (B, T)) -> (summed label-smoothed loss, summed NLL, target tokens)``,
padding (``PAD_ID``) left out."""


def model_config(config: WmtConfig, vocab_size: int, precision: str) -> TransformerConfig:
    overrides: dict[str, Any] = {
        "dtype": PRECISION_DTYPES[precision],
        "fp8": fp8_gemms(precision),
        "remat": config.remat,
    }
    if config.dropout is not None:
        overrides.update(
            hidden_dropout_ratio=config.dropout,
            attn_prob_dropout_ratio=config.dropout,
            activation_dropout_ratio=config.dropout,
        )
    return TransformerConfig.preset(config.preset, vocab_size, **overrides)


def build_model(implementation: str, model_cfg: TransformerConfig) -> nn.Module:
    """ls_jax's Transformer of ``model_cfg``, or (``flax``) the plain Flax one of the same shape, dropout and dtype.
    Both take ``(src, tgt_in, deterministic=...)`` and decode through `ls_jax.models.decoding`."""
    if implementation == "ls_jax":
        return Transformer(model_cfg)
    return ReferenceTransformer(from_ls_jax.transformer_config(model_cfg))


def make_criterion(implementation: str, epsilon: float) -> Criterion:
    """The label-smoothed cross entropy of ``implementation``: ls_jax's fused op, or the plain one written with
    optax (`train.reference.losses`); the same math (fairseq's target distribution)."""
    if implementation == "ls_jax":
        return functools.partial(label_smoothed_cross_entropy, epsilon=epsilon, pad_id=PAD_ID)
    return functools.partial(label_smoothed_sums, epsilon=epsilon, ignore_label=PAD_ID)


def model_signature(config: WmtConfig, model_cfg: TransformerConfig) -> dict[str, Any]:
    """What a checkpoint must agree on with the run restoring it (the harness adds optimizer and precision)."""
    layer = model_cfg.layer
    return {
        "preset": config.preset,
        "vocab_size": model_cfg.vocab_size,
        **resume.layer_signature(layer),
        "encoder_layers": model_cfg.num_encoder_layers,
        "decoder_layers": model_cfg.num_decoder_layers,
    }


def make_loss_fn(model: nn.Module, criterion: Criterion):
    def loss_fn(variables, batch, rng):
        logits = model.apply(variables, batch["src"], batch["tgt_in"], deterministic=False, rngs={"dropout": rng})
        loss_sum, nll_sum, num_tokens = criterion(logits, batch["labels"])
        return loss_sum, num_tokens, {"nll": nll_sum}

    return loss_fn


def make_flops_fn(model_cfg: TransformerConfig):
    layer = model_cfg.layer

    def flops(shapes: Mapping[str, tuple[int, ...]]) -> float:
        grad_accum, rows, src_len = shapes["src"]
        tgt_len = shapes["tgt_in"][2]
        return grad_accum * metrics.transformer_train_flops(
            batch=rows,
            src_len=src_len,
            tgt_len=tgt_len,
            hidden=layer.hidden_size,
            ffn=layer.intermediate_size,
            encoder_layers=model_cfg.num_encoder_layers,
            decoder_layers=model_cfg.num_decoder_layers,
            vocab=model_cfg.vocab_size,
        )

    return flops


def decode_row_bytes(model_cfg: TransformerConfig, *, src_len: int, decode_len: int, beams: int) -> int:
    """Device bytes one source row of ``src_len`` tokens needs while ``beams`` hypotheses of it are decoded for up
    to ``decode_len`` tokens (`ls_jax.models.decoding`), in the model's compute dtype of b bytes, by ls_jax's
    Transformer (the plain Flax one caches the self-attention keys and values and the encoded source, and projects
    the source's keys and values again at every step, one layer at a time: less than this bound):

        beams x [ 2 x 2 Ld (decode_len + src_len) H b     keys and values of every decoder layer, self and source
                                                          (twice: the cache reordered by beam beside the old one)
                  + src_len H b                           the encoded source
                  + 3 x 4 V                               f32 logits, log-probabilities and their top-k input
                  + 3 x 4 decode_len ]                    int32 live, finished and candidate sequences

    The caches dominate: transformer-base (Ld 6, H 512, bf16, decode_len 256) needs 28 MB per 16-token row at
    beam 4, so the 512 rows ``--max-tokens 8192`` puts in a batch of such rows would need 14.5 GB.
    """
    layer = model_cfg.layer
    item = jnp.dtype(layer.dtype).itemsize
    caches = 2 * 2 * model_cfg.num_decoder_layers * (decode_len + src_len) * layer.hidden_size * item
    per_hypothesis = caches + src_len * layer.hidden_size * item + 3 * 4 * model_cfg.vocab_size + 3 * 4 * decode_len
    return beams * per_hypothesis


def decode_rows(budget_bytes: int, row_bytes: int, *, num_shards: int) -> int:
    """Rows per decoding batch over ``num_shards`` devices: as many as fit ``budget_bytes`` on each device, at
    least one per device."""
    return num_shards * max(1, budget_bytes // row_bytes)
