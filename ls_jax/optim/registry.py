"""The optimizers a training tool picks by name, one entry each: ls_jax's fused AdamW and Adan and optax's unfused
ones they are measured against. The tools' flag choices, defaults, help and error messages derive from here, so
a new optimizer is one entry (and its update rule, for a fused one).

    spec = ls_jax.optim.registry.get("adan")
    tx = spec.build(schedule, spec.hyperparameters({"b1": 0.9}), weight_decay=0.02, mask=decay_mask,
                    max_grad_norm=1.0)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import optax

from ls_jax.optim.adam import adamw
from ls_jax.optim.adan import adan


@dataclasses.dataclass(frozen=True)
class Hyperparameter:
    """One hyperparameter of an optimizer: its default and what it means there."""

    default: float
    meaning: str

    def check(self, name: str, value: float) -> None:
        """Raises ValueError unless ``value`` lies in the range of ``name`` (eps > 0, betas in [0, 1))."""
        valid = value > 0 if name == "eps" else 0.0 <= value < 1.0
        if not valid:
            rule = "eps must be > 0" if name == "eps" else "betas lie in [0, 1)"
            raise ValueError(f"--{name} {value:g} is out of range: {rule}")


Build = Callable[..., optax.GradientTransformation]


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer by name.

    Attributes:
      name: what ``--optimizer`` takes.
      rule: the update rule's name in messages (``AdamW``, ``Adan``).
      fused: ls_jax.optim's multi-tensor update (one kernel for every leaf, master weights, ZeRO-1); else optax's
        per-leaf update.
      takes: its hyperparameters, in flag order, with defaults.
      builder: ``builder(learning_rate, values, *, weight_decay, mask, max_grad_norm, storage_dtype,
        master_weights)`` with ``values`` the full hyperparameter dict.
    """

    name: str
    rule: str
    fused: bool
    takes: Mapping[str, Hyperparameter]
    builder: Build

    def hyperparameters(self, given: Mapping[str, float | None]) -> dict[str, float]:
        """The defaults overridden by the ``given`` values that are not None.

        Raises:
          ValueError: a hyperparameter this optimizer does not take, or a value out of range.
        """
        values = {name: spec.default for name, spec in self.takes.items()}
        for name, value in given.items():
            if value is None:
                continue
            if name not in values:
                owners = sorted({spec.rule for spec in OPTIMIZERS.values() if name in spec.takes})
                raise ValueError(
                    f"--{name} is {' and '.join(owners) or 'no optimizer'}'s hyperparameter; {self.name} has only "
                    f"{', '.join(values)}"
                )
            values[name] = float(value)
        for name, value in values.items():
            self.takes[name].check(name, value)
        return values

    def build(
        self,
        learning_rate: optax.ScalarOrSchedule,
        values: Mapping[str, float],
        *,
        weight_decay: float,
        mask: Any = None,
        max_grad_norm: float | None = None,
        storage_dtype: Any = None,
        master_weights: bool = False,
    ) -> optax.GradientTransformation:
        """The transformation with hyperparameters ``values`` (`hyperparameters`).

        Raises:
          ValueError: 16-bit storage or master weights asked of an unfused optimizer.
        """
        if not self.fused and (storage_dtype is not None or master_weights):
            fused = ", ".join(name for name, spec in OPTIMIZERS.items() if spec.fused)
            raise ValueError(f"--master-weights needs a fused optimizer ({fused}); {self.name} keeps no master weights")
        return self.builder(
            learning_rate,
            dict(values),
            weight_decay=weight_decay,
            mask=mask,
            max_grad_norm=max_grad_norm,
            storage_dtype=storage_dtype,
            master_weights=master_weights,
        )


def _fused(update: Build) -> Build:
    def build(learning_rate, values, *, max_grad_norm, **options):
        return update(learning_rate, **values, max_grad_norm=max_grad_norm or None, **options)

    return build


def _unfused(update: Build) -> Build:
    """optax's ``update`` after optax's global-norm clipping when ``max_grad_norm`` is set."""

    def build(learning_rate, values, *, weight_decay, mask, max_grad_norm, storage_dtype, master_weights):
        del storage_dtype, master_weights  # refused by OptimizerSpec.build
        transformation = update(learning_rate, **values, weight_decay=weight_decay, mask=mask)
        if not max_grad_norm:
            return transformation
        return optax.chain(optax.clip_by_global_norm(max_grad_norm), transformation)

    return build


_FIRST = "first-moment decay"
_EPS = "denominator epsilon"
# AdamW with fairseq's Transformer betas; Adan with its paper's (optax.adan's) defaults.
_ADAMW = {
    "b1": Hyperparameter(0.9, _FIRST),
    "b2": Hyperparameter(0.98, "second-moment decay"),
    "eps": Hyperparameter(1e-8, _EPS),
}
_ADAN = {
    "b1": Hyperparameter(0.98, _FIRST),
    "b2": Hyperparameter(0.92, "gradient-difference decay"),
    "b3": Hyperparameter(0.99, "second-moment decay"),
    "eps": Hyperparameter(1e-8, _EPS),
}

OPTIMIZERS: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in (
        OptimizerSpec("adamw", "AdamW", True, _ADAMW, _fused(adamw)),
        OptimizerSpec("adan", "Adan", True, _ADAN, _fused(adan)),
        OptimizerSpec("optax-adamw", "AdamW", False, _ADAMW, _unfused(optax.adamw)),
        OptimizerSpec("optax-adan", "Adan", False, _ADAN, _unfused(optax.adan)),
    )
}


def get(name: str) -> OptimizerSpec:
    """The optimizer called ``name``.

    Raises:
      ValueError: no optimizer has that name (the message lists those that do).
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]


def names(*, fused: bool | None = None) -> tuple[str, ...]:
    """Every optimizer's name, or only the fused (``fused=True``) or unfused ones."""
    return tuple(name for name, spec in OPTIMIZERS.items() if fused is None or spec.fused == fused)


def hyperparameter_names() -> tuple[str, ...]:
    """Every hyperparameter some optimizer takes, in flag order."""
    return tuple(dict.fromkeys(name for spec in OPTIMIZERS.values() for name in spec.takes))


def meaning(hyperparameter: str) -> str:
    """What ``hyperparameter`` means, per update rule where the rules differ (for a flag's help)."""
    by_rule = {
        spec.rule: spec.takes[hyperparameter].meaning for spec in OPTIMIZERS.values() if hyperparameter in spec.takes
    }
    if len(set(by_rule.values())) == 1:
        text = next(iter(by_rule.values()))
        return text if len(by_rule) > 1 else f"{next(iter(by_rule))} only: {text}"
    return "; ".join(f"{rule}: {text}" for rule, text in by_rule.items())
