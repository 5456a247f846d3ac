"""`python -m train.compare` over fixture logs from three kinds of device (tests/data/compare): a CPU run (a real
`python -m train.wmt --steps 40` log), two H100-shaped runs (fused kernels and XLA) and a TPU v3-8-shaped run with
estimated energy. Expected numbers are computed here from the values in those logs, with the formulas of
docs/compare.md."""

import dataclasses
import json
import re
from pathlib import Path

import matplotlib.image
import pytest

from train.compare import plots, quality, scoring
from train.compare import report as compare
from train.compare import runs as run_logs
from train.compare.tables import runs_table
from train.records import runlog
from train.tasks import TASKS

DATA = Path(__file__).parents[1] / "data" / "compare"
RESULTS = Path(__file__).parents[2] / "docs" / "results"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# Summary values of the fixture logs: train_time_s, cost_usd, energy_j, mfu.
CPU = dict(time=121.07333772100014, cost=None, energy=None, mfu=None)
H100_FFI = dict(time=194.021, cost=0.161145, energy=113502.3, mfu=0.184354)
H100_XLA = dict(time=299.403, cost=0.248671, energy=161677.6, mfu=0.119466)
TPU_V3 = dict(time=364.089, cost=0.809087, energy=320398.3, mfu=0.197561)
ORDER = [CPU, H100_FFI, H100_XLA, TPU_V3]  # sorted directory names: cpu-tiny, h100-ffi, h100-xla, tpu-v3-8


# A gate every fixture run passes (the CPU run's 40 steps reach BLEU 0.12): tests of the scoring without the gate.
OPEN_GATE = quality.Gate(TASKS["wmt"].quality, threshold=0.0, margin=0.999)


def hand_scores(runs, w_t, w_c, w_e, w_u):
    max_t = max(run["time"] for run in runs)
    max_c = max(run["cost"] for run in runs)
    max_e = max(run["energy"] for run in runs)
    max_u = max(run["mfu"] for run in runs)
    return [
        w_t * run["time"] / max_t + w_c * run["cost"] / max_c + w_e * run["energy"] / max_e - w_u * run["mfu"] / max_u
        for run in runs
    ]


@pytest.fixture(scope="module")
def runs():
    loaded, notes = run_logs.load_runs([DATA])
    assert notes == []
    return loaded


def test_fixture_logs_load_in_directory_order(runs):
    assert [run.device_kind for run in runs] == ["cpu", "NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3", "TPU v3"]
    assert [run.backend for run in runs] == ["xla", "ffi", "xla", "xla"]
    # written before the run record named the implementation: the tasks trained ls_jax's models then
    assert all("implementation" not in runlog.read(run.source)[0] for run in runs)
    assert [run.implementation for run in runs] == ["ls_jax"] * 4
    assert [run.train_time_s for run in runs] == [entry["time"] for entry in ORDER]
    assert [run.energy_estimated for run in runs] == [False, False, False, True]
    assert runs[3].device_count == 8 and runs[3].batch_label == "8192 tokens"


def test_ratios_against_chosen_baseline(runs):
    comparison = scoring.compare(runs, baseline=run_logs.find_baseline(runs, "h100-xla"))
    assert comparison.baseline == 2
    for entry, ratios in zip(ORDER, comparison.ratios):
        assert ratios.speedup == pytest.approx(H100_XLA["time"] / entry["time"], rel=1e-12)
        if entry["cost"] is None:
            assert ratios.cost is None and ratios.energy is None
        else:
            assert ratios.cost == pytest.approx(entry["cost"] / H100_XLA["cost"], rel=1e-12)
            assert ratios.energy == pytest.approx(entry["energy"] / H100_XLA["energy"], rel=1e-12)
    assert comparison.ratios[1].speedup == pytest.approx(1.5432, abs=1e-4)


