"""Where one training step's GPU time goes, by category, for the plain Flax reference and for ls_jax.

``python -m train.bench profile [--model big-6e6d] [--tokens 8192] [--profile-steps 5]``

Each implementation of ``train.benchmarks.e2e`` is measured as ``e2e`` measures it (its step time is added to
docs/results/e2e-<device>.json) and then traced with ``jax.profiler`` for a few more steps.
Every GPU kernel in the trace is attributed to the HLO instruction that launched it, whose ``op_name`` metadata
(from the compiled HLO) carries the JAX name scopes: Flax module names, the ls_jax op names that
``ls_jax.ops._common.dispatch`` adds, and the ``criterion``/``optimizer`` scopes of the benchmark's step. The
categories are GEMM, attention (fused attention kernels), LayerNorm, softmax, dropout/elementwise, embedding,
criterion, optimizer, copies/transposes, other, and idle (the step's wall time on the device not covered by
any kernel). Writes docs/results/profile-<device>.json and prints the two breakdowns side by side.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

import jax

from train.benchmarks import common
from train.benchmarks import e2e

CATEGORIES = (
    "GEMM",
    "attention",
    "LayerNorm",
    "softmax",
    "dropout/elementwise",
    "embedding",
    "criterion",
    "optimizer",
    "copies/transposes",
    "other",
    "idle",
)
_GEMM_KERNEL = re.compile(r"gemm|cublas|cutlass|nvjet|xmma|gmma|matmul", re.IGNORECASE)
_ATTENTION_KERNEL = re.compile(r"fmha|flash|fprop_attn|bprop_attn", re.IGNORECASE)
_SCOPE_RULES = (
    ("criterion", re.compile(r"criterion|cross_entropy")),
    ("optimizer", re.compile(r"optimizer")),
    ("LayerNorm", re.compile(r"LayerNorm|layer_norm")),
    ("softmax", re.compile(r"softmax")),
    ("embedding", re.compile(r"Embed|embed|gather|scatter")),
    ("dropout/elementwise", re.compile(r"Dropout|dropout|random_bits|threefry|philox")),
)
_COPY = re.compile(r"copy|transpose", re.IGNORECASE)


def hlo_op_names(hlo_text: str) -> dict[str, str]:
    """Maps each HLO instruction name of a compiled module to its ``op_name`` metadata."""
    pattern = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?op_name=\"([^\"]*)\"", re.MULTILINE)
    return {name: op_name for name, op_name in pattern.findall(hlo_text)}


def categorize(kernel: str, op_name: str) -> str:
    """The category of one GPU kernel, from its name and the op_name of the HLO instruction behind it."""
    if _ATTENTION_KERNEL.search(kernel):
        return "attention"
    if _GEMM_KERNEL.search(kernel):
        return "GEMM"
    for category, pattern in _SCOPE_RULES:
        if pattern.search(op_name):
            return category
    if _COPY.search(kernel) or _COPY.search(op_name.rsplit("/", 1)[-1]):
        return "copies/transposes"
    return "other"


def _trace_events(log_dir: Path) -> list[dict[str, Any]]:
    files = sorted(log_dir.rglob("*.trace.json.gz")) or sorted(log_dir.rglob("perfetto_trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"jax.profiler wrote no trace JSON under {log_dir}")
    with gzip.open(files[-1], "rt") as handle:
        return json.load(handle)["traceEvents"]


def gpu_kernel_events(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Complete ('X') events on GPU device processes (not the host threads)."""
    events = list(events)
    gpu_pids = {
        e["pid"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name" and "GPU" in str(e.get("args", {}).get("name", ""))
    }
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e]


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def breakdown(kernels: list[dict[str, Any]], op_names: dict[str, str], steps: int) -> dict[str, float]:
    """Milliseconds per step in each category (trace timestamps are microseconds)."""
    per_category = dict.fromkeys(CATEGORIES, 0.0)
    for event in kernels:
        args = event.get("args", {})
        hlo_op = str(args.get("hlo_op", ""))
        per_category[categorize(event["name"], op_names.get(hlo_op, ""))] += event["dur"]
    intervals = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    if intervals:
        window = max(stop for _, stop in intervals) - min(start for start, _ in intervals)
        per_category["idle"] = window - _union_length(intervals)
    return {category: microseconds / 1e3 / steps for category, microseconds in per_category.items()}


def trace_gpu_kernels(fn: Callable[[], Any], calls: int) -> list[dict[str, Any]]:
    """GPU kernel events of ``calls`` back-to-back calls of ``fn`` (warmed up beforehand by the caller)."""
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            for _ in range(calls):
                out = fn()
            jax.block_until_ready(out)
        return gpu_kernel_events(_trace_events(Path(log_dir)))


def kernel_time_by_name(kernels: list[dict[str, Any]], calls: int) -> dict[str, float]:
    """Milliseconds per call spent in each kernel name, largest first."""
    totals: dict[str, float] = {}
    for event in kernels:
        totals[event["name"]] = totals.get(event["name"], 0.0) + event["dur"] / 1e3 / calls
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def step_breakdown(train_step: Any, batch: Any, steps: int) -> dict[str, Any]:
    """Category breakdown of ``steps`` traced calls of an ``e2e.TrainStep`` (already warmed up)."""
    op_names = hlo_op_names(train_step.compiled.as_text())
    kernels = trace_gpu_kernels(lambda: train_step.run(batch), steps)
    ms = breakdown(kernels, op_names, steps)
    top = dict(list(kernel_time_by_name(kernels, steps).items())[:25])
    return {"ms_per_step": ms, "total_ms_per_step": sum(ms.values()), "kernels_per_step": len(kernels) / steps,
            "top_kernels_ms_per_step": top}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.bench profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="big-6e6d", choices=sorted(e2e.MODELS))
    parser.add_argument("--tokens", type=int, default=8192, help="target tokens per step")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (the e2e measurement)")
    parser.add_argument("--profile-steps", type=int, default=5, help="traced steps")
    parser.add_argument("--implementations", default="reference,ls_jax_xla,ls_jax_ffi")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args(argv)
    implementations = args.implementations.split(",")
    if jax.default_backend() != "gpu":
        parser.error("profiling attributes GPU kernels: it needs a GPU")
    measurements = e2e.ResultFile.open(args.out, e2e.header(), fresh=False)
    e2e.run([args.model], [args.tokens], implementations, args.steps, measurements, profile_steps=args.profile_steps)
    results = {impl: measurements.results[f"{args.model}/{args.tokens}/{impl}"] for impl in implementations}
    breakdowns = {impl: record["profile"] for impl, record in results.items() if "profile" in record}
    written = common.write_result(
        "profile",
        {"model": args.model, "target_tokens": args.tokens, "steps": args.profile_steps, "results": breakdowns},
        args.out,
    )
    shown = list(breakdowns)
    print(f"{'category':22s}" + "".join(f"{impl:>16s}" for impl in shown) + "   (ms per step)")
    for category in (*CATEGORIES, "total"):
        row = [
            breakdowns[impl]["total_ms_per_step"] if category == "total" else breakdowns[impl]["ms_per_step"][category]
            for impl in shown
        ]
        print(f"{category:22s}" + "".join(f"{value:16.2f}" for value in row))
    print(f"{'step time (timed)':22s}" + "".join(f"{results[impl]['step_time_s'] * 1e3:16.2f}" for impl in shown))
    print(f"wrote {written} and {measurements.path}")
    return 0
