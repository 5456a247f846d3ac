"""Hardware counters of one training step, ls_jax against the plain Flax reference, under Nsight Compute.

``python -m train.bench counters [--workload wmt-big-6e6d] [--batch 16] [--implementations reference,ls_jax_ffi]``

Each implementation's workload (`train.bench.steps.counter_workloads`) runs in a child process under ``ncu``; only
its one measured call is profiled (cuProfilerStart/Stop with ``--profile-from-start off``), every kernel of that
call, with ncu's default cache control (caches flushed before each kernel's replay: DRAM bytes are cold-cache).
The metric set is the nvprof set of the LightSeq2-vs-Fairseq counter study in its Hopper names
(`train.bench.tracing.ncu_report.METRICS`); metrics the GPU lacks are left out and listed. Kernels are grouped by the
categories of ``train.bench profile``; totals are reduced as the study does (sums for counts, medians for
efficiencies, plus time-weighted means), and each implementation is divided by the reference.

Writes the workload's entry of docs/results/counters-<device>.json (other workloads' entries are kept) and
counters-<device>-<workload>.png, the study's bar figure of normalised counters.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from train.bench import common
from train.bench.steps.counter_workloads import WARMUP_CALLS, WORKLOADS
from train.bench.tracing import ncu_report, ncu_run
from train.bench.tracing.kernel_trace import categorize, hlo_op_names, stage

FIGURE_METRICS = (
    "instructions",
    "instructions_per_warp",
    "sm_throughput_pct_median",
    "flops_half",
    "flops_single",
    "flops_tensor",
    "dram_read_bytes",
    "dram_write_bytes",
    "global_load_requests",
    "global_store_requests",
    "ipc_median",
    "achieved_occupancy_pct_median",
    "kernels",
    "time_ns",
)


def summarize(kernels: list[ncu_report.Kernel], hlo: str) -> dict[str, Any]:
    """Totals, per-category and per-stage aggregates of one profiled call's kernels. A kernel is matched to its
    HLO instruction by name; ncu does not see which custom call launched an ls_jax kernel, so those count as
    "unattributed" among the stages (their categories come from their names)."""
    op_names = hlo_op_names(hlo)
    category_of = lambda kernel: categorize(kernel.name, op_names.get(kernel.name, ""))
    stage_of = lambda kernel: stage(op_names.get(kernel.name, ""))
    return {
        "total": ncu_report.aggregate(kernels),
        "categories": ncu_report.by_category(kernels, category_of),
        "stages": ncu_report.by_category(kernels, stage_of),
    }


def sampled(
    whole_step: bool, max_kernels: int | None, layers: int | None = None, model_layers: int | None = None
) -> str:
    """What the counters cover, in words (``layers`` of the model's ``model_layers`` when fewer were run)."""
    call = "training step" if whole_step else "forward + backward call"
    if layers is not None and layers != model_layers:
        half, model_half = layers // 2, model_layers // 2
        call += (
            f" of the model with {half} encoder and {half} decoder layers of its {model_half} + {model_half}"
            if whole_step
            else f" of {layers} of the model's {model_layers} identical layers"
        )
    which = "every kernel" if max_kernels is None else f"the first {max_kernels} kernels (a partial call)"
    return (
        f"{which} of one {call} after {WARMUP_CALLS} warm-up calls; ncu replays each kernel once per metric "
        "pass and flushes the caches before each replay"
    )


def normalised(results: dict[str, Any], reference: str) -> dict[str, Any]:
    """Every implementation's totals divided by the reference's."""
    base = results[reference]["total"]
    return {impl: ncu_report.normalise(record["total"], base) for impl, record in results.items() if impl != reference}


def merge_result(path: Path, workload: str, entry: dict[str, Any], environment: dict[str, Any]) -> dict[str, Any]:
    """The result file's content with ``entry`` as the workload's record (other workloads kept)."""
    existing = json.loads(path.read_text()) if path.exists() else {}
    workloads = {**existing.get("workloads", {}), workload: entry}
    return {"suite": "counters", "environment": environment, "workloads": workloads}


def plot(ratios: dict[str, dict[str, float | None]], title: str, path: Path) -> None:
    """Bars of implementation / reference per counter, a line at 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [name for name in FIGURE_METRICS if any(r.get(name) is not None for r in ratios.values())]
    figure, axes = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / max(len(ratios), 1)
    for index, (impl, ratio) in enumerate(ratios.items()):
        values = [ratio.get(name) if ratio.get(name) is not None else np.nan for name in names]
        axes.bar(np.arange(len(names)) + index * width, values, width, label=impl)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks(np.arange(len(names)) + width * (len(ratios) - 1) / 2, names, rotation=40, ha="right")
    axes.set_ylabel("relative to the reference")
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def print_table(results: dict[str, Any], ratios: dict[str, Any]) -> None:
    shown = list(results)
    print(f"{'counter':32s}" + "".join(f"{impl:>16s}" for impl in shown) + "".join(f"{'x ' + i:>18s}" for i in ratios))
    for name in results[shown[0]]["total"]:
        values = [results[impl]["total"][name] for impl in shown]
        row = "".join(f"{v:16.4g}" if v is not None else f"{'n/a':>16s}" for v in values)
        row += "".join(f"{r[name]:18.3f}" if r[name] is not None else f"{'n/a':>18s}" for r in ratios.values())
        print(f"{name:32s}{row}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.bench counters", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="wmt-big-6e6d", choices=sorted(WORKLOADS))
    parser.add_argument("--batch", type=int, help="sentences (wmt) or sequences; default: the workload's")
    parser.add_argument(
        "--seq-len", type=int, help="positions per sequence (encoder workloads); default: the workload's"
    )
    parser.add_argument(
        "--implementations",
        default="reference,ls_jax_ffi",
        help="comma-separated; the first is the reference the others are divided by",
    )
    parser.add_argument(
        "--layers",
        type=int,
        help="profile this many of the model's layers (a shorter ncu run with the same per-layer "
        "counters): identical layers of an encoder workload, or an even number of a WMT step's "
        "(half encoder, half decoder); default: all",
    )
    parser.add_argument("--ncu", help="path of the ncu executable (default: ncu on PATH or in the CUDA toolkit)")
    parser.add_argument("--timeout", type=float, default=270.0, help="seconds one implementation may run under ncu")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="result directory (default docs/results)")
    parser.add_argument(
        "--max-kernels",
        type=int,
        help="profile only the first N kernels of the call (a partial step; said in 'sampled')",
    )
    parser.add_argument("--keep", type=Path, help="keep each implementation's ncu CSV, HLO and command here")
    args = parser.parse_args(argv)
    spec = WORKLOADS[args.workload]
    if spec.whole_step and args.seq_len is not None:
        parser.error(
            f"--seq-len applies to the encoder workloads; {args.workload} is a whole training step of its "
            f"own shape ({spec.default_batch} x {spec.default_seq_len}): drop --seq-len"
        )
    if args.layers is not None:
        if spec.whole_step and not (2 <= args.layers <= spec.layers and args.layers % 2 == 0):
            parser.error(
                f"--layers takes an even number from 2 to {spec.layers} for {args.workload} (half encoder, "
                f"half decoder layers), got {args.layers}"
            )
        if not spec.whole_step and not 1 <= args.layers <= spec.layers:
            parser.error(f"--layers takes 1 to {spec.layers} for {args.workload}, got {args.layers}")
    batch, seq_len = args.batch or spec.default_batch, args.seq_len or spec.default_seq_len
    implementations = args.implementations.split(",")
    try:
        ncu = ncu_run.find_ncu(args.ncu)
    except FileNotFoundError as err:
        parser.error(str(err))
    metrics, missing = ncu_run.split_supported(ncu_report.METRICS, ncu_run.available_metrics(ncu))
    with tempfile.TemporaryDirectory() as scratch:
        root = args.keep or Path(scratch)
        profiles = {
            impl: ncu_run.profile(
                ncu,
                metrics,
                args.workload,
                impl,
                batch,
                seq_len,
                root / impl,
                args.timeout,
                args.max_kernels,
                args.layers,
            )
            for impl in implementations
        }
    results = {impl: summarize(p.kernels, p.hlo) for impl, p in profiles.items()}
    ratios = normalised(results, implementations[0])
    environment = profiles[implementations[0]].environment
    entry = {
        "batch": batch,
        "seq_len": seq_len,
        "tokens": batch * seq_len,
        "layers": args.layers or spec.layers,
        "reference": implementations[0],
        "sampled": sampled(spec.whole_step, args.max_kernels, args.layers, spec.layers),
        "metrics": metrics,
        "metrics_not_available": missing,
        "ncu_wall_s": {impl: p.wall_s for impl, p in profiles.items()},
        "results": results,
        "normalised": ratios,
    }
    slug = common.device_slug(environment["device_kind"])
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"counters-{slug}.json"
    path.write_text(json.dumps(merge_result(path, args.workload, entry, environment), indent=2) + "\n")
    figure = args.out / f"counters-{slug}-{args.workload}.png"
    plot(ratios, f"{args.workload}, {batch} x {seq_len}: counters relative to {implementations[0]}", figure)
    print_table(results, ratios)
    print(f"wrote {path} and {figure}")
    return 0