def test_balance_scores_rank_runs_and_leave_out_the_cpu_run(runs):
    comparison = scoring.compare(runs, weights_name="balance", gate=OPEN_GATE)
    expected = hand_scores([H100_FFI, H100_XLA, TPU_V3], 0.3, 0.3, 0.3, 0.1)
    assert comparison.scores[0] is None
    assert [score.value for score in comparison.scores[1:]] == pytest.approx(expected, rel=1e-12)
    # Worked by hand: H100 ffi T = 194.021/364.089 = 0.5329, C = 0.161145/0.809087 = 0.1992,
    # E = 113502.3/320398.3 = 0.3542, U = 0.184354/0.197561 = 0.9332: 0.3 (0.5329 + 0.1992 + 0.3542) - 0.1 0.9332;
    # H100 xla: 0.3 (0.8223 + 0.3073 + 0.5046) - 0.1 0.6047; the TPU holds every maximum, MFU's too: 0.9 - 0.1.
    assert [score.value for score in comparison.scores[1:]] == pytest.approx([0.2326, 0.4298, 0.8000], abs=1e-4)
    assert comparison.scores[3].time == comparison.scores[3].cost == comparison.scores[3].energy == 1.0
    assert comparison.ranking == [1, 2, 3]
    assert any("#1" in note and "cost, energy and MFU are unknown" in note for note in comparison.notes)


@pytest.mark.parametrize(
    ("preset", "weights"),
    [
        ("balance", (0.3, 0.3, 0.3, 0.1)),
        ("time_cost_energy", (0.5, 0.3, 0.1, 0.1)),
        ("time_energy_cost", (0.5, 0.1, 0.3, 0.1)),
        ("cost_time_energy", (0.3, 0.5, 0.1, 0.1)),
        ("cost_energy_time", (0.1, 0.5, 0.3, 0.1)),
        ("energy_time_cost", (0.3, 0.1, 0.5, 0.1)),
        ("energy_cost_time", (0.1, 0.3, 0.5, 0.1)),
    ],
)
def test_study_presets(runs, preset, weights):
    comparison = scoring.compare(runs[1:], weights_name=preset)
    assert [score.value for score in comparison.scores] == pytest.approx(
        hand_scores([H100_FFI, H100_XLA, TPU_V3], *weights), rel=1e-12
    )


def test_custom_weights_score_runs_that_lack_only_unweighted_terms(runs):
    name, weights = scoring.parse_weights("0.6,0.4,0,0")
    comparison = scoring.compare(runs, weights_name=name, weights=weights, gate=OPEN_GATE)
    assert comparison.scores[0] is None  # the CPU run has no cost
    max_t = max(entry["time"] for entry in ORDER[1:])
    max_c = max(entry["cost"] for entry in ORDER[1:])
    assert [score.value for score in comparison.scores[1:]] == pytest.approx(
        [0.6 * e["time"] / max_t + 0.4 * e["cost"] / max_c for e in ORDER[1:]], rel=1e-12
    )

    time_only = scoring.compare(runs, weights_name="custom", weights=scoring.Weights(1, 0, 0, 0), gate=OPEN_GATE)
    max_t = max(entry["time"] for entry in ORDER)
    assert [score.value for score in time_only.scores] == pytest.approx([e["time"] / max_t for e in ORDER])
    assert time_only.scores[0].energy is None and time_only.scores[0].utilization is None
    assert time_only.ranking == [0, 1, 2, 3]


def test_cli_writes_report_with_tables_and_plots(tmp_path, capsys):
    out = tmp_path / "report"
    assert compare.main([str(DATA), "--baseline", "h100-xla", "--weights", "balance", "--out", str(out)]) == 0
    stdout, stderr = capsys.readouterr()
    for kind in ("cpu", "NVIDIA H100 80GB HBM3", "TPU v3"):
        assert kind in stdout
    assert "320 kJ (estimated)" in stdout and "114 kJ (measured)" in stdout
    assert f"| {H100_XLA['time'] / H100_FFI['time']:.2f}x" in stdout
    ranked = [line for line in stdout.splitlines() if line.startswith("| 1    |")]
    assert ranked and "| h100-ffi |" in ranked[0]  # runs are named by their run directories
    assert "did not converge (BLEU 0.1244 misses the threshold 1): shown, never ranked" in stderr
    assert "different amounts of data" in stderr

    text = (out / "report.md").read_text()
    for name in (plots.COST_VS_ENERGY, plots.ENERGY_VS_TIME, plots.COST_VS_TIME, plots.QUALITY, plots.SPEEDUP):
        assert f"]({name})" in text
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE)
        height, width, _ = matplotlib.image.imread(out / name).shape
        assert height > 300 and width > 500
    expected_scores = hand_scores([H100_FFI, H100_XLA, TPU_V3], 0.3, 0.3, 0.3, 0.1)
    for value in expected_scores:
        assert f"{value:.4f}" in text
    assert "## Notes" in text and "- #4 tpu-v3-8: its log (schema 1) has no warm-up" in text
    source = next(
        line for line in text.splitlines() if line.startswith("- #2 h100-ffi (run id 20260105T101500Z-f3e9a1): [")
    )
    link = source.rsplit("(", 1)[1].rstrip(")")
    assert not Path(link).is_absolute() and (out / link).resolve() == (DATA / "h100-ffi" / "run.jsonl").resolve()
    ratios = next(line for line in text.splitlines() if line.startswith("| #") and "speedup" in line)
    assert all(cell.strip() for cell in ratios.strip("|").split("|"))  # every column has a header


