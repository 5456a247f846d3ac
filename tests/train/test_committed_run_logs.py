"""The run logs committed under docs/results, read as the results page reads them: none reports a training
window whose measured energy over its time exceeds what its devices can draw (a window that counted compilation
energy into its training time would)."""

from pathlib import Path

import pytest

from train.costs import devices as device_table
from train.records import runlog

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
LOGS = sorted(RESULTS.rglob(runlog.LOG_FILENAME))
# NVML's energy counter moves in steps of tens of milliseconds: a window much shorter than a second can read a step
# more or less than it drew, so only longer ones are held to the bound.
MIN_SECONDS = 1.0
# NVML documents its power readings as accurate to within 5%, and a card at its power cap draws it on average:
# such a window may read a little above the board power, a window with compilation in it far above.
TOLERANCE = 1.05


def windows(summary: dict) -> dict[str, tuple[float | None, float]]:
    """(energy J, time s) of the training window and of each part that has both."""
    found = {"training": (summary.get("energy_j"), summary["train_time_s"])}
    for part in ("warmup", "steady"):
        if isinstance(summary.get(part), dict):
            found[part] = (summary[part].get("energy_j"), summary[part]["time_s"])
    return found


@pytest.mark.parametrize("path", LOGS, ids=[str(p.relative_to(RESULTS).parent) for p in LOGS])
def test_no_window_draws_more_than_its_devices_can(path):
    records = runlog.read(path)
    run = next(r for r in records if r["type"] == "run")
    summary = next((r for r in records if r["type"] == "summary"), None)
    spec = device_table.find_device(run["device_kind"])
    if summary is None or summary.get("energy_source") != "nvml" or spec is None or spec.max_power_w is None:
        pytest.skip("no measured energy against a known board power")
    limit = spec.max_power_w * run["device_count"] * TOLERANCE
    for name, (energy, seconds) in windows(summary).items():
        if energy is not None and seconds >= MIN_SECONDS:
            assert energy / seconds <= limit, f"{name}: {energy / seconds:.0f} W on {run['device_count']} x {spec.name}"


def test_the_results_hold_run_logs():
    assert len(LOGS) >= 10
