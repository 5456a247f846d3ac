"""What the end-to-end benchmark measures: one model at one size, built by each of its implementations.

A result key is ``<model>/<size>/<implementation>``: for the WMT Transformers (`transformer_steps`) the size is the
target tokens per step, for BERT and GPT-2 (`zoo_steps`) the sequence length, at the model's batch rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from ls_jax.layers import fp8
from train.bench.steps import token_ids as token_ids_lib
from train.bench.steps import transformer_steps, zoo_steps
from train.bench.steps.transformer_steps import TrainStep

FAMILIES = {
    "wmt": tuple(name for name in transformer_steps.MODELS if name != transformer_steps.QUICK_MODEL),
    "bert": ("bert-base",),
    "gpt": ("gpt2-small",),
}
"""``--models`` may name a family for these models."""
ZOO = (*FAMILIES["bert"], *FAMILIES["gpt"])
ALL_IMPLEMENTATIONS = tuple(dict.fromkeys((*transformer_steps.IMPLEMENTATIONS, *zoo_steps.IMPLEMENTATIONS)))
FP8_IMPLEMENTATIONS = tuple(dict.fromkeys((*transformer_steps.FP8_IMPLEMENTATIONS, *zoo_steps.FP8_IMPLEMENTATIONS)))
DEFAULT_IMPLEMENTATIONS = tuple(i for i in ALL_IMPLEMENTATIONS if i not in FP8_IMPLEMENTATIONS)
"""What ``train.bench e2e`` runs unless told: the FP8 rows only when named."""
QUICK_MODELS = {"wmt": transformer_steps.QUICK_MODEL, **zoo_steps.QUICK_MODELS}
MODEL_ORDER = (*transformer_steps.MODELS, *zoo_steps.MODELS)
REFERENCES = ("reference", "flax", "flax_cudnn", *zoo_steps.TORCH_IMPLEMENTATIONS)
PRIMARY_REFERENCES = ("reference", zoo_steps.REFERENCE)
"""Each model's first reference: the WMT Transformers' plain Flax "reference", BERT's and GPT-2's "flax"."""
NEEDS_GPU = ("ls_jax_ffi", "ls_jax_ffi_fp8", "flax_cudnn")
TORCH_IMPLEMENTATIONS = zoo_steps.TORCH_IMPLEMENTATIONS
"""Rows timed as PyTorch steps (`train.bench.steps.torch_steps`), not as JAX `TrainStep`s."""


def check_fp8_device(implementations: list[str]) -> None:
    """Raises ValueError naming the device when ``implementations`` hold an FP8 row it cannot multiply."""
    if any(i in FP8_IMPLEMENTATIONS for i in implementations):
        fp8.check_device(jax.devices()[0])


def is_wmt(model: str) -> bool:
    return model in transformer_steps.MODELS


def implementations_of(model: str) -> tuple[str, ...]:
    return transformer_steps.IMPLEMENTATIONS if is_wmt(model) else zoo_steps.IMPLEMENTATIONS


@dataclasses.dataclass(frozen=True)
class Workload:
    """``model`` at ``size`` (WMT: target tokens per step; BERT/GPT-2: sequence length over ``rows`` rows)."""

    model: str
    size: int
    rows: int
    token_ids: str = token_ids_lib.DEFAULT

    def key(self, implementation: str) -> str:
        return f"{self.model}/{self.size}/{implementation}"

    @property
    def seq_len(self) -> int:
        return transformer_steps.SEQ_LEN if is_wmt(self.model) else self.size

    def batch(self, seed: int | None = None) -> dict[str, jax.Array]:
        seed = self.size if seed is None else seed
        if is_wmt(self.model):
            return transformer_steps.make_batch(self.rows, seed=seed, token_ids=self.token_ids)
        return zoo_steps.make_batch(self.model, self.rows, self.size, seed=seed, token_ids=self.token_ids)

    def build(self, implementation: str, batch) -> TrainStep:
        if is_wmt(self.model):
            return transformer_steps.build_step(implementation, self.model, batch)
        return zoo_steps.build_step(implementation, self.model, batch)

    def kernel_mode(self, implementation: str) -> str:
        return transformer_steps.kernel_mode(implementation)

    def tokens(self) -> int:
        """Tokens a step reads: source plus target for WMT, rows x length otherwise."""
        return self.rows * self.seq_len * (2 if is_wmt(self.model) else 1)

    def flops(self) -> float:
        if not is_wmt(self.model):
            return zoo_steps.train_flops(self.model, self.rows, self.size)
        return transformer_steps.train_flops(self.model, self.rows)

    def describe(self) -> dict[str, Any]:
        """The shape a record is measured at."""
        return {
            "batch_rows": self.rows,
            "seq_len": self.seq_len,
            "tokens_per_step": self.tokens(),
            "token_ids": self.token_ids,
        }


def wmt_workload(model: str, target_tokens: int, token_ids: str = token_ids_lib.DEFAULT) -> Workload:
    """``model`` at ``target_tokens`` per step (rows of SEQ_LEN target tokens), ids drawn from ``token_ids``."""
    rows = target_tokens // transformer_steps.SEQ_LEN
    if rows < 1:
        raise ValueError(
            f"{model}: {target_tokens} target tokens is less than one {transformer_steps.SEQ_LEN}-token "
            "sentence; give --tokens of at least that"
        )
    return Workload(model, target_tokens, rows, token_ids)


def zoo_workload(model: str, seq_len: int, rows: int | None = None, token_ids: str = token_ids_lib.DEFAULT) -> Workload:
    """``model`` at ``seq_len`` with ``rows`` rows (default: the model's), ids drawn from ``token_ids``."""
    rows = zoo_steps.MODELS[model].rows if rows is None else rows
    zoo_steps.check_shape(model, seq_len, rows)
    return Workload(model, seq_len, rows, token_ids)


def expand_models(names: list[str], quick: bool = False) -> list[str]:
    """Model names with each family name (``FAMILIES``) replaced by its models, or with ``quick`` by its tiny
    model; raises ValueError naming an unknown name."""
    models: list[str] = []
    for name in names:
        if name in FAMILIES:
            models.extend([QUICK_MODELS[name]] if quick else FAMILIES[name])
        elif name in MODEL_ORDER:
            models.append(name)
        else:
            raise ValueError(
                f"unknown model {name!r}; give a family ({', '.join(FAMILIES)}) or a model ({', '.join(MODEL_ORDER)})"
            )
    return list(dict.fromkeys(models))


def workloads(
    models: list[str],
    token_counts: list[int],
    seq_lens: list[int] | None = None,
    rows: int | None = None,
    token_ids: str = token_ids_lib.DEFAULT,
) -> list[Workload]:
    """Every (model, size): WMT models at each of ``token_counts``, the others at ``seq_lens`` (default: the
    model's own lengths) and ``rows`` (default: the model's); every batch's ids drawn from ``token_ids``."""
    out = []
    for model in models:
        if is_wmt(model):
            out.extend(wmt_workload(model, tokens, token_ids) for tokens in token_counts)
        else:
            lengths = seq_lens or zoo_steps.MODELS[model].seq_lens
            out.extend(zoo_workload(model, length, rows, token_ids) for length in lengths)
    return out
