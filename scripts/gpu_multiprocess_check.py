"""N processes x 1 GPU train exactly as 1 process x N GPUs: `python scripts/gpu_multiprocess_check.py --gpus 0,1`.

Runs ``python -m train.<task>`` on the same global batch twice, dropout off and fp32: once as one process seeing
the N GPUs of ``--gpus``, once as N processes on localhost, each seeing one GPU (CUDA_VISIBLE_DEVICES) and joined by
``jax.distributed`` (``--distributed``, the coordinator variables). The per-interval training losses of the two
runs must agree to ``--rtol``. Writes ``multiprocess-<device>x<N>.json`` (both loss curves, device counts, the largest
relative difference, the verdict) to ``--out`` and exits 1 when they differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from train.bench.cli_scaling import device_env, free_port  # noqa: E402 - after the checkout is on sys.path

TASK_ARGS = {
    "imdb": ["--batch-size", "32", "--dropout", "0"],
    "wmt": ["--max-tokens", "2048", "--dropout", "0", "--warmup-steps", "2"],
}
COMMON = ["--precision", "fp32", "--eval-every", "1000", "--log-every", "1", "--no-progress", "--no-tensorboard"]


def _command(task: str, run_dir: Path, steps: int, backend: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        f"train.{task}",
        *TASK_ARGS[task],
        *COMMON,
        "--steps",
        str(steps),
        "--backend",
        backend,
        "--run-dir",
        str(run_dir),
        *extra,
    ]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "run.jsonl").read_text().splitlines() if line.strip()]


def _run_summary(run_dir: Path) -> dict:
    records = _records(run_dir)
    run = next(r for r in records if r["type"] == "run")
    return {"device_count": run["device_count"], "losses": [r["loss"] for r in records if r["type"] == "interval"]}


def one_process(task: str, run_dir: Path, steps: int, backend: str, gpus: str, timeout: int, cpu: bool) -> dict:
    env = {**os.environ, **device_env([int(gpu) for gpu in gpus.split(",")], cpu)}
    started = time.perf_counter()
    subprocess.run(_command(task, run_dir, steps, backend), cwd=ROOT, env=env, check=True, timeout=timeout)
    return {**_run_summary(run_dir), "wall_s": time.perf_counter() - started}


def process_per_gpu(
    task: str, run_dir: Path, steps: int, backend: str, gpus: list[str], timeout: int, cpu: bool
) -> dict:
    port, started = free_port(), time.perf_counter()
    processes = [
        subprocess.Popen(
            _command(task, run_dir, steps, backend, "--distributed"),
            cwd=ROOT,
            env={
                **os.environ,
                **device_env([int(gpu)], cpu),
                "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                "JAX_NUM_PROCESSES": str(len(gpus)),
                "JAX_PROCESS_ID": str(rank),
            },
        )
        for rank, gpu in enumerate(gpus)
    ]
    try:
        codes = [process.wait(timeout=timeout) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    if any(codes):
        raise SystemExit(f"the {len(gpus)}-process run failed with exit codes {codes}")
    return {**_run_summary(run_dir), "wall_s": time.perf_counter() - started}


def compare(reference: list[float], other: list[float], rtol: float) -> dict:
    """The largest relative difference of ``other`` from ``reference`` and whether it is within ``rtol``."""
    if len(reference) != len(other) or not reference:
        return {"max_relative_difference": None, "match": False, "why": f"{len(reference)} vs {len(other)} losses"}
    a, b = np.asarray(reference), np.asarray(other)
    worst = float(np.max(np.abs(b - a) / np.abs(a)))
    return {"max_relative_difference": worst, "match": worst <= rtol}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="imdb,wmt")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--backend", default="ffi", choices=("ffi", "xla"))
    parser.add_argument("--gpus", default="0,1", help="the GPUs (CUDA_VISIBLE_DEVICES indices)")
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("--timeout", type=int, default=400, help="seconds per run")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    parser.add_argument("--cpu", action="store_true", help="a trial of the script on CPU devices (xla backend)")
    args = parser.parse_args(argv)
    gpus = args.gpus.split(",")
    checks = []
    with tempfile.TemporaryDirectory() as scratch:
        for task in args.tasks.split(","):
            single = one_process(
                task, Path(scratch) / f"{task}-one", args.steps, args.backend, args.gpus, args.timeout, args.cpu
            )
            multi = process_per_gpu(
                task, Path(scratch) / f"{task}-per-gpu", args.steps, args.backend, gpus, args.timeout, args.cpu
            )
            verdict = compare(single["losses"], multi["losses"], args.rtol)
            checks.append({"task": task, "one_process_all_gpus": single, "one_process_per_gpu": multi, **verdict})
            print(
                f"{task}: max relative loss difference {verdict['max_relative_difference']}, "
                f"{'match' if verdict['match'] else 'MISMATCH'}",
                flush=True,
            )
    device = "cpu" if args.cpu else _device_kind()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"multiprocess-{device}x{len(gpus)}.json"
    path.write_text(
        json.dumps(
            {
                "backend": args.backend,
                "gpus": len(gpus),
                "precision": "fp32",
                "dropout": 0,
                "steps": args.steps,
                "rtol": args.rtol,
                "device": device,
                "checks": checks,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {path}")
    return 0 if all(check["match"] for check in checks) else 1


def _device_kind() -> str:
    """'h100', 'h200', ... from nvidia-smi (this process never starts JAX on the GPUs the runs use)."""
    try:
        name = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, check=True
            )
            .stdout.splitlines()[0]
            .lower()
        )
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "gpu"
    return next((kind for kind in ("h200", "h100", "a100") if kind in name), "gpu")


if __name__ == "__main__":
    raise SystemExit(main())
