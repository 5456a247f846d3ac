"""train.bench gemm: ``--quick`` on CPU writes one case per FFN GEMM with consistent figures; bad flags are one line."""

import json

import pytest

from train.bench import gemm


def test_quick_run_writes_both_gemms_of_the_ffn(tmp_path, capsys):
    assert gemm.main(["--quick", "--models", "wmt-base", "--tokens", "1024", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "gemm-cpu.json").read_text())
    cases = {case["layer"]: case for case in data["cases"]}
    assert set(cases) == {"fc1", "fc2"}
    # --quick: tokens / 16, widths / 4
    assert (cases["fc1"]["tokens"], cases["fc1"]["k"], cases["fc1"]["n"]) == (64, 128, 512)
    assert (cases["fc2"]["tokens"], cases["fc2"]["k"], cases["fc2"]["n"]) == (64, 512, 128)
    for case in cases.values():
        assert case["flops"] == 6 * case["tokens"] * case["k"] * case["n"]
        assert set(case) >= {"gemm", "gemm+xla"} and "gemm+ffi" not in case  # no CUDA device here
        for variant in ("gemm", "gemm+xla"):
            timing = case[variant]
            assert timing["tflops"] == pytest.approx(case["flops"] / (timing["median_ms"] / 1e3) / 1e12)
            assert timing["share_of_peak"] == pytest.approx(timing["tflops"] / data["peak_tflops"])
        assert case["epilogue_ms"] == pytest.approx(case["gemm+xla"]["median_ms"] - case["gemm"]["median_ms"])
    row = next(line for line in capsys.readouterr().out.splitlines() if "fc1 64x128x512" in line)
    assert row.startswith("wmt-base") and f"{cases['fc1']['gemm']['share_of_peak']:4.0%}" in row


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--models", "t5"], "unknown models: t5"),
        (["--tokens", "1k"], "comma-separated integers"),
        (["--tokens", "0"], "must be positive"),
    ],
)
def test_bad_flags_are_one_line(flags, message, capsys):
    with pytest.raises(SystemExit):
        gemm.main(flags)
    assert message in capsys.readouterr().err
