"""The training step with gradients summed inside the backward on 2 and 4 CPU devices: the checks are in
overlapped_step_checks.py."""

from pathlib import Path

from helpers.host_devices import run_checks


def test_overlapped_step_on_two_and_four_devices():
    run_checks(Path(__file__).with_name("overlapped_step_checks.py"), devices=4)
