"""scripts/ncu_ops.py: the ops benchmark's cases run for Nsight Compute (here on the CPU, XLA mode, small shapes)."""

import pytest

from scripts.ncu_ops import main


def test_a_case_with_a_backward_and_a_forward_only_case_run():
    assert main(["dropout", "fp8_quantize", "--quick", "--mode", "xla", "--calls", "1"]) == 0


def test_an_unknown_case_is_refused_with_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["drop_out"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'drop_out'" in capsys.readouterr().err
