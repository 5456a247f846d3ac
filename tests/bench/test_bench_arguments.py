"""Shape flags that a suite cannot use are one argparse error line (exit 2), before any ncu or GPU work."""

import pytest

from train.bench import counters, flops, profile


def _refused(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("error", "python -m"))]
    assert len(errors) == 1, errors
    return errors[0]


@pytest.mark.parametrize("batches", ["16,x", "16,0", "-4", "16,,32"])
def test_flops_refuses_batches_that_are_not_whole_numbers_above_zero(batches, tmp_path, capsys):
    line = _refused(flops.main, ["--batches", batches, "--out", str(tmp_path)], capsys)
    assert f"--batches {batches}: give comma-separated whole numbers > 0" in line


def test_flops_batch_sizes_parse_a_good_list():
    assert flops.batch_sizes("16,32,256") == [16, 32, 256]


def test_counters_refuses_a_seq_len_for_a_whole_wmt_step(tmp_path, capsys):
    line = _refused(counters.main, ["--workload", "wmt-big-6e6d", "--seq-len", "64", "--out", str(tmp_path)], capsys)
    assert "--seq-len applies to the encoder workloads; wmt-big-6e6d is a whole training step" in line


@pytest.mark.parametrize(
    "workload, layers, says",
    [
        (
            "wmt-big-6e6d",
            "3",
            "an even number from 2 to 12 for wmt-big-6e6d (half encoder, half decoder layers), got 3",
        ),
        ("wmt-big-6e6d", "14", "an even number from 2 to 12"),
        ("bert-base", "13", "--layers takes 1 to 12 for bert-base, got 13"),
    ],
)
def test_counters_refuses_a_layer_count_the_workload_cannot_run(workload, layers, says, tmp_path, capsys):
    line = _refused(counters.main, ["--workload", workload, "--layers", layers, "--out", str(tmp_path)], capsys)
    assert says in line


@pytest.mark.parametrize(
    "model, flags, named",
    [
        ("bert-base", ["--tokens", "4096"], "--tokens"),
        ("gpt2-small", ["--tokens", "4096"], "--tokens"),
        ("big-6e6d", ["--seq-len", "128"], "--seq-len"),
        ("big-6e6d", ["--seq-len", "128", "--rows", "8"], "--seq-len and --rows"),
    ],
)
def test_profile_refuses_the_shape_flags_of_another_family(model, flags, named, tmp_path, capsys):
    line = _refused(profile.main, ["--model", model, *flags, "--out", str(tmp_path)], capsys)
    assert f"error: {named} does not apply to {model}" in line


@pytest.mark.parametrize("suite", ["ops", "optim", "gemm", "e2e"])
def test_an_out_that_is_a_file_is_refused_before_anything_is_measured(suite, tmp_path, capsys, monkeypatch):
    import importlib

    module = importlib.import_module(f"train.bench.{suite}")
    in_the_way = tmp_path / "results.txt"
    in_the_way.write_text("")
    monkeypatch.setattr(module.common, "environment", lambda: pytest.fail("measured before checking --out"))
    line = _refused(module.main, ["--quick", "--out", str(in_the_way)], capsys)
    assert f"--out {in_the_way}: a file is in the way; name a folder for the results" in line


def test_ops_refuses_an_empty_list_of_ops(tmp_path, capsys):
    from train.bench import ops

    assert "--ops names no op; give a comma-separated subset of: layer_norm" in _refused(
        ops.main, ["--quick", "--ops", "", "--out", str(tmp_path)], capsys
    )


@pytest.mark.parametrize("flags", [["--tokens", "512"], ["--seq-lens", "64"], ["--rows", "4"]])
def test_e2e_quick_refuses_the_shapes_it_would_ignore(flags, tmp_path, capsys):
    from train.bench import e2e

    line = _refused(e2e.main, ["--quick", *flags, "--out", str(tmp_path)], capsys)
    assert f"--quick runs its own small shapes; drop {flags[0]}" in line
