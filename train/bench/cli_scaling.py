"""Weak scaling as a user runs it: ``python -m train.bench cli-scaling --task wmt -- TASK FLAGS``.

Runs the training command itself, ``python -m train.<task> TASK FLAGS``, once per (backend, device count N,
process layout) and reads each run's own summary, so the numbers are the ones a user's run reports: the same step,
batches, loop and host work. N GPUs are the first N of this host (``CUDA_VISIBLE_DEVICES``; on a CPU, N host
devices). Layouts: ``one`` (one process driving N devices) and, for the backends ``--processes`` names,
``per-device`` (N processes of one device each, joined by ``jax.distributed`` over localhost, ``--distributed``).

Per run: the steady state's median step time and rates, the whole run's rates, the host's time per step
(`train.harness.host_phases`) and, with ``--profile-steps``, where each device's time went in those steps
(`train.bench.timeline`: busy, NCCL, exposed NCCL, idle). Efficiency is the steady rate of the task's first count
(tokens, examples) at N over N times the one-device rate of the same backend: what a user gets out of N devices.
``speedup_vs_xla`` divides an ffi run's steady rate by the xla run's at the same N and layout. What makes those
ratios less than they seem is printed after the table and kept in the JSON (``caveats``): a short steady window, a
run that traced no step, batches that held different counts per device-step at different N.

The parent process never starts JAX on a device, so every child has its GPUs to itself; runs go one after another,
or with ``--concurrent`` side by side on disjoint GPUs (sharing the host's CPUs). Writes
``cli-scaling-<device>x<devices of this host>[-TAG].json``, again after every run, so a set cut short keeps what
finished; ``--keep-logs DIR`` keeps each run's run.jsonl, config.json, output, timeline and traces (``--pack``: one
tar.gz a run).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from train.bench import timeline
from train.bench.common import REPO_ROOT, SCRATCH_DIR
from train.records import runlog

TASKS = ("wmt", "imdb", "gpt")
LAYOUTS = ("one", "per-device")
MIN_STEADY_STEPS = 50  # below this a steady window's median and rate are noisy
MATCHED_BATCHES = 1.01  # device-step counts further apart than this make efficiencies compare different data
QUIET = ["--no-progress", "--no-tensorboard", "--eval-every", "0", "--checkpoint-every", "1000000000"]


def gpu_names() -> list[str]:
    """The names nvidia-smi gives this host's GPUs, [] without any (the parent must not start JAX on them)."""
    try:
        listed = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return []
    return [line.strip() for line in listed.stdout.splitlines() if line.strip()]


def device_env(devices: Sequence[int], cpu: bool) -> dict[str, str]:
    """The environment that shows a process ``devices`` of this host (GPU indices), or as many CPU devices."""
    if cpu:
        return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={len(devices)}"}
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in devices)}


