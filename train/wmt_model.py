"""The Transformer of ``python -m train.wmt``: its configuration from a preset and the flags, the label-smoothed
loss and the FLOPs of a step."""

from __future__ import annotations

from typing import Any, Mapping

from ls_jax.models import PAD_ID, Transformer, TransformerConfig
from ls_jax.ops import label_smoothed_cross_entropy
from train import metrics
from train.precision import PRECISION_DTYPES


def model_config(config: Mapping[str, Any], vocab_size: int, precision: str) -> TransformerConfig:
    overrides: dict[str, Any] = {"dtype": PRECISION_DTYPES[precision], "remat": config["remat"]}
    if config["dropout"] is not None:
        overrides.update(
            hidden_dropout_ratio=config["dropout"],
            attn_prob_dropout_ratio=config["dropout"],
            activation_dropout_ratio=config["dropout"],
        )
    return TransformerConfig.preset(config["preset"], vocab_size, **overrides)


def model_signature(config: Mapping[str, Any], model_cfg: TransformerConfig) -> dict[str, Any]:
    """What a checkpoint must agree on with the run restoring it (the harness adds optimizer and precision)."""
    layer = model_cfg.layer
    return {
        "preset": config["preset"],
        "vocab_size": model_cfg.vocab_size,
        "hidden_size": layer.hidden_size,
        "intermediate_size": layer.intermediate_size,
        "nhead": layer.nhead,
        "encoder_layers": model_cfg.num_encoder_layers,
        "decoder_layers": model_cfg.num_decoder_layers,
    }


def make_loss_fn(model: Transformer, epsilon: float):
    def loss_fn(params, batch, rng):
        logits = model.apply(
            {"params": params}, batch["src"], batch["tgt_in"], deterministic=False, rngs={"dropout": rng}
        )
        loss_sum, nll_sum, num_tokens = label_smoothed_cross_entropy(
            logits, batch["labels"], epsilon=epsilon, pad_id=PAD_ID
        )
        return loss_sum, num_tokens, {"nll": nll_sum}

    return loss_fn


def make_flops_fn(model_cfg: TransformerConfig):
    layer = model_cfg.layer

    def flops(shapes: Mapping[str, tuple[int, ...]]) -> float:
        grad_accum, rows, src_len = shapes["src"]
        tgt_len = shapes["tgt_in"][2]
        return grad_accum * metrics.transformer_train_flops(
            batch=rows, src_len=src_len, tgt_len=tgt_len, hidden=layer.hidden_size, ffn=layer.intermediate_size,
            encoder_layers=model_cfg.num_encoder_layers, decoder_layers=model_cfg.num_decoder_layers,
            vocab=model_cfg.vocab_size,
        )

    return flops
