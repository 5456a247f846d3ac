"""``python -m train.bench cli-scaling``: the training command itself at 1 and 2 devices, its own summaries read
back, efficiencies and speedups; and the data-parallel step's XLA options."""

import json
import types
from pathlib import Path

import numpy as np
import pytest

from train.bench import cli_scaling
from train.harness.parallel import DataParallel


def row(backend, devices, rate, layout="one"):
    return {"backend": backend, "devices": devices, "layout": layout, "steady_rate": rate}


def test_efficiency_is_against_n_times_one_device_and_speedup_against_xla():
    rows = [
        row("ffi", 1, 100.0),
        row("ffi", 2, 180.0),
        row("ffi", 2, 150.0, "per-device"),
        row("xla", 2, 120.0),
        row("xla", 4, None),
    ]
    cli_scaling.add_ratios(rows)
    assert [r["efficiency"] for r in rows] == [1.0, 0.9, 0.75, None, None]  # xla has no one-device run here
    assert [r["speedup_vs_xla"] for r in rows] == [None, 1.5, None, None, None]


def test_the_report_shows_missing_numbers_as_dashes():
    rows = [{**row("ffi", 2, None), "steady_step_ms": None, "host_phases": None, "timeline": None}]
    cli_scaling.add_ratios(rows)
    line = cli_scaling.report(rows, "tokens").splitlines()[1]
    assert line.split()[:4] == ["ffi", "2", "one", "-"]


def test_a_row_says_what_one_devices_batch_held_per_step():
    # Committed 4 x H200 runs: the first 150 steps of synthetic:600000 hold fewer tokens per GPU at 2 GPUs than at 1.
    runs = Path(__file__).resolve().parents[2] / "docs/results/scale-out-h200x4/defaults"
    one, two = (cli_scaling.run_row(runs / name, "tokens") for name in ("wmt-ffi-1-one", "wmt-ffi-2-one"))
    assert round(one["steady_count_per_device_step"]) == 12788 and round(two["steady_count_per_device_step"]) == 12513
    shown = {**two, "devices": 2, "layout": "one", "efficiency": None, "speedup_vs_xla": None, "timeline": None}
    line = cli_scaling.report([shown], "tokens")
    assert "12,513" in line.splitlines()[1]


def committed_rows(directory: str, names: list[str]) -> list[dict]:
    runs = Path(__file__).resolve().parents[2] / "docs/results" / directory
    rows = []
    for name in names:
        _, backend, devices, layout = name.split("-", 3)
        rows.append(
            {
                **cli_scaling.run_row(runs / name, "tokens"),
                "backend": backend,
                "devices": int(devices),
                "layout": layout,
                "timeline": json.loads((runs / name / "timeline.json").read_text()),
                "error": None,
            }
        )
    return rows


def test_caveats_name_batches_of_other_sizes_short_windows_and_untraced_runs():
    # 150 steps at 1 and 2 GPUs held 2.2% fewer tokens per GPU-step at 2; five epochs each held the same pairs.
    steps_150 = committed_rows("scale-out-h200x4/defaults", ["wmt-ffi-1-one", "wmt-ffi-2-one"])
    (note,) = cli_scaling.caveats(steps_150, "tokens", profiled=True)
    assert "12,513 to 12,788 tokens per device-step (2.2% apart)" in note and "--epochs" in note
    epochs_5 = committed_rows("scale-out-h200x2", ["wmt-ffi-1-one", "wmt-ffi-2-one", "wmt-ffi-2-per-device"])
    assert cli_scaling.caveats(epochs_5, "tokens", profiled=True) == []
    short = {**epochs_5[1], "steady_steps": 14, "timeline": None}
    notes = cli_scaling.caveats([epochs_5[0], short], "tokens", profiled=True)
    assert notes == [
        "ffi at 2 (one): its steady window holds 14 steps; its rates are noisy (more steps)",
        "ffi at 2 (one): traced no whole step (--profile-steps past its end, or a step too few)",
    ]
    assert cli_scaling.caveats([epochs_5[0], short], "tokens", profiled=False) == notes[:1]


