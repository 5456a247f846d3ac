"""train.bench.tracing.ncu_report / counters: Nsight Compute's raw CSV parsed, grouped, aggregated and normalised."""

import json
from pathlib import Path

import pytest

from train.bench import counters
from train.bench.tracing import ncu_report, ncu_run

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "ncu" / "raw-page.csv"
HLO = """
HloModule jit_step
%loop_add_fusion.49 = bf16[8192] fusion(%a), kind=kLoop, metadata={op_name="jit(step)/jvp(M)/encoder/LayerNorm_0/add"}
ROOT %input_reduce_fusion = f32[] fusion(%c), kind=kInput, metadata={op_name="jit(step)/jvp(criterion)/reduce_sum"}
"""


@pytest.fixture
def kernels():
    return ncu_report.parse_csv(SAMPLE.read_text())


def test_parse_skips_prof_lines_and_reads_thousands_separators(kernels):
    assert [k.id for k in kernels] == [0, 1, 2, 3]
    assert kernels[1].name.startswith("void ls::(anonymous namespace)::layer_norm_fwd_kernel<__nv_bfloat16, float, 8>")
    assert kernels[0].metrics[ncu_report.DRAM_READ] == 12_582_912
    assert kernels[0].metrics["sm__ops_path_tensor_src_bf16_dst_fp32.sum"] == 17_179_869_184
    assert kernels[3].metrics[ncu_report.DRAM_WRITE] is None  # "n/a"
    assert "Block Size" not in kernels[0].metrics


def test_parse_reads_the_requested_metrics_among_the_raw_pages_word_attributes():
    lines = SAMPLE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    extra = ['"launch__func_cache_config"', '""'] + ['"CachePreferNone"'] * (len(lines) - start - 2)
    text = "\n".join([*lines[:start], *(f"{line},{cell}" for line, cell in zip(lines[start:], extra))])
    requested = [ncu_report.DRAM_READ, ncu_report.TIME]
    kernels = ncu_report.parse_csv(text, requested)
    assert [set(k.metrics) for k in kernels] == [set(requested)] * 4
    assert kernels[0].metrics[ncu_report.DRAM_READ] == 12_582_912
    with pytest.raises(ValueError, match="'CachePreferNone' is not a number"):
        ncu_report.parse_csv(text)
    with pytest.raises(ValueError, match="no column for dram__bytes_written.sum"):
        ncu_report.parse_csv(text, ["dram__bytes_written.sum"])


@pytest.mark.parametrize(
    "text, unit, value",
    [
        ("1,234.5", "byte", 1234.5),
        ("2", "Kbyte", 2e3),
        ("1.5", "Mbyte", 1.5e6),
        ("3", "usecond", 3e3),
        ("7", "msecond", 7e6),
        ("80.5", "%", 80.5),
        ("", "byte", None),
        ("n/a", "inst", None),
    ],
)
def test_parse_number_to_base_units(text, unit, value):
    assert ncu_report.parse_number(text, unit) == value


def test_non_numeric_cell_and_missing_header_are_one_clear_error():
    with pytest.raises(ValueError, match="not a number"):
        ncu_report.parse_number("NVIDIA H100", "")
    with pytest.raises(ValueError, match="--csv --page raw"):
        ncu_report.parse_csv("==PROF== Connected\n==ERROR== ERR_NVGPUCTRPERM\n")


def test_aggregate_sums_counts_medians_and_time_weights_efficiencies(kernels):
    total = ncu_report.aggregate(kernels)
    assert total["kernels"] == 4
    assert total["time_ns"] == 200_000
    assert total["dram_read_bytes"] == 12_582_912 + 2_000_000 + 3_000_000 + 1_000
    assert total["dram_write_bytes"] == 4_194_304 + 2_000_000 + 1_000_000  # the n/a cell is left out
    assert total["instructions"] == 1_305_000
    assert total["instructions_per_warp"] == pytest.approx(1_305_000 / 7_032)
    assert total["global_load_requests"] == 60_010 and total["global_store_requests"] == 35_001
    assert total["flops_half"] == 1_000 + 2_000 + 2 * 3_000  # hadd + hmul + 2 hfma
    assert total["flops_single"] == 100_000 + 200_000 + 2 * 300_000
    assert total["flops_tensor"] == 17_179_869_184
    assert total["sm_throughput_pct_median"] == pytest.approx(30.0)
    assert total["sm_throughput_pct_time_weighted"] == pytest.approx(44.35)
    assert total["achieved_occupancy_pct_median"] == pytest.approx(35.0)
    assert total["achieved_occupancy_pct_time_weighted"] == pytest.approx(17.75)
    assert total["ipc_median"] == pytest.approx(1.0)
    assert total["ipc_time_weighted"] == pytest.approx(0.935)


def test_categories_follow_the_profile_suite(kernels):
    summary = counters.summarize(kernels, HLO)
    categories = summary["categories"]
    assert list(categories) == ["GEMM", "LayerNorm", "criterion"]
    assert categories["LayerNorm"]["kernels"] == 2  # the ls_jax kernel by name, the fusion by its op_name
    assert categories["LayerNorm"]["time_ns"] == 30_000
    assert categories["criterion"]["dram_read_bytes"] == 1_000
    assert summary["total"]["kernels"] == 4
    stages = summary["stages"]  # the GEMM and the ls_jax kernel have no HLO instruction of their name
    assert {name: entry["kernels"] for name, entry in stages.items()} == {
        "unattributed": 2,
        "encoder forward": 1,
        "output projection + loss": 1,
    }