def free_port() -> int:
    """A TCP port of localhost free now (for a ``jax.distributed`` coordinator)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_command(
    task: str,
    flags: Sequence[str],
    backend: str,
    steps: int,
    run_dir: Path,
    profile: str | None,
    batch_size: int | None = None,
    epochs: int | None = None,
) -> list:
    """The training command of one run: ``steps`` steps, or with ``epochs`` that many passes over the data (wmt);
    ``batch_size`` (examples or rows over all devices) is passed when given."""
    # One logged interval: with epochs the run's length is known only to the run.
    log_every = str(steps) if epochs is None else "1000000000"
    length = ["--steps", str(steps)] if epochs is None else ["--epochs", str(epochs)]
    return [
        sys.executable,
        "-m",
        f"train.{task}",
        *flags,
        *QUIET,
        *length,
        "--log-every",
        log_every,
        "--backend",
        backend,
        "--run-dir",
        str(run_dir),
        *(["--profile-steps", profile] if profile else []),
        *(["--batch-size", str(batch_size)] if batch_size else []),
    ]


@dataclasses.dataclass
class Job:
    """One run: its configuration, command and, once started, its processes and GPUs."""

    name: str
    backend: str
    devices: int
    layout: str
    command: list[str]
    run_dir: Path
    log: Path
    processes: list[subprocess.Popen] = dataclasses.field(default_factory=list)
    gpus: list[int] = dataclasses.field(default_factory=list)
    started: float = 0.0
    error: str | None = None

    def start(self, gpus: list[int], cpu: bool) -> None:
        """Starts the run on ``gpus`` (``devices`` of them) in its layout; its output goes to ``log``."""
        self.gpus, self.started = gpus, time.monotonic()
        out = self.log.open("w")
        if self.layout == "one":
            self.processes = [_popen(self.command, device_env(gpus, cpu), out)]
        else:
            port = free_port()
            self.processes = [
                _popen(
                    [*self.command, "--distributed"],
                    {
                        **device_env([gpu], cpu),
                        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                        "JAX_NUM_PROCESSES": str(len(gpus)),
                        "JAX_PROCESS_ID": str(rank),
                    },
                    out,
                )
                for rank, gpu in enumerate(gpus)
            ]
        out.close()

    def done(self, timeout: int) -> bool:
        """Whether every process has ended; kills them past ``timeout`` seconds. A failed run keeps its ``error``
        (the exit codes and its output's last line)."""
        if time.monotonic() - self.started > timeout:
            for process in self.processes:
                process.kill()
        codes = [process.poll() for process in self.processes]
        if None in codes:
            return False
        if any(codes):
            lines = self.log.read_text(errors="replace").strip().splitlines() or [""]
            self.error = f"exit codes {codes}: {lines[-1]}"
            print(f"{self.name} failed, {self.error}", flush=True)
        return True


def run_jobs(
    jobs: list[Job], gpu_count: int, cpu: bool, concurrent: bool, timeout: int, finished: Callable[[Job], None]
) -> None:
    """Runs every job, calling ``finished`` with each as it ends; with ``concurrent``, jobs whose GPUs are free
    start beside the running ones (each job on GPUs of its own), else one after another."""
    free, pending, running = list(range(gpu_count)), list(jobs), []
    while pending or running:
        for job in list(pending):
            if job.devices <= len(free) and (concurrent or not running):
                job.start(free[: job.devices], cpu)
                del free[: job.devices]
                pending.remove(job)
                running.append(job)
                print(f"{job.name} on devices {job.gpus}: {' '.join(job.command[1:])}", flush=True)
            if not concurrent and running:
                break
        time.sleep(0.5)
        for job in [job for job in running if job.done(timeout)]:
            running.remove(job)
            free = sorted(free + job.gpus)
            finished(job)


def _popen(command: list[str], env: dict[str, str], out: Any) -> subprocess.Popen:
    return subprocess.Popen(
        command, cwd=REPO_ROOT, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, text=True
    )


def run_row(run_dir: Path, counted: str) -> dict[str, Any]:
    """What a finished run's log says: its steady and whole-run figures and the host's time per step."""
    records = runlog.read(run_dir / runlog.LOG_FILENAME)
    run = next(r for r in records if r["type"] == "run")
    summary = next(r for r in reversed(records) if r["type"] == "summary")
    steady = summary["steady"]
    rate = steady.get(f"{counted}_per_s")
    return {
        "device_kind": run["device_kind"],
        "device_count": run["device_count"],
        "backend": run["backend"],
        "steady_steps": steady["steps"],
        "steady_step_ms": None if steady["step_time_s"] is None else 1e3 * steady["step_time_s"],
        "steady_mean_step_ms": 1e3 * steady["time_s"] / steady["steps"] if steady["steps"] else None,
        "steady_rate": rate,
        # what one device's batch held per step: a rate's part that is not the step's speed
        "steady_count_per_device_step": rate * steady["time_s"] / steady["steps"] / run["device_count"]
        if rate and steady["steps"]
        else None,
        "steady_mfu": steady["mfu"],
        "whole_rate": summary.get(f"{counted}_per_s"),
        "compilation_s": summary["compilation"]["time_s"],
        "wall_s": summary["wall_time_s"],
        "host_phases": summary.get("host_phases"),
        "final_loss": summary["final_loss"],
    }


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``efficiency`` (steady rate at N / (N x at one device), same backend; the one-process one-device run is the
    base of both layouts; None without one) and ``speedup_vs_xla`` (an ffi row's steady rate / the xla row's, same
    N and layout)."""
    one = {r["backend"]: r["steady_rate"] for r in rows if r["devices"] == 1 and r["layout"] == "one"}
    xla = {(r["devices"], r["layout"]): r["steady_rate"] for r in rows if r["backend"] == "xla"}
    for r in rows:
        base = one.get(r["backend"])
        r["efficiency"] = r["steady_rate"] / (r["devices"] * base) if base and r["steady_rate"] else None
        other = xla.get((r["devices"], r["layout"]))
        r["speedup_vs_xla"] = r["steady_rate"] / other if r["backend"] != "xla" and other and r["steady_rate"] else None


def caveats(rows: list[dict[str, Any]], counted: str, profiled: bool) -> list[str]:
    """What makes the rows' ratios less than they seem, one line each: a steady window of fewer than
    `MIN_STEADY_STEPS` steps (its median and rate are noisy), a run that traced no step though ``profiled``
    (--profile-steps beyond its length), and batches that held different counts per device-step at different N
    (part of an efficiency is then which examples a run saw, not its speed)."""
    notes = []
    finished = [r for r in rows if r.get("error") is None and r.get("steady_rate")]
    for r in finished:
        name = f"{r['backend']} at {r['devices']} ({r['layout']})"
        if r["steady_steps"] < MIN_STEADY_STEPS:
            notes.append(f"{name}: its steady window holds {r['steady_steps']} steps; its rates are noisy (more steps)")
        if profiled and r.get("timeline") is None:
            notes.append(f"{name}: traced no whole step (--profile-steps past its end, or a step too few)")
    held = [r["steady_count_per_device_step"] for r in finished if r.get("steady_count_per_device_step")]
    if held and max(held) > MATCHED_BATCHES * min(held):
        notes.append(
            f"the runs' batches held {min(held):,.0f} to {max(held):,.0f} {counted} per device-step "
            f"({max(held) / min(held) - 1:.1%} apart): their efficiencies include which examples each saw; for wmt, "
            "--epochs trains every run on the same pairs"
        )
    return notes


def report(rows: list[dict[str, Any]], counted: str) -> str:
    lines = [
        f"{'backend':8}{'N':>3} {'layout':11}{'step ms':>9}{counted + '/s':>16}{'/device-step':>13}{'eff':>7}"
        f"{'vs xla':>8}  host ms/step "
        "(own, waited)  device ms/step (busy, nccl exposed, idle)"
    ]
    for r in rows:
        host = r["host_phases"]
        own = sum(v for k, v in host.items() if k.endswith("_ms") and k != "wait_ms") if host else None
        devices = list((r.get("timeline") or {}).values())
        device = (
            f"{sum(d['busy_ms'] for d in devices) / len(devices):.2f}, "
            f"{sum(d['exposed_nccl_ms'] for d in devices) / len(devices):.2f}, "
            f"{sum(d['idle_ms'] for d in devices) / len(devices):.2f}"
            if devices
            else "-"
        )

        def fmt(value: float | None, spec: str) -> str:
            width = re.match(r"\d*", spec).group()
            return "-".rjust(int(width or 0)) if value is None else format(value, spec)

        lines.append(
            f"{r['backend']:8}{r['devices']:>3} {r['layout']:11}{fmt(r['steady_step_ms'], '9.2f')}"
            f"{fmt(r['steady_rate'], '16,.0f')}{fmt(r.get('steady_count_per_device_step'), '13,.0f')}"
            f"{fmt(r['efficiency'], '7.3f')}{fmt(r['speedup_vs_xla'], '8.3f')}  "
            f"{fmt(own, '.2f')}, {fmt(host and host['wait_ms'], '.2f')}  {device}"
        )
    return "\n".join(lines)


def device_timelines(run_dir: Path, steps: int, step_kernel: str) -> dict[str, Any] | None:
    """Per device (every process's trace), `timeline.device_timeline` of the run's --profile-steps trace (whole
    steps between runs of ``step_kernel`` where the trace has them)."""
    profile = run_dir / "profile"
    if not profile.is_dir():
        return None
    devices = {}
    for path in timeline.trace_files(profile):
        process = path.relative_to(profile).parts[0]
        summary = timeline.summarize(timeline.read_events(path), steps, step_kernel=step_kernel)
        for name, numbers in summary["devices"].items():
            devices[f"{process} {name}"] = numbers
    return devices


def keep(job: Job, row: dict[str, Any], directory: Path, pack: bool) -> None:
    """Copies the run's run.jsonl, config.json and output into ``directory``, with its timeline and traces; with
    ``pack``, into ``directory``.tar.gz instead (one file a run)."""
    directory.mkdir(parents=True, exist_ok=True)
    for file in (runlog.LOG_FILENAME, "config.json"):
        if (job.run_dir / file).exists():
            shutil.copy(job.run_dir / file, directory / file)
    shutil.copy(job.log, directory / "output.txt")
    if row["timeline"] is not None:
        (directory / "timeline.json").write_text(json.dumps(row["timeline"], indent=1) + "\n")
        profile = job.run_dir / "profile"
        for trace in timeline.trace_files(profile):
            shutil.copy(trace, directory / f"{trace.relative_to(profile).parts[0]}.trace.json.gz")
    if pack:
        with tarfile.open(f"{directory}.tar.gz", "w:gz") as archive:
            archive.add(directory, arcname=directory.name)
        shutil.rmtree(directory)


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m train.bench cli-scaling",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s --task TASK [options] -- [TASK FLAGS]",
    )
    parser.add_argument("--task", choices=TASKS, required=True)
    parser.add_argument("--devices", default="1,2", help="comma-separated device counts (default 1,2)")
    parser.add_argument("--backends", default="ffi,xla", help="comma-separated of ffi, xla (default both)")
    parser.add_argument(
        "--processes", default="", help="backends (comma-separated) also run as N processes x 1 device at each N > 1"
    )
    parser.add_argument(
        "--batch-per-device",
        type=int,
        help="imdb, gpt: examples (rows) per device, passed as --batch-size N x this to a run on N devices, so every "
        "N trains the same batch per device (wmt's --max-tokens already counts per device)",
    )
    parser.add_argument("--steps", type=int, default=150, help="steps per run (default 150)")
    parser.add_argument(
        "--epochs",
        type=int,
        help="wmt: whole passes over the training pairs per run instead of --steps, so every device count trains on "
        "the same pairs (its length buckets in the same shares)",
    )
    parser.add_argument("--profile-steps", help="FIRST:LAST steps each run traces (default: none)")
    parser.add_argument(
        "--step-kernel",
        default="step_kernel",
        help="a kernel every step runs once, bounding the traced steps (default: the fused optimizer's)",
    )
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run")
    parser.add_argument("--cpu", action="store_true", help="CPU devices (a trial of the suite without GPUs)")
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="start a run while others go on when GPUs of its own are free (each run on its own GPUs, sharing the "
        "host's CPUs): fewer minutes for the whole set",
    )
    parser.add_argument("--keep-logs", type=Path, help="keep each run's run.jsonl, config.json and timeline here")
    parser.add_argument("--pack", action="store_true", help="with --keep-logs: one NAME.tar.gz per run")
    parser.add_argument("--tag", help="name the file cli-scaling-<device>x<N>-<TAG>.json")
    parser.add_argument("--out", type=Path, help="directory of the JSON (default docs/results on a GPU host)")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    return parser.parse_args(argv[:split]), argv[split + 1 :]


def counted_of(task: str) -> str:
    """The count the task's throughput is read in (its run log's first counted key)."""
    return {"wmt": "tokens", "imdb": "examples", "gpt": "tokens"}[task]


def main(argv: list[str] | None = None) -> int:
    args, flags = parse(argv)
    names = [] if args.cpu else gpu_names()
    counts = [int(n) for n in args.devices.split(",")]
    if not names and not args.cpu:
        raise SystemExit("no GPU found by nvidia-smi; pass --cpu to try the suite on CPU devices")
    available = max(counts) if args.cpu else len(names)
    if any(n < 1 or n > available for n in counts):
        raise SystemExit(f"--devices {args.devices}: counts from 1 to {available}")
    backends = args.backends.split(",")
    if set(backends) - {"ffi", "xla"}:
        raise SystemExit(f"--backends {args.backends}: choose from ffi, xla")
    steps = None
    if args.profile_steps:
        first, _, last = args.profile_steps.partition(":")
        steps = int(last or first) - int(first) + 1
    if args.epochs is not None and (args.task != "wmt" or args.epochs < 1):
        raise SystemExit("--epochs: a positive count, for wmt (imdb and gpt batches hold the same examples at any N)")
    if args.batch_per_device is not None and (args.task == "wmt" or args.batch_per_device < 1):
        raise SystemExit("--batch-per-device: a positive count, for imdb and gpt (wmt's --max-tokens is per device)")
    counted = counted_of(args.task)
    device = "cpu" if args.cpu else _slug(names[0])
    out = args.out or (SCRATCH_DIR if args.cpu else REPO_ROOT / "docs" / "results")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cli-scaling-{device}x{available}{'-' + args.tag if args.tag else ''}.json"
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()

    def finished(job: Job) -> None:
        """Reads a finished run and rewrites the JSON with it, so an interrupted set keeps what finished."""
        row = {"backend": job.backend, "devices": job.devices, "layout": job.layout, "gpus": job.gpus}
        if job.error is None:
            row.update(run_row(job.run_dir, counted), error=None)
            row["timeline"] = device_timelines(job.run_dir, steps, args.step_kernel) if steps else None
        else:
            row.update(dict.fromkeys(("steady_rate", "steady_step_ms", "host_phases", "timeline")), error=job.error)
        rows.append(row)
        if args.keep_logs is not None:
            keep(job, row, args.keep_logs / job.name, pack=args.pack)
        add_ratios(rows)
        payload = {
            "suite": "cli-scaling",
            "task": args.task,
            "flags": flags,
            "steps": args.steps if args.epochs is None else None,
            "epochs": args.epochs,
            "profile_steps": args.profile_steps,
            "counted": counted,
            "concurrent": args.concurrent and not args.cpu,
            "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": runlog.git_commit(),
            "wall_s": time.perf_counter() - started,
            "rows": rows,
            "caveats": caveats(rows, counted, steps is not None),
        }
        path.write_text(json.dumps(payload, indent=1) + "\n")
        print(report([row], counted).splitlines()[1], flush=True)

    with tempfile.TemporaryDirectory() as scratch:
        jobs = []
        for backend in backends:
            for n in counts:
                for layout in LAYOUTS if backend in args.processes.split(",") and n > 1 else LAYOUTS[:1]:
                    name = f"{args.task}-{backend}-{n}-{layout}"
                    run_dir = Path(scratch) / name
                    batch = args.batch_per_device and args.batch_per_device * n
                    command = run_command(
                        args.task, flags, backend, args.steps, run_dir, args.profile_steps, batch, args.epochs
                    )
                    jobs.append(Job(name, backend, n, layout, command, run_dir, Path(scratch) / f"{name}.out"))
        run_jobs(jobs, available, args.cpu, args.concurrent and not args.cpu, args.timeout, finished)
    print(report(rows, counted), flush=True)
    for note in caveats(rows, counted, steps is not None):
        print(f"note: {note}")
    print(f"wrote {path}")
    return 1 if any(row["error"] for row in rows) else 0


def _slug(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind in ("h200", "h100", "a100", "l4") if kind in lowered), "gpu")
