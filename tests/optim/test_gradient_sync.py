"""ls_jax.optim.GradientSync on 4 CPU devices: the checks are in gradient_sync_checks.py."""

from pathlib import Path

from helpers.host_devices import run_checks


def test_gradient_sync_on_four_devices():
    run_checks(Path(__file__).with_name("gradient_sync_checks.py"), devices=4)
