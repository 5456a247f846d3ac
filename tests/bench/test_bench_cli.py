"""The ``python -m train.bench`` front end: a suite's own ``--help``."""

import argparse

import pytest

from train.bench import suites as bench


def test_suite_help_is_the_suites_own(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["ops", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m train.bench ops") and "--out" in out


def test_top_level_help_names_the_suites(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    out = capsys.readouterr().out
    suites = "{attention,cli-scaling,counters,e2e,flops,gemm,ops,optim,profile,scaling,schedule,timeline}"
    assert "SUITE --help" in out and suites in out


def test_results_go_to_runs_bench_without_a_gpu(capsys, tmp_path):
    from train.bench import common

    parser = argparse.ArgumentParser()
    assert common.out_dir(None, parser) == common.REPO_ROOT / "runs" / "bench"  # the CPU test machine
    assert common.out_dir(tmp_path / "new", parser) == tmp_path / "new" and (tmp_path / "new").is_dir()
    with pytest.raises(SystemExit):
        bench.main(["ops", "--help"])
    assert "runs/bench otherwise" in " ".join(capsys.readouterr().out.split())
