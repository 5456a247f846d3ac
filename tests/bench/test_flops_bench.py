"""train.bench.flops: measured counters against the hand count (no GPU: synthetic counter totals)."""

import pytest

from train.bench import flops
from train.bench.steps import hand_count


def test_measured_flops_add_tensor_half_and_single_and_dram_adds_read_and_write():
    total = {
        "flops_tensor": 900.0,
        "flops_half": 60.0,
        "flops_single": 40.0,
        "dram_read_bytes": 7.0,
        "dram_write_bytes": 3.0,
    }
    assert flops.measured(total) == {"flops": 1000.0, "dram_bytes": 10.0, "tensor_share": pytest.approx(0.9)}
    # Without the tensor counter the FLOPs would miss every GEMM: unknown, not the CUDA-core part alone.
    assert flops.measured({**total, "flops_tensor": None})["flops"] is None
    assert flops.measured({**total, "dram_write_bytes": None})["dram_bytes"] is None


def test_slope_of_an_exact_line():
    fit = flops.fit_slope([1.0, 2.0, 4.0], [2.5, 4.5, 8.5])
    assert fit == pytest.approx({"slope": 2.0, "intercept": 0.5})
    assert flops.fit_slope([1.0], [2.0]) is None


def _row(batch, scale_flops, scale_bytes):
    estimate = flops.count_record(flops.encoder_block_estimate(batch, 128))
    return {
        "batch": batch,
        "flops": scale_flops * estimate["flops"],
        "dram_bytes": scale_bytes * estimate["dram_bytes"],
        "tensor_share": 0.95,
        "estimated": estimate,
    }


def test_sweep_summary_fits_measured_on_estimated(tmp_path):
    points = {
        "reference": [_row(b, 1.1, 3.0) for b in (16, 32, 64)],
        "ls_jax_ffi": [_row(b, 1.05, 1.5) for b in (16, 32, 64)],
    }
    summary = flops.sweep_summary(points)
    assert summary["reference"]["flops_fit"]["slope"] == pytest.approx(1.1)
    assert summary["ls_jax_ffi"]["dram_fit"]["slope"] == pytest.approx(1.5)
    assert "1.50 x as fast as the perfect-fusion minimum" in summary["ls_jax_ffi"]["why"]
    figure = tmp_path / "flops.png"
    flops.plot(points, summary, figure)
    assert figure.read_bytes()[:4] == b"\x89PNG"


def test_whole_steps_compare_a_counters_file_with_the_hand_count():
    estimate = hand_count.training_step(16, 64, 64, 1024, 4096, 16, 6, 6, 32768)
    counters_result = {
        "workloads": {
            "wmt-big-6e6d": {
                "batch": 16,
                "seq_len": 64,
                "results": {
                    "reference": {
                        "total": {
                            "flops_tensor": 2.0 * estimate.flops,
                            "flops_half": 0.0,
                            "flops_single": 0.0,
                            "dram_read_bytes": 3.0 * estimate.dram_bytes,
                            "dram_write_bytes": 0.0,
                        }
                    }
                },
            }
        }
    }
    result = flops.whole_steps(counters_result)["wmt-big-6e6d"]
    assert result["estimated"]["flops"] == estimate.flops
    assert result["implementations"]["reference"]["flops_over_estimate"] == pytest.approx(2.0)
    assert result["implementations"]["reference"]["dram_over_minimum"] == pytest.approx(3.0)


def test_an_encoder_stack_of_fewer_layers_is_counted_at_its_own_depth():
    block = flops.encoder_block_estimate(1, 512)
    entry = {
        "batch": 1,
        "seq_len": 512,
        "layers": 2,
        "results": {
            "reference": {
                "total": {
                    "flops_tensor": 2.0 * block.flops,
                    "flops_half": 0.0,
                    "flops_single": 0.0,
                    "dram_read_bytes": block.dram_bytes,
                    "dram_write_bytes": 0.0,
                }
            }
        },
    }
    result = flops.whole_steps({"workloads": {"bert-base": entry}})["bert-base"]
    assert result["estimated"]["flops"] == pytest.approx(2 * block.flops)
    assert result["implementations"]["reference"]["flops_over_estimate"] == pytest.approx(1.0)
    assert flops.workload_estimate("bert-base", 1, 512).flops == pytest.approx(12 * block.flops)


def test_a_wmt_step_of_fewer_layers_is_counted_with_half_encoder_half_decoder_layers():
    assert flops.workload_estimate("wmt-big-6e6d", 128, 64, 2) == hand_count.training_step(
        128, 64, 64, 1024, 4096, 16, 1, 1, 32768
    )
    assert flops.workload_estimate("wmt-big-6e6d", 128, 64, 12) == flops.workload_estimate("wmt-big-6e6d", 128, 64)
