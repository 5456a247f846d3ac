"""What the input pipelines of every task share: the optional tfds import, this host's rows of a step, and a
training stream that walks epoch after epoch and resumes at a position."""

from __future__ import annotations

import abc
import dataclasses
import math
from types import ModuleType
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from train.errors import UsageError


def import_tfds() -> ModuleType:
    """tensorflow_datasets, imported only when a ``tfds:`` source is read.

    Raises:
      UsageError: it is not installed; the message says how to install it.
    """
    try:
        import tensorflow_datasets as tfds
    except ImportError as err:
        raise UsageError(
            "--data tfds:... needs tensorflow-datasets and tensorflow: "
            "pip install 'ls-jax[data]' (or pip install tensorflow-datasets tensorflow-cpu)"
        ) from err
    return tfds


def host_rows(indices: np.ndarray, process_index: int, process_count: int) -> np.ndarray:
    """This host's contiguous slice of the rows (axis -1) of a step's indices."""
    rows = indices.shape[-1]
    if rows % process_count:
        raise UsageError(f"{rows} rows per micro-batch cannot be split over {process_count} hosts")
    share = rows // process_count
    return indices[..., process_index * share : (process_index + 1) * share]


@dataclasses.dataclass(kw_only=True)
class EpochStream(abc.ABC):
    """Training batches epoch after epoch, resumable at ``position`` = (epoch, step index within the epoch).

    A subclass plans the steps of an epoch (`_plan_for`, deterministic in ``(seed, epoch)``) and turns one planned
    step into ``(batch, counts)`` (`_batch`): this host's rows and the step's global counts.
    """

    seed: int
    process_index: int = 0
    process_count: int = 1
    epoch: int = 0
    index: int = 0

    def __post_init__(self) -> None:
        self._plan = self._plan_for(self.epoch)

    @abc.abstractmethod
    def _plan_for(self, epoch: int) -> Sequence[Any]: ...

    @abc.abstractmethod
    def _batch(self, step: Any) -> tuple[dict[str, np.ndarray], dict[str, int]]: ...

    @property
    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def at(self, position: Mapping[str, int]) -> EpochStream:
        """The same stream continuing from ``position`` (a checkpoint's)."""
        return dataclasses.replace(self, **position)

    @property
    def steps_per_epoch(self) -> int:
        return len(self._plan)

    def __iter__(self) -> Iterator[tuple[dict[str, np.ndarray], dict[str, int]]]:
        return self

    def __next__(self) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        if self.index >= len(self._plan):
            self.epoch, self.index = self.epoch + 1, 0
            self._plan = self._plan_for(self.epoch)
        step = self._plan[self.index]
        self.index += 1
        return self._batch(step)


def _filled(indices: np.ndarray, multiple: int) -> np.ndarray:
    """``indices`` followed by -1 up to a multiple of ``multiple``."""
    filled = np.full(math.ceil(len(indices) / multiple) * multiple, -1, np.int64)
    filled[: len(indices)] = indices
    return filled


def plan_fixed_epoch(num_examples: int, *, batch_size: int, grad_accum: int, seed: int, epoch: int) -> np.ndarray:
    """The steps of one epoch: example indices of shape (steps, grad_accum, batch_size), -1 for empty rows."""
    order = np.random.default_rng([seed, epoch]).permutation(num_examples)
    return _filled(order, batch_size * grad_accum).reshape(-1, grad_accum, batch_size)


def fixed_eval_plan(num_examples: int, batch_size: int) -> np.ndarray:
    """Every example once, in order, in batches of ``batch_size`` rows: (batches, batch_size), -1 for empty rows."""
    return _filled(np.arange(num_examples), batch_size).reshape(-1, batch_size)
