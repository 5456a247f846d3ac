"""Run an ls-jax training command on every worker of a Cloud TPU VM slice and fetch its run logs.

    python -m tpu.launch --tpu NAME --zone ZONE [--project P] [--workers all] [--dry-run]
                         [--setup-only | --skip-setup] [--source ARCHIVE] [--python PY] [--jax REQ]
                         [--env K=V ...] [--logs-to DIR] -- python -m train.wmt ...

Steps, each one gcloud command (``gcloud compute tpus tpu-vm ssh|scp``), run from this machine:
  setup  pack this checkout's source (``python -m tpu.source``: the library and the tools, train/ and tpu/) or take
         --source, copy it to every worker, unpack it into ~/ls_jax_work/src, make a virtual environment
         ~/ls_jax_work/venv from a Python 3.11+ (the first on the worker's PATH, else Python 3.12 installed with uv:
         TPU VM images of Ubuntu 22.04 ship 3.10, which current JAX does not support) and ``pip install``
         ``jax[tpu]`` and the library into it;
  run    the command, on all workers at once, in ~/ls_jax_work/<launch id>/, with that environment's Python, the
         source on PYTHONPATH (so ``python -m train.wmt`` finds the tools), LS_JAX_KERNELS=xla (the fused CUDA
         kernels do not exist on TPU) and JAX_PLATFORMS=tpu,cpu (a TPU that fails to start is an error, not a
         silent fall back to CPU). ``python -m train.*`` commands get the TPU defaults they do not set themselves:
         ``--backend xla --precision bf16 --distributed`` (jax.distributed.initialize(), which on Cloud TPU finds
         the other hosts of the slice itself; on one host it is a one-process cluster);
  fetch  pack every run.jsonl under the launch directory on worker 0 (the process that writes the logs), copy the
         archive here and unpack it into --logs-to, ready for ``python -m train.compare``.
Commands are argument lists (no local shell); the remote command line quotes every word with shlex.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
ARCHIVE = REPO_ROOT / "build" / "tpu_launch" / "ls_jax_src.tar.gz"
REMOTE_WORK_DIR = "ls_jax_work"
REMOTE_SOURCE = f"{REMOTE_WORK_DIR}/src"
REMOTE_PYTHON = f"~/{REMOTE_WORK_DIR}/venv/bin/python"
MIN_PYTHON = (3, 11)
RUN_ENV = {"LS_JAX_KERNELS": "xla", "JAX_PLATFORMS": "tpu,cpu"}
# Flags of the train.* entry points (train/harness/cli.py) and their values on TPU; None marks a switch.
TRAINER_TPU_FLAGS: dict[str, str | None] = {"--backend": "xla", "--precision": "bf16", "--distributed": None}
EXIT_USAGE = 2
_WORKERS = re.compile(r"all|\d+(-\d+)?(,\d+(-\d+)?)*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclasses.dataclass(frozen=True)
class Target:
    """The TPU VM: name, zone and (optional) project, as gcloud takes them."""

    tpu: str
    zone: str
    project: str | None = None

    def flags(self) -> list[str]:
        return [f"--zone={self.zone}"] + ([f"--project={self.project}"] if self.project else [])


@dataclasses.dataclass(frozen=True)
class Step:
    """One command of a launch, run here: ``argv`` (after making the local directory ``creates``), or, with
    ``extract`` = (archive, directory), unpacking a fetched archive in Python. ``stage``: setup, run or fetch."""

    stage: str
    description: str
    argv: tuple[str, ...] = ()
    creates: Path | None = None
    extract: tuple[Path, Path] | None = None

    def show(self) -> str:
        if self.extract:
            archive, into = self.extract
            return f"(python) unpack {archive} into {into}"
        return shlex.join(self.argv)


def remote_word(word: str) -> str:
    """``word`` quoted for the remote POSIX shell; a leading ``~/`` stays unquoted so it means the remote home."""
    if word.startswith("~/"):
        return "~/" + shlex.quote(word[2:])
    return shlex.quote(word)


def remote_line(words: Sequence[str]) -> str:
    return " ".join(map(remote_word, words))


def ssh(target: Target, workers: str, command: str) -> tuple[str, ...]:
    """gcloud argv running the shell ``command`` on ``workers`` (``all``, ``0``, ``1,3``, ``0-3``) concurrently."""
    return (
        "gcloud",
        "compute",
        "tpus",
        "tpu-vm",
        "ssh",
        target.tpu,
        *target.flags(),
        f"--worker={workers}",
        "--command",
        command,
    )


def scp_to(target: Target, workers: str, local: Path, remote: str) -> tuple[str, ...]:
    return (
        "gcloud",
        "compute",
        "tpus",
        "tpu-vm",
        "scp",
        str(local),
        f"{target.tpu}:{remote}",
        *target.flags(),
        f"--worker={workers}",
    )


def scp_from(target: Target, worker: str, remote: str, local: Path) -> tuple[str, ...]:
    return (
        "gcloud",
        "compute",
        "tpus",
        "tpu-vm",
        "scp",
        f"{target.tpu}:{remote}",
        str(local),
        *target.flags(),
        f"--worker={worker}",
    )


def build_source(archive: Path) -> tuple[str, ...]:
    return (sys.executable, str(REPO_ROOT / "tpu" / "source.py"), str(archive))


def install_script(archive_name: str, python: str | None, jax_requirement: str) -> str:
    """The shell command that installs on a worker: the source unpacked into ~/ls_jax_work/src, a virtual
    environment ~/ls_jax_work/venv made from ``python`` (None: the first Python of MIN_PYTHON or newer on the PATH,
    else Python 3.12 installed with uv), and ``jax_requirement`` and the library with the tools' extra (``train``)
    pip-installed into it."""
    minimum = ", ".join(map(str, MIN_PYTHON))
    if python is not None:
        choose = f"PY={remote_word(python)}"
    else:
        choose = (
            "PY=; for candidate in python3.13 python3.12 python3.11 python3; do "
            f"if \"$candidate\" -c 'import sys; sys.exit(sys.version_info < ({minimum}))' 2>/dev/null; then "
            'PY=$(command -v "$candidate"); break; fi; done; '
            'if [ -z "$PY" ]; then echo "no Python 3.11+ on this worker: installing Python 3.12 with uv" >&2; '
            "python3 -m pip install --user --quiet uv && ~/.local/bin/uv python install 3.12 && "
            "PY=$(~/.local/bin/uv python find 3.12); fi"
        )
    pip = "venv/bin/python -m pip install --quiet --upgrade"
    return "; ".join(
        [
            "set -e",
            f"cd ~/{REMOTE_WORK_DIR}",
            f"rm -rf src && mkdir src && tar -xzf {shlex.quote(archive_name)} -C src",
            choose,
            '"$PY" -m venv --clear venv',
            f"{pip} pip",
            f"{pip} {shlex.quote(jax_requirement)} './src[train]'",
        ]
    )


def setup_steps(target: Target, workers: str, archive: Path, python: str | None, jax_requirement: str) -> list[Step]:
    """Copy the source ``archive`` to ``workers`` and install it there (`install_script`)."""
    return [
        Step("setup", "make the work directory on every worker", ssh(target, workers, f"mkdir -p {REMOTE_WORK_DIR}")),
        Step(
            "setup",
            f"copy {archive.name} to every worker",
            scp_to(target, workers, archive, f"{REMOTE_WORK_DIR}/{archive.name}"),
        ),
        Step(
            "setup",
            f"install {jax_requirement} and ls-jax on every worker",
            ssh(target, workers, install_script(archive.name, python, jax_requirement)),
        ),
    ]


def with_tpu_defaults(command: Sequence[str]) -> list[str]:
    """The command as run on TPU: ``python``/``python3`` replaced by the workers' environment's interpreter, and
    each flag of TRAINER_TPU_FLAGS that a ``python -m train.*`` command does not give added to it."""
    command = list(command)
    if command[0] in ("python", "python3"):
        command[0] = REMOTE_PYTHON
    if not (len(command) >= 3 and command[1] == "-m" and command[2].startswith("train.")):
        return command
    for flag, value in TRAINER_TPU_FLAGS.items():
        if not any(word == flag or word.startswith(flag + "=") for word in command):
            command += [flag] if value is None else [flag, value]
    return command


def run_step(target: Target, workers: str, launch_dir: str, command: Sequence[str], env: Mapping[str, str]) -> Step:
    """The training command on ``workers``, all at once, in ``launch_dir`` with RUN_ENV, the source on PYTHONPATH
    and ``env`` set."""
    assignments = [f"{name}={shlex.quote(value)}" for name, value in {**RUN_ENV, **env}.items()]
    line = " ".join(
        [
            f"mkdir -p {shlex.quote(launch_dir)} && cd {shlex.quote(launch_dir)} &&",
            f'PYTHONPATH="$HOME/{REMOTE_SOURCE}"',
            *assignments,
            remote_line(with_tpu_defaults(command)),
        ]
    )
    return Step("run", f"run the command on workers {workers}", ssh(target, workers, line))


def fetch_steps(target: Target, launch_dir: str, logs_to: Path) -> list[Step]:
    """Copy every run.jsonl under ``launch_dir`` on worker 0 into ``logs_to``, keeping the directory layout."""
    archive = f"{launch_dir}.logs.tgz"
    local_archive = logs_to / Path(archive).name
    pack = (
        f"cd {shlex.quote(launch_dir)} && find . -name run.jsonl -print0 "
        f"| tar -czf {shlex.quote('../' + Path(archive).name)} --null -T -"
    )
    return [
        Step("fetch", "pack the run logs on worker 0", ssh(target, "0", pack)),
        Step("fetch", "copy them here", scp_from(target, "0", archive, local_archive), creates=logs_to),
        Step("fetch", "unpack them", extract=(local_archive, logs_to)),
    ]


def parse_env(pairs: Sequence[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, equals, value = pair.partition("=")
        if not equals or not _ENV_NAME.fullmatch(name):
            raise ValueError(f"--env {pair!r}: expected NAME=VALUE with NAME a shell variable name")
        env[name] = value
    return env


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(launcher arguments, command): the command is everything after the first ``--``."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    at = argv.index("--")
    return argv[:at], argv[at + 1 :]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tpu.launch",
        usage="%(prog)s --tpu NAME --zone ZONE [options] -- python -m train.wmt ...",
        description=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tpu", required=True, help="TPU VM name (gcloud compute tpus tpu-vm create NAME ...)")
    parser.add_argument("--zone", required=True, help="its zone, e.g. us-central1-f")
    parser.add_argument("--project", help="Google Cloud project (default: gcloud's configured project)")
    parser.add_argument(
        "--workers",
        default="all",
        help="workers to set up and run on: all (default; multi-host slices need all), 0, 1,3 or 0-3",
    )
    stage = parser.add_mutually_exclusive_group()
    stage.add_argument("--setup-only", action="store_true", help="install on the workers, run nothing")
    stage.add_argument("--skip-setup", action="store_true", help="the workers are set up already: run and fetch")
    parser.add_argument(
        "--source",
        help="a source archive made by python -m tpu.source to install (default: this checkout, packed into "
        f"{ARCHIVE})",
    )
    parser.add_argument(
        "--python",
        help="the Python on the workers the environment is made from, 3.11 or newer (default: the first on their "
        "PATH, else 3.12 installed with uv)",
    )
    parser.add_argument("--jax", default="jax[tpu]", help="the JAX requirement installed (default jax[tpu])")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment variable for the command (repeatable)",
    )
    parser.add_argument(
        "--logs-to", type=Path, help="local directory for the fetched run logs (default: runs/<tpu>-<launch id>)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return parser


def _source(spec: str | None, dry_run: bool) -> tuple[list[Step], Path]:
    """Steps that make the source archive, and the archive."""
    if spec is None:
        return [Step("setup", "pack this checkout's source", build_source(ARCHIVE))], ARCHIVE
    path = Path(spec).expanduser()
    if not spec.endswith(".tar.gz"):
        raise ValueError(f"--source {spec}: give a .tar.gz made by python -m tpu.source")
    if not dry_run and not path.is_file():
        raise FileNotFoundError(f"--source {spec}: no such file")
    return [], path.resolve()


def plan(args: argparse.Namespace, command: Sequence[str], launch_id: str) -> list[Step]:
    """Every step of the launch, in order."""
    if not _WORKERS.fullmatch(args.workers):
        raise ValueError(f"--workers {args.workers!r}: expected all, an index, a list (1,3) or a range (0-3)")
    if not command and not args.setup_only:
        raise ValueError("no command to run: put it after --, e.g. -- python -m train.wmt --preset transformer-base")
    if command and args.setup_only:
        raise ValueError("--setup-only runs no command: leave out the command after --")
    if args.source and args.skip_setup:
        raise ValueError("--source is installed by the setup, which --skip-setup skips")
    target = Target(args.tpu, args.zone, args.project)
    steps: list[Step] = []
    if not args.skip_setup:
        build, archive = _source(args.source, args.dry_run)
        steps += build + setup_steps(target, args.workers, archive, args.python, args.jax)
    if args.setup_only:
        return steps
    launch_dir = f"{REMOTE_WORK_DIR}/{launch_id}"
    logs_to = args.logs_to or Path("runs") / f"{args.tpu}-{launch_id}"
    steps.append(run_step(target, args.workers, launch_dir, command, parse_env(args.env)))
    return steps + fetch_steps(target, launch_dir, logs_to)


def _unpack(archive: Path, into: Path) -> int:
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(into, filter="data")
    except (OSError, tarfile.TarError) as err:
        print(f"error: cannot unpack the fetched logs {archive}: {err}", file=sys.stderr)
        return 1
    archive.unlink()
    logs = sorted(into.rglob("run.jsonl"))
    for log in logs:
        print(f"fetched {log}")
    if not logs:
        print("error: the launch directory on worker 0 holds no run.jsonl", file=sys.stderr)
        return 1
    print(f"compare them with: python -m train.compare {shlex.quote(str(into))} [other logs]")
    return 0


def execute(steps: Sequence[Step]) -> int:
    """Runs the steps in order and returns the first failure's exit code; a failed run still has its logs
    fetched (a run stopped early writes a summary too), any other failure ends the launch."""
    status = 0
    for step in steps:
        print(f"==> {step.description}: {step.show()}", flush=True)
        if step.creates:
            step.creates.mkdir(parents=True, exist_ok=True)
        outcome = _unpack(*step.extract) if step.extract else subprocess.run(step.argv, check=False).returncode
        if outcome != 0:
            print(f"error: {step.description!r} failed (exit {outcome})", file=sys.stderr)
            if step.stage != "run":
                return outcome
            status = outcome
    return status


def main(argv: Sequence[str] | None = None) -> int:
    own, command = split_command(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(own)
    launch_id = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    try:
        steps = plan(args, command, launch_id)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    if args.dry_run:
        for step in steps:
            print(f"# {step.description}\n{step.show()}")
        return 0
    if shutil.which("gcloud") is None:
        print(
            "error: the gcloud CLI is not on PATH. Install the Google Cloud SDK "
            "(https://cloud.google.com/sdk/docs/install), run `gcloud auth login`, then try again.",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        return execute(steps)
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: a command already started on the workers may still be running there "
            f"(see it with: gcloud compute tpus tpu-vm ssh {args.tpu} --zone={args.zone} --worker=all "
            "--command 'ps -ef | grep train')",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
