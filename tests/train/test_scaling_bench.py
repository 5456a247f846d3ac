"""`python -m train.bench scaling`: the overlap estimate on known schedules, and the JSON of a tiny 2-device CPU run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from train.bench import scaling
from train.bench.scaling import bucket_sizes, device_counts, efficiencies
from train.bench.steps import overlap, scaling_models

ROOT = Path(__file__).resolve().parents[2]


def test_communication_waits_for_its_compute_and_for_the_channel():
    # compute ends at 2, 3, 4; all-reduces: [2, 3], then [3, 6] (channel free at 3), then [6, 7] (waits for it)
    assert overlap.communication_schedule([2, 1, 1], [1, 3, 1]) == [(2, 3), (3, 6), (6, 7)]
    assert overlap.overlapped_backward([2, 1, 1], [1, 3, 1]) == 7


def test_hidden_communication_costs_nothing_and_serial_communication_adds_up():
    assert overlap.overlapped_backward([1, 1, 1], [0.5, 0.5, 0]) == 3  # each hidden behind the next stage
    assert overlap.overlapped_backward([1, 1, 1], [0.5, 0.5, 0.5]) == 3.5  # the last one cannot hide
    assert overlap.overlapped_backward([1, 0, 0], [0, 2, 2]) == 5  # nothing to hide behind
    assert overlap.overlapped_backward([3], [0]) == 3
    assert overlap.overlapped_backward([], []) == 0


def test_bad_schedules_are_refused():
    with pytest.raises(ValueError, match="compute has 2 stages but comm has 1"):
        overlap.communication_schedule([1, 1], [1])
    with pytest.raises(ValueError, match=">= 0"):
        overlap.communication_schedule([1, -1], [1, 1])


def test_model_stages_run_the_rest_first_and_send_the_rest_last():
    stages = overlap.model_stages(10.0, [("decoder layer", 2, 2.0, 1.0), ("encoder layer", 1, 1.0, 0.5)], 3.0)
    assert stages == [
        ("outside the repeated layers", 5.0, 0.0),
        ("decoder layer 2", 2.0, 1.0),
        ("decoder layer 1", 2.0, 1.0),
        ("encoder layer 1", 1.0, 0.5),
        ("gradients outside the repeated layers", 0.0, 3.0),
    ]
    # compute ends 5, 7, 9, 10, 10; sends [7, 8], [9, 10], [10, 10.5], [10.5, 13.5]
    assert overlap.overlapped_backward([s[1] for s in stages], [s[2] for s in stages]) == 13.5
    assert overlap.relative_error(13.5, 12.0) == pytest.approx(0.125)


def test_efficiency_falls_back_to_the_replicated_step_at_one_device():
    rows = [
        {"model": "m", "implementation": "i", "mode": "replicated", "devices": 1, "step_ms": 10.0},
        {"model": "m", "implementation": "i", "mode": "sharded", "devices": 2, "step_ms": 12.5},
        {"model": "m", "implementation": "i", "mode": "replicated", "devices": 2, "step_ms": 11.0, "variant": "--flag"},
    ]
    efficiencies(rows)
    assert rows[1]["efficiency"] == pytest.approx(0.8) and rows[1]["efficiency_base"] == "replicated, 1 device"
    assert rows[2]["efficiency"] == pytest.approx(10 / 11)
    assert [r["exposed_comm_ms"] for r in rows] == pytest.approx([0.0, 2.5, 1.0])


def test_bucket_sizes_are_positive_numbers():
    assert bucket_sizes("25,100000") == [25.0, 100000.0]
    with pytest.raises(SystemExit, match="each size must be from 9.53674e-07 to 1.04858e.06 MiB, got 0"):
        bucket_sizes("25,0")
    with pytest.raises(SystemExit, match="got 1e.303"):
        bucket_sizes("1e303")
    with pytest.raises(SystemExit, match="give MiB as numbers"):
        bucket_sizes("25MB")


def test_an_unknown_implementation_is_one_line():
    with pytest.raises(SystemExit, match="--implementations foo: unknown foo; choose from ls_jax_ffi, ls_jax_xla"):
        scaling.main(["--implementations", "foo"])


def test_more_devices_than_there_are_is_one_line():
    with pytest.raises(SystemExit, match="--devices 1,4: this host has 2 devices"):
        device_counts(2, "1,4")
    assert device_counts(4, None) == [1, 2, 4]


@pytest.mark.slow
def test_a_tiny_two_device_run_writes_every_table(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    command = [
        sys.executable,
        "-m",
        "train.bench",
        "scaling",
        "--models",
        "tiny-2e2d",
        "--implementations",
        "ls_jax_xla",
        "--devices",
        "1,2",
        "--steps",
        "1",
        "--tokens-per-device",
        "128",
        "--allreduce-mb",
        "1",
        "--sharded-for",
        "tiny-2e2d:ls_jax_xla",
        "--compile-threads",
        "2",
        "--grad-bucket-mb",
        "0.05,100000",
        "--no-plot",
        "--tag",
        "tiny",
        "--out",
        str(tmp_path),
    ]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "scaling-cpux2-tiny.json").read_text())
    rows = {(r["model"], r["mode"], r["devices"], r["grad_bucket_mb"]): r for r in data["results"]}
    # Both bucket sizes side by side at 2 devices; one device sums nothing over devices.
    assert set(rows) == {
        ("tiny-2e2d", "replicated", 1, 0.05),
        *((("tiny-2e2d", mode, 2, mb) for mode in ("replicated", "sharded") for mb in (0.05, 100000))),
    }
    for (model, mode, n, _), row in rows.items():
        assert row["step_ms"] > 0 and row["efficiency"] > 0 and row["tokens_per_s"] > 0
        assert ("split" in row) == (mode == "replicated")
        assert row["exposed_comm_ms"] == pytest.approx(row["step_ms"] - rows[(model, "replicated", 1, 0.05)]["step_ms"])
    rows = {key[:3]: row for key, row in rows.items() if key[3] == 0.05}
    two = rows[("tiny-2e2d", "replicated", 2)]["split"]
    assert two["allreduce_ms"] > 0 and two["forward_ms"] > 0 and two["backward_ms"] > 0 and two["optimizer_ms"] > 0
    assert rows[("tiny-2e2d", "replicated", 1)]["split"]["allreduce_ms"] == 0
    sharded = rows[("tiny-2e2d", "sharded", 2)]["optimizer_state_bytes_per_device"]
    assert sharded < rows[("tiny-2e2d", "replicated", 2)]["optimizer_state_bytes_per_device"]
    estimates = {(e["model"], e["devices"]): e for e in data["backward_estimate"] if e["grad_bucket_mb"] == 0.05}
    assert set(estimates) == {("tiny-2e2d", 1), ("tiny-2e2d", 2)}
    tiny = estimates[("tiny-2e2d", 2)]
    assert [s["name"] for s in tiny["stages"]][1:-1] == [
        "decoder layer 2",
        "decoder layer 1",
        "encoder layer 2",
        "encoder layer 1",
    ]
    assert tiny["estimated_ms"] == pytest.approx(
        overlap.overlapped_backward([s["compute_ms"] for s in tiny["stages"]], [s["comm_ms"] for s in tiny["stages"]])
    )
    assert tiny["relative_error"] == pytest.approx((tiny["estimated_ms"] - tiny["measured_ms"]) / tiny["measured_ms"])
    one = estimates[("tiny-2e2d", 1)]  # nothing to send on one device: the stages' compute, one after another
    assert all(s["comm_ms"] == 0 for s in one["stages"])
    assert one["estimated_ms"] == pytest.approx(sum(s["compute_ms"] for s in one["stages"]))
    pieces = {p["model"]: p for p in data["pieces"]}
    bus = data["allreduce"][0]["bus_gb_per_s"]
    assert tiny["stages_from_bandwidth"][-1]["comm_ms"] == pytest.approx(
        2 * (2 - 1) / 2 * pieces["tiny-2e2d"]["rest_gradient_bytes"] / (bus * 1e9) * 1e3
    )
    layers = pieces["tiny-2e2d"]["layers"]
    assert layers["encoder layer"]["count"] == layers["decoder layer"]["count"] == 2
    assert layers["encoder layer"]["gradient_bytes"] > 0
    assert [p["devices"] for p in data["allreduce"]] == [2] and data["allreduce"][0]["bus_gb_per_s"] > 0
    assert set(data["method"]["split"]) == {"forward_ms", "backward_ms", "allreduce_ms", "optimizer_ms", "rest_ms"}


def test_a_transformer_takes_the_vocabulary_and_sentence_length_a_cli_run_has():
    rows, length = scaling_models.rows_and_length("tiny-2e2d", 512, 32, 128, sentence_length=16)
    model = scaling_models.build("tiny-2e2d", rows, length, vocab=300)
    assert (rows, length) == (32, 16) and model.batch["src"].shape == (1, 32, 16) and model.tokens_per_device == 512
    assert model.batch["src"].max() < 300 and model.module.config.vocab_size == 300