def test_speedup_groups_average_repeats_and_need_the_baseline_configuration(runs):
    cpu, ffi, xla, tpu = runs
    repeat = dataclasses.replace(xla, run_id="xla-repeat", train_time_s=320.0)
    bigger = [
        dataclasses.replace(
            run,
            run_id=run.run_id + "-big",
            model="transformer-big",
            params=209_000_000,
            train_time_s=3 * run.train_time_s,
        )
        for run in (ffi, xla)
    ]
    groups = scoring.speedups_by_model_and_batch([cpu, ffi, xla, tpu, repeat, *bigger], baseline=2)
    reference = (H100_XLA["time"] + 320.0) / 2
    assert [(g.model, g.configuration_label) for g in groups] == [
        ("transformer-base", "NVIDIA H100 80GB HBM3 x1 ls_jax ffi bf16"),
        ("transformer-base", "TPU v3 x8 ls_jax xla bf16"),
        ("transformer-big", "NVIDIA H100 80GB HBM3 x1 ls_jax ffi bf16"),
    ]
    assert [g.speedup for g in groups] == pytest.approx(
        [reference / H100_FFI["time"], reference / TPU_V3["time"], H100_XLA["time"] / H100_FFI["time"]]
    )
    assert scoring.speedups_by_model_and_batch(runs, baseline=0) == []


def test_speedup_plot_not_drawn_without_groups_says_why(tmp_path, capsys):
    assert compare.main([str(DATA / "cpu-tiny"), str(DATA / "tpu-v3-8"), "--out", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "*Speedup by model size and batch: not drawn; no model and batch has runs of both" in text
    assert not (tmp_path / "speedup_by_model_and_batch.png").exists()


def _lines(name):
    return [json.loads(line) for line in (DATA / name / "run.jsonl").read_text().splitlines()]


def _write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


@pytest.mark.parametrize(
    ("record_type", "key"),
    [("run", "device_kind"), ("summary", "train_time_s"), ("summary", "energy_source"), ("run", "batch")],
)
def test_missing_key_names_file_line_and_key(tmp_path, capsys, record_type, key):
    records = _lines("h100-ffi")
    for record in records:
        if record["type"] == record_type:
            del record[key]
    path = _write(tmp_path / "bad" / "run.jsonl", records)
    line = 1 if record_type == "run" else len(records)
    with pytest.raises(ValueError, match=re.escape(f"{path}:{line}: the '{record_type}' record has no key '{key}'")):
        run_logs.load_runs([path])
    assert compare.main([str(path), "--out", str(tmp_path / "out")]) == 2
    assert f"no key '{key}'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda records: records[-1].update(train_time_s="fast"), r"train_time_s='fast'.* is not a JSON number"),
        (lambda records: records[-1].update(train_time_s=0), r"train_time_s=0 must be > 0"),
        (lambda records: records[-1].update(energy_source=None), r"energy_j and energy_source must both be null"),
        (lambda records: records[0].update(schema=4), r"schema 4; this version of ls-jax reads schema 1, 2 and 3"),
        (lambda records: records[0].update(batch={"grad_accum": 1}), r"must hold max_tokens or batch_size"),
        (lambda records: records.pop(0), r"the first record is 'interval'"),
        (lambda records: records[-1].pop("tokens_per_s"), r"the 'summary' record has no key 'tokens_per_s'"),
    ],
)
def test_malformed_values_are_named(tmp_path, change, message):
    records = _lines("h100-ffi")
    change(records)
    path = _write(tmp_path / "run.jsonl", records)
    with pytest.raises(ValueError, match=message):
        run_logs.load_runs([path])


