"""`train.compare` with the windows of schema 2: the whole run and the steady state side by side, scoring either,
the warm-up warning, and plots named by window and configuration. tests/data/windows/cpu-imdb is a real
`python -m train.imdb --preset bert-tiny --steps 40` log of a 2-core CPU."""

import dataclasses
import json
import statistics
from pathlib import Path

import pytest

from train.compare import plots, quality, scoring, tables
from train.compare import report as compare
from train.compare import runs as run_logs
from train.compare.runs import Steady, Warmup
from train.costs import windows
from train.tasks import TASKS

DATA = Path(__file__).parents[1] / "data"
CPU_LOG = DATA / "windows" / "cpu-imdb" / "run.jsonl"
OPEN_GATE = quality.Gate(TASKS["imdb"].quality, threshold=0.0, margin=0.999)
PRICE = 4.916  # USD per device-hour (an H100)


@pytest.fixture(scope="module")
def cpu_run():
    (run,), notes = run_logs.load_runs([CPU_LOG])
    assert notes == []
    return run


def test_a_schema_2_log_reads_its_windows(cpu_run):
    summary = json.loads(CPU_LOG.read_text().splitlines()[-1])
    assert cpu_run.schema == 2 and cpu_run.implementation == "ls_jax"
    assert cpu_run.warmup == Warmup(**summary["warmup"])
    steady = summary["steady"]
    assert cpu_run.steady.throughput == steady["examples_per_s"] and cpu_run.steady.power_w == steady["power_w"]
    assert cpu_run.warmup.steps + cpu_run.steady.steps == summary["steps"] == 40
    assert cpu_run.wall_energy_j == summary["wall_energy_j"] > cpu_run.energy_j
    figures = scoring.figures(cpu_run, "steady")
    assert figures.time == pytest.approx(1 / steady["examples_per_s"])
    assert figures.energy == pytest.approx(steady["power_w"] / steady["examples_per_s"])
    assert figures.utilization is None  # a CPU has no datasheet peak
    assert scoring.figures(cpu_run, "whole") == scoring.Figures(
        cpu_run.train_time_s, cpu_run.cost_usd, cpu_run.energy_j, None
    )


def profile_run(template, name, backend, times, watts):
    """A 100-step BERT run at batch 32 whose step times are ``times``, drawing ``watts`` on one H100: its
    windows as the harness computes them (train.costs.windows)."""
    flags = windows.warmup_flags(times, [0])
    warm = [time for time, flag in zip(times, flags) if flag]
    steady = [time for time, flag in zip(times, flags) if not flag]
    cost = lambda seconds: seconds * PRICE / 3600  # noqa: E731
    return dataclasses.replace(
        template,
        run_id=name,
        source=template.source.parents[1] / name / template.source.name,
        task="imdb",
        backend=backend,
        metrics={"accuracy": 0.9},
        schema=2,
        train_time_s=sum(times),
        cost_usd=cost(sum(times)),
        energy_j=watts * sum(times),
        mfu=None,
        trained=3200,
        trained_unit="examples",
        throughput=3200 / sum(times),
        warmup=Warmup(len(warm), sum(warm), watts * sum(warm), cost(sum(warm))),
        steady=Steady(
            len(steady),
            sum(steady),
            statistics.median(steady),
            32 * len(steady) / sum(steady),
            None,
            None,
            watts * sum(steady),
            watts,
            cost(sum(steady)),
        ),
    )


@pytest.fixture(scope="module")
def h100_pair():
    """The H100 BERT-base runs of the fused kernels (ffi) and of plain XLA: per-step times in s."""
    template = run_logs.load_runs([DATA / "compare" / "h100-ffi"])[0][0]
    ffi = profile_run(template, "ffi", "ffi", [0.235] * 10 + [0.073] * 10 + [0.026] * 80, watts=400.0)
    xla = profile_run(template, "xla", "xla", [0.048] * 10 + [0.104] * 10 + [0.040] * 80, watts=350.0)
    return [ffi, xla]


def test_the_whole_run_hides_the_steady_lead_that_the_steady_window_shows(h100_pair):
    ffi, xla = h100_pair
    assert ffi.train_time_s > xla.train_time_s  # 5.16 s against 4.72 s: the fused kernels' first steps
    whole = scoring.compare(h100_pair, baseline=1, gate=OPEN_GATE)
    steady = scoring.compare(h100_pair, baseline=1, gate=OPEN_GATE, window="steady")
    assert whole.ranked_under("time_cost_energy") == [1, 0]
    assert steady.ranked_under("time_cost_energy") == [0, 1]
    assert whole.ratios[0].speedup == pytest.approx(4.72 / 5.16)
    assert whole.ratios[0].steady_speedup == pytest.approx(0.040 / 0.026)
    # Steady state, per example: T = s/example, E = J/example; maxima are XLA's.
    ffi_time, xla_time = 0.026 / 32, 0.040 / 32
    expected = 0.5 * ffi_time / xla_time + 0.3 * ffi_time / xla_time + 0.1 * (400 * ffi_time) / (350 * xla_time)
    assert steady.matrix["time_cost_energy"][0].value == pytest.approx(expected)
    assert "steady state" in tables.score_explanation(steady)


