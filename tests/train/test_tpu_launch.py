"""`python -m tpu.launch`: the gcloud commands it prints (--dry-run) for a single-host v3-8 and a multi-host v4-32,
its input checks, a missing gcloud, and a full launch against a stand-in gcloud that records its calls."""

import json
import os
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tpu import launch

REPO = Path(__file__).parents[2]
FIXTURE_LOG = Path(__file__).parents[1] / "data" / "compare" / "tpu-v3-8" / "run.jsonl"
GCLOUD_TPU = ["gcloud", "compute", "tpus", "tpu-vm"]
PY = launch.REMOTE_PYTHON


def dry_run(capsys, argv):
    """(description, argv) of each step that ``--dry-run`` prints."""
    assert launch.main(["--dry-run", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) % 2 == 0 and all(line.startswith("# ") for line in lines[::2])
    return [(comment[2:], shlex.split(command)) for comment, command in zip(lines[::2], lines[1::2])]


def remote_words(argv):
    """The words of the shell command an ssh step runs on the workers."""
    assert argv[:5] == [*GCLOUD_TPU, "ssh"] and argv[-2] == "--command"
    return shlex.split(argv[-1])


def test_dry_run_single_host_v3_8(capsys):
    steps = dry_run(
        capsys,
        [
            "--tpu",
            "my-v3-8",
            "--zone",
            "europe-west4-a",
            "--",
            "python",
            "-m",
            "train.wmt",
            "--preset",
            "transformer-base",
            "--steps",
            "2000",
        ],
    )
    commands = [argv for _, argv in steps]
    archive = launch.ARCHIVE
    assert commands[0] == [sys.executable, str(REPO / "tpu" / "source.py"), str(archive)]
    assert commands[1] == [
        *GCLOUD_TPU,
        "ssh",
        "my-v3-8",
        "--zone=europe-west4-a",
        "--worker=all",
        "--command",
        "mkdir -p ls_jax_work",
    ]
    assert commands[2] == [
        *GCLOUD_TPU,
        "scp",
        str(archive),
        f"my-v3-8:ls_jax_work/{archive.name}",
        "--zone=europe-west4-a",
        "--worker=all",
    ]
    assert commands[3][-1] == launch.install_script(archive.name, None, "jax[tpu]")
    assert commands[3][5:8] == ["my-v3-8", "--zone=europe-west4-a", "--worker=all"]

    run = remote_words(commands[4])
    launch_dir = run[2]
    assert launch_dir.startswith("ls_jax_work/") and run[:6] == ["mkdir", "-p", launch_dir, "&&", "cd", launch_dir]
    assert run[6:] == [
        "&&",
        "PYTHONPATH=$HOME/ls_jax_work/src",
        "LS_JAX_KERNELS=xla",
        "JAX_PLATFORMS=tpu,cpu",
        "~/ls_jax_work/venv/bin/python",
        "-m",
        "train.wmt",
        "--preset",
        "transformer-base",
        "--steps",
        "2000",
        "--backend",
        "xla",
        "--precision",
        "bf16",
        "--distributed",
    ]
    assert "--worker=all" in commands[4]

    launch_id = launch_dir.split("/")[1]
    assert "--worker=0" in commands[5]
    assert remote_words(commands[5]) == [
        "cd",
        launch_dir,
        "&&",
        "find",
        ".",
        "-name",
        "run.jsonl",
        "-print0",
        "|",
        "tar",
        "-czf",
        f"../{launch_id}.logs.tgz",
        "--null",
        "-T",
        "-",
    ]
    local_dir = Path("runs") / f"my-v3-8-{launch_id}"
    assert commands[6] == [
        *GCLOUD_TPU,
        "scp",
        f"my-v3-8:ls_jax_work/{launch_id}.logs.tgz",
        str(local_dir / f"{launch_id}.logs.tgz"),
        "--zone=europe-west4-a",
        "--worker=0",
    ]
    assert steps[7][0] == "unpack them" and str(local_dir) in steps[7][1]
    assert len(steps) == 8


def test_dry_run_multi_host_v4_32(capsys, tmp_path):
    archive = tmp_path / "ls_jax_src.tar.gz"
    steps = dry_run(
        capsys,
        [
            "--tpu",
            "pod-v4-32",
            "--zone",
            "us-central2-b",
            "--project",
            "my-proj",
            "--workers",
            "all",
            "--source",
            str(archive),
            "--logs-to",
            str(tmp_path / "logs"),
            "--env",
            "XLA_FLAGS=--xla_dump_to=/tmp/dump",
            "--",
            "python",
            "-m",
            "train.wmt",
            "--precision=fp32",
            "--data",
            "text:/data/wmt de",
        ],
    )
    descriptions = [description for description, _ in steps]
    assert descriptions[0] == "make the work directory on every worker"  # a given archive is not built
    for description, argv in steps:
        if argv[:4] == GCLOUD_TPU:
            assert "--project=my-proj" in argv and "--zone=us-central2-b" in argv
            fetching = description in ("pack the run logs on worker 0", "copy them here")
            assert ("--worker=0" if fetching else "--worker=all") in argv
    run = remote_words(steps[3][1])
    assert run[6:] == [
        "&&",
        "PYTHONPATH=$HOME/ls_jax_work/src",
        "LS_JAX_KERNELS=xla",
        "JAX_PLATFORMS=tpu,cpu",
        "XLA_FLAGS=--xla_dump_to=/tmp/dump",
        "~/ls_jax_work/venv/bin/python",
        "-m",
        "train.wmt",
        "--precision=fp32",
        "--data",
        "text:/data/wmt de",
        "--backend",
        "xla",
        "--distributed",
    ]
    assert steps[5][1][6].startswith(str(tmp_path / "logs"))


def test_run_command_quotes_every_word():
    target = launch.Target("t", "z")
    step = launch.run_step(
        target,
        "all",
        "ls_jax_work/id",
        ["python", "-m", "train.wmt", "--data", "$(whoami); ls"],
        {"NOTE": "a b; rm -rf ~"},
    )
    line = step.argv[-1]
    assert "'$(whoami); ls'" in line and "NOTE='a b; rm -rf ~'" in line
    assert " ~/ls_jax_work/venv/bin/python " in line  # the remote home, expanded by the remote shell
    assert shlex.split(line)[-11:] == [
        "NOTE=a b; rm -rf ~",
        "~/ls_jax_work/venv/bin/python",
        "-m",
        "train.wmt",
        "--data",
        "$(whoami); ls",
        "--backend",
        "xla",
        "--precision",
        "bf16",
        "--distributed",
    ]


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (
            ["python", "-m", "train.imdb"],
            [PY, "-m", "train.imdb", "--backend", "xla", "--precision", "bf16", "--distributed"],
        ),
        (
            ["python3", "-m", "train.wmt", "--precision", "fp32", "--distributed"],
            [PY, "-m", "train.wmt", "--precision", "fp32", "--distributed", "--backend", "xla"],
        ),
        (
            ["python", "-m", "train.wmt", "--precision=fp16", "--backend=xla"],
            [PY, "-m", "train.wmt", "--precision=fp16", "--backend=xla", "--distributed"],
        ),
        (["python", "my_script.py"], [PY, "my_script.py"]),
        (["bash", "-c", "nproc"], ["bash", "-c", "nproc"]),
    ],
)
def test_tpu_defaults(command, expected):
    assert launch.with_tpu_defaults(command) == expected


