"""Where the host's time goes in each training step, to tell a device-bound run from one the host holds back.

The loop keeps one step in flight: while the device runs step n, the host takes step n+1's batch from the stream
(``batch``), places it on the devices (``transfer``), launches it (``launch``), then waits for step n to finish
(``wait``) and reads its metrics, meters and records (``account``). The device idles between steps only when the
host's own work (everything but ``wait``) outlasts a step: then ``wait`` falls towards zero and the step time is the
host's. `HostPhases.host_bound` says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Iterator

PHASES = ("batch", "transfer", "launch", "wait", "account")
HOST_BOUND_WAIT_SHARE = 0.1
"""A run whose host waited less than this share of its step time for the device is held back by the host."""


@dataclasses.dataclass
class HostPhases:
    """Seconds the host spent in each of `PHASES` over ``steps`` training steps (every resumed segment's)."""

    steps: int = 0
    seconds: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    @contextlib.contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        """Adds the time spent inside to ``phase``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def count_step(self) -> None:
        self.steps += 1

    def per_step_ms(self) -> dict[str, float] | None:
        """Milliseconds per step of each phase, or None before the first step."""
        if self.steps == 0:
            return None
        return {f"{phase}_ms": 1e3 * self.seconds[phase] / self.steps for phase in PHASES}

    def host_bound(self, step_time_s: float | None) -> bool:
        """Whether the host waited for the device less than `HOST_BOUND_WAIT_SHARE` of a step of ``step_time_s``."""
        if self.steps == 0 or not step_time_s:
            return False
        return self.seconds["wait"] / self.steps < HOST_BOUND_WAIT_SHARE * step_time_s

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HostPhases:
        return cls(int(data["steps"]), {phase: float(data["seconds"].get(phase, 0.0)) for phase in PHASES})
