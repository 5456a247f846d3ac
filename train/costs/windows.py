"""The windows of a run: which stretch of its time each time, energy and cost figure covers, and where the step
time settles after the one-time work of the first steps.

A run's wall time holds these windows (docs/run-log.md, "Windows"):

  compilation   compiling the step for every batch shape before the first step (each resumed segment again)
  warm-up       the first training steps of each segment, until the step time has settled (`warmup_flags`)
  steady        every training step after that
  training      warm-up + steady: every training step
  evaluation    every evaluation
  checkpoints   every checkpoint write
  wall          the process, from its start to its end (setup and the windows above included)

Time and energy are read together (`Reading`), at the edges of each window, once the device has finished the
work inside it, so a window's energy over its time is a power the devices drew during it.

Settled: let m be the steady median, the median step time over the last half of the run's steps (after warm-up,
whatever its length below half the run). A segment's step time has settled at its first step whose own time and
the median of the `SETTLE_STEPS` steps from it (fewer at the segment's end) are both at most
(1 + `SETTLE_TOLERANCE`) x m. The steps before it are that segment's warm-up; a segment that never settles is all
warm-up. For steps of 235 ms (10 steps), 73 ms (10) and then 26 ms, m = 26 ms and the warm-up is the first 20.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Iterable, Sequence

SETTLE_STEPS = 5
SETTLE_TOLERANCE = 0.10


def add_optional(a: float | None, b: float | None) -> float | None:
    """a + b, or None when either is unknown."""
    return None if a is None or b is None else a + b


def total(values: Iterable[float | None]) -> float | None:
    """The sum of ``values`` (0 for none), or None when any of them is unknown."""
    result: float | None = 0.0
    for value in values:
        result = add_optional(result, value)
    return result


@dataclasses.dataclass(frozen=True)
class Span:
    """The time (s) and energy (J; None where not measured) of a stretch of the run."""

    time_s: float = 0.0
    energy_j: float | None = 0.0

    def __add__(self, other: Span) -> Span:
        return Span(self.time_s + other.time_s, add_optional(self.energy_j, other.energy_j))


@dataclasses.dataclass(frozen=True)
class Reading:
    """The clock (s) and the energy meter (J since it started; None without one) read at one instant."""

    time_s: float
    energy_j: float | None

    def since(self, earlier: Reading) -> Span:
        """The span from ``earlier`` to this reading."""
        energy = None if self.energy_j is None or earlier.energy_j is None else self.energy_j - earlier.energy_j
        return Span(self.time_s - earlier.time_s, energy)


@dataclasses.dataclass
class Tally:
    """How often a kind of one-time work (compilation, evaluation, checkpoint) ran and its summed time and energy."""

    count: int = 0
    time_s: float = 0.0
    energy_j: float | None = 0.0

    def add(self, span: Span) -> None:
        """Counts one more run of the work, which took ``span``."""
        self.count += 1
        self.extend(span)

    def extend(self, span: Span) -> None:
        """Adds ``span`` to a run already counted (the end of work that went on in the background)."""
        self.time_s += span.time_s
        self.energy_j = add_optional(self.energy_j, span.energy_j)


def steady_median(step_times: Sequence[float]) -> float | None:
    """The median step time over the last half of ``step_times`` (the middle step counted in it), None for none."""
    if not step_times:
        return None
    return statistics.median(step_times[len(step_times) // 2 :])


def settled_offset(times: Sequence[float], steady: float) -> int:
    """Index of the first step of ``times`` (one segment) at which the step time has settled to ``steady``, or
    ``len(times)`` when it never does (see the module docstring)."""
    bound = (1.0 + SETTLE_TOLERANCE) * steady
    for index, time_s in enumerate(times):
        if time_s <= bound and statistics.median(times[index : index + SETTLE_STEPS]) <= bound:
            return index
    return len(times)


def warmup_flags(step_times: Sequence[float], segment_starts: Sequence[int]) -> list[bool]:
    """Per step of the run, whether it belongs to its segment's warm-up. ``segment_starts`` are the indices of
    the first step of each segment (a fresh start, then every resume); steps before the first are warm-up-free
    (they come from a log that did not record segments)."""
    steady = steady_median(step_times)
    flags = [False] * len(step_times)
    if steady is None:
        return flags
    bounds = [*sorted(set(segment_starts)), len(step_times)]
    for start, end in zip(bounds, bounds[1:]):
        for index in range(start, start + settled_offset(step_times[start:end], steady)):
            flags[index] = True
    return flags
