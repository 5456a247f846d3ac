"""The run log: its schema is docs/run-log.md, records are validated, files are written and truncated."""

import errno
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from train.records import runlog

ROOT = Path(__file__).resolve().parents[2]

DOC = Path(__file__).resolve().parents[2] / "docs" / "run-log.md"
WMT_COUNTS = ("tokens", "target_tokens")


def documented_keys() -> dict[str, set[str]]:
    """Record type -> keys, read from the tables under the ``### `type` `` headings of docs/run-log.md."""
    keys: dict[str, set[str]] = {}
    current = None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"### `(\w+)`", line)
        if heading:
            current = keys.setdefault(heading.group(1), set())
        elif line.startswith("## "):
            current = None
        elif current is not None and line.startswith("| ") and not line.startswith("| key") and "---" not in line:
            cell = line.split("|")[1]
            current.update(name.strip() for name in cell.split(","))
    return keys


def check_log_schema(records, counters, undocumented=frozenset()):
    """One run and one summary record, every record valid for the task's ``counters`` and carrying the keys
    docs/run-log.md lists for its type (except ``undocumented``: another task's counters)."""
    documented = documented_keys()
    assert records[0]["type"] == "run" and records[-1]["type"] == "summary"
    assert [r["type"] for r in records].count("run") == 1 and [r["type"] for r in records].count("summary") == 1
    for record in records:
        runlog.validate(record, counters)
        assert documented[record["type"]] - undocumented <= set(record)


def check_run_files(run_dir, checkpoint_steps):
    """The files a training run leaves: config, vocabulary, log, TensorBoard events, checkpoints at the steps."""
    expected = {"config.json", "spm.model", "run.jsonl", "tensorboard", "checkpoints"}
    assert {p.name for p in run_dir.iterdir()} >= expected
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == checkpoint_steps
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_schema_is_the_documented_schema():
    documented = documented_keys()
    assert set(documented) == set(runlog.SCHEMA)
    for record_type, keys in documented.items():
        in_code = set(runlog.SCHEMA[record_type]) | set(runlog.throughput_keys(record_type, WMT_COUNTS))
        in_code.discard("type")
        assert keys == in_code, record_type


def valid_interval(**changes):
    record = {key: 1.0 for key in runlog.SCHEMA["interval"]}
    record.update(
        type="interval",
        step=3,
        peak_memory_bytes=None,
        energy_source=None,
        fp8_overflows=None,
        tokens_per_s=2.0,
        target_tokens_per_s=1.0,
    )
    record.update(changes)
    return record


def test_validate_accepts_a_good_record_and_names_the_problem_of_a_bad_one():
    runlog.validate(valid_interval(), WMT_COUNTS)
    broken = valid_interval()
    del broken["lr"]
    with pytest.raises(ValueError, match="interval record lacks 'lr'"):
        runlog.validate(broken, WMT_COUNTS)
    with pytest.raises(ValueError, match="interval.step must be int, got float"):
        runlog.validate(valid_interval(step=3.0), WMT_COUNTS)
    with pytest.raises(ValueError, match="interval.elapsed_s must be int or float, got a bool"):
        runlog.validate(valid_interval(elapsed_s=True), WMT_COUNTS)
    with pytest.raises(ValueError, match="lacks 'examples_per_s'"):
        runlog.validate(valid_interval(), ("examples",))
    with pytest.raises(ValueError, match="type must be one of"):
        runlog.validate({"type": "note"})


def test_run_log_writes_json_lines_and_tensorboard_events(tmp_path):
    log = runlog.RunLog(tmp_path, WMT_COUNTS)
    log.write(valid_interval(loss=float("nan")))
    log.write(
        {
            "type": "eval",
            "step": 3,
            "split": "valid",
            "loss": 2.0,
            "nll": 1.5,
            "metrics": {"bleu": 10.0},
        }
    )
    log.close()
    records = runlog.read(tmp_path / runlog.LOG_FILENAME)
    assert [r["type"] for r in records] == ["interval", "eval"]
    assert records[0]["loss"] is None  # JSON has no NaN: non-finite numbers are logged as null
    assert list((tmp_path / runlog.TENSORBOARD_DIR).glob("events.out.tfevents.*"))


