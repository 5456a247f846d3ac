"""Bad input to the three training entry points is one ``error:`` line (exit code 2 for a flag, 3 for the data),
never a traceback, and a start that fails leaves no run directory behind: data files whose bytes are not UTF-8,
seeds and prices out of range."""

import json

import pytest

from train.gpt import task as gpt
from train.gpt.config import GptConfig
from train.harness.training import run_training
from train.imdb import task as imdb
from train.imdb.config import ImdbConfig
from train.records.rundir import save_config
from train.wmt import task as wmt
from train.wmt.config import WmtConfig

TASKS = {"gpt": gpt.TASK, "imdb": imdb.TASK, "wmt": wmt.TASK}
NOT_UTF8 = "caf\xe9 au lait".encode("latin-1")  # a Latin-1 text: byte 0xe9 is no UTF-8 sequence


def run(task, argv, capsys):
    """Exit code and stderr of ``python -m train.<task> ARGV``, in this process."""
    code = run_training(TASKS[task], argv)
    return code, capsys.readouterr().err


def assert_one_line(err):
    assert "Traceback" not in err and err.startswith("error: ") and err.count("\n") == 1, err


def write_latin1_text(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"a first line in plain ascii\n" + NOT_UTF8 + b"\n")
    return path


def write_gpt_directory(tmp_path):
    directory = tmp_path / "documents"
    directory.mkdir()
    (directory / "a.txt").write_text("a document in UTF-8\n")
    (directory / "b.txt").write_bytes(NOT_UTF8)
    return directory, directory / "b.txt"


def write_imdb(tmp_path, kind):
    path = tmp_path / f"reviews.{kind}"
    if kind == "csv":
        path.write_bytes(b'text,label\n"a good film",1\n"' + NOT_UTF8 + b'",0\n')
    else:
        path.write_bytes(
            json.dumps({"text": "a good film", "label": 1}).encode()
            + b"\n"
            + b'{"text": "'
            + NOT_UTF8
            + b'", "label": 0}\n'
        )
    return path


def write_wmt(tmp_path):
    directory = tmp_path / "parallel"
    directory.mkdir()
    for split in ("train", "valid"):
        (directory / f"{split}.de").write_text("ein Satz\n")
        (directory / f"{split}.en").write_text("a sentence\n")
    (directory / "train.de").write_bytes(b"ein Satz\n" + NOT_UTF8 + b"\n")
    (directory / "train.en").write_text("a sentence\nanother one\n")
    return directory, directory / "train.de"


@pytest.mark.parametrize("case", ["gpt-file", "gpt-directory", "imdb-csv", "imdb-jsonl", "imdb-test-data", "wmt"])
def test_data_that_is_not_utf8_is_one_line_naming_the_file(tmp_path, capsys, case):
    if case == "gpt-file":
        bad = write_latin1_text(tmp_path)
        task, flags, line = "gpt", ["--data", f"text:{bad}"], 2
    elif case == "gpt-directory":
        directory, bad = write_gpt_directory(tmp_path)
        task, flags, line = "gpt", ["--data", f"text:{directory}"], 1
    elif case == "imdb-test-data":
        bad = write_imdb(tmp_path, "csv")
        task, flags, line = "imdb", ["--data", "synthetic", "--test-data", f"csv:{bad}"], 3
    elif case.startswith("imdb"):
        kind = case.split("-")[1]
        bad = write_imdb(tmp_path, kind)
        task, flags, line = "imdb", ["--data", f"{kind}:{bad}"], 3 if kind == "csv" else 2
    else:
        directory, bad = write_wmt(tmp_path)
        task, flags, line = "wmt", ["--data", f"text:{directory}"], 2
    run_dir = tmp_path / "runs" / "bad-data"
    code, err = run(task, [*flags, "--run-dir", str(run_dir), "--no-progress", "--no-tensorboard"], capsys)
    assert code == 3, err
    assert_one_line(err)
    assert f"error: {bad} is not UTF-8 text (byte 0xe9 at line {line}, byte" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--seed", "-1"], "--seed must be an integer in [0, 4294967296), got -1"),
        (["--seed", str(2**32)], f"--seed must be an integer in [0, 4294967296), got {2**32}"),
        (["--price-per-hour", "-1"], "--price-per-hour must be a finite number >= 0, got -1.0"),
        (["--price-per-hour", "nan"], "--price-per-hour must be a finite number >= 0, got nan"),
        *(
            (
                ["--grad-bucket-mb", value],
                f"--grad-bucket-mb must be from {2**-20:g} (one byte) to 1.04858e+06 "
                f"(1 TiB, one bucket for any model), got {float(value):g}",
            )
            for value in ("0", "1e-9", "1e303", "nan")
        ),
    ],
)
def test_a_number_out_of_range_is_one_line_and_no_directory(tmp_path, capsys, task, flags, message):
    run_dir = tmp_path / "run"
    code, err = run(task, [*flags, "--run-dir", str(run_dir)], capsys)
    assert code == 2
    assert err == f"error: {message}\n"
    assert not run_dir.exists()


def test_one_label_is_refused(tmp_path, capsys):
    code, err = run("imdb", ["--num-labels", "1", "--run-dir", str(tmp_path / "r")], capsys)
    assert code == 2 and err == "error: --num-labels must be >= 2: a classifier of one class has nothing to learn\n"


