"""train.costs.measured_utilization and ``train.compare --counters``: measured occupancy attached to the runs it
fits."""

import dataclasses
import json
from pathlib import Path

import pytest

from train.compare import report as compare
from train.compare import runs as run_logs
from train.costs import measured_utilization

DATA = Path(__file__).parents[1] / "data" / "compare"
H100 = "NVIDIA H100 80GB HBM3"


def _counters_file(tmp_path, implementations=("reference", "ls_jax_ffi")):
    total = lambda occupancy: {
        "achieved_occupancy_pct_time_weighted": occupancy,
        "sm_throughput_pct_time_weighted": 2 * occupancy,
        "achieved_occupancy_pct_median": 1.0,
    }
    results = {impl: {"total": total(30.0 + i)} for i, impl in enumerate(implementations)}
    path = tmp_path / "counters-h100.json"
    path.write_text(
        json.dumps(
            {
                "suite": "counters",
                "environment": {"device_kind": H100},
                "workloads": {"wmt-big-6e6d": {"results": results}},
            }
        )
    )
    return path


def test_load_keeps_ls_jax_implementations_with_their_backend(tmp_path):
    measured = measured_utilization.load(_counters_file(tmp_path, ("reference", "ls_jax_ffi", "ls_jax_xla")))
    assert [(m.backend, m.achieved_occupancy_pct, m.sm_throughput_pct) for m in measured] == [
        ("ffi", 31.0, 62.0),
        ("xla", 32.0, 64.0),
    ]  # the reference is no run's backend; time-weighted means are used
    assert all(m.device_kind == H100 and m.workload == "wmt-big-6e6d" for m in measured)


def test_runs_get_measured_counters_of_their_device_and_backend_else_mfu_labeled(tmp_path):
    runs, _ = run_logs.load_runs([str(DATA)])
    measured = measured_utilization.load(_counters_file(tmp_path))
    header, rows = measured_utilization.table(runs, measured)
    by_run = {row[1]: row for row in rows}
    ffi = next(run for run in runs if run.device_kind == H100 and run.backend == "ffi")
    xla = next(run for run in runs if run.device_kind == H100 and run.backend == "xla")
    # The runs train transformer-base; the counters were measured on Transformer big: labeled as another model.
    assert by_run[ffi.name][2:5] == ["measured (ncu, wmt-big-6e6d, not transformer-base)", "31.0%", "62.0%"]
    assert by_run[xla.name][2].startswith("MFU (no counters")
    assert len(rows) == len(runs) and header[3] == "achieved occupancy"


def test_compare_cli_writes_the_utilization_section(tmp_path, capsys):
    out = tmp_path / "report"
    assert (
        compare.main(
            [str(DATA), "--baseline", "h100-xla", "--out", str(out), "--counters", str(_counters_file(tmp_path))]
        )
        == 0
    )
    report = (out / "report.md").read_text()
    assert "## Utilization: measured counters or MFU" in report
    assert "measured (ncu, wmt-big-6e6d, not transformer-base)" in report
    assert "31.0%" in capsys.readouterr().out


def test_a_measurement_on_the_runs_own_model_is_preferred(tmp_path):
    runs, _ = run_logs.load_runs([str(DATA)])
    ffi = next(run for run in runs if run.device_kind == H100 and run.backend == "ffi")
    other = measured_utilization.Measured(H100, "ffi", "bert-base", 10.0, 20.0, "c.json")
    own = measured_utilization.Measured(H100, "ffi", "wmt-big-6e6d", 30.0, 40.0, "c.json")
    transformer_big = dataclasses.replace(ffi, model="transformer-big")
    assert measured_utilization.for_run(transformer_big, [other, own]) is own
    assert measured_utilization.for_run(ffi, [other, own]) is other  # no measurement of its model: the first
    _, rows = measured_utilization.table([transformer_big, ffi], [other, own])
    assert rows[0][2] == "measured (ncu, wmt-big-6e6d)"
    assert rows[1][2] == f"measured (ncu, bert-base, not {ffi.model})"


MALFORMED = [
    '{"environment": {"device_kind": "H100"}, "workloads": {"bert-base": {}}}',  # no results
    '{"environment": {"device_kind": "H100"}, "workloads": {"bert-base": {"results": {"ls_jax_ffi": {}}}}}',  # total
    '{"environment": {"device_kind": "H100"}, "workloads": ["bert-base"]}',
]


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such file"),
        ("{not json", "not a counters result file"),
        ('{"suite": "e2e"}', "not a counters result file"),
        *((content, "not a counters result file") for content in MALFORMED),
    ],
)
def test_bad_counters_file_is_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "counters.json"
    if content is not None:
        path.write_text(content)
    assert compare.main([str(DATA), "--out", str(tmp_path / "r"), "--counters", str(path)]) == compare.EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
