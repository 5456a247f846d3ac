"""What a checkpoint must agree on with the run restoring it: the model's name and shapes (the harness adds the
optimizer and precision)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ls_jax.layers import LayerConfig


def model_name(config: Mapping[str, Any]) -> str:
    """The preset's name, or the directory name of the pretrained model given by ``--init-from``."""
    return config["preset"] or Path(config["init_from"]).name


def layer_signature(layer: LayerConfig) -> dict[str, Any]:
    """The sizes every layer of a stack shares."""
    return {"hidden_size": layer.hidden_size, "intermediate_size": layer.intermediate_size, "nhead": layer.nhead}


def stack_signature(config: Mapping[str, Any], vocab_size: int, layer: LayerConfig, num_layers: int) -> dict[str, Any]:
    """The signature of a single stack of ``num_layers`` layers over learned positions (BERT, GPT)."""
    return {"model": model_name(config), "vocab_size": vocab_size, **layer_signature(layer), "num_layers": num_layers,
            "positions": layer.max_seq_len}
