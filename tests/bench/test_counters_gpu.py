"""Nsight Compute end to end on the GPU: one encoder block profiled through the counters child."""

import pytest

from train.bench import counters, flops
from train.bench.steps import hand_count
from train.bench.tracing import ncu_report, ncu_run

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
BATCH, SEQ_LEN = 4, 128


@pytest.fixture(scope="module")
def ncu():
    return ncu_run.find_ncu(None)


@pytest.fixture(scope="module")
def metrics(ncu):
    supported, missing = ncu_run.split_supported(ncu_report.METRICS, ncu_run.available_metrics(ncu))
    assert not missing, f"the GPU lacks {missing}"
    return supported


@pytest.mark.parametrize("implementation, fused_category", [("reference", None), ("ls_jax_ffi", "LayerNorm")])
def test_encoder_block_counters(ncu, metrics, implementation, fused_category, tmp_path):
    run = ncu_run.profile(ncu, metrics, "encoder-block", implementation, BATCH, SEQ_LEN, tmp_path, timeout_s=300)
    summary = counters.summarize(run.kernels, run.hlo)
    total = summary["total"]
    assert total["kernels"] >= 6 and "GEMM" in summary["categories"]
    assert total["dram_read_bytes"] > 0 and total["instructions"] > 0
    assert 0 < total["achieved_occupancy_pct_time_weighted"] <= 100
    # Tensor-core math ops against the hand-counted GEMM FLOPs: 1 if ncu counts a multiply-add as 2 ops.
    estimate = hand_count.encoder_block(BATCH, SEQ_LEN, 768, 3072, 12)
    assert 0.45 < total["flops_tensor"] / estimate.gemm_flops < 1.6
    assert flops.measured(total)["flops"] > total["flops_tensor"]
    if fused_category is not None:  # ls_jax's own kernels are found by name
        assert any("ls::" in k.name for k in run.kernels)
        assert summary["categories"][fused_category]["kernels"] > 0
