"""Where a step's GPU time goes: GPU kernels of a ``jax.profiler`` trace, attributed to categories.

An XLA kernel is attributed to the HLO instruction that launched it (found by the kernel's name, which XLA
derives from the fusion's, else by the trace event's ``hlo_op``), whose ``op_name`` metadata (from the compiled HLO)
carries the JAX name scopes: Flax module names, the ls_jax op names that ``ls_jax.ops._common.dispatch`` adds,
and the ``criterion``/``optimizer`` scopes of the benchmarked step. An ls_jax CUDA kernel is attributed by its
function name (``ls::..._kernel``). The categories are GEMM, attention (fused attention kernels), LayerNorm,
softmax, dropout/elementwise, embedding, criterion, optimizer, copies/transposes, other, and idle (the step's wall
time on the device not covered by any kernel).

The same kernels are also attributed to the stages of a training step (`stage`), from the name scopes of their
``op_name``: ``encoder`` / ``decoder`` scopes (and the embeddings they own), ``output_projection`` and
``criterion``, ``optimizer``; the backward pass is what JAX names ``transpose(jvp(...))``.
"""

from __future__ import annotations

import gzip
import json
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

import jax

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
STAGES = (
    "encoder forward",
    "decoder forward",
    "output projection + loss",
    "decoder backward",
    "encoder backward",
    "optimizer",
    "unattributed",
)
_STAGE_SCOPES = {"encoder": "encoder", "source_embedding": "encoder", "decoder": "decoder",
                 "target_embedding": "decoder"}
_TRANSFORM_WRAPPER = re.compile(r"^(?:\w+\()+|\)+$")  # "transpose(jvp(criterion))" -> "criterion"
_GEMM_KERNEL = re.compile(r"gemm|cublas|cutlass|nvjet|xmma|gmma|matmul", re.IGNORECASE)
_ATTENTION_KERNEL = re.compile(r"fmha|flash|fprop_attn|bprop_attn", re.IGNORECASE)
_SCOPE_RULES = (
    ("criterion", re.compile(r"criterion|cross_entropy")),
    ("optimizer", re.compile(r"optimizer")),
    ("LayerNorm", re.compile(r"LayerNorm|layer_norm")),
    ("softmax", re.compile(r"softmax|\battention\b")),  # ops.attn_softmax; the XLA path of the fused attention
    ("embedding", re.compile(r"Embed|embed|gather|scatter")),
    ("dropout/elementwise", re.compile(r"Dropout|dropout|random_bits|threefry|philox")),
)
_COPY = re.compile(r"copy|transpose", re.IGNORECASE)
# The anonymous namespace is "(anonymous namespace)" in a jax.profiler trace; some demanglers write "<unnamed>".
_LS_KERNEL = re.compile(r"\bls::(?:\(anonymous namespace\)::|<unnamed>::)?(\w+)_kernel\b")
# ls_jax's CUDA kernels (ffi_kernels/csrc) by the start of their function names.
_LS_KERNEL_PREFIXES = (
    ("attention", "attention"),
    ("layer_norm", "LayerNorm"),
    ("softmax", "softmax"),
    ("cross_entropy", "criterion"),
    ("embed", "embedding"),
    ("step", "optimizer"),
    ("norm_partials", "optimizer"),
    ("dropout", "dropout/elementwise"),
    ("bias", "dropout/elementwise"),
)


def _kernel_style(name: str) -> str:
    """An HLO instruction name as XLA names the GPU kernel it emits (``.`` and ``-`` become ``_``)."""
    return re.sub(r"[.\-]", "_", name)


def hlo_op_names(hlo_text: str) -> dict[str, str]:
    """Maps each HLO instruction name of a compiled module, as written and in kernel style, to its ``op_name``."""
    pattern = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?op_name=\"([^\"]*)\"", re.MULTILINE)
    names = {}
    for name, op_name in pattern.findall(hlo_text):
        names[name] = names[_kernel_style(name)] = op_name
    return names


def categorize(kernel: str, op_name: str) -> str:
    """The category of one GPU kernel, from its name and the op_name of the HLO instruction behind it."""
    ls_kernel = _LS_KERNEL.search(kernel)
    if ls_kernel:
        function = ls_kernel.group(1)
        return next((category for prefix, category in _LS_KERNEL_PREFIXES if function.startswith(prefix)), "other")
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


def stage(op_name: str) -> str:
    """The training-step stage of an HLO instruction from its ``op_name`` scopes: ``optimizer`` first, then
    ``criterion`` / ``output_projection``, then the outermost of ``encoder`` / ``decoder`` (forward, or backward
    under a ``transpose(...)`` scope); "unattributed" where none applies (e.g. an FFI kernel without an HLO op)."""
    scopes = op_name.split("/")
    segments = [_TRANSFORM_WRAPPER.sub("", scope) for scope in scopes]
    if "optimizer" in segments:
        return "optimizer"
    if "criterion" in segments or "output_projection" in segments:
        return "output projection + loss"
    part = next((_STAGE_SCOPES[segment] for segment in segments if segment in _STAGE_SCOPES), None)
    if part is None:
        return "unattributed"
    backward = any(scope.startswith("transpose(") for scope in scopes)
    return f"{part} {'backward' if backward else 'forward'}"


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


