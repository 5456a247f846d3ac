"""SIGINT and SIGTERM during training: where a signal stops the run at once and where it waits for a step's end."""

from __future__ import annotations

import contextlib
import signal
from typing import Any, Iterator

from train.errors import Interrupted


class StopSignals:
    """SIGINT and SIGTERM while active. Inside `interruptible` (setup, compilation, evaluation: nothing is being
    written) a signal raises `Interrupted` at once; elsewhere it sets ``received`` and the loop stops at the next
    step boundary, so a checkpoint or log write is never cut in half."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._interruptible = False

    def _handle(self, signum, frame) -> None:
        self.received = signum
        if self._interruptible:
            self._interruptible = False
            raise Interrupted(signum)

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A phase a signal ends at once; one that came before it ends it on entry."""
        if self.received is not None:
            raise Interrupted(self.received)
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def __enter__(self) -> StopSignals:
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