def test_invalid_json_inside_a_log_names_the_line(tmp_path):
    path = tmp_path / "run.jsonl"
    lines = (DATA / "h100-ffi" / "run.jsonl").read_text().splitlines()
    lines[2] = lines[2][:40]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: not valid JSON")):
        run_logs.load_runs([path])


def test_runs_without_summary_are_skipped_with_a_note(tmp_path, capsys):
    unfinished = _write(tmp_path / "logs" / "unfinished" / "run.jsonl", _lines("tpu-v3-8")[:-1])
    killed = tmp_path / "logs" / "killed" / "run.jsonl"
    killed.parent.mkdir()
    text = (DATA / "h100-xla" / "run.jsonl").read_text()
    killed.write_text(text[: text.rindex('"type": "summary"') + 30])
    _write(tmp_path / "logs" / "done" / "run.jsonl", _lines("h100-ffi"))
    runs, notes = run_logs.load_runs([tmp_path / "logs"])
    assert [run.run_id for run in runs] == ["20260105T101500Z-f3e9a1"]
    assert any(str(unfinished) in note and "no summary record" in note for note in notes)
    assert any(str(killed) in note and "last line is cut short" in note for note in notes)
    assert compare.main([str(tmp_path / "logs"), "--out", str(tmp_path / "out")]) == 0
    assert "skipped run 20260106T080000Z-e5d6f7" in capsys.readouterr().err


def test_runs_stopped_early_are_compared_with_a_note(tmp_path):
    records = _lines("tpu-v3-8")
    records[-1].update(completed=False, stop_reason="signal", steps=1200)
    runs, _ = run_logs.load_runs([_write(tmp_path / "tpu-run" / "run.jsonl", records)])
    notes = scoring.compare(runs).notes
    assert notes == [
        "#1 tpu-run stopped early (signal) after 1200 steps: its totals cover only that part",
        "#1 tpu-run: its log (schema 1) has no warm-up or steady-state figures, and its energy covers "
        "compilation and evaluations besides the training steps",
    ]