def event_op_name(event: dict[str, Any], op_names: dict[str, str]) -> str:
    """The ``op_name`` of the HLO instruction behind a kernel event ("" where unknown, e.g. a custom call's kernel).

    The kernel's own name comes first: inside a CUDA graph the event's ``hlo_op`` is the command buffer that
    launched the graph, not the fusion that the kernel computes."""
    by_kernel_name = op_names.get(event["name"])
    if by_kernel_name is not None:
        return by_kernel_name
    return op_names.get(str(event.get("args", {}).get("hlo_op", "")), "")


def breakdown(kernels: list[dict[str, Any]], op_names: dict[str, str], steps: int) -> dict[str, float]:
    """Milliseconds per step in each category (trace timestamps are microseconds)."""
    per_category = dict.fromkeys(CATEGORIES, 0.0)
    for event in kernels:
        per_category[categorize(event["name"], event_op_name(event, op_names))] += event["dur"]
    intervals = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    if intervals:
        window = max(stop for _, stop in intervals) - min(start for start, _ in intervals)
        per_category["idle"] = window - _union_length(intervals)
    return {category: microseconds / 1e3 / steps for category, microseconds in per_category.items()}


def stage_breakdown(kernels: list[dict[str, Any]], op_names: dict[str, str], steps: int) -> dict[str, float]:
    """Milliseconds of kernel time per step in each of `STAGES`."""
    per_stage = dict.fromkeys(STAGES, 0.0)
    for event in kernels:
        per_stage[stage(event_op_name(event, op_names))] += event["dur"]
    return {name: microseconds / 1e3 / steps for name, microseconds in per_stage.items()}


def trace_gpu_kernels(fn: Callable[[], Any], calls: int, log_dir: Path | None = None) -> list[dict[str, Any]]:
    """GPU kernel events of ``calls`` back-to-back calls of ``fn`` (warmed up beforehand by the caller); the
    trace stays in ``log_dir`` if given."""
    if log_dir is None:
        with tempfile.TemporaryDirectory() as temporary:
            return trace_gpu_kernels(fn, calls, Path(temporary))
    with jax.profiler.trace(str(log_dir), create_perfetto_trace=True):
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
    return gpu_kernel_events(_trace_events(log_dir))


def kernel_time_by_name(kernels: list[dict[str, Any]], calls: int) -> dict[str, float]:
    """Milliseconds per call spent in each kernel name, largest first."""
    totals: dict[str, float] = {}
    for event in kernels:
        totals[event["name"]] = totals.get(event["name"], 0.0) + event["dur"] / 1e3 / calls
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


HLO_FILENAME = "step.hlo.txt"


def step_breakdown(train_step: Any, batch: Any, steps: int, trace_dir: Path | None = None) -> dict[str, Any]:
    """Category breakdown of ``steps`` traced calls of a `transformer_steps.TrainStep` (already warmed up).

    With ``trace_dir``, the trace and the compiled HLO stay there (for Perfetto, or `reanalyze`)."""
    hlo = train_step.compiled.as_text()
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        (trace_dir / HLO_FILENAME).write_text(hlo)
    kernels = trace_gpu_kernels(lambda: train_step.run(batch), steps, trace_dir)
    return summarize(kernels, hlo_op_names(hlo), steps)


def reanalyze(result_path: Path, trace_root: Path) -> dict[str, Any]:
    """Recomputes the breakdowns of a profile result file from the traces its run kept under ``trace_root``
    (``--trace-dir``: one directory per implementation), keeping the file's environment; returns the new file."""
    result = json.loads(result_path.read_text())
    for implementation in result["results"]:
        directory = trace_root / implementation
        kernels = gpu_kernel_events(_trace_events(directory))
        op_names = hlo_op_names((directory / HLO_FILENAME).read_text())
        result["results"][implementation] = summarize(kernels, op_names, result["steps"])
    return result


def summarize(kernels: list[dict[str, Any]], op_names: dict[str, str], steps: int) -> dict[str, Any]:
    """The breakdown of ``steps`` traced steps, the kernel count and the largest kernels with their categories."""
    ms = breakdown(kernels, op_names, steps)
    op_name_of = {event["name"]: event_op_name(event, op_names) for event in kernels}
    top = [
        {"kernel": name, "ms_per_step": time, "category": categorize(name, op_name_of[name]),
         "op_name": op_name_of[name]}
        for name, time in list(kernel_time_by_name(kernels, steps).items())[:40]
    ]
    return {"ms_per_step": ms, "total_ms_per_step": sum(ms.values()), "kernels_per_step": len(kernels) / steps,
            "stage_ms_per_step": stage_breakdown(kernels, op_names, steps), "top_kernels": top}
