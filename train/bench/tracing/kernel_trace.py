"""Where a step's GPU time goes: GPU kernels of a ``jax.profiler`` trace, attributed to categories.

An XLA kernel is attributed to the HLO instruction that launched it (found by the kernel's name, which XLA
derives from the fusion's, else by the trace event's ``hlo_op``), whose ``op_name`` metadata (from the compiled HLO)
carries the JAX name scopes: Flax module names, the ls_jax op names that ``ls_jax.ops._common.dispatch`` adds,
and the ``criterion``/``optimizer`` scopes of the benchmarked step. An ls_jax CUDA kernel is attributed by its
function name (``ls::..._kernel``). The categories are GEMM, attention (fused attention kernels), LayerNorm,
softmax, dropout/elementwise, embedding, criterion, optimizer, fp8 scaling (an FP8 product's quantization, amax
reductions and history updates), copies/transposes, other, and idle (the step's wall time on the device not covered
by any kernel).

Kernels are also attributed to the stages of a training step (`stage`), from the name scopes of their
``op_name``: ``encoder`` / ``decoder`` scopes (and the embeddings they own), ``output_projection`` and
``criterion``, ``optimizer``; the backward pass is what JAX names ``transpose(jvp(...))``. Inside a CUDA graph (an
XLA command buffer) a kernel's trace event names only the graph, and the kernels of cuBLAS GEMMs and FFI custom calls
have no name of their own to look up, so the stages come from a second trace of the same step compiled without
command buffers (`STAGE_COMPILER_OPTIONS`), where every kernel's event names the instruction that launched it.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

import jax

from train.bench import timeline

CATEGORIES = (
    "GEMM",
    "attention",
    "LayerNorm",
    "softmax",
    "dropout/elementwise",
    "embedding",
    "criterion",
    "optimizer",
    "fp8 scaling",
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
HLO_FILENAME = "step.hlo.txt"
STAGE_TRACE_DIR = "stages"
STAGE_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": ""}
"""XLA options of the stage trace's compile: no command buffers, so each kernel event names its HLO instruction."""
STAGE_WARMUP_STEPS = 2
# The part of the model a scope belongs to; BERT's "embeddings" feed its encoder, GPT-2's "embedding" its decoder.
_STAGE_SCOPES = {
    "encoder": "encoder",
    "source_embedding": "encoder",
    "embeddings": "encoder",
    "decoder": "decoder",
    "target_embedding": "decoder",
    "embedding": "decoder",
}
# Scopes of the output projection and loss: the logits of a tied table are its ``.attend``, BERT's head the rest.
_OUTPUT_SCOPES = {"criterion", "output_projection", "pooler", "classifier"}
_TRANSFORM_WRAPPER = re.compile(r"^(?:\w+\()+|\)+$")  # "transpose(jvp(criterion))" -> "criterion"
_GEMM_KERNEL = re.compile(r"gemm|cublas|cutlass|nvjet|xmma|gmma|matmul", re.IGNORECASE)
_ATTENTION_KERNEL = re.compile(r"fmha|flash|fprop_attn|bprop_attn", re.IGNORECASE)
_SCOPE_RULES = (
    ("fp8 scaling", re.compile(r"fp8", re.IGNORECASE)),  # the scope of an FP8 product's op (ls_jax's or Flax's)
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
    ("quantize", "fp8 scaling"),
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
    """The training-step stage of an HLO instruction from its ``op_name`` scopes: ``optimizer`` first, then the
    output projection and loss, then the outermost of ``encoder`` / ``decoder`` (forward, or backward under a
    ``transpose(...)`` scope); "unattributed" where none applies (e.g. a kernel without an HLO op)."""
    scopes = op_name.split("/")
    segments = [_TRANSFORM_WRAPPER.sub("", scope) for scope in scopes]
    if "optimizer" in segments:
        return "optimizer"
    if any(segment in _OUTPUT_SCOPES or segment.endswith(".attend") for segment in segments):
        return "output projection + loss"
    part = next((_STAGE_SCOPES[segment] for segment in segments if segment in _STAGE_SCOPES), None)
    if part is None:
        return "unattributed"
    backward = any(scope.startswith("transpose(") for scope in scopes)
    return f"{part} {'backward' if backward else 'forward'}"


def _trace_events(log_dir: Path) -> list[dict[str, Any]]:
    """The events of the trace kept in ``log_dir`` (not of the stage trace in its ``stages`` subdirectory)."""

    def own(pattern: str) -> list[Path]:
        return sorted(f for f in log_dir.rglob(pattern) if f.relative_to(log_dir).parts[0] != STAGE_TRACE_DIR)

    files = own("*.trace.json.gz") or own("perfetto_trace.json.gz")
    if not files:
        raise FileNotFoundError(f"jax.profiler wrote no trace JSON under {log_dir}")
    return timeline.read_events(files[-1])


def gpu_kernel_events(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Complete ('X') events on GPU device processes (not the host threads)."""
    events = list(events)
    gpu_pids = set(timeline.gpu_processes(events))
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e]


def event_op_name(event: dict[str, Any], op_names: dict[str, str]) -> str:
    """The ``op_name`` of the HLO instruction behind a kernel event ("" where unknown, e.g. a custom call's kernel).

    The kernel's own name comes first: inside a CUDA graph the event's ``hlo_op`` is the command buffer that
    launched the graph, not the fusion that the kernel computes."""
    by_kernel_name = op_names.get(event["name"])
    if by_kernel_name is not None:
        return by_kernel_name
    return op_names.get(str(event.get("args", {}).get("hlo_op", "")), "")


def launching_op_name(event: dict[str, Any], op_names: dict[str, str]) -> str:
    """The ``op_name`` of the instruction that launched a kernel, in a trace without command buffers.

    There the event's ``hlo_op`` comes first: XLA compiles one kernel for fusions with identical bodies and names it
    after one of them, so a kernel name stands for every layer's copy of a fusion, and the scopes of only one."""
    launched_by = op_names.get(str(event.get("args", {}).get("hlo_op", "")))
    return launched_by if launched_by is not None else event_op_name(event, op_names)


def breakdown(kernels: list[dict[str, Any]], op_names: dict[str, str], steps: int) -> dict[str, float]:
    """Milliseconds per step in each category (trace timestamps are microseconds)."""
    per_category = dict.fromkeys(CATEGORIES, 0.0)
    for event in kernels:
        per_category[categorize(event["name"], event_op_name(event, op_names))] += event["dur"]
    intervals = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    if intervals:
        window = max(stop for _, stop in intervals) - min(start for start, _ in intervals)
        per_category["idle"] = window - timeline.length(timeline.union(intervals))
    return {category: microseconds / 1e3 / steps for category, microseconds in per_category.items()}


OpNameOf = Callable[[dict[str, Any], dict[str, str]], str]


def stage_breakdown(
    kernels: list[dict[str, Any]], op_names: dict[str, str], steps: int, op_name_of: OpNameOf = launching_op_name
) -> dict[str, float]:
    """Milliseconds of kernel time per step in each of `STAGES`; ``op_name_of`` finds a kernel's instruction
    (`launching_op_name` in a trace without command buffers, `event_op_name` in one with them)."""
    per_stage = dict.fromkeys(STAGES, 0.0)
    for event in kernels:
        per_stage[stage(op_name_of(event, op_names))] += event["dur"]
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


def _traced(run: Callable[[], Any], hlo: str, steps: int, trace_dir: Path | None) -> list[dict[str, Any]]:
    """Kernel events of ``steps`` calls of ``run``; with ``trace_dir``, the trace and ``hlo`` stay there."""
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        (trace_dir / HLO_FILENAME).write_text(hlo)
    return trace_gpu_kernels(run, steps, trace_dir)


def step_breakdown(train_step: Any, batch: Any, steps: int, trace_dir: Path | None = None) -> dict[str, Any]:
    """Category breakdown of ``steps`` traced calls of a `transformer_steps.TrainStep` (already warmed up), and
    its stage breakdown from ``steps`` traced calls of the same step compiled without command buffers.

    With ``trace_dir``, both traces and their compiled HLO stay there (for Perfetto, or `reanalyze`); the stage
    trace in its ``stages`` subdirectory."""
    hlo = train_step.compiled.as_text()
    kernels = _traced(lambda: train_step.run(batch), hlo, steps, trace_dir)
    staged = train_step.recompiled(STAGE_COMPILER_OPTIONS)
    try:
        for _ in range(STAGE_WARMUP_STEPS):
            staged.run(batch)
        staged_hlo = staged.compiled.as_text()
        stage_kernels = _traced(
            lambda: staged.run(batch), staged_hlo, steps, None if trace_dir is None else trace_dir / STAGE_TRACE_DIR
        )
    finally:
        train_step.state = staged.state  # the staged step donated the state it was given
    return summarize(kernels, hlo_op_names(hlo), steps, stage_kernels, hlo_op_names(staged_hlo))


def reanalyze(result_path: Path, trace_root: Path) -> dict[str, Any]:
    """Recomputes the breakdowns of a profile result file from the traces its run kept under ``trace_root``
    (``--trace-dir``: one directory per implementation), keeping the file's environment; returns the new file."""
    result = json.loads(result_path.read_text())
    for implementation in result["results"]:
        kernels, op_names = _kept_trace(trace_root / implementation)
        stage_dir = trace_root / implementation / STAGE_TRACE_DIR
        stage_kernels, stage_op_names = _kept_trace(stage_dir) if stage_dir.is_dir() else (None, None)
        result["results"][implementation] = summarize(kernels, op_names, result["steps"], stage_kernels, stage_op_names)
    return result


def _kept_trace(directory: Path) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The kernel events and HLO op names of a trace kept by `step_breakdown` in ``directory``."""
    return gpu_kernel_events(_trace_events(directory)), hlo_op_names((directory / HLO_FILENAME).read_text())


def summarize(
    kernels: list[dict[str, Any]],
    op_names: dict[str, str],
    steps: int,
    stage_kernels: list[dict[str, Any]] | None = None,
    stage_op_names: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The breakdown of ``steps`` traced steps, the kernel count and the largest kernels with their categories;
    the stages from ``stage_kernels`` (the trace without command buffers) where given, else from ``kernels``."""
    ms = breakdown(kernels, op_names, steps)
    top = [
        {**entry, "category": categorize(entry["kernel"], entry["op_name"])}
        for entry in _largest_with_op_names(kernels, op_names, steps, 40)
    ]
    op_name_of: OpNameOf = launching_op_name
    if stage_kernels is None:  # a trace with command buffers only: a kernel's own name is what finds its instruction
        stage_kernels, stage_op_names, op_name_of = kernels, op_names, event_op_name
    stage_op_names = stage_op_names or {}
    unattributed = [event for event in stage_kernels if stage(op_name_of(event, stage_op_names)) == "unattributed"]
    return {
        "ms_per_step": ms,
        "total_ms_per_step": sum(ms.values()),
        "kernels_per_step": len(kernels) / steps,
        "stage_ms_per_step": stage_breakdown(stage_kernels, stage_op_names, steps, op_name_of),
        "unattributed_kernels": _largest_with_op_names(unattributed, stage_op_names, steps, 10, op_name_of),
        "top_kernels": top,
    }


def _largest_with_op_names(
    kernels: list[dict[str, Any]],
    op_names: dict[str, str],
    steps: int,
    count: int,
    op_name_of: OpNameOf = event_op_name,
) -> list[dict[str, Any]]:
    """The ``count`` kernel names with the most time per step, each with the op_name of one of its events."""
    op_name_by_kernel = {event["name"]: op_name_of(event, op_names) for event in kernels}
    return [
        {"kernel": name, "ms_per_step": time, "op_name": op_name_by_kernel[name]}
        for name, time in list(kernel_time_by_name(kernels, steps).items())[:count]
    ]