def fake_parallel(count, platform):
    devices = np.asarray([types.SimpleNamespace(platform=platform)] * count)
    return DataParallel(types.SimpleNamespace(size=count, devices=devices))


def test_several_gpus_compile_with_the_latency_hiding_scheduler_and_early_collectives_unless_the_user_says(
    monkeypatch,
):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    early = {"xla_gpu_experimental_collective_start_as_early_as_possible": True}
    assert fake_parallel(2, "gpu").compiler_options() == {"xla_gpu_enable_latency_hiding_scheduler": True, **early}
    assert fake_parallel(1, "gpu").compiler_options() == {}
    assert fake_parallel(4, "cpu").compiler_options() == {}
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=false")
    assert fake_parallel(2, "gpu").compiler_options() == early


@pytest.mark.slow
def test_the_suite_runs_the_training_command_at_one_and_two_devices(tmp_path):
    code = cli_scaling.main(
        [
            "--task",
            "wmt",
            "--devices",
            "1,2",
            "--backends",
            "xla",
            "--processes",
            "xla",
            "--cpu",
            "--steps",
            "6",
            "--profile-steps",
            "4:5",
            "--keep-logs",
            str(tmp_path / "logs"),
            "--pack",
            "--out",
            str(tmp_path),
            "--",
            "--preset",
            "transformer-tiny",
            "--bleu-sentences",
            "0",
        ]
    )
    assert code == 0
    result = json.loads((tmp_path / "cli-scaling-cpux2.json").read_text())
    layouts = [(r["devices"], r["layout"]) for r in result["rows"]]
    assert layouts == [(1, "one"), (2, "one"), (2, "per-device")]
    for r in result["rows"]:
        assert r["error"] is None and r["device_count"] == r["devices"] and r["steady_rate"] > 0
        assert r["host_phases"]["steps"] == 6 and r["efficiency"] > 0
    assert (
        "xla at 2 (per-device): its steady window holds 5 steps; its rates are noisy (more steps)" in result["caveats"]
    )
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "wmt-xla-1-one.tar.gz",
        "wmt-xla-2-one.tar.gz",
        "wmt-xla-2-per-device.tar.gz",
    ]


def test_a_batch_per_device_grows_the_batch_with_the_device_count(tmp_path):
    code = cli_scaling.main(
        [
            "--task",
            "imdb",
            "--devices",
            "1,2",
            "--backends",
            "xla",
            "--batch-per-device",
            "4",
            "--cpu",
            "--steps",
            "3",
            "--keep-logs",
            str(tmp_path / "logs"),
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    kept = {p.name: json.loads((p / "config.json").read_text()) for p in (tmp_path / "logs").iterdir()}
    assert {name: config["batch_size"] for name, config in kept.items()} == {"imdb-xla-1-one": 4, "imdb-xla-2-one": 8}


def test_epochs_replace_steps_in_the_training_command_and_are_wmt_only(tmp_path):
    by_epochs = cli_scaling.run_command("wmt", [], "ffi", 150, tmp_path, None, epochs=2)
    by_steps = cli_scaling.run_command("wmt", [], "ffi", 150, tmp_path, None)
    assert by_epochs[by_epochs.index("--epochs") + 1] == "2" and "--steps" not in by_epochs
    assert by_steps[by_steps.index("--steps") + 1] == "150" and "--epochs" not in by_steps
    with pytest.raises(SystemExit, match="--epochs: a positive count, for wmt"):
        cli_scaling.main(["--task", "imdb", "--epochs", "1", "--cpu"])


def test_a_batch_per_device_is_refused_for_wmt():
    with pytest.raises(SystemExit, match="--batch-per-device"):
        cli_scaling.main(["--task", "wmt", "--batch-per-device", "4", "--cpu"])
