"""train.bench.ops: a case for every fused op and form, and ``python -m train.bench ops --quick`` on CPU."""

import json
import math

import pytest

from ls_jax import ops
from train.bench import common
from train.bench import ops as ops_bench
from train.bench import suites as bench

# ls_jax.ops functions with no kernel of their own: dense is the layers' GEMM (XLA everywhere), dropout_seed makes
# a seed, attention_unfused is two einsums around attn_softmax (which has its cases).
NOT_KERNELS = {"attention_unfused", "dense", "dropout_seed"}
# The case name of each op whose case is not named after its function.
CASE_PREFIX = {"label_smoothed_cross_entropy": "cross_entropy"}


def _case_names() -> list[str]:
    return [case.op for case in ops_bench.CASES]


def _prefix(name: str) -> str:
    return name.split("[")[0].split("+")[0]


def test_every_fused_op_has_a_case():
    functions = {name for name in ops.__all__ if callable(getattr(ops, name)) and name[0].islower()} - NOT_KERNELS
    benchmarked = {_prefix(name) for name in _case_names()}
    missing = {name for name in functions if CASE_PREFIX.get(name, name) not in benchmarked}
    assert not missing, f"ls_jax.ops functions with no case in train/bench/ops.py: {sorted(missing)}"


def test_every_fused_form_has_a_case():
    names = set(_case_names())
    assert {"layer_norm", "layer_norm+residual", "layer_norm+bias_dropout_residual"} <= names
    assert {f"bias_act_dropout[{activation}]" for activation in ops.ACTIVATIONS} <= names
    assert any(name.startswith("attn_softmax_causal") for name in names)
    assert len(names) == len(_case_names()), "case names must be unique: the results are keyed by them"


def _results_dir_state() -> dict[str, int]:
    if not common.RESULTS_DIR.exists():
        return {}
    return {path.name: path.stat().st_mtime_ns for path in common.RESULTS_DIR.iterdir()}


def _assert_timing(result: dict, bytes_moved: int, copy_bandwidth_GBps: float) -> None:
    for key in ("median_ms", "p10_ms", "p90_ms", "achieved_GBps", "fraction_of_copy_bandwidth"):
        assert math.isfinite(result[key]) and result[key] > 0, (key, result[key])
    assert result["p10_ms"] <= result["median_ms"] <= result["p90_ms"]
    assert result["achieved_GBps"] == pytest.approx(bytes_moved / (result["median_ms"] / 1e3) / 1e9)
    assert result["fraction_of_copy_bandwidth"] == pytest.approx(result["achieved_GBps"] / copy_bandwidth_GBps)
    assert result["kernels"] == []  # the xla backend calls no ls_* kernel
    assert "device_ms" not in result  # device time is traced on a GPU only


@pytest.mark.slow
def test_quick_run_on_xla_writes_every_case_into_out(tmp_path, capsys):
    results_before = _results_dir_state()
    assert bench.main(["ops", "--quick", "--backends", "xla", "--out", str(tmp_path)]) == 0
    assert _results_dir_state() == results_before, "the suite wrote into docs/results despite --out"
    (path,) = tmp_path.glob("ops-*.json")
    report = json.loads(path.read_text())

    assert report["suite"] == "ops" and report["quick"] is True
    environment = report["environment"]
    assert path.name == f"ops-{common.device_slug(environment['device_kind'])}.json"
    assert environment["device_count"] >= 1 and environment["versions"]["jax"]
    assert report["activation_dtype"] == "bfloat16" and report["param_dtype"] == "float32"
    assert report["dropout_rate"] == ops_bench.DROPOUT
    copy = report["copy_bandwidth_GBps"]
    assert math.isfinite(copy) and copy > 0

    assert [case["op"] for case in report["cases"]] == _case_names()
    printed = capsys.readouterr().out
    for case in report["cases"]:
        assert case["bytes_moved"] > 0 and case["shape"]
        assert case["floor_ms"] == pytest.approx(1e3 * case["bytes_moved"] / (copy * 1e9))
        assert "ffi" not in case and "speedup" not in case
        _assert_timing(case["xla"], case["bytes_moved"], copy)
        assert any(line.startswith(case["op"] + " ") for line in printed.splitlines()), case["op"]
    assert f"wrote {path}" in printed


def test_unknown_ops_and_backends_are_refused(capsys):
    with pytest.raises(SystemExit) as refused:
        bench.main(["ops", "--quick", "--ops", "layer_norm,no_such_op"])
    assert refused.value.code == 2 and "unknown ops: no_such_op" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        bench.main(["ops", "--quick", "--backends", "cuda"])
    assert refused.value.code == 2 and "--backends takes ffi and/or xla" in capsys.readouterr().err