def test_unusable_times_and_unreadable_logs_are_notes_and_the_rest_compare(tmp_path, capsys):
    logs = tmp_path / "runs"
    for name in ("h100-ffi", "h100-xla"):
        _write(logs / name / "run.jsonl", _lines(name))
    nan_time = _lines("tpu-v3-8")
    nan_time[-1]["train_time_s"] = float("nan")
    nan_log = _write(logs / "nan-time" / "run.jsonl", nan_time)  # json.dumps writes the NaN token
    assert "NaN" in nan_log.read_text()
    stopped = _lines("cpu-tiny")  # the summary of a run stopped while compiling, as the harness writes it
    stopped[-1].update(completed=False, stop_reason="signal", steps=0, train_time_s=0.0, cost_usd=None)
    _write(logs / "stopped" / "run.jsonl", stopped)
    binary = logs / "binary" / "run.jsonl"
    binary.parent.mkdir()
    binary.write_bytes((DATA / "h100-ffi" / "run.jsonl").read_bytes().replace(b"NVIDIA", b"\xff\xfeNVIDIA"))
    broken = logs / "broken" / "run.jsonl"
    broken.parent.mkdir()
    lines = (DATA / "h100-ffi" / "run.jsonl").read_text().splitlines()
    broken.write_text("\n".join([lines[0], lines[1][:30], *lines[2:]]) + "\n")

    assert compare.main([str(logs), "--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert "nan" not in out.lower()
    for name in ("h100-ffi", "h100-xla"):
        assert f"| {name} " in out
    for name in ("nan-time", "stopped", "binary", "broken"):
        assert f"| {name} " not in out
    assert f"left out run 20260106T080000Z-e5d6f7 ({nan_log}:" in err and "train_time_s=nan is not a finite" in err
    assert "it stopped before its first step" in err
    assert f"left out {binary}: not a UTF-8 text file" in err
    assert f"left out {broken}:2: not valid JSON" in err
    assert "Traceback" not in err


def test_packed_rows_are_labelled_rows_of_their_tokens(tmp_path):
    records = _lines("tpu-v3-8")
    records[0]["batch"] = {"batch_size": 8, "grad_accum": 2, "seq_len": 1024}  # as train.gpt logs its batch
    runs, _ = run_logs.load_runs([_write(tmp_path / "gpt-run" / "run.jsonl", records)])
    assert runs[0].batch_label == "8 rows of 1024 tokens x2 accum"


def test_only_unfinished_runs_is_an_error(tmp_path):
    path = _write(tmp_path / "run.jsonl", _lines("tpu-v3-8")[:-1])
    with pytest.raises(ValueError, match="no run to compare: skipped run"):
        run_logs.load_runs([path])


def test_directory_search_passes_over_other_jsonl_and_deduplicates(tmp_path):
    _write(tmp_path / "metrics.jsonl", [{"step": 1, "loss": 2.0}])
    _write(tmp_path / "a" / "run.jsonl", _lines("h100-ffi"))
    _write(tmp_path / "b" / "copy.jsonl", _lines("h100-ffi"))
    runs, notes = run_logs.load_runs([tmp_path, tmp_path / "a" / "run.jsonl"])
    assert len(runs) == 1
    assert any("metrics.jsonl: not a run log" in note for note in notes)
    assert any("same run id" in note for note in notes)


def test_missing_paths_are_clear_errors(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        run_logs.load_runs([tmp_path / "absent"])
    with pytest.raises(FileNotFoundError, match="no run logs"):
        run_logs.load_runs([tmp_path])
    assert compare.main([str(tmp_path / "absent")]) == 2
    assert "error:" in capsys.readouterr().err


def test_baseline_selection(runs):
    slowest = min(range(len(runs)), key=lambda index: runs[index].throughput)
    assert runs[slowest].throughput < min(run.throughput for i, run in enumerate(runs) if i != slowest)
    assert run_logs.find_baseline(runs, None) == slowest, "by default the slowest run"
    moved_last = [run for i, run in enumerate(runs) if i != slowest] + [runs[slowest]]
    assert run_logs.find_baseline(moved_last, None) == len(runs) - 1, "wherever it stands"
    unmeasured = [dataclasses.replace(run, throughput=None) for run in runs]
    assert run_logs.find_baseline(unmeasured, None) == 0, "the first run where no run logs a throughput"
    assert run_logs.find_baseline(runs, "20260106T080000Z-e5d6f7") == 3
    assert run_logs.find_baseline(runs, "2") == 1
    assert run_logs.find_baseline(runs, "#3") == 2  # the form the tables print
    assert run_logs.find_baseline(runs, "7b4c2d") == 2
    assert run_logs.find_baseline(runs, "tpu-v3") == 3
    with pytest.raises(ValueError, match="matches 2 runs"):
        run_logs.find_baseline(runs, "h100")
    with pytest.raises(ValueError, match="matches no run id"):
        run_logs.find_baseline(runs, "a100")
    with pytest.raises(ValueError, match="numbered #1 to #4"):
        run_logs.find_baseline(runs, "5")
    with pytest.raises(ValueError, match="numbered #1 to #4"):
        run_logs.find_baseline(runs, "#5")


def test_several_tasks_need_a_choice(tmp_path, runs):
    records = _lines("h100-ffi")
    records[0].update(
        task="imdb",
        run_id="imdb-run",
        batch={"batch_size": 32, "grad_accum": 1},
        optimizer="adamw",
        implementation="flax",
    )
    for key in ("tokens", "tokens_per_s", "target_tokens", "target_tokens_per_s"):
        del records[-1][key]
    records[-1].update(examples=75_000, examples_per_s=412.5, accuracy=0.9312, bleu=None)
    imdb = _write(tmp_path / "imdb" / "run.jsonl", records)
    with pytest.raises(ValueError, match=r"several tasks \(wmt: 4 runs, imdb: 1 run\); choose one with --task"):
        run_logs.select_task(run_logs.load_runs([DATA, imdb])[0], None)
    chosen = run_logs.select_task(run_logs.load_runs([DATA, imdb])[0], "imdb")
    assert [run.run_id for run in chosen] == ["imdb-run"]
    assert (chosen[0].trained, chosen[0].throughput, chosen[0].batch_label) == (75_000, 412.5, "32 examples")
    header, rows = runs_table(scoring.compare(chosen))
    assert "accuracy" in header and "BLEU" not in header and rows[0][header.index("accuracy")] == "0.9312"
    assert rows[0][-1] == "passed"
    assert rows[0][header.index("throughput")] == "412 examples/s"
    assert rows[0][header.index("optimizer")] == "adamw"  # the fixture ran adan
    assert rows[0][header.index("implementation")] == "flax" and chosen[0].study_label.startswith(
        "NVIDIA H100 80GB HBM3 x1 flax ffi bf16 adamw"
    )
    with pytest.raises(ValueError, match="no run of task 'gpt'"):
        run_logs.select_task(chosen, "gpt")


def test_equal_work_has_no_unequal_work_note(runs):
    assert not any("different amounts of data" in note for note in scoring.compare(runs[1:]).notes)
    assert any("different amounts of data" in note for note in scoring.compare(runs).notes)


def test_zero_cost_runs_normalize_to_zero(runs, tmp_path):
    free = scoring.compare([dataclasses.replace(run, cost_usd=0.0) for run in runs[1:]])
    assert [score.cost for score in free.scores] == [0.0, 0.0, 0.0]
    plot = plots.plot_cost_vs_time(free, tmp_path / "cost.png")
    assert plot.file_name == "cost.png" and (tmp_path / "cost.png").read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("fastest", "neither a preset"),
        ("0.5,0.5,0", "neither a preset"),
        ("0.5,-0.1,0.3,0.3", "non-negative"),
        ("0,0,0,1", "at least one of time, cost, energy"),
    ],
)
def test_bad_weights(text, message, capsys):
    with pytest.raises(ValueError, match=message):
        scoring.parse_weights(text)
    assert compare.main([str(DATA), "--weights", text]) == 2
    assert message in capsys.readouterr().err


def test_help_documents_every_preset_and_its_weights():
    text = compare.build_parser().format_help()
    for name, weights in scoring.WEIGHT_PRESETS.items():
        assert f"{name:<17} {weights.describe()}" in text
    assert "never counted as zero" in text and "--score-window {whole,steady}" in text
    assert "earlier names, still accepted: time_cost = time_cost_energy" in text


@pytest.mark.parametrize("log", sorted(RESULTS.rglob("run.jsonl")), ids=lambda path: str(path.relative_to(RESULTS)))
def test_logs_under_docs_results_compare_with_the_fixtures(log, tmp_path):
    runs, _ = run_logs.load_runs([log, DATA])
    assert runs[0].source == log.resolve()
    comparison = scoring.compare(run_logs.select_task(runs, runs[0].task))
    assert compare.write_report(comparison, tmp_path, "pytest").read_text().count(runs[0].name) >= 3


@pytest.mark.parametrize("log", sorted(DATA.glob("*/run.jsonl")), ids=lambda path: path.parent.name)
def test_fixture_logs_pass_the_harness_schema(log):
    from train.records import runlog

    records = runlog.read(log)
    assert records[0]["schema"] == 1  # written before the windows: the schema-2 keys are missing
    for record in records:
        runlog.validate(record, counted=("tokens", "target_tokens"), schema=1)
    with pytest.raises(runlog.RecordError, match="summary record lacks 'wall_energy_j'"):
        runlog.validate(records[-1], counted=("tokens", "target_tokens"))


def test_points_at_one_place_share_one_label():
    """Two runs with the same time and cost would print '#1' over '#2'; they get one label '#1 #2' instead."""
    xs, ys = [10.0, 10.05, 50.0, 10.0], [3.0, 3.01, 1.0, 1.0]
    places = plots._labels_by_place([0, 1, 2, 3], xs, ys, 1.0, 1.0)
    assert sorted(places.values()) == [[0, 1], [2], [3]]
    assert plots._labels_by_place([0, 2], xs, ys, 1.0, 1.0) == {(10.0, 3.0): [0], (50.0, 1.0): [2]}


def test_a_file_that_is_not_a_run_log_is_left_out_named_once(tmp_path):
    notes_file = tmp_path / "notes.txt"
    notes_file.write_text("some notes, not JSON\n")
    runs, notes = run_logs.load_runs([DATA / "h100-ffi" / "run.jsonl", notes_file])
    assert len(runs) == 1
    assert notes == [f"left out {notes_file}: holds no complete run-log record (one JSON object per line)"]
