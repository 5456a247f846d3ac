"""StopSignals with real signals sent to this process."""

import os
import signal
import time

import pytest

from train.errors import Interrupted
from train.harness.signals import StopSignals


def _signal_self_inside_code_that_swallows_exceptions(signum: int) -> None:
    try:
        os.kill(os.getpid(), signum)
        time.sleep(5)  # the handler runs before this returns, and raises here
    except Exception:  # as a garbage-collection callback or JAX's compilation-cache read does
        pass


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_that_code_inside_swallowed_still_ends_the_phase(signum):
    started = time.monotonic()
    with StopSignals() as signals, pytest.raises(Interrupted) as raised:
        with signals.interruptible():
            _signal_self_inside_code_that_swallows_exceptions(signum)
    assert raised.value.signum == signum and time.monotonic() - started < 4


def test_a_signal_inside_the_phase_ends_it_at_once():
    with StopSignals() as signals, pytest.raises(Interrupted) as raised:
        with signals.interruptible():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            pytest.fail("the phase went on after the signal")
    assert raised.value.signum == signal.SIGTERM


def test_outside_a_phase_a_signal_is_only_recorded():
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert signals.received == signal.SIGTERM