def fill(directory: Path) -> None:
    """Writes a file in ``directory`` until its disk is full."""
    with open(directory / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(4096))
        except OSError as err:
            assert err.errno == errno.ENOSPC


def test_the_summary_is_written_to_a_full_disk_and_no_record_is_half_written(small_disk):
    log = runlog.RunLog(small_disk, ("examples",), tensorboard=False)
    log.write(valid_interval(step=1, examples_per_s=1.0))
    fill(small_disk)
    before = (small_disk / runlog.LOG_FILENAME).read_bytes()
    with pytest.raises(OSError, match="No space left"):  # a record of two pages: its write fails part way
        log.write(valid_interval(step=2, examples_per_s=1.0, note="x" * 8192))
    assert (small_disk / runlog.LOG_FILENAME).read_bytes() == before
    log.write(valid_summary())  # from the space the log held back
    log.close()
    assert [r["type"] for r in runlog.read(small_disk / runlog.LOG_FILENAME)] == ["interval", "summary"]
    assert not (small_disk / runlog.RESERVE_FILENAME).exists()


def test_only_the_main_process_writes(tmp_path):
    log = runlog.RunLog(tmp_path, WMT_COUNTS, enabled=False)
    log.write(valid_interval())
    with pytest.raises(ValueError):
        log.write(valid_interval(step="3"))  # still validated
    log.close()
    assert not (tmp_path / runlog.LOG_FILENAME).exists()


def test_truncate_for_resume_keeps_the_run_record_and_records_up_to_the_step(tmp_path):
    lines = [
        {"type": "run", "run_id": "x", "schema": 1},
        {"type": "interval", "step": 10},
        {"type": "eval", "step": 10, "bleu": 12.5, "accuracy": None},
        {"type": "interval", "step": 20},
        {"type": "summary", "steps": 20},
    ]
    (tmp_path / runlog.LOG_FILENAME).write_text("".join(json.dumps(r) + "\n" for r in lines))
    runlog.truncate_for_resume(tmp_path, 10)
    # The resumed run writes this version's records, so the log takes this version's schema and form: the old eval
    # record's quality keys move into its metrics.
    assert runlog.read(tmp_path / runlog.LOG_FILENAME) == [
        {**lines[0], "schema": runlog.SCHEMA_VERSION},
        lines[1],
        {"type": "eval", "step": 10, "metrics": {"bleu": 12.5}},
    ]


def test_truncate_for_resume_on_a_full_disk_leaves_the_log_as_it_was(small_disk):
    lines = [{"type": "run", "run_id": "x", "schema": 3, "note": "a" * 300}]
    lines += [{"type": "interval", "step": step, "note": "b" * 300} for step in range(1, 20)]
    path = small_disk / runlog.LOG_FILENAME
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    before = path.read_bytes()
    fill(small_disk)
    with pytest.raises(OSError, match="No space left"):
        runlog.truncate_for_resume(small_disk, 10)
    assert path.read_bytes() == before
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", runlog.LOG_FILENAME]


def test_identity_fields():
    record = runlog.identity("wmt", runlog.new_run_id(), "python -m train.wmt", runlog.utc_now())
    assert re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{6}", record["run_id"])
    assert set(record["versions"]) == {"python", "jax", "jaxlib", "flax", "optax", "ls_jax"}
    assert record["git_commit"] is None or re.fullmatch(r"[0-9a-f]{40}", record["git_commit"])
    assert record["git_dirty"] in (None, True, False)


def test_git_dirty_says_whether_tracked_files_differ_from_the_commit(tmp_path, monkeypatch):
    """In a copy of the checkout, editing a tracked file marks it dirty; an untracked file does not."""
    if shutil.which("git") is None or runlog.git_commit() is None:
        pytest.skip("needs git and a git checkout")
    copy = tmp_path / "checkout"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{ROOT}", str(copy)], check=True, timeout=120)
    module = copy / "train" / "records" / "runlog.py"
    spec = importlib.util.spec_from_file_location("copied_runlog", module)
    copied = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, copied)  # its dataclasses look their module up there
    spec.loader.exec_module(copied)
    assert copied.git_dirty() is False
    (copy / "notes.txt").write_text("untracked\n")
    assert copied.git_dirty() is False
    module.write_text(module.read_text() + "\n")
    assert copied.git_dirty() is True
    monkeypatch.setenv("LS_JAX_GIT_COMMIT", "0" * 40)
    assert copied.git_dirty() is None


