"""A run's start-up, from the moment the process loads the training tools to compilation, in named parts the
summary reports."""

from __future__ import annotations

import dataclasses
import threading
import time

# When this process loaded the training tools: the ``train`` package imports this module first, and
# ``python -m train.<task>`` imports that package before anything else.
LOADED_AT = time.monotonic()

# The parts in the order a run passes them; `StartupClock.mark` closes each.
PARTS = ("imports", "run_directory", "hardware", "data_and_model", "state", "run_record", "loop")


def tools_loaded_at() -> float:
    """``time.monotonic()`` when this process loaded the ``train`` package: a ``python -m train.<task>`` run's
    start, before the imports it waits for. (The process's own start time would also count a wrapper that execs
    Python, such as ``bash -c "... && python -m train.wmt"``, which runs its last command in its own process.)"""
    return LOADED_AT


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


def warm_up_devices() -> threading.Thread:
    """Runs one small program on each local device on a thread of its own and returns that thread at once.

    A process's first program on a GPU pays the runtime's one-time work (about 1.8 s on an H200 host, whatever the
    program); begun here, it overlaps reading the data and building the model instead of delaying them. A failure
    here shows again, with its message, where the run first uses the device.
    """

    import jax  # here, not at the top: this module starts the clock before the tools' imports
    import numpy as np

    def run() -> None:
        try:
            increment = jax.jit(lambda x: x + 1)
            for device in jax.local_devices():
                jax.block_until_ready(increment(jax.device_put(np.int32(0), device)))
        except Exception:  # noqa: BLE001 - the run's own first use of the device reports it
            pass

    # Not a daemon: a process ending meanwhile (a refused flag) waits for it rather than stop it mid-way through
    # writing the program to the compilation cache.
    thread = threading.Thread(target=run, name="warm-up-devices")
    thread.start()
    return thread
