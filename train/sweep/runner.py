"""Run a grid of training runs, each in its own run directory, then compare them all.

    python -m train.sweep [SPEC.toml] [--out DIR] [--device NAME] [--score-window whole|steady] [--dry-run]

SPEC (`train.sweep.spec`; default: the embedded train/sweep/specs/cpu-default.toml) lists grids over task, device,
preset, optimizer, precision, backend, batch, length, steps and seeds. Each run goes to OUT/<run name> (``{device}``
in OUT stands for this machine's device, e.g. h100-sxm), marked with
the sweep's name (sweep.json). Running the sweep again skips the finished runs, resumes an interrupted one from
its latest checkpoint (``train.<task> --resume``) and starts again one that stopped before its first checkpoint
(the harness starts such a run again from step 0 in its own directory, under the directory's lock).
A run whose device axis names another device is not run here: its command is printed, and its run directory,
copied back into OUT, joins the comparison. The sweep ends with ``train.compare`` over every finished run of each
task (OUT/report, or OUT/report-<task>): the whole run and the steady state side by side, the score under the
study's seven strategies (whole run by default, as the study scored; ``--score-window steady`` scores the steady
state, and picks a ``from_best`` grid's best by it too) and one recommendation per strategy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from train.compare import quality, scoring
from train.compare import report as compare
from train.compare import runs as run_logs
from train.errors import EXIT_SIGNAL_BASE, EXIT_USAGE, ArgumentParser, Interrupted, UsageError
from train.records import runlog
from train.records.checkpoints import CHECKPOINT_DIR, complete_steps
from train.sweep.spec import Point, Spec, parse, points

DEFAULT_SPEC = Path(__file__).resolve().parent / "specs" / "cpu-default.toml"
MARKER = "sweep.json"
EXIT_RUN_FAILED = 1
Runner = Callable[[list[str]], int]  # runs a `python -m train.<task> ...` command line; returns its exit code


def training_command(point: Point, run_dir: Path, spec: Spec) -> list[str]:
    return ["python", "-m", f"train.{point.task}", "--run-dir", str(run_dir), "--no-progress", *point.flags(spec.flags)]


def resume_command(point: Point, run_dir: Path) -> list[str]:
    """Continue ``run_dir`` from its latest checkpoint; --steps again in case the spec asks for more now."""
    steps = point.values.get("steps")
    return [
        "python",
        "-m",
        f"train.{point.task}",
        "--resume",
        str(run_dir),
        "--no-progress",
        *(["--steps", str(steps)] if steps else []),
    ]


def remote_command(point: Point, run_dir: Path, spec: Spec) -> str:
    """The command to run ``point`` on its device: through tpu.launch on a TPU VM, else as is."""
    command = training_command(point, Path(run_dir.name), spec)
    if point.device and point.device.upper().startswith("TPU"):
        return shlex.join(
            [
                "python",
                "-m",
                "tpu.launch",
                "--tpu",
                "TPU_NAME",
                "--zone",
                "ZONE",
                "--logs-to",
                str(run_dir),
                "--",
                *command,
            ]
        )
    return f"{shlex.join(command)}   # then copy {run_dir.name}/ into {run_dir.parent}/"


def _summary(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / runlog.LOG_FILENAME
    if not path.exists():
        return None
    records, _ = runlog.read_numbered(path)
    schema = records[0][1].get("schema", runlog.SCHEMA_VERSION) if records else runlog.SCHEMA_VERSION
    summaries = [runlog.upgrade(record, schema) for _, record in records if record["type"] == "summary"]
    return summaries[-1] if summaries else None


def _has_checkpoint(run_dir: Path) -> bool:
    directory = run_dir / CHECKPOINT_DIR
    return directory.is_dir() and any(entry.name.isdigit() for entry in directory.iterdir())


def run_state(run_dir: Path, spec: Spec, point: Point) -> str:
    """``new``, ``done``, ``interrupted`` (has a checkpoint to resume from) or ``restart`` (stopped before one).

    Raises:
      UsageError: the directory holds something that is not this sweep's run of ``point``.
    """
    if not run_dir.exists() or not any(run_dir.iterdir()):
        return "new"
    marker = run_dir / MARKER
    if not marker.is_file():
        raise UsageError(
            f"{run_dir} exists and was not made by a sweep (no {MARKER}); move it away or choose "
            "another out in the spec"
        )
    owner = json.loads(marker.read_text(encoding="utf-8"))
    if owner.get("sweep") != spec.name:
        raise UsageError(
            f"{run_dir} belongs to sweep {owner.get('sweep')!r}, not {spec.name!r}; give this sweep "
            "another out, or another name"
        )
    summary = _summary(run_dir)
    steps = point.values.get("steps")
    if summary and summary["completed"] and (steps is None or summary["steps"] >= steps):
        return "done"
    if _has_checkpoint(run_dir):
        return "interrupted"
    return "restart" if (run_dir / runlog.LOG_FILENAME).exists() else "new"


def _mark(run_dir: Path, spec: Spec, point: Point) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / MARKER).write_text(
        json.dumps({"sweep": spec.name, "point": point.values}, indent=2) + "\n", encoding="utf-8"
    )


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def subprocess_runner(command: list[str]) -> int:
    """Runs a ``python -m ...`` command line with this interpreter, in its own process, and returns its exit code.
    A SIGINT or SIGTERM to the sweep meanwhile goes on to the run, which stops at its next step boundary and writes
    its checkpoint and summary; the sweep waits for that, so its run directory is complete when the sweep exits."""
    child = subprocess.Popen([sys.executable, *command[1:]])
    previous = {
        signum: signal.signal(signum, lambda signum, frame: child.send_signal(signum)) for signum in STOP_SIGNALS
    }
    try:
        return child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def detect_device() -> str:
    """This machine's device as a sweep names it: ``cpu``, or its entry in the device table (e.g. H100-SXM),
    else JAX's device_kind. Asked in a child process, so that this one holds no accelerator memory."""
    code = (
        "import jax; from train.costs import devices; d = jax.devices()[0]; s = devices.find_device(d.device_kind); "
        "print('cpu' if d.platform == 'cpu' else (s.name if s else d.device_kind))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    if result.returncode != 0:
        last_line = (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
        raise UsageError(f"could not detect this machine's device ({last_line}); pass --device NAME")
    return result.stdout.strip()


class Sweep:
    """Runs the points of a spec in order, printing one progress line per run."""

    def __init__(self, spec: Spec, *, device: Callable[[], str], runner: Runner, dry_run: bool = False):
        self.spec, self.runner, self.dry_run = spec, runner, dry_run
        self._device, self._device_name = device, None
        self.failed: list[str] = []
        self.elsewhere: list[str] = []

    def here(self, point: Point) -> bool:
        if point.device is None:
            return True
        if self._device_name is None:
            self._device_name = self._device()
        return point.device.lower() == self._device_name.lower()

    def run_all(self, todo: Sequence[Point], first: int, total: int) -> None:
        for number, point in enumerate(todo, first):
            self.run_one(point, f"[{number}/{total}] {point.name}")

    def run_one(self, point: Point, label: str) -> None:
        run_dir = self.spec.out / point.name
        if not self.here(point):
            self.elsewhere_run(point, run_dir, label)
            return
        state = run_state(run_dir, self.spec, point)
        if state == "done":
            print(f"{label}: finished earlier, skipped", flush=True)
            return
        command = (
            resume_command(point, run_dir) if state == "interrupted" else training_command(point, run_dir, self.spec)
        )
        if self.dry_run:
            print(f"{label}: would run {shlex.join(command)}", flush=True)
            return
        _mark(run_dir, self.spec, point)
        print(f"{label}: {'resuming' if state == 'interrupted' else 'running'}: {shlex.join(command)}", flush=True)
        started = time.monotonic()
        code = self.runner(command)
        if code - EXIT_SIGNAL_BASE in STOP_SIGNALS:
            saved = complete_steps(run_dir / CHECKPOINT_DIR)
            kept = f"its checkpoint {saved[-1]} kept in {run_dir}" if saved else "before its first checkpoint"
            print(f"{label}: stopped by a signal, {kept}", flush=True)
            raise Interrupted(code - EXIT_SIGNAL_BASE)
        outcome = "finished" if code == 0 else f"FAILED with exit code {code}"
        if code != 0:
            self.failed.append(_failure(point.name, run_dir, code))
        print(f"{label}: {outcome} in {time.monotonic() - started:.0f} s{_quality(run_dir)}", flush=True)

    def elsewhere_run(self, point: Point, run_dir: Path, label: str) -> None:
        """A run for another device: its log, once copied back, joins the sweep; until then, its command."""
        summary = _summary(run_dir)
        if summary and summary["completed"]:
            if not (run_dir / MARKER).exists():
                _mark(run_dir, self.spec, point)
            print(f"{label}: finished on {point.device}, copied back{_quality(run_dir)}", flush=True)
            return
        self.elsewhere.append(point.name)
        print(f"{label}: for {point.device}, run there: {remote_command(point, run_dir, self.spec)}", flush=True)


def _failure(name: str, run_dir: Path, code: int) -> str:
    """A failed run as the sweep's last line names it: where its log is, or that it has none."""
    log = run_dir / runlog.LOG_FILENAME
    return (
        f"{name} (exit code {code}, log {log})"
        if log.exists()
        else (f"{name} (exit code {code}, no run log: it stopped before training; its output is above)")
    )


def _quality(run_dir: Path) -> str:
    summary = _summary(run_dir) or {}
    found = [f"{key} {value:.4g}" for key, value in summary.get("metrics", {}).items()]
    return f", {', '.join(found)}" if found else ""


def best_point(
    spec: Spec, candidates: Sequence[Point], preset: str, window: str = scoring.DEFAULT_WINDOW
) -> dict[str, Any] | None:
    """The point of the best converged finished run among ``candidates`` under ``preset`` in ``window``, or None."""
    finished = {
        str((spec.out / p.name / runlog.LOG_FILENAME).resolve()): p for p in candidates if _summary(spec.out / p.name)
    }
    if not finished:
        return None
    runs, _ = run_logs.load_runs(list(finished))
    gate = quality.default_gate(runs[0].task, spec.quality_threshold)
    ranked = scoring.compare(runs, window=window, gate=gate).ranked_under(preset)
    return finished[str(runs[ranked[0]].source)].values if ranked else None


def _no_best(spec: Spec, candidates: Iterable[Point], preset: str) -> str:
    """Why a ``from_best`` grid has no best run to start from: none of the grids before it finished here yet, or
    none that finished converged (running again would not change that)."""
    finished = sum(1 for point in candidates if _summary(spec.out / point.name))
    if not finished:
        return (
            f"no run of the grids before it has finished here yet, so its best under {preset} is unknown; run the "
            "sweep again once they have"
        )
    return (
        f"none of the {finished} finished runs of the grids before it passed the quality gate, so none is best "
        f"under {preset} and this grid is skipped; the report says why each missed it"
    )


def report(spec: Spec, names: Sequence[str], window: str = scoring.DEFAULT_WINDOW) -> int:
    """`train.compare` over the finished runs ``names`` in OUT, scored in ``window``, one report per task; 0 when
    there was nothing to compare."""
    logs = [spec.out / name / runlog.LOG_FILENAME for name in names if _summary(spec.out / name)]
    if not logs:
        print("no finished run to compare yet", flush=True)
        return 0
    tasks = sorted({runlog.read(path)[0]["task"] for path in logs})
    code = 0
    for task in tasks:
        out = spec.out / ("report" if len(tasks) == 1 else f"report-{task}")
        print(f"\ncomparing the {task} runs into {out}", flush=True)
        code = max(
            code,
            compare.main(
                [
                    *map(str, logs),
                    "--task",
                    task,
                    "--weights",
                    spec.weights,
                    "--out",
                    str(out),
                    "--score-window",
                    window,
                    *([] if spec.quality_threshold is None else ["--quality-threshold", str(spec.quality_threshold)]),
                ]
            ),
        )
    return code


def with_device_in_out(spec: Spec, device: Callable[[], str]) -> Spec:
    """``{device}`` in the spec's out replaced by this machine's device, lower case (e.g. sweep-h100-sxm)."""
    if "{device}" not in str(spec.out):
        return spec
    return dataclasses.replace(spec, out=Path(str(spec.out).replace("{device}", device().lower())))


def run_sweep(
    spec: Spec,
    *,
    device: Callable[[], str],
    runner: Runner,
    dry_run: bool = False,
    window: str = scoring.DEFAULT_WINDOW,
) -> int:
    """Every grid in order (a ``from_best`` grid after the grids before it ran), then the report, scored in
    ``window``."""
    spec = with_device_in_out(spec, device)
    sweep = Sweep(spec, device=device, runner=runner, dry_run=dry_run)
    done: dict[str, Point] = {}
    best: list[dict[str, Any] | None] = []
    total = len(points(spec))
    for index, grid in enumerate(spec.grids):
        chosen = None
        if grid.from_best:
            chosen = best_point(spec, list(done.values()), grid.from_best, window)
            if chosen is None:
                print(f"grid #{index + 1}: {_no_best(spec, done.values(), grid.from_best)}", flush=True)
                best.append(None)
                continue
            chosen = {key: value for key, value in chosen.items() if key not in grid.axes}
            print(
                f"grid #{index + 1}: the best run under {grid.from_best} has "
                + ", ".join(f"{key} {value}" for key, value in chosen.items()),
                flush=True,
            )
        best.append(chosen)
        todo = [point for point in grid.points(chosen) if point.name not in done]
        total = max(total, len(done) + len(todo))
        sweep.run_all(todo, len(done) + 1, total)
        done.update((point.name, point) for point in todo)
    code = 0 if dry_run else report(spec, list(done), window)
    if sweep.elsewhere:
        print(
            f"\n{len(sweep.elsewhere)} runs are for other devices; copy their run directories into {spec.out} and "
            "run the sweep again to compare them with the rest",
            flush=True,
        )
    if sweep.failed:
        print(
            f"error: {len(sweep.failed)} runs failed: {'; '.join(sweep.failed)}; run the sweep again to retry them",
            file=sys.stderr,
        )
        return EXIT_RUN_FAILED
    return code


def load_spec(path: Path | None) -> Spec:
    path = path or DEFAULT_SPEC
    if not path.is_file():
        raise UsageError(f"{path}: no such sweep spec file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not a sweep spec: not UTF-8 text, so not TOML") from None
    return parse(text, path)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m train.sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("spec", nargs="?", type=Path, help=f"the sweep's TOML file (default {DEFAULT_SPEC.name})")
    parser.add_argument("--out", type=Path, help="the sweep's directory instead of the spec's out")
    parser.add_argument(
        "--device",
        help="this machine's device as the spec's device axis names it (default: "
        "detected: cpu, or the device table's name such as H100-SXM)",
    )
    compare.add_window_argument(parser)
    parser.add_argument("--dry-run", action="store_true", help="print what each run would do; run nothing")
    return parser


def main(argv: Sequence[str] | None = None, runner: Runner = subprocess_runner) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec = load_spec(args.spec)
        if args.out:
            spec = dataclasses.replace(spec, out=args.out)
        device = (lambda: args.device) if args.device else detect_device
        return run_sweep(spec, device=device, runner=runner, dry_run=args.dry_run, window=args.score_window)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except Interrupted as err:
        print("sweep stopped: run it again to resume the stopped run and go on with the rest", file=sys.stderr)
        return EXIT_SIGNAL_BASE + err.signum