def valid_summary():
    """A summary record of an imdb run (counting examples) with every key and part of the schema."""
    record = {key: 1.0 for key in runlog.SCHEMA["summary"]}
    record.update(
        type="summary",
        metrics={"accuracy": 0.75},
        completed=True,
        stop_reason="finished",
        steps=3,
        energy_source="nvml",
        energy_estimated=False,
        memory=None,
        host_phases=None,
        compile_cache={"directory": None, "requests": 0, "hits": 0},
        startup_parts={"imports": 1.5, "state": 2.0},
        peak_memory_bytes=None,
        examples=24,
        examples_per_s=8.0,
    )
    for name, keys in runlog.PARTS["summary"].items():
        record[name] = {key: 1.0 for key in keys}
        record[name].update({key: 1 for key in ("steps", "count") if key in keys})
    record["steady"]["examples_per_s"] = None  # no steady step: no steady rate
    return record


def test_summary_parts_are_validated_and_a_schema_1_log_may_lack_them():
    runlog.validate(valid_summary(), ("examples",), complete=True)
    broken = valid_summary()
    del broken["steady"]["power_w"]
    with pytest.raises(runlog.RecordError, match=r"summary.steady record lacks 'power_w'"):
        runlog.validate(broken, ("examples",))
    broken = valid_summary()
    broken["warmup"]["steps"] = 2.0
    with pytest.raises(runlog.RecordError, match=r"summary.warmup.steps must be int, got float"):
        runlog.validate(broken)
    broken = valid_summary()
    del broken["steady"]["examples_per_s"]
    with pytest.raises(runlog.RecordError, match=r"lacks 'examples_per_s'"):
        runlog.validate(broken, ("examples",))
    schema_1 = {key: value for key, value in valid_summary().items() if key not in runlog.SCHEMA_2_KEYS["summary"]}
    runlog.validate(schema_1, ("examples",), schema=1)
    with pytest.raises(runlog.RecordError, match="summary record lacks 'wall_energy_j'"):
        runlog.validate(schema_1, ("examples",))


def test_tensorboard_that_cannot_write_is_one_warning_and_the_run_log_keeps_every_record(tmp_path, capsys):
    (tmp_path / runlog.TENSORBOARD_DIR).write_text("a file where the events' directory goes")
    log = runlog.RunLog(tmp_path, WMT_COUNTS)
    log.write(valid_interval())
    log.write(valid_interval())
    log.close()
    warnings = [line for line in capsys.readouterr().err.splitlines() if "TensorBoard" in line]
    assert len(warnings) == 1 and str(tmp_path / runlog.LOG_FILENAME) in warnings[0]
    assert [r["type"] for r in runlog.read(tmp_path / runlog.LOG_FILENAME)] == ["interval", "interval"]


def test_a_record_written_later_keeps_its_place_before_the_records_after_it(tmp_path):
    """The run record is made on a thread (it waits for a count): a record written meanwhile waits for it."""
    made = threading.Event()
    log = runlog.RunLog(tmp_path, WMT_COUNTS, tensorboard=False)
    log.write_later(lambda: made.wait(5) and valid_interval(step=1))
    threading.Timer(0.2, made.set).start()
    log.write(valid_interval(step=2))
    log.close()
    assert [r["step"] for r in runlog.read(tmp_path / runlog.LOG_FILENAME)] == [1, 2]


def test_what_making_a_later_record_raised_is_raised_by_the_next_write(tmp_path):
    def count():
        raise RuntimeError("the optimizer step did not compile")

    log = runlog.RunLog(tmp_path, WMT_COUNTS, tensorboard=False)
    log.write_later(lambda: valid_interval(step=count()))
    with pytest.raises(RuntimeError, match="did not compile"):
        log.write(valid_interval(step=2))
    log.close()
