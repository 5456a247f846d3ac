"""XLA's FLOP count of a data-parallel step on several devices (run with 2 CPU devices by test_metrics.py)."""

import jax
from helpers.flop_step import FLOP_TOLERANCE, tiny_transformer_step

from ls_jax import backend
from train.harness.step_compiler import StepCompiler


def test_xla_flops_are_the_whole_steps_not_one_devices_share():
    assert jax.device_count() == 2
    compiler, state, batch, analytic = tiny_transformer_step()
    with backend.use("xla"):
        compiler.compiled(state, batch)
    xla = compiler.xla_flops(StepCompiler.key(batch))
    # One device's share would be half the analytic count.
    assert abs(analytic - xla) / xla < FLOP_TOLERANCE, (analytic, xla)
