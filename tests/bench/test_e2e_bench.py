"""train.bench.e2e: the largest-batch prediction, and a --quick run of the whole benchmark on CPU."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.bench import e2e
from train.bench.steps import transformer_steps
from train.bench.tracing import kernel_trace
from train.costs import devices as device_table


def _linear_memory(base: float, per_token: float, tokens: list[int]) -> dict[int, int]:
    return {t: int(base + per_token * t) for t in tokens}


def test_largest_batch_is_the_last_multiple_of_1024_tokens_under_capacity():
    memory = _linear_memory(1e9, 1e5, [1024, 4096, 8192])
    # (2e9 - 1e9) / 1e5 = 10000 tokens fit; the largest multiple of 1024 below is 9216.
    assert e2e.predict_largest_batch(memory, capacity=int(2e9)) == 9216


def test_largest_batch_needs_two_measured_sizes():
    with pytest.raises(ValueError, match="two measured batch sizes"):
        e2e.predict_largest_batch({1024: 10**9}, capacity=2 * 10**9)


def test_predicted_largest_batches_compare_each_implementation_with_the_reference():
    results = {
        **{f"big/{t}/reference": {"memory_bytes": m} for t, m in _linear_memory(1e9, 2e5, [1024, 8192]).items()},
        **{f"big/{t}/ls_jax_ffi": {"memory_bytes": m} for t, m in _linear_memory(1e9, 1e5, [1024, 8192]).items()},
        "big/1024/ls_jax_xla": {"memory_bytes": 10**9},  # one size only: no prediction
        "big/largest/reference": {"verified_tokens": 4096},
    }
    table = e2e.predicted_largest_batches(results, capacity=int(3e9))
    assert table["big"]["reference"] == 9216 and table["big"]["ls_jax_ffi"] == 19456
    assert math.isclose(table["big"]["ls_jax_ffi_vs_reference"], 19456 / 9216)
    assert "ls_jax_xla" not in table["big"]
    assert e2e.predicted_largest_batches(results, capacity=None) == {}


def test_speedups_pair_records_of_one_run_only():
    results = {
        "big/8192/reference": {"step_time_s": 0.03, "run": "a"},
        "big/8192/ls_jax_ffi": {"step_time_s": 0.02, "run": "a"},
        "big/8192/ls_jax_xla": {"step_time_s": 0.025, "run": "b"},  # another run: its host may dispatch faster
    }
    assert e2e.speedups(results) == {"big/8192": {"ls_jax_ffi": pytest.approx(1.5)}}


def test_kernel_trace_without_a_directory_leaves_nothing_behind(tmp_path):
    """The ops benchmark traces without keeping the trace; on CPU there are no GPU kernels to report."""
    x = jnp.ones((8, 8))
    assert kernel_trace.trace_gpu_kernels(lambda: x @ x, 2) == []
    assert kernel_trace.trace_gpu_kernels(lambda: x @ x, 2, tmp_path / "kept") == []
    assert any((tmp_path / "kept").rglob("*.trace.json.gz"))


@pytest.mark.slow
def test_quick_run_measures_reference_and_ls_jax_side_by_side(tmp_path):
    assert e2e.main(["--quick", "--models", "wmt", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "e2e-cpu.json").read_text())
    assert set(report["results"]) == {"tiny-2e2d/256/reference", "tiny-2e2d/256/ls_jax_xla"}
    for record in report["results"].values():
        assert record["step_time_s"] > 0 and record["memory_bytes"] > 0
        assert record["steps_timed"] == 2 * record["steps_per_sample"] == 2 * e2e.STEPS_PER_SAMPLE
        assert 0 < record["host_dispatch_s"] < record["init_compile_and_first_step_s"]
        assert math.isfinite(record["first_loss"]) and math.isfinite(record["loss_after_timing"])
        assert record["flops_per_step"] > 0
        assert record["commit"] and record["run"] == report["results"]["tiny-2e2d/256/reference"]["run"]
    ratio = report["speedup_vs_reference"]["tiny-2e2d/256"]["ls_jax_xla"]
    timed = report["results"]
    assert math.isclose(
        ratio, timed["tiny-2e2d/256/reference"]["step_time_s"] / timed["tiny-2e2d/256/ls_jax_xla"]["step_time_s"]
    )
    assert (tmp_path / "e2e-cpu.png").stat().st_size > 0
    assert report["setup"]["vocab"] == transformer_steps.VOCAB  # a WMT model ran: its setup is written
    assert report["target_basis_tflops"] is None and timed["tiny-2e2d/256/reference"]["mfu_vs_target_basis"] is None


def test_the_wmt_setup_is_written_only_with_a_wmt_record():
    header = {"peak_tflops": None, "setup": {"vocab": transformer_steps.VOCAB}, "zoo_setup": {"dropout": 0.1}}
    zoo_only = {"bert-base/512/flax": {}, "gpt2-small/1024/ls_jax_xla": {}}
    assert e2e.header_of(header, zoo_only) == {"peak_tflops": None, "zoo_setup": {"dropout": 0.1}}
    assert e2e.header_of(header, {**zoo_only, "big-6e6d/8192/reference": {}}) == header


def test_target_mfu_basis_applies_to_the_h100_and_h200_sxm_only():
    assert e2e.target_basis_tflops(device_table.find_device("NVIDIA H100 80GB HBM3")) == 790.0
    assert e2e.target_basis_tflops(device_table.find_device("NVIDIA H200")) == 790.0
    assert e2e.target_basis_tflops(device_table.find_device("NVIDIA H100 PCIe")) is None
    assert e2e.target_basis_tflops(device_table.find_device("TPU v5 lite")) is None
    assert e2e.target_basis_tflops(None) is None


@pytest.mark.slow
def test_ls_jax_steps_train_bf16_params_from_split_f32_master_weights():
    from ls_jax import optim

    batch = transformer_steps.make_batch(4, seed=0)
    train_step = transformer_steps.build_step("ls_jax_xla", "tiny-2e2d", batch, layers_each=1)
    paths = [[key.key for key in path] for path, _ in jax.tree_util.tree_leaves_with_path(train_step.state[0])]
    assert sorted({"/".join(path[:2]) for path in paths if path[1].startswith("layer_")}) == [
        "decoder/layer_0",
        "encoder/layer_0",
    ]  # the model's widths at the depth asked for
    initial_params = jax.tree.map(np.asarray, train_step.state[0])  # the steps donate the state's buffers
    for _ in range(2):
        assert math.isfinite(float(train_step.run(batch)))
    params, opt_state, _, scaling = train_step.state
    assert scaling == {}  # no FP8 scaling state without FP8
    assert isinstance(opt_state, optim.MasterWeightsState)
    leaves = jax.tree.leaves(params)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in leaves)
    assert all(leaf.dtype == jnp.int16 for leaf in jax.tree.leaves(opt_state.master))  # the f32 masters' low halves
    for leaf, master_leaf in zip(leaves, jax.tree.leaves(optim.master_params(opt_state, params))):
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(optim.master.round_to_bf16(master_leaf)))
    assert any(np.any(np.asarray(a) != b) for a, b in zip(leaves, jax.tree.leaves(initial_params)))


@pytest.mark.parametrize(
    "build",
    [
        lambda batch: transformer_steps.build_step("reference_fp8", "tiny-2e2d", batch, layers_each=1),
        lambda batch: transformer_steps.ls_jax_step("tiny-2e2d", batch, layers_each=1, fp8_gemms=True),
    ],
    ids=["reference_fp8", "ls_jax_fp8"],
)
def test_fp8_steps_multiply_in_fp8_and_carry_their_scaling_state(build):
    """Both FP8 rows quantize to e4m3 and e5m2 in the compiled step, and each step's amax histories become the
    next step's scaling state (the optimizer never sees them)."""
    batch = transformer_steps.make_batch(4, seed=0)
    train_step = build(batch)
    hlo = train_step.lowered.as_text()
    assert "f8E4M3FN" in hlo and "f8E5M2" in hlo
    histories = lambda: {  # noqa: E731 - each quantized tensor's newest amax
        "/".join(str(k.key) for k in path): float(np.asarray(leaf)[0])
        for path, leaf in jax.tree_util.tree_leaves_with_path(train_step.state[3])
        if path[-1].key.endswith("amax_history")
    }
    assert histories() and all(value == 0.0 for value in histories().values())
    assert math.isfinite(float(train_step.run(batch)))
    after_one = histories()
    assert all(value > 0.0 for value in after_one.values()), after_one  # inputs, kernels and output gradients
    assert any(path.endswith("output_grad_amax_history") for path in after_one)
