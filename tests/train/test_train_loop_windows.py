"""The windows of a run end to end on the toy loop of test_train_loop: real delays in the first batches make a
warm-up, and a meter of constant power gives every window that power only if time and energy are read at the
same instants."""

import dataclasses
import time

import jax
import optax
import pytest
from test_train_loop import ToyStream, new_state, run_loop

from train.costs.devices import Power
from train.costs.energy import EstimatedEnergy
from train.costs.hardware import Hardware
from train.harness.parallel import DataParallel
from train.harness.progress import Counters, describe_windows
from train.records import runlog
from train.records.checkpoints import Checkpoints

WATTS = 10.0
SLOW, FAST = 0.4, 0.05  # seconds the data stream takes for a slow and for an ordinary batch
READ_APART = 5e-3  # seconds between reading the clock and the meter, at most (a busy 2-core machine)


def delays(slow_batches):
    """A stream hook: the first ``slow_batches`` batches take SLOW seconds to fetch, the others FAST."""
    return lambda served: time.sleep(SLOW if served <= slow_batches else FAST)


def metered():
    """This machine's devices with an energy meter of WATTS, started now."""
    return dataclasses.replace(Hardware.detect("fp32"), energy=EstimatedEnergy(Power(WATTS, "the test's figure"), 1))


def drew_the_meters_power(part):
    """Whether a window's energy is WATTS over its time, but for the moments between reading clock and meter."""
    return abs(part["energy_j"] - WATTS * part["time_s"]) <= 2 * WATTS * READ_APART


def test_slow_first_steps_are_the_warm_up_and_every_window_draws_the_meters_power(tmp_path):
    hardware = metered()
    result, _ = run_loop(
        tmp_path, ToyStream(on_step=delays(4)), steps=20, checkpoint_every=1000, log_every=5, hardware=hardware
    )
    summary = result.summary
    warmup, steady = summary["warmup"], summary["steady"]
    # Batches 1-4 take 0.4 s each; steps 1-3 hold them (a step ends once the host has queued the next one).
    assert 3 <= warmup["steps"] <= 5 and warmup["time_s"] >= 4 * SLOW
    assert warmup["steps"] + steady["steps"] == 20
    assert FAST <= steady["step_time_s"] < 4 * FAST
    assert warmup["time_s"] + steady["time_s"] == pytest.approx(summary["train_time_s"], rel=1e-9)
    assert warmup["energy_j"] + steady["energy_j"] == pytest.approx(summary["energy_j"], rel=1e-9)
    # Read together, time and energy give each window the meter's power.
    for part in (warmup, steady, summary["compilation"], summary["evaluation"], summary["checkpoints"]):
        assert drew_the_meters_power(part)
    assert steady["power_w"] == pytest.approx(WATTS, rel=1e-2)
    assert drew_the_meters_power({"energy_j": summary["energy_j"], "time_s": summary["train_time_s"]})
    assert steady["energy_per_step_j"] == pytest.approx(steady["energy_j"] / steady["steps"])
    assert steady["examples_per_s"] == pytest.approx(8 * steady["steps"] / steady["time_s"])
    assert steady["cost_usd"] == pytest.approx(steady["time_s"] * hardware.price_per_device_hour / 3600)
    assert [summary[name]["count"] for name in ("compilation", "evaluation", "checkpoints")] == [1, 1, 1]
    one_time = sum(summary[name]["energy_j"] for name in ("compilation", "evaluation", "checkpoints"))
    assert summary["wall_energy_j"] > summary["energy_j"] + one_time
    # Start-up, compilation, the steps, evaluation and checkpoints are disjoint stretches of the wall time.
    parts = ("startup", "compilation", "evaluation", "checkpoints")
    assert summary["startup"]["count"] == 1 and summary["startup"]["time_s"] > 0
    assert summary["wall_time_s"] >= summary["train_time_s"] + sum(summary[name]["time_s"] for name in parts)
    # The interval records' energy covers the loop: compilation and training so far.
    last_interval = [r for r in runlog.read(tmp_path / runlog.LOG_FILENAME) if r["type"] == "interval"][-1]
    loop_energy = last_interval["energy_j"]
    assert summary["energy_j"] + summary["compilation"]["energy_j"] < loop_energy < summary["wall_energy_j"]
    lines = describe_windows(summary, lambda record: f"{record['examples_per_s']:.1f} examples/s")
    assert lines[0].startswith(f"  steady      {steady['steps']} steps, ") and "at 10 W" in lines[0]
    assert f"/step (median; mean {steady['time_s'] / steady['steps']:.4g} s)" in lines[0]
    assert lines[1].startswith(f"  warm-up     {warmup['steps']} steps until the step time settled")
    assert "compilation" in lines[3] and "(1x)" in lines[3]


def test_a_resumed_run_counts_the_warm_up_and_compilation_of_each_segment(tmp_path):
    run_loop(tmp_path, ToyStream(on_step=delays(3)), steps=10, checkpoint_every=10, log_every=5, hardware=metered())
    checkpoints = Checkpoints(tmp_path / "checkpoints")
    template = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        DataParallel.over_all_devices().replicate(new_state(optax.sgd(0.05))),
    )
    state, progress = checkpoints.restore(10, template, {"toy": 1})
    checkpoints.close()
    counters = Counters.from_dict(progress["counters"])
    assert counters.segment_starts == [0] and len(counters.step_energy_j) == 10
    assert counters.compilation.count == 1 and counters.compilation.energy_j > 0
    resumed, _ = run_loop(
        tmp_path,
        ToyStream(**progress["data"], on_step=delays(3)),
        steps=20,
        state=state,
        counters=counters,
        checkpoint_every=10,
        log_every=5,
        hardware=metered(),
    )
    summary = resumed.summary
    # A checkpoint's counters are saved before its own write: the resumed run counts its own checkpoint only.
    assert summary["compilation"]["count"] == 2 and summary["checkpoints"]["count"] == 1
    assert summary["startup"]["count"] == 2
    # Each segment's batches 1-3 are slow: its steps 1-2 hold them.
    assert 4 <= summary["warmup"]["steps"] <= 8 and summary["warmup"]["time_s"] >= 6 * SLOW
    assert summary["warmup"]["steps"] + summary["steady"]["steps"] == 20
    assert drew_the_meters_power(summary["warmup"]) and drew_the_meters_power(summary["compilation"])
    assert drew_the_meters_power({"energy_j": summary["energy_j"], "time_s": summary["train_time_s"]})


def test_counters_of_a_checkpoint_written_before_the_windows_resume_with_unknown_parts():
    old = {
        "train_time_s": 3.0,
        "wall_time_s": 9.0,
        "counts": {"examples": 24},
        "flops": 6.0,
        "xla_flops": 0.0,
        "xla_flops_known": True,
        "energy_j": 30.0,
        "step_times": [2.0, 0.5, 0.5],
        "last_loss": 1.0,
        "last_eval": {},
    }
    counters = Counters.from_dict(old)
    assert counters.segment_starts == [0] and counters.wall_energy_j is None
    assert counters.step_energy_j == [None] * 3 and counters.step_counts == {"examples": [None] * 3}
    assert counters.compilation.count == 0 and counters.compilation.energy_j is None
