"""What BERT and GPT-2 share: parameter rules (one ls_jax parameter <-> its Hugging Face tensors), a model family's
conversion of whole parameter trees both ways, checked key by key and shape by shape, and the config.json checks
both families make."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.models.bert import BertConfig
from ls_jax.models.gpt import GPTConfig

logger = logging.getLogger("ls_jax.models.hf")

ModelConfig = BertConfig | GPTConfig
Params = dict[str, Any]
ParamPath = tuple[str, ...]

_HF_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


# ---- parameter rules ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
    """One ls_jax parameter made of one or more Hugging Face tensors, with the conversions both ways.

    Conversions run on host numpy arrays (no device work, no compilation). ``to_hf`` uses only array
    methods, so it also runs on abstract values to derive the expected checkpoint shapes.
    """

    path: ParamPath
    hf_keys: tuple[str, ...]
    to_hf: Callable[[Any], tuple[Any, ...]]
    to_flax: Callable[[tuple[np.ndarray, ...], tuple[int, ...]], np.ndarray]


def same(path: ParamPath, key: str) -> Rule:
    """A tensor stored identically: embeddings, LayerNorm parameters, biases."""
    return Rule(path, (key,), lambda p: (p,), lambda ws, shape: ws[0])


def layer_norm(path: ParamPath, prefix: str) -> list[Rule]:
    """A LayerNorm's ``scale`` and ``bias`` under ``path`` <-> ``prefix.weight`` and ``prefix.bias``."""
    return [same(path + ("scale",), prefix + ".weight"), same(path + ("bias",), prefix + ".bias")]


# ---- model families ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its ls_jax model, its Hugging Face names and layouts, and its config.json mapping.

    Attributes:
      model_type: config.json's ``model_type``.
      model: the ls_jax model class, built from the family's config.
      rules: the config's parameters as rules, covering every tensor of the Hugging Face model.
      canonical_key: a checkpoint key as the Hugging Face model names it, or None for a tensor to skip.
      config_from_hf: parsed config.json -> the family's config.
      config_to_hf: the family's config -> config.json contents.
      optional_head: key prefixes of a head a checkpoint may lack, initialized from ``rng`` when one is given.
      drop_tied_weights: removes tensors transformers ties to others from the canonical tensors, raising
        ValueError where they differ.
    """

    model_type: str
    model: Callable[[Any], nn.Module]
    rules: Callable[[Any], list[Rule]]
    canonical_key: Callable[[str], str | None]
    config_from_hf: Callable[[Mapping[str, Any]], ModelConfig]
    config_to_hf: Callable[[Any], dict[str, Any]]
    optional_head: tuple[str, ...] = ()
    drop_tied_weights: Callable[[dict[str, Any]], None] | None = None

    def _init_params(self, config: ModelConfig, rng: jax.Array) -> Params:
        return jax.jit(self.model(config).init)(rng, jnp.zeros((1, 1), jnp.int32))["params"]

    def _abstract_params(self, config: ModelConfig) -> Params:
        return jax.eval_shape(lambda: self._init_params(config, jax.random.key(0)))

    def _apply_to_hf(self, config: ModelConfig, params: Params) -> dict[str, Any]:
        flat = flax.traverse_util.flatten_dict(params)
        state_dict = {}
        for rule in self.rules(config):
            state_dict.update(zip(rule.hf_keys, rule.to_hf(flat[rule.path])))
        return state_dict

    def params_to_hf(self, config: ModelConfig, params: Params) -> dict[str, np.ndarray]:
        """ls_jax params -> Hugging Face state dict (key -> float32 numpy array)."""
        return self._apply_to_hf(config, jax.tree.map(lambda leaf: np.asarray(leaf, np.float32), params))

    def _hf_shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        abstract = jax.eval_shape(lambda params: self._apply_to_hf(config, params), self._abstract_params(config))
        return {key: tuple(value.shape) for key, value in abstract.items()}

    def params_from_hf(
        self, config: ModelConfig, state_dict: Mapping[str, Any], *, rng: jax.Array | None = None
    ) -> Params:
        """Hugging Face state dict -> ls_jax params (float32); ValueError lists every mismatch."""
        tensors: dict[str, Any] = {}
        for key, value in state_dict.items():
            canonical = self.canonical_key(key)
            if canonical is not None:
                tensors[canonical] = value
        if self.drop_tied_weights is not None:
            self.drop_tied_weights(tensors)
        expected = self._hf_shapes(config)
        missing = sorted(set(expected) - set(tensors))
        fresh_head = [key for key in missing if key.startswith(self.optional_head)] if rng is not None else []
        missing = [key for key in missing if key not in fresh_head]
        unexpected = sorted(set(tensors) - set(expected))
        wrong_shapes = [
            f"{key}: checkpoint {tuple(np.shape(tensors[key]))}, model {expected[key]}"
            for key in sorted(set(expected) & set(tensors))
            if tuple(np.shape(tensors[key])) != expected[key]
        ]
        if missing or unexpected or wrong_shapes:
            report = _mismatch_report(missing, unexpected, wrong_shapes)
            raise ValueError(f"checkpoint does not match {type(config).__name__}: {report}")

        abstract = flax.traverse_util.flatten_dict(self._abstract_params(config))
        fresh = flax.traverse_util.flatten_dict(self._init_params(config, rng)) if fresh_head else {}
        if fresh_head:
            logger.warning("initialized %s from rng: the checkpoint has no classifier", fresh_head)
        flat = {}
        for rule in self.rules(config):
            if rule.hf_keys[0] in fresh_head:
                flat[rule.path] = fresh[rule.path]
                continue
            parts = tuple(np.asarray(tensors[key], np.float32) for key in rule.hf_keys)
            flat[rule.path] = jnp.asarray(rule.to_flax(parts, abstract[rule.path].shape))
        return flax.traverse_util.unflatten_dict(flat)


def _mismatch_report(missing: list[str], unexpected: list[str], wrong_shapes: list[str]) -> str:
    parts = []
    if missing:
        parts.append(f"missing keys {missing}")
    if unexpected:
        parts.append(f"unexpected keys {unexpected}")
    if wrong_shapes:
        parts.append(f"shape mismatches {wrong_shapes}")
    return "; ".join(parts)


# ---- configuration -----------------------------------------------------------------------------------------


def activation_from_hf(name: str) -> str:
    """A Hugging Face activation name (``hidden_act``, ``activation_function``) -> LayerConfig's activation_fn."""
    if name not in _HF_ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported are {sorted(_HF_ACTIVATIONS)}")
    return _HF_ACTIVATIONS[name]


def require(hf: Mapping[str, Any], key: str, expected: Any, default: Any) -> None:
    """Raises ValueError unless config.json's ``key`` (``default`` where absent) is ``expected``."""
    if hf.get(key, default) != expected:
        raise ValueError(f"config.json has {key}={hf.get(key)!r}; only {expected!r} is supported")