def test_max_len_0_is_refused_like_its_neighbours(tmp_path, capsys):
    for value in ("0", "-3"):
        code, err = run("wmt", ["--max-len", value, "--run-dir", str(tmp_path / "run")], capsys)
        assert code == 2 and err == f"error: --max-len must be >= 1, got {value}\n"


def test_a_default_refused_beside_a_given_flag_is_named_a_default(tmp_path, capsys):
    code, err = run("gpt", ["--positions", "32", "--run-dir", str(tmp_path / "run")], capsys)
    assert code == 2 and err.startswith("error: the default --max-seq-len 64 is longer than the 32 positions")
    code, err = run("gpt", ["--positions", "32", "--max-seq-len", "64", "--run-dir", str(tmp_path / "run")], capsys)
    assert code == 2 and err.startswith("error: --max-seq-len 64 is longer than the 32 positions")


def test_a_data_path_of_the_wrong_kind_says_which_kind_it_is(tmp_path, capsys):
    (tmp_path / "file.txt").write_text("a line\n")
    code, err = run("wmt", ["--data", f"text:{tmp_path / 'file.txt'}", "--run-dir", str(tmp_path / "r")], capsys)
    assert code == 3 and err.startswith(f"error: {tmp_path / 'file.txt'} is a file: --data text: takes a directory")
    code, err = run("imdb", ["--data", f"csv:{tmp_path}", "--run-dir", str(tmp_path / "r")], capsys)
    assert code == 3 and err == f"error: {tmp_path} is a directory, not a data file\n"


def test_a_failed_start_keeps_a_directory_the_user_made(tmp_path, capsys):
    given = tmp_path / "mine"
    given.mkdir()  # empty: a new run refuses a directory of other files before it starts
    bad = write_latin1_text(tmp_path)
    code, err = run("gpt", ["--data", f"text:{bad}", "--run-dir", str(given), "--no-tensorboard"], capsys)
    assert code == 3
    assert_one_line(err)
    assert given.is_dir()


@pytest.mark.parametrize(
    "saved_task, saved_config, task, article",
    [("gpt", GptConfig, "imdb", "a"), ("wmt", WmtConfig, "imdb", "a"), ("imdb", ImdbConfig, "wmt", "an")],
)
def test_resuming_the_run_of_another_task_names_it(saved_task, saved_config, task, article, tmp_path, capsys):
    """Named before any of the saved fields is checked: they are the other task's."""
    run_dir = tmp_path / f"{saved_task}-run"
    run_dir.mkdir()
    save_config(run_dir, {"task": saved_task, "run_id": "20261128T000000Z-000000", **saved_config().to_dict()})
    before = sorted(run_dir.iterdir())
    code, err = run(task, ["--resume", str(run_dir)], capsys)
    assert code == 2
    assert err == (
        f"error: --resume {run_dir}: that is {article} {saved_task} run; resume it with python -m "
        f"train.{saved_task} --resume {run_dir}\n"
    )
    assert sorted(run_dir.iterdir()) == before


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--grad-comm-dtype", "fp16"], "argument --grad-comm-dtype: invalid choice: 'fp16' (choose from"),
        (["--steps", "abc"], "argument --steps: invalid int value: 'abc'"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--step", "5"], "unrecognized arguments: --step 5"),  # not taken for --steps
        (["--lr", "-1e-3,2"], "expected one argument (a value that starts with '-' is given as --flag=VALUE)"),
    ],
)
def test_a_flag_argparse_refuses_is_one_line(capsys, task, flags, message):
    with pytest.raises(SystemExit) as stop:
        run(task, flags, capsys)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and message in err and err.endswith("; see --help\n"), err


def test_a_run_directory_that_is_a_file_is_named_as_one(tmp_path, capsys):
    path = tmp_path / "a.csv"
    path.write_text("text,label\n")
    code, err = run("wmt", ["--run-dir", str(path)], capsys)
    assert code == 2
    assert err == f"error: the run directory {path} is a file; name a directory (new or a run's) instead\n"
    assert path.read_text() == "text,label\n"


BOM = b"\xef\xbb\xbf"  # what spreadsheet programs write in front of UTF-8


def test_a_byte_order_mark_in_front_of_a_data_file_is_dropped(tmp_path):
    from train.gpt import data as gpt_data
    from train.imdb import data as imdb_data

    (tmp_path / "r.csv").write_bytes(BOM + b'text,label\n"a good film",1\n')
    (tmp_path / "r.jsonl").write_bytes(BOM + b'{"text": "a good film", "label": 1}\n')
    (tmp_path / "g.txt").write_bytes(BOM + b"first line\nsecond line\n")
    assert imdb_data.read_csv(tmp_path / "r.csv", "text", "label").texts == ["a good film"]
    assert imdb_data.read_jsonl(tmp_path / "r.jsonl", "text", "label").texts == ["a good film"]
    assert gpt_data.read_text(tmp_path / "g.txt") == ["first line", "second line"]


def test_training_texts_that_are_all_empty_are_one_line(tmp_path, capsys):
    data = tmp_path / "empty-texts.csv"
    data.write_text("text,label\n" + '"",1\n"",0\n' * 10)
    code, err = run("imdb", ["--data", f"csv:{data}", "--run-dir", str(tmp_path / "r"), "--steps", "1"], capsys)
    assert code == 3
    assert_one_line(err)
    assert "holds no text to learn a vocabulary from" in err
    assert not (tmp_path / "r").exists()
