"""What every benchmark shares: the environment record, careful timing, the copy-bandwidth ceiling and output.

Timing follows one rule: warm up (compilation and autotuning stay out), then take the median of many samples,
each sample timing ``inner`` back-to-back calls closed by one ``block_until_ready`` so that host dispatch
overlaps device work as it does in a training loop.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

from train.records import runlog

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "docs" / "results"
SCRATCH_DIR = REPO_ROOT / "runs" / "bench"


def add_out_argument(parser: argparse.ArgumentParser, suite: str) -> None:
    """``--out DIR``; unset, `out_dir` picks docs/results on a GPU and runs/bench elsewhere."""
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"directory for {suite}-<device>.json (default: docs/results when JAX sees a GPU, "
        "runs/bench otherwise, so CPU trials leave the published results alone)",
    )


def out_dir(given: Path | None, parser: argparse.ArgumentParser) -> Path:
    """``given``, else docs/results when JAX's default backend is a GPU, else runs/bench; made before anything is
    measured, so a ``--out`` that cannot hold the results is refused by ``parser`` at once, not after the suite."""
    directory = given if given is not None else RESULTS_DIR if jax.default_backend() == "gpu" else SCRATCH_DIR
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        parser.error(f"--out {directory}: a file is in the way; name a folder for the results")
    except OSError as err:
        parser.error(f"--out {directory}: cannot make the folder ({err.strerror or err})")
    return directory


def git_state() -> dict[str, Any]:
    """The commit the code came from and whether tracked files differ from it (`train.records.runlog`)."""
    return {"commit": runlog.git_commit(), "dirty": runlog.git_dirty()}


def environment() -> dict[str, Any]:
    """Device, software versions, commit and time: the header of every result file."""
    devices = jax.devices()
    return {
        "date": runlog.utc_now(),
        "host": socket.gethostname(),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "versions": runlog.versions(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "git": git_state(),
    }


def device_slug(device_kind: str | None = None) -> str:
    """A file-name-safe short name of the device, e.g. 'h100' for 'NVIDIA H100 80GB HBM3'."""
    kind = (device_kind or jax.devices()[0].device_kind).lower()
    for known in ("h200", "h100", "a100", "a10", "v100", "t4", "l4"):
        if known in kind:
            return known
    return re.sub(r"[^a-z0-9]+", "-", kind).strip("-") or "device"


def time_call(
    fn: Callable[[], Any],
    *,
    warmup: int = 5,
    samples: int = 30,
    inner: int = 5,
    wait: Callable[[Any], Any] = jax.block_until_ready,
) -> dict[str, float]:
    """Median, 10th and 90th percentile seconds per call of ``fn`` (no arguments); ``wait(out)`` returns once the
    device has computed ``fn``'s result ``out`` (JAX's ``block_until_ready`` for JAX arrays)."""
    for _ in range(warmup):
        wait(fn())
    per_call = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(inner):
            out = fn()
        wait(out)
        per_call.append((time.perf_counter() - start) / inner)
    per_call.sort()
    return {
        "median_s": statistics.median(per_call),
        "p10_s": per_call[len(per_call) // 10],
        "p90_s": per_call[(9 * len(per_call)) // 10],
        "samples": samples,
        "calls_per_sample": inner,
    }


def forward_backward(op: Callable[..., Any], primals: tuple[Any, ...]) -> tuple[Callable[..., Any], Any]:
    """``(fn, cotangent)``: ``fn(primals, cotangent)`` runs one forward and one backward pass of ``op``, jitted
    (trace it inside ``backend.use``), against a fixed all-ones cotangent."""

    def run(primals, cotangent):
        outputs, vjp = jax.vjp(op, *primals)
        return outputs, vjp(cotangent)

    outputs = jax.eval_shape(op, *primals)
    return jax.jit(run), jax.tree.map(lambda o: jnp.ones(o.shape, o.dtype), outputs)


def copy_bandwidth(num_bytes: int = 1 << 30) -> float:
    """Measured device memory bandwidth in bytes/s, counting bytes read plus bytes written.

    An elementwise negation of a float32 buffer reads and writes every byte once, like a copy, but cannot be
    elided by XLA. It runs in place (its input donated), as an optimizer step updates its buffers: a CPU that
    allocates a fresh output every call pays page faults a copy does not. Measure it at the size of the work it
    is set against, so both run from the same level of the memory hierarchy (a small buffer stays in a CPU's
    cache).
    """
    carry = {"x": jnp.ones((num_bytes // 4,), jnp.float32)}
    negate = jax.jit(lambda a: -a, donate_argnums=0)

    def call():
        carry["x"] = negate(carry["x"])
        return carry["x"]

    timing = time_call(call, warmup=3, samples=20, inner=3)
    return 2 * num_bytes / timing["median_s"]


def write_result(suite: str, payload: dict[str, Any], out_dir: Path = RESULTS_DIR, stem: str | None = None) -> Path:
    """Writes ``{"suite", "environment", **payload}`` to ``out_dir/<stem>-<device>.json`` (``stem`` defaults to
    the suite's name) and returns the path."""
    env = environment()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem or suite}-{device_slug(env['device_kind'])}.json"
    path.write_text(json.dumps({"suite": suite, "environment": env, **payload}, indent=2) + "\n")
    return path