def test_setup_only_makes_the_environment_from_the_python_given(capsys):
    steps = dry_run(
        capsys,
        ["--tpu", "t", "--zone", "z", "--setup-only", "--python", "~/py312/bin/python3", "--jax", "jax[tpu]==0.11.2"],
    )
    assert [description for description, _ in steps][-1] == "install jax[tpu]==0.11.2 and ls-jax on every worker"
    script = steps[-1][1][-1]
    assert script == launch.install_script(launch.ARCHIVE.name, "~/py312/bin/python3", "jax[tpu]==0.11.2")
    assert "PY=~/py312/bin/python3;" in script and "uv" not in script
    assert script.endswith("venv/bin/python -m pip install --quiet --upgrade 'jax[tpu]==0.11.2' './src[train]'")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tpu", "t", "--zone", "z"], "no command to run: put it after --"),
        (
            ["--tpu", "t", "--zone", "z", "--setup-only", "--", "python", "-m", "train.wmt"],
            "--setup-only runs no command",
        ),
        (["--tpu", "t", "--zone", "z", "--workers", "first", "--", "python"], "--workers 'first'"),
        (["--tpu", "t", "--zone", "z", "--env", "1X=2", "--", "python"], "--env '1X=2'"),
        (["--tpu", "t", "--zone", "z", "--env", "NOEQUALS", "--", "python"], "expected NAME=VALUE"),
        (["--tpu", "t", "--zone", "z", "--skip-setup", "--source", "x.tar.gz", "--", "python"], "--skip-setup skips"),
        (["--tpu", "t", "--zone", "z", "--source", "/no/such/src.tar.gz", "--", "python"], "no such file"),
        (["--tpu", "t", "--zone", "z", "--source", "ls_jax.whl", "--", "python"], "made by python -m tpu.source"),
    ],
)
def test_bad_input_is_a_clear_error(capsys, argv, message):
    assert launch.main(argv) == launch.EXIT_USAGE
    assert message in capsys.readouterr().err


