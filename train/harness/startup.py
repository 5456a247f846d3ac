"""A run's start-up, from the process's start to compilation, in named parts the summary reports."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

# The parts in the order a run passes them; `StartupClock.mark` closes each.
PARTS = ("imports", "run_directory", "hardware", "data_and_model", "state", "run_record", "loop")


def process_started_at() -> float:
    """``time.monotonic()`` at this process's start (Linux: its start time in /proc, in clock ticks since boot, so
    the interpreter's start and every import count); the time of the call where /proc does not say."""
    now = time.monotonic()
    try:
        # Fields after the command name (which may hold spaces) start at the 3rd; the start time is the 22nd.
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(after_name[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return now
    return now - max(age, 0.0)


@dataclasses.dataclass
class StartupClock:
    """Where a start-up's time went: ``mark(part)`` gives ``part`` the time since the previous mark (or since
    ``started_at``); ``parts`` holds seconds by part, in `PARTS`' names."""

    started_at: float = dataclasses.field(default_factory=time.monotonic)  # time.monotonic() at the start
    parts: dict[str, float] = dataclasses.field(default_factory=dict)
    _last: float | None = None

    def mark(self, part: str) -> float:
        """Closes ``part`` now; returns the clock's reading."""
        if part not in PARTS:
            raise ValueError(f"unknown start-up part {part!r}; one of {', '.join(PARTS)}")
        now = time.monotonic()
        last = self.started_at if self._last is None else self._last
        self.parts[part] = self.parts.get(part, 0.0) + now - last
        self._last = now
        return now
