"""Hand-counted FLOPs and minimal DRAM bytes against Nsight Compute's measured ones, over batch sizes.

``python -m train.bench flops [--batches 16,32,64,128,256] [--seq-len 128] [--counters COUNTERS_JSON]``

For each batch size and implementation, forward + backward of one BERT-base encoder block
(`counter_workloads` ``encoder-block``: H 768, F 3072, 12 heads, bf16) runs under ncu with only the FLOP and DRAM
counters; measured FLOPs are tensor-core math ops plus the half- and single-precision sass op counts (an FMA is 2),
measured DRAM bytes are bytes read plus written. They are set against `train.bench.steps.hand_count` (GEMM FLOPs plus
the elementwise estimate; the perfect-fusion DRAM bytes), with the least-squares slope of measured on estimated.
With ``--counters``, every workload of a counters result file is set against the hand count of its whole step too.
Writes docs/results/flops-<device>.json and flops-<device>.png (measured FLOPs vs batch, measured DRAM vs batch,
measured vs estimated with the fitted slopes).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from train.bench import common
from train.bench.steps import hand_count
from train.bench.steps.counter_workloads import ENCODER_SHAPE, WORKLOADS
from train.bench.steps.transformer_steps import MODELS, SEQ_LEN, VOCAB
from train.bench.tracing import ncu_report, ncu_run

WORKLOAD = "encoder-block"


def measured(total: dict[str, float | None]) -> dict[str, float | None]:
    """FLOPs (tensor + half + single) and DRAM bytes (read + write) of an `ncu_report.aggregate`; the tensor
    share of the FLOPs; None where the tensor counter or the DRAM counters are missing."""
    parts = [total.get(name) for name in ("flops_tensor", "flops_half", "flops_single")]
    flops = None if parts[0] is None else sum(part or 0.0 for part in parts)
    read, write = total.get("dram_read_bytes"), total.get("dram_write_bytes")
    return {
        "flops": flops,
        "dram_bytes": None if read is None or write is None else read + write,
        "tensor_share": None if not flops else parts[0] / flops,
    }


def encoder_block_estimate(batch: int, seq_len: int) -> hand_count.Count:
    shape = ENCODER_SHAPE
    return hand_count.encoder_block(batch, seq_len, shape.hidden, shape.intermediate, shape.heads)


def workload_estimate(workload: str, batch: int, seq_len: int, layers: int | None = None) -> hand_count.Count:
    """The hand count of a counters workload: a WMT step (optimizer included; ``layers`` split half encoder, half
    decoder) or an encoder stack (no optimizer) of ``layers`` layers (default: the workload's)."""
    spec = WORKLOADS[workload]
    if spec.whole_step:
        shape = MODELS[workload.removeprefix("wmt-")]
        encoder_layers, decoder_layers = (
            (shape.encoder_layers, shape.decoder_layers) if layers is None else (layers // 2, layers // 2)
        )
        return hand_count.training_step(
            batch,
            SEQ_LEN,
            SEQ_LEN,
            shape.hidden,
            shape.intermediate,
            shape.heads,
            encoder_layers,
            decoder_layers,
            VOCAB,
        )
    return encoder_block_estimate(batch, seq_len).times(layers or spec.layers)


def fit_slope(estimated: list[float], observed: list[float]) -> dict[str, float] | None:
    """Least-squares line observed = slope x estimated + intercept (None with fewer than two points)."""
    import numpy as np

    if len(estimated) < 2:
        return None
    slope, intercept = np.polyfit(np.asarray(estimated, float), np.asarray(observed, float), 1)
    return {"slope": float(slope), "intercept": float(intercept)}


def explain(
    flops_fit: dict[str, float] | None, dram_fit: dict[str, float] | None, tensor_share: float | None, gemm_share: float
) -> str:
    """One sentence on the slopes, from the numbers and from what the hand count leaves out."""
    if flops_fit is None or dram_fit is None:
        return "too few batch sizes measured for a slope"
    share = "" if tensor_share is None else f"; {tensor_share:.0%} of the measured FLOPs are tensor-core math ops"
    return (
        f"measured FLOPs grow {flops_fit['slope']:.2f} x as fast as the hand count (its GEMMs, "
        f"{gemm_share:.0%} of it, counted exactly, its elementwise work estimated){share}. Measured DRAM bytes "
        f"grow {dram_fit['slope']:.2f} x as fast as the perfect-fusion minimum: what lies above 1 is traffic "
        f"the minimum leaves out, intermediates written and read back between kernels, and ncu flushes the "
        f"caches before each kernel, so no kernel finds its inputs in L2"
    )


def whole_steps(counters_result: dict[str, Any]) -> dict[str, Any]:
    """Each workload of a counters result file against its hand count: measured / estimated FLOPs and bytes."""
    comparison = {}
    for workload, entry in counters_result["workloads"].items():
        estimate = workload_estimate(workload, entry["batch"], entry["seq_len"], entry.get("layers"))
        comparison[workload] = {"estimated": count_record(estimate), "implementations": {}}
        for impl, record in entry["results"].items():
            observed = measured(record["total"])
            comparison[workload]["implementations"][impl] = {
                **observed,
                "flops_over_estimate": _ratio(observed["flops"], estimate.flops),
                "dram_over_minimum": _ratio(observed["dram_bytes"], estimate.dram_bytes),
            }
    return comparison


def _ratio(value: float | None, reference: float) -> float | None:
    return None if value is None or not reference else value / reference


def count_record(count: hand_count.Count) -> dict[str, int]:
    return {
        "gemm_flops": count.gemm_flops,
        "elementwise_flops": count.elementwise_flops,
        "flops": count.flops,
        "dram_bytes": count.dram_bytes,
    }


def sweep_summary(points: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per implementation: the slopes of measured on estimated FLOPs and bytes, and the explaining sentence."""
    summary = {}
    for impl, rows in points.items():
        rows = [row for row in rows if row["flops"] is not None and row["dram_bytes"] is not None]
        flops_fit = fit_slope([r["estimated"]["flops"] for r in rows], [r["flops"] for r in rows])
        dram_fit = fit_slope([r["estimated"]["dram_bytes"] for r in rows], [r["dram_bytes"] for r in rows])
        shares = [r["tensor_share"] for r in rows if r["tensor_share"] is not None]
        gemm_shares = [r["estimated"]["gemm_flops"] / r["estimated"]["flops"] for r in rows] or [1.0]
        summary[impl] = {
            "flops_fit": flops_fit,
            "dram_fit": dram_fit,
            "why": explain(
                flops_fit, dram_fit, sum(shares) / len(shares) if shares else None, sum(gemm_shares) / len(gemm_shares)
            ),
        }
    return summary


def plot(points: dict[str, list[dict[str, Any]]], summary: dict[str, Any], path: Path) -> None:
    """Measured FLOPs vs batch, measured DRAM bytes vs batch (hand counts dashed), measured vs estimated FLOPs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (flops_axes, dram_axes, fit_axes) = plt.subplots(1, 3, figsize=(15, 4.5))
    for impl, rows in points.items():
        batches = [r["batch"] for r in rows]
        flops_axes.plot(batches, [r["flops"] for r in rows], "o-", label=impl)
        dram_axes.plot(batches, [r["dram_bytes"] for r in rows], "o-", label=impl)
        fit = summary[impl]["flops_fit"]
        label = impl if fit is None else f"{impl}: slope {fit['slope']:.2f}"
        fit_axes.plot([r["estimated"]["flops"] for r in rows], [r["flops"] for r in rows], "o", label=label)
    rows = next(iter(points.values()))
    batches = [r["batch"] for r in rows]
    flops_axes.plot(batches, [r["estimated"]["flops"] for r in rows], "k--", label="hand count")
    dram_axes.plot(batches, [r["estimated"]["dram_bytes"] for r in rows], "k--", label="minimal (hand count)")
    estimated = [r["estimated"]["flops"] for r in rows]
    fit_axes.plot(estimated, estimated, "k:", label="measured = estimated")
    for axes, title, ylabel in ((flops_axes, "measured FLOPs", "FLOPs"), (dram_axes, "measured DRAM", "bytes")):
        axes.set(xlabel="batch size", ylabel=ylabel, title=title, xscale="log", yscale="log")
        axes.legend()
    fit_axes.set(xlabel="estimated FLOPs", ylabel="measured FLOPs", title="measured vs estimated")
    fit_axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def batch_sizes(text: str) -> list[int] | None:
    """The batch sizes of a comma-separated list, or None when one is not a whole number > 0."""
    try:
        batches = [int(item) for item in text.split(",")]
    except ValueError:
        return None
    return batches if all(batch > 0 for batch in batches) else None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.bench flops", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="16,32,64,128,256")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--implementations", default="reference,ls_jax_ffi")
    parser.add_argument("--counters", type=Path, help="a counters result file whose whole steps to compare too")
    parser.add_argument("--ncu", help="path of the ncu executable")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one batch size may run under ncu")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args(argv)
    batches = batch_sizes(args.batches)
    if batches is None:
        parser.error(f"--batches {args.batches}: give comma-separated whole numbers > 0, e.g. 16,32,64")
    if args.counters is not None and not args.counters.is_file():
        parser.error(f"--counters {args.counters}: no such file; run python -m train.bench counters first")
    try:
        ncu = ncu_run.find_ncu(args.ncu)
    except FileNotFoundError as err:
        parser.error(str(err))
    metrics, missing = ncu_run.split_supported(ncu_report.FLOP_METRICS, ncu_run.available_metrics(ncu))
    points: dict[str, list[dict[str, Any]]] = {}
    environment: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for impl in args.implementations.split(","):
            for batch in batches:
                run = ncu_run.profile(
                    ncu, metrics, WORKLOAD, impl, batch, args.seq_len, Path(scratch) / f"{impl}-{batch}", args.timeout
                )
                environment = run.environment
                row = {
                    "batch": batch,
                    "kernels": len(run.kernels),
                    **measured(ncu_report.aggregate(run.kernels)),
                    "estimated": count_record(encoder_block_estimate(batch, args.seq_len)),
                }
                points.setdefault(impl, []).append(row)
                print(
                    f"{impl:12s} batch {batch:4d}: {row['flops']} FLOPs, {row['dram_bytes']} DRAM bytes measured; "
                    f"{row['estimated']['flops']} FLOPs, {row['estimated']['dram_bytes']} bytes estimated"
                )
    summary = sweep_summary(points)
    payload = {
        "suite": "flops",
        "environment": environment,
        "workload": WORKLOAD,
        "seq_len": args.seq_len,
        "shape": {"hidden": ENCODER_SHAPE.hidden, "ffn": ENCODER_SHAPE.intermediate, "heads": ENCODER_SHAPE.heads},
        "metrics": metrics,
        "metrics_not_available": missing,
        "points": points,
        "summary": summary,
        "whole_steps": whole_steps(json.loads(args.counters.read_text())) if args.counters else None,
    }
    slug = common.device_slug(environment["device_kind"])
    args.out.mkdir(parents=True, exist_ok=True)
    path, figure = args.out / f"flops-{slug}.json", args.out / f"flops-{slug}.png"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    plot(points, summary, figure)
    for impl, entry in summary.items():
        print(f"{impl}: {entry['why']}")
    print(f"wrote {path} and {figure}")
    return 0