def test_missing_gcloud_is_a_clear_message_not_a_traceback(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tpu.launch",
            "--tpu",
            "t",
            "--zone",
            "z",
            "--skip-setup",
            "--",
            "python",
            "-m",
            "train.wmt",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "the gcloud CLI is not on PATH" in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""


FAKE_GCLOUD = """#!{python}
import io, json, os, sys, tarfile
args = sys.argv[1:]
with open(os.environ["FAKE_GCLOUD_CALLS"], "a") as calls:
    calls.write(json.dumps(args) + "\\n")
if os.environ["FAKE_GCLOUD_FAIL"] and os.environ["FAKE_GCLOUD_FAIL"] in " ".join(args):
    sys.exit(3)
if args[3] == "scp" and ":" in args[4]:
    with tarfile.open(args[5], "w:gz") as archive:
        archive.add(os.environ["FAKE_GCLOUD_RUN_LOG"], arcname="./runs/20260106T080000Z-e5d6f7/run.jsonl")
"""


@pytest.fixture
def fake_gcloud(tmp_path, monkeypatch):
    """A gcloud on PATH that records each call; FAKE_GCLOUD_FAIL makes calls containing that text exit 3."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(FAKE_GCLOUD.format(python=sys.executable))
    gcloud.chmod(0o755)
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_GCLOUD_CALLS", str(calls))
    monkeypatch.setenv("FAKE_GCLOUD_RUN_LOG", str(FIXTURE_LOG))
    monkeypatch.setenv("FAKE_GCLOUD_FAIL", "")
    return lambda: [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []


def _launch_argv(tmp_path):
    archive = tmp_path / "ls_jax_src.tar.gz"
    archive.write_bytes(b"stand-in archive")
    return [
        "--tpu",
        "t",
        "--zone",
        "z",
        "--source",
        str(archive),
        "--logs-to",
        str(tmp_path / "logs"),
        "--",
        "python",
        "-m",
        "train.wmt",
    ]


def test_launch_runs_every_step_and_unpacks_the_logs(tmp_path, fake_gcloud, capsys):
    assert launch.main(_launch_argv(tmp_path)) == 0
    calls = fake_gcloud()
    assert [call[3] for call in calls] == ["ssh", "scp", "ssh", "ssh", "ssh", "scp"]
    fetched = tmp_path / "logs" / "runs" / "20260106T080000Z-e5d6f7" / "run.jsonl"
    assert fetched.read_text() == FIXTURE_LOG.read_text()
    assert not list((tmp_path / "logs").glob("*.tgz"))
    assert f"python -m train.compare {tmp_path / 'logs'}" in capsys.readouterr().out


def test_failed_run_still_fetches_logs_and_returns_its_exit_code(tmp_path, fake_gcloud, monkeypatch):
    monkeypatch.setenv("FAKE_GCLOUD_FAIL", "train.wmt")
    assert launch.main(_launch_argv(tmp_path)) == 3
    assert [call[3] for call in fake_gcloud()][-2:] == ["ssh", "scp"]
    assert (tmp_path / "logs" / "runs" / "20260106T080000Z-e5d6f7" / "run.jsonl").is_file()


def test_failed_setup_stops_the_launch(tmp_path, fake_gcloud, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_GCLOUD_FAIL", "pip install")
    assert launch.main(_launch_argv(tmp_path)) == 3
    assert len(fake_gcloud()) == 3
    assert "'install jax[tpu] and ls-jax on every worker' failed (exit 3)" in capsys.readouterr().err


def test_fetch_without_run_logs_is_an_error(tmp_path, capsys):
    archive = tmp_path / "empty.tgz"
    with tarfile.open(archive, "w:gz"):
        pass
    assert launch.execute([launch.Step("fetch", "unpack them", extract=(archive, tmp_path / "logs"))]) == 1
    assert "holds no run.jsonl" in capsys.readouterr().err


def test_unpacking_a_missing_archive_is_an_error(tmp_path, capsys):
    step = launch.Step("fetch", "unpack them", extract=(tmp_path / "absent.tgz", tmp_path / "logs"))
    assert launch.execute([step]) == 1
    assert "cannot unpack the fetched logs" in capsys.readouterr().err


def test_interrupt_says_the_remote_command_may_still_run(tmp_path, fake_gcloud, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch.subprocess, "run", interrupted)
    assert launch.main(_launch_argv(tmp_path)) == 130
    assert "may still be running" in capsys.readouterr().err


def test_the_source_archive_holds_the_library_and_the_tools_only(tmp_path):
    from tpu import source

    archive = source.build(tmp_path / "src.tar.gz")
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {"pyproject.toml", "README.md", "train/wmt/__main__.py", "tpu/launch.py", "ls_jax/__init__.py"} <= names
    assert "ffi_kernels/csrc/common.cuh" in names
    assert not any(name.startswith(("tests/", "docs/")) or "__pycache__" in name for name in names)