def test_warm_up_above_a_tenth_of_training_is_one_warning_per_run(h100_pair):
    ffi, xla = h100_pair
    calm = dataclasses.replace(xla, run_id="calm", warmup=Warmup(2, 0.05 * xla.train_time_s, None, None))
    notes = scoring.compare([ffi, xla, calm], gate=OPEN_GATE).notes
    warnings = [note for note in notes if "warm-up took" in note]
    assert warnings == [
        "#1 ffi: warm-up took 60% of its training time (20 steps, 3.08 s): its whole-run figures understate its "
        "steady state (see the steady-state table)",
        "#2 xla: warm-up took 32% of its training time (20 steps, 1.52 s): its whole-run figures understate its "
        "steady state (see the steady-state table)",
    ]
    header, rows = tables.steady_table(scoring.compare([ffi, xla, calm], gate=OPEN_GATE))
    assert rows[0][header.index("warm-up")] == "20 steps, 3.08 s (60%)"
    assert rows[0][header.index("step time")] == "0.0260 s" and rows[1][header.index("power")] == "350 W"


def test_without_an_mfu_for_any_run_the_score_leaves_utilization_out(h100_pair):
    comparison = scoring.compare(h100_pair, gate=OPEN_GATE)
    assert all(score is not None and score.utilization is None for score in comparison.scores)
    # balance for XLA, every maximum the fused run's: 0.3 (T + C + E) = 0.3 (4.72/5.16 + 4.72/5.16 + 1652/2064 J).
    assert comparison.scores[1].value == pytest.approx(0.3 * (2 * 4.72 / 5.16 + 350 * 4.72 / (400 * 5.16)))
    assert (
        "no converged run has an MFU (no datasheet peak for its device): the scores leave the utilization term "
        "out" in comparison.notes
    )
    with_mfu = [dataclasses.replace(h100_pair[0], mfu=0.3), h100_pair[1]]  # one run has it: the other is not scored
    mixed = scoring.compare(with_mfu, gate=OPEN_GATE)
    assert mixed.scores[1] is None and any("#2 xla is not scored: its MFU is unknown" in n for n in mixed.notes)


def test_plots_name_their_window_and_mark_implementation_backend_and_precision(h100_pair, tmp_path):
    whole = scoring.compare(h100_pair, gate=OPEN_GATE)
    steady = scoring.compare(h100_pair, gate=OPEN_GATE, window="steady")
    assert plots.scatter_axes(whole)["energy"].quantity == "energy, whole run"
    axes = plots.scatter_axes(steady)
    assert axes["time"].quantity == "time per 1,000 examples, steady state"
    assert axes["energy"].values[0] == pytest.approx(1000 * 400 * 0.026 / 32)
    assert plots.kernel_colours(h100_pair) == {"ls_jax ffi bf16": "C0", "ls_jax xla bf16": "C1"}
    drawn = plots.write_plots(steady, tmp_path)
    assert [plot.file_name for plot in drawn[:3]] == [plots.COST_VS_ENERGY, plots.ENERGY_VS_TIME, plots.COST_VS_TIME]
    assert all((tmp_path / plot.file_name).stat().st_size > 10_000 for plot in drawn[:3])


def test_cli_scores_the_steady_state_of_a_real_cpu_log(tmp_path, capsys):
    out = tmp_path / "report"
    assert compare.main([str(CPU_LOG), "--score-window", "steady", "--quality-threshold", "0", "--out", str(out)]) == 0
    stdout, stderr = capsys.readouterr()
    assert "Warm-up and steady state:" in stdout and "Score under each preset, steady state" in stdout
    assert "balance: #1 (cpu x1 ls_jax xla fp32 adamw 8 examples), score" in stdout
    assert "the scores leave the utilization term out" in stderr
    report = (out / "report.md").read_text()
    assert "## Warm-up and steady state" in report and "scoring the steady state" in report
    with pytest.raises(SystemExit) as exited:
        compare.main([str(CPU_LOG), "--score-window", "best", "--out", str(out)])
    assert exited.value.code == 2
    assert "argument --score-window: invalid choice: 'best' (choose from 'whole', 'steady')" in capsys.readouterr().err
    for flag, value in (("--quality-threshold", "nan"), ("--quality-threshold", "-5"), ("--quality-margin", "inf")):
        with pytest.raises(SystemExit) as exited:
            compare.main([str(CPU_LOG), flag, value, "--out", str(out)])
        assert exited.value.code == 2
        assert f"{flag} {float(value):g}: give a finite" in capsys.readouterr().err