def test_normalise_divides_by_the_reference(kernels):
    results = {"reference": counters.summarize(kernels, HLO), "ls_jax_ffi": counters.summarize(kernels[:2], HLO)}
    ratios = counters.normalised(results, "reference")
    assert list(ratios) == ["ls_jax_ffi"]
    assert ratios["ls_jax_ffi"]["kernels"] == pytest.approx(0.5)
    assert ratios["ls_jax_ffi"]["time_ns"] == pytest.approx(110_000 / 200_000)
    assert ratios["ls_jax_ffi"]["flops_half"] == 0.0  # its two kernels do none of the 9000 half FLOPs
    assert ncu_report.normalise({"a": 2.0, "b": None}, {"a": 0.0, "b": 1.0}) == {"a": None, "b": None}


def test_result_file_keeps_other_workloads_and_figure_is_written(tmp_path, kernels):
    path = tmp_path / "counters-h100.json"
    path.write_text(json.dumps({"suite": "counters", "workloads": {"bert-base": {"batch": 1}}}))
    merged = counters.merge_result(path, "wmt-big-6e6d", {"batch": 16}, {"device_kind": "H100"})
    assert merged["workloads"] == {"bert-base": {"batch": 1}, "wmt-big-6e6d": {"batch": 16}}
    figure = tmp_path / "bars.png"
    counters.plot({"ls_jax_ffi": {"kernels": 0.5, "time_ns": 0.7, "flops_half": None}}, "test", figure)
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ncu_command_profiles_only_the_marked_range_of_every_process(tmp_path):
    command = ncu_run.ncu_command("/bin/ncu", ["a.sum", "b.sum"], tmp_path / "log.csv", ["python", "-m", "x"])
    joined = " ".join(command)
    for flags in (
        "--csv --page raw",
        "--print-units base",
        "--metrics a.sum,b.sum",
        "--target-processes application-only",
        "--profile-from-start off",
        f"--log-file {tmp_path / 'log.csv'}",
    ):
        assert flags in joined
    assert command[-3:] == ["python", "-m", "x"]


def test_metrics_the_gpu_lacks_are_listed_not_requested():
    have, lack = ncu_run.split_supported(
        ["dram__bytes_read.sum", "sm__ops_path_tensor_src_bf16_dst_fp32.sum"], {"dram__bytes_read"}
    )
    assert have == ["dram__bytes_read.sum"] and lack == ["sm__ops_path_tensor_src_bf16_dst_fp32.sum"]
    assert ncu_run.split_supported(["x.sum"], None) == (["x.sum"], [])


def test_missing_ncu_is_one_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="--ncu PATH"):
        ncu_run.find_ncu(str(tmp_path / "ncu"))


@pytest.mark.parametrize("suite", ["counters", "flops"])
def test_suites_without_ncu_stop_with_one_line(suite, tmp_path, capsys):
    from train.bench import suites as bench

    with pytest.raises(SystemExit) as exit_info:
        bench.main([suite, "--ncu", str(tmp_path / "ncu"), "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "Nsight Compute (ncu) not found" in capsys.readouterr().err


def test_a_kernel_limit_is_passed_to_ncu_and_said_in_the_result(tmp_path):
    command = ncu_run.ncu_command("/bin/ncu", ["a.sum"], tmp_path / "log.csv", ["python"], max_kernels=500)
    assert command[command.index("--launch-count") + 1] == "500"
    assert "--launch-count" not in ncu_run.ncu_command("/bin/ncu", ["a.sum"], tmp_path / "l", ["python"])
    assert counters.sampled(True, None).startswith("every kernel of one training step")
    assert "first 500 kernels" in counters.sampled(True, 500)
    assert "of 2 of the model's 12 identical layers" in counters.sampled(False, None, 2, 12)
    assert "identical layers" not in counters.sampled(False, None, 12, 12)
    assert "training step of the model with 1 encoder and 1 decoder layers of its 6 + 6" in counters.sampled(
        True, None, 2, 12
    )
    command = ncu_run.child_command("bert-base", "reference", 1, 512, Path("/w"), layers=2)
    assert command[command.index("--layers") + 1] == "2"
    assert "--layers" not in ncu_run.child_command("bert-base", "reference", 1, 512, Path("/w"))


def _script(path, body):
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_a_hung_profile_is_killed_at_the_timeout(tmp_path):
    hung = _script(tmp_path / "ncu", "sleep 60")
    with pytest.raises(TimeoutError, match="ran past 1 s under ncu"):
        ncu_run.profile(hung, ["a.sum"], "encoder-block", "reference", 2, 16, tmp_path / "work", timeout_s=1)


def test_ncu_failure_shows_the_end_of_its_log(tmp_path):
    # The log file is the argument after --log-file; a failing ncu writes its error there.
    failing = _script(
        tmp_path / "ncu",
        'while [ "$1" != --log-file ]; do shift; done\n'
        'echo "==ERROR== ERR_NVGPUCTRPERM - no permission" > "$2"\nexit 1',
    )
    with pytest.raises(RuntimeError, match="ERR_NVGPUCTRPERM - no permission"):
        ncu_run.profile(failing, ["a.sum"], "encoder-block", "reference", 2, 16, tmp_path / "work", timeout_s=30)
