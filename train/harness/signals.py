"""SIGINT and SIGTERM during training: where a signal stops the run at once, where it waits for the work in hand
to return, and where it waits for a step's end."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any, Iterator

from train.errors import EXIT_SIGNAL_BASE, Interrupted


class StopSignals:
    """SIGINT and SIGTERM while active.

    Inside `interruptible` (evaluation: nothing is being written) a signal raises `Interrupted` at once. Inside
    `deferred` (setup and compilation, where XLA compiles in C++ and an exception raised into it crashed the process
    at exit) it raises `Interrupted` once the block's work has returned; a second signal there ends the process at
    once. Elsewhere it sets ``received`` and the loop stops at the next step boundary, so a checkpoint or log write is
    never cut in half."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._interruptible = False
        self._deferring: str | None = None  # what a deferred block does, for the line a second signal prints

    def _handle(self, signum, frame) -> None:
        if self._deferring is not None and self.received is not None:
            print(
                f"stopped by {signal.Signals(signum).name} again during {self._deferring}: exiting at once, "
                "nothing saved",
                file=sys.stderr,
                flush=True,
            )
            os._exit(EXIT_SIGNAL_BASE + signum)  # the work in hand is C++ that an exception must not unwind
        self.received = signum
        if self._interruptible:
            self._interruptible = False
            raise Interrupted(signum)

    @contextlib.contextmanager
    def deferred(self, doing: str) -> Iterator[None]:
        """A phase a signal ends once the work inside returns (``doing`` names it); one that came before it ends it
        on entry."""
        if self.received is not None:
            raise Interrupted(self.received)
        self._deferring = doing
        try:
            yield
        finally:
            self._deferring = None
        if self.received is not None:
            raise Interrupted(self.received)

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A phase a signal ends at once; one that came before it ends it on entry. Where code inside swallowed the
        `Interrupted` (a garbage-collection callback, JAX's read of its compilation cache), the phase ends when that
        code returns."""
        if self.received is not None:
            raise Interrupted(self.received)
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False
        if self.received is not None:
            raise Interrupted(self.received)

    def __enter__(self) -> StopSignals:
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, _PYTHON_DEFAULTS[signum] if handler is _stop_at_start_up else handler)


_PYTHON_DEFAULTS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}


def _stop_at_start_up(signum, frame) -> None:
    print(f"stopped by {signal.Signals(signum).name} while starting; nothing to save", file=sys.stderr, flush=True)
    os._exit(EXIT_SIGNAL_BASE + signum)


def stop_at_start_up() -> None:
    """Until `StopSignals` takes over, SIGINT and SIGTERM end the process with one line and 128 + the signal number.

    An entry point calls it before it imports JAX: the imports take seconds, and a KeyboardInterrupt raised inside
    one prints a traceback (and inside jaxlib's C++ can crash the process). Nothing has been written then.
    """
    for signum in StopSignals.SIGNALS:
        signal.signal(signum, _stop_at_start_up)
