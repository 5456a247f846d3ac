"""Hugging Face checkpoint directories: config.json and weights in model.safetensors or pytorch_model.bin, sharded
or not, read into and written from ls_jax configs and params."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np

from ls_jax.layers.config import replace_checked
from ls_jax.models.hf.families import config_from_hf, config_to_hf, params_from_hf, params_to_hf
from ls_jax.models.hf.mapping import ModelConfig, Params

_SAFETENSORS = "model.safetensors"
_TORCH = "pytorch_model.bin"
_INDEX_SUFFIX = ".index.json"


def _weight_files(directory: Path) -> list[Path]:
    """The checkpoint's weight files: one file or the shards its index lists; safetensors preferred."""
    for name in (_SAFETENSORS, _TORCH):
        if (directory / name).is_file():
            return [directory / name]
        index = directory / (name + _INDEX_SUFFIX)
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            absent = [shard for shard in shards if not (directory / shard).is_file()]
            if absent:
                raise FileNotFoundError(f"{index} lists shards that do not exist: {absent}")
            return [directory / shard for shard in shards]
    raise FileNotFoundError(
        f"no weights in {directory}: expected {_SAFETENSORS}, {_TORCH} or a sharded {_SAFETENSORS}{_INDEX_SUFFIX}"
    )


def _read_safetensors(path: Path) -> dict[str, jax.Array]:
    """A .safetensors file -> its tensors by name, as jax arrays."""
    try:
        from safetensors import safe_open
    except ImportError as err:
        raise ImportError(f"reading {path.name} needs the safetensors package: pip install safetensors") from err
    with safe_open(str(path), framework="flax") as file:
        return {key: file.get_tensor(key) for key in file.keys()}


def _read_torch(path: Path) -> dict[str, np.ndarray]:
    """A torch .bin file -> its tensors by name, as numpy arrays (floating point ones as float32)."""
    try:
        import torch
    except ImportError as err:
        raise ImportError(f"reading {path.name} needs torch: pip install torch (or convert it to safetensors)") from err
    state_dict = torch.load(path, map_location="cpu", weights_only=True)
    return {
        key: tensor.float().numpy() if tensor.is_floating_point() else tensor.numpy()
        for key, tensor in state_dict.items()
    }


def read_state_dict(directory: str | os.PathLike) -> dict[str, Any]:
    """All tensors of a Hugging Face checkpoint directory, by name."""
    state_dict: dict[str, Any] = {}
    for path in _weight_files(Path(directory)):
        state_dict.update(_read_safetensors(path) if path.suffix == ".safetensors" else _read_torch(path))
    return state_dict


def load_pretrained(
    directory: str | os.PathLike,
    *,
    rng: jax.Array | None = None,
    num_labels: int | None = None,
    **layer_overrides: Any,
) -> tuple[ModelConfig, Params]:
    """Loads a local Hugging Face BERT or GPT-2 directory into (BertConfig | GPTConfig, params).

    Args:
      directory: holds config.json and model.safetensors or pytorch_model.bin (or their sharded index).
      rng: initializes a BERT classifier the checkpoint lacks (fine-tuning from a pre-trained encoder).
      num_labels: the classes of a BERT whose checkpoint has no classifier (default: config.json's); a checkpoint
        with one must have this many.
      layer_overrides: LayerConfig fields to replace, e.g. ``dtype=jnp.bfloat16`` or dropout ratios.

    Raises:
      FileNotFoundError: the directory, config.json or the weights are missing.
      ValueError: an unsupported configuration, or weights that do not fit it (listing every mismatch).
    """
    directory = Path(directory)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: a Hugging Face model directory needs config.json")
    config = config_from_hf(json.loads(config_file.read_text()))
    config = dataclasses.replace(config, layer=replace_checked(config.layer, layer_overrides))
    state_dict = read_state_dict(directory)
    if num_labels is not None:
        config = _with_labels(config, num_labels, state_dict)
    return config, params_from_hf(config, state_dict, rng=rng)


def _with_labels(config: ModelConfig, num_labels: int, state_dict: Mapping[str, Any]) -> ModelConfig:
    """``config`` with ``num_labels`` classes; ValueError for a model without classes or a checkpoint whose
    classifier has another number."""
    if not hasattr(config, "num_labels"):
        raise ValueError(f"num_labels applies to a BERT classifier, not a {type(config).__name__}")
    head = next((value for key, value in state_dict.items() if key.endswith("classifier.weight")), None)
    if head is not None and np.shape(head)[0] != num_labels:
        raise ValueError(
            f"its classifier has {np.shape(head)[0]} labels, not {num_labels}: fine-tune it with as many, or start "
            "from the encoder alone (a checkpoint without a classifier)"
        )
    return dataclasses.replace(config, num_labels=num_labels)


def save_pretrained(config: ModelConfig, params: Params, directory: str | os.PathLike) -> Path:
    """Writes config.json and model.safetensors that ``transformers``' ``from_pretrained`` loads; returns the path."""
    try:
        from safetensors.numpy import save_file
    except ImportError as err:
        raise ImportError("saving model.safetensors needs the safetensors package: pip install safetensors") from err
    directory = Path(directory)
    hf_config = config_to_hf(config)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    tensors = {key: np.ascontiguousarray(value, np.float32) for key, value in params_to_hf(config, params).items()}
    save_file(tensors, str(directory / _SAFETENSORS), metadata={"format": "pt"})
    return directory
