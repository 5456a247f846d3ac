"""Run an ls-jax training command on every worker of a Cloud TPU VM slice and fetch its run logs.

    python -m tpu.launch --tpu NAME --zone ZONE [--project P] [--workers all] [--dry-run]
                         [--setup-only | --skip-setup] [--package WHEEL|SPEC] [--python PY] [--env K=V ...]
                         [--logs-to DIR] -- python -m train.wmt ...

Steps, each one gcloud command (``gcloud compute tpus tpu-vm ssh|scp``), run from this machine:
  setup  build a wheel of this checkout (or take --package), copy it to every worker, and
         ``pip install -U "jax[tpu]" <wheel>`` there;
  run    the command, on all workers at once, in ~/ls_jax_work/<launch id>/, with LS_JAX_KERNELS=xla (the fused
         CUDA kernels do not exist on TPU) and JAX_PLATFORMS=tpu,cpu (a TPU that fails to start is an error, not
         a silent fall back to CPU). ``python -m train.*`` commands get the TPU defaults they do not set
         themselves: ``--backend xla --precision bf16 --distributed`` (jax.distributed.initialize(), which on
         Cloud TPU finds the other hosts of the slice itself; on one host it is a one-process cluster);
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
WHEEL_DIR = REPO_ROOT / "build" / "tpu_launch"
REMOTE_WORK_DIR = "ls_jax_work"
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


def wheel_name(version: str) -> str:
    """File name of the pure-Python wheel of ls-jax ``version`` (what ``pip wheel`` names it)."""
    return f"ls_jax-{version}-py3-none-any.whl"


def build_wheel(wheel_dir: Path) -> tuple[str, ...]:
    return (sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(wheel_dir), str(REPO_ROOT))


def setup_steps(target: Target, workers: str, package: str | Path, python: str) -> list[Step]:
    """Install JAX for TPU and ls-jax on ``workers``; ``package`` is a local wheel/sdist (copied over) or a pip
    requirement (e.g. ``ls-jax @ git+https://...``) installed as given."""
    steps = []
    if isinstance(package, Path):
        remote_package = f"{REMOTE_WORK_DIR}/{package.name}"
        steps += [
            Step(
                "setup", "make the work directory on every worker", ssh(target, workers, f"mkdir -p {REMOTE_WORK_DIR}")
            ),
            Step("setup", f"copy {package.name} to every worker", scp_to(target, workers, package, remote_package)),
        ]
        requirement = remote_package
    else:
        requirement = package
    install = remote_line([python, "-m", "pip", "install", "--upgrade", "jax[tpu]", requirement])
    steps.append(Step("setup", "install jax[tpu] and ls-jax on every worker", ssh(target, workers, install)))
    return steps


def with_tpu_defaults(command: Sequence[str], python: str) -> list[str]:
    """The command as run on TPU: ``python``/``python3`` replaced by the workers' interpreter, and each flag of
    TRAINER_TPU_FLAGS that a ``python -m train.*`` command does not give added to it."""
    command = list(command)
    if command[0] in ("python", "python3"):
        command[0] = python
    if not (len(command) >= 3 and command[1] == "-m" and command[2].startswith("train.")):
        return command
    for flag, value in TRAINER_TPU_FLAGS.items():
        if not any(word == flag or word.startswith(flag + "=") for word in command):
            command += [flag] if value is None else [flag, value]
    return command


def run_step(
    target: Target, workers: str, launch_dir: str, command: Sequence[str], python: str, env: Mapping[str, str]
) -> Step:
    """The training command on ``workers``, all at once, in ``launch_dir`` with RUN_ENV and ``env`` set."""
    assignments = [f"{name}={shlex.quote(value)}" for name, value in {**RUN_ENV, **env}.items()]
    line = " ".join(
        [
            f"mkdir -p {shlex.quote(launch_dir)} && cd {shlex.quote(launch_dir)} &&",
            *assignments,
            remote_line(with_tpu_defaults(command, python)),
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
        "--package",
        help="what to install: a local .whl/.tar.gz file, or a pip requirement such as "
        "'ls-jax @ git+https://github.com/ORG/ls-jax@COMMIT' "
        f"(default: a wheel built from this checkout into {WHEEL_DIR})",
    )
    parser.add_argument(
        "--python",
        default="python3",
        help="Python interpreter on the workers (default python3; e.g. ~/venv/bin/python)",
    )
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


def checkout_version() -> str:
    """The version in this checkout's pyproject.toml: the version of the wheel built from it."""
    pyproject = REPO_ROOT / "pyproject.toml"
    if not pyproject.is_file():
        raise ValueError(f"no source checkout at {REPO_ROOT} to build a wheel from: pass --package")
    try:
        import tomllib
    except ImportError:
        raise ValueError("building the wheel here needs Python 3.11+ (tomllib); pass --package instead") from None
    return tomllib.loads(pyproject.read_text())["project"]["version"]


def _package(spec: str | None, dry_run: bool) -> tuple[list[Step], Path | str]:
    """Steps that make the package, and the package: a local file, or a pip requirement."""
    if spec is None:
        build = Step("setup", f"build the ls-jax wheel into {WHEEL_DIR}", build_wheel(WHEEL_DIR))
        return [build], WHEEL_DIR / wheel_name(checkout_version())
    if spec.endswith((".whl", ".tar.gz")) and not spec.startswith(("http://", "https://")):
        path = Path(spec).expanduser()
        if not dry_run and not path.is_file():
            raise FileNotFoundError(f"--package {spec}: no such file")
        return [], path.resolve()
    return [], spec


def plan(args: argparse.Namespace, command: Sequence[str], launch_id: str) -> list[Step]:
    """Every step of the launch, in order."""
    if not _WORKERS.fullmatch(args.workers):
        raise ValueError(f"--workers {args.workers!r}: expected all, an index, a list (1,3) or a range (0-3)")
    if not command and not args.setup_only:
        raise ValueError("no command to run: put it after --, e.g. -- python -m train.wmt --preset transformer-base")
    if command and args.setup_only:
        raise ValueError("--setup-only runs no command: leave out the command after --")
    if args.package and args.skip_setup:
        raise ValueError("--package is installed by the setup, which --skip-setup skips")
    target = Target(args.tpu, args.zone, args.project)
    steps: list[Step] = []
    if not args.skip_setup:
        build, package = _package(args.package, args.dry_run)
        steps += build + setup_steps(target, args.workers, package, args.python)
    if args.setup_only:
        return steps
    launch_dir = f"{REMOTE_WORK_DIR}/{launch_id}"
    logs_to = args.logs_to or Path("runs") / f"{args.tpu}-{launch_id}"
    steps.append(run_step(target, args.workers, launch_dir, command, args.python, parse_env(args.env)))
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
