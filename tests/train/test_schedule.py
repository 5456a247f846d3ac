"""``python -m train.bench schedule``: a scheduled HLO's all-reduces placed among its matrix products."""

import json

import pytest

from train.bench import schedule

HLO = """HloModule jit_train_step, is_scheduled=true

%async_computation.1 (p: f32[8]) -> f32[8] {
  %gemm_fusion_dot.9 = f32[8]{0} fusion(%p), kind=kCustom, calls=%x
}

ENTRY %main (p0: f32[8,8], p1: f32[8]) -> f32[8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %custom-call.1 = f32[8]{0} custom-call(%p0), custom_call_target="ls_layer_norm_fwd"
  %custom-call.2 = f32[8]{0} custom-call(%p0), custom_call_target="ls_cross_entropy_bwd"
  %custom-call.3 = (f32[8,8]{1,0}, s8[4]{0}) custom-call(%p0), custom_call_target="__cublas$lt$matmul"
  %gemm_fusion_dot.1 = f32[8]{0} fusion(%p0), kind=kCustom, calls=%y
  %input_concatenate_fusion.1 = f32[16]{0} fusion(%p0), kind=kInput, calls=%z
  %all-reduce-start.1 = ((f32[16]{0}), f32[16]{0}) async-start(%input_concatenate_fusion.1), calls=%a
  %gemm_fusion_dot.2 = f32[8]{0} fusion(%p0), kind=kCustom, calls=%y
  %all-reduce-done.1 = f32[16]{0} async-done(%all-reduce-start.1)
  %add.1 = f32[8]{0} add(%gemm_fusion_dot.1, %gemm_fusion_dot.2)
  ROOT %custom-call.4 = f32[8]{0} custom-call(%add.1), custom_call_target="ls_optim_step"
}
"""


def test_the_sequence_from_the_loss_backward_and_the_products_after_the_first_all_reduce():
    summary = schedule.summarize(HLO)
    assert summary["sequence"] == [
        "cross_entropy_bwd",
        "gemm x2",
        "concatenate",
        "all-reduce-start",
        "gemm",
        "all-reduce-done",
        "optim_step",
    ]
    assert (summary["all_reduces"], summary["gemms"], summary["gemms_after_first_all_reduce"]) == (1, 3, 1)
    assert schedule.summarize(HLO, start="absent")["sequence"][0] == "layer_norm_fwd"


def test_the_command_writes_its_summary_and_refuses_a_file_without_an_entry(tmp_path, capsys):
    dump = tmp_path / "step.txt"
    dump.write_text(HLO)
    assert schedule.main([str(dump), "--out", str(tmp_path / "s.json")]) == 0
    assert "1 of 3 matrix products run after the first all-reduce starts" in capsys.readouterr().out
    assert json.loads((tmp_path / "s.json").read_text())["all_reduces"] == 1
    dump.write_text("HloModule m\n")
    with pytest.raises(SystemExit) as exited:
        schedule.main([str(dump)])
    assert exited.value.code == 2 and "no ENTRY computation" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        schedule.main([str(tmp_path / "absent.txt")])
    assert exited.value.code == 2
    assert f"error: no such file: {tmp_path / 'absent.txt'}" in capsys.readouterr().err


def test_a_synchronous_all_reduce_counts_as_one():
    # The form XLA leaves when an all-reduce has nothing to overlap (seen in a 2-GPU step's dump).
    line = (
        "  %all-reduce.4 = f32[16]{0} all-reduce(%input_concatenate_fusion.1), channel_id=1, to_apply=%r, "
        'metadata={scheduling_name="all-reduce-start"}\n'
    )
    text = HLO.replace(
        "  %gemm_fusion_dot.2",
        line + "  %gemm_fusion_dot.3 = f32[8]{0} fusion(%p0), kind=kCustom\n  %gemm_fusion_dot.2",
    )
    summary = schedule.summarize(text)
    assert summary["sequence"][3:6] == ["all-reduce-start", "all-reduce", "gemm x2"]
    assert (summary["all_reduces"], summary["gemms_after_first_all_reduce"]) == (2, 2)
