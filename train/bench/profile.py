"""Where one training step's GPU time goes, by category, for the plain Flax references and for ls_jax.

``python -m train.bench profile [--model big-6e6d] [--tokens 8192] [--profile-steps 5]``
``python -m train.bench profile --model bert-base --seq-len 512`` (or ``--model gpt2-small --seq-len 1024``)

Each implementation of the model (`train.bench.steps.workloads`: the WMT Transformers' reference, ls_jax_xla and
ls_jax_ffi; BERT's and GPT-2's flax, flax_cudnn, ls_jax_xla and ls_jax_ffi) is measured as ``e2e`` measures it
(its step time is added to docs/results/e2e-<device>.json) and then traced with ``jax.profiler`` for a few more
steps, its kernels attributed to categories by `train.bench.tracing.kernel_trace`. Writes
docs/results/profile-<device>.json for a WMT model (profile-<model>-<seq_len>-<device>.json for BERT and GPT-2),
which holds every implementation profiled at that shape into the same --out (so ``--implementations`` subsets run
one after another add up), and prints the breakdowns side by side: by kernel category, and by stage of the step
(encoder and decoder forward, output projection + loss, decoder and encoder backward, optimizer), as LightSeq2's
step breakdown shows it, also drawn as one stacked bar per implementation next to the JSON (.png). The stages come
from a second trace of the step compiled without command buffers (`kernel_trace.step_breakdown`). BERT's and
GPT-2's PyTorch row, ``torch_compile``, is not profiled: the JAX profiler does not see its kernels.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import jax

from train.bench import common, e2e
from train.bench.steps import workloads
from train.bench.tracing.kernel_trace import CATEGORIES, STAGES, reanalyze

DEFAULT_TOKENS = 8192


def workload_of(model: str, tokens: int, seq_len: int | None, rows: int | None) -> workloads.Workload:
    """The profiled workload: a WMT model at ``tokens`` target tokens, BERT or GPT-2 at ``seq_len`` (default: the
    model's longest length) and ``rows`` rows (default: the model's); raises ValueError on a bad shape."""
    if workloads.is_wmt(model):
        return workloads.wmt_workload(model, tokens)
    lengths = workloads.zoo_steps.MODELS[model].seq_lens
    return workloads.zoo_workload(model, max(lengths) if seq_len is None else seq_len, rows)


def profiled_implementations_of(model: str) -> tuple[str, ...]:
    """``model``'s implementations that the JAX profiler can break down: all but the PyTorch rows."""
    return tuple(i for i in workloads.implementations_of(model) if i not in workloads.TORCH_IMPLEMENTATIONS)


def shape_flags_of_another_family(args: argparse.Namespace) -> str:
    """The shape flags given that the model's family does not take ("" when none): --tokens for BERT and GPT-2,
    --seq-len and --rows for a WMT model."""
    if workloads.is_wmt(args.model):
        given = [flag for flag, value in (("--seq-len", args.seq_len), ("--rows", args.rows)) if value is not None]
    else:
        given = ["--tokens"] if args.tokens is not None else []
    return " and ".join(given)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.bench profile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="big-6e6d", choices=workloads.MODEL_ORDER)
    parser.add_argument(
        "--tokens", type=int, default=None, help=f"WMT models: target tokens per step (default {DEFAULT_TOKENS})"
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="BERT and GPT-2: sequence length (default: the model's longest benchmarked length)",
    )
    parser.add_argument("--rows", type=int, default=None, help="BERT and GPT-2: rows per batch (default: the model's)")
    parser.add_argument(
        "--steps", type=int, default=10, help=f"timed samples of {e2e.STEPS_PER_SAMPLE} steps (the e2e measurement)"
    )
    parser.add_argument("--profile-steps", type=int, default=5, help="traced steps")
    parser.add_argument(
        "--implementations",
        default=None,
        help="comma-separated (default: all of the model's but the FP8 rows: "
        + "; ".join(
            f"{family} {','.join(profiled_implementations_of(names[0]))}"
            for family, names in workloads.FAMILIES.items()
        )
        + ")",
    )
    common.add_out_argument(parser, "profile")
    parser.add_argument("--trace-dir", type=Path, help="keep each implementation's trace and compiled HLO here")
    parser.add_argument(
        "--reanalyze",
        type=Path,
        metavar="RESULT_JSON",
        help="no GPU work: recompute the breakdowns of RESULT_JSON from the traces in --trace-dir",
    )
    args = parser.parse_args(argv)
    args.out = common.out_dir(args.out, parser)
    if args.reanalyze:
        if args.trace_dir is None:
            parser.error("--reanalyze needs --trace-dir, the directory the profiled run kept its traces in")
        result = reanalyze(args.reanalyze, args.trace_dir)
        args.reanalyze.write_text(json.dumps(result, indent=2) + "\n")
        print_breakdowns(result["results"], {})
        plot_stages(
            result["results"], _title(result, result["environment"]["device_kind"]), args.reanalyze.with_suffix(".png")
        )
        return 0
    own = profiled_implementations_of(args.model)
    default = [i for i in own if i in workloads.DEFAULT_IMPLEMENTATIONS]
    implementations = default if args.implementations is None else args.implementations.split(",")
    if set(implementations) - set(own):
        parser.error(
            f"{args.model} has no implementation {', '.join(sorted(set(implementations) - set(own)))}; "
            f"its implementations are {', '.join(own)}"
        )
    try:
        workloads.check_fp8_device(implementations)
    except ValueError as err:
        parser.error(str(err))
    misplaced = shape_flags_of_another_family(args)
    if misplaced:
        parser.error(
            f"{misplaced} does not apply to {args.model}: WMT models take --tokens, BERT and GPT-2 take "
            f"--seq-len and --rows"
        )
    try:
        workload = workload_of(
            args.model, DEFAULT_TOKENS if args.tokens is None else args.tokens, args.seq_len, args.rows
        )
    except ValueError as err:
        parser.error(str(err))
    if jax.default_backend() != "gpu":
        parser.error("profiling attributes GPU kernels: it needs a GPU")
    measurements = e2e.ResultFile.open(args.out, e2e.header(), fresh=False)
    e2e.run(
        [workload],
        implementations,
        args.steps,
        measurements,
        profile_steps=args.profile_steps,
        trace_dir=args.trace_dir,
    )
    results = profiled_records(measurements.results, workload, own)
    breakdowns = {impl: record["profile"] for impl, record in results.items()}
    written = common.write_result(
        "profile",
        {**profile_header(workload), "steps": args.profile_steps, "results": breakdowns},
        args.out,
        stem=profile_stem(workload),
    )
    print_breakdowns(
        breakdowns, {impl: record["step_time_s"] for impl, record in results.items() if "step_time_s" in record}
    )
    plot_stages(breakdowns, _title(profile_header(workload), jax.devices()[0].device_kind), written.with_suffix(".png"))
    print(f"wrote {written} (and its .png) and {measurements.path}")
    return 0


def profiled_records(
    records: dict[str, Any], workload: workloads.Workload, implementations: list[str]
) -> dict[str, Any]:
    """The e2e records of ``implementations`` at ``workload``'s shape that carry a profile, in that order: every
    implementation profiled into one --out, so that subsets run one after another add up to one profile file."""
    return {
        impl: records[workload.key(impl)]
        for impl in implementations
        if "profile" in records.get(workload.key(impl), {})
    }


def profile_header(workload: workloads.Workload) -> dict[str, Any]:
    """The profiled shape: the model and its target tokens (WMT) or its sequence length and rows."""
    if workloads.is_wmt(workload.model):
        return {"model": workload.model, "target_tokens": workload.size}
    return {"model": workload.model, "seq_len": workload.size, "batch_rows": workload.rows}


def profile_stem(workload: workloads.Workload) -> str:
    """ "profile" for a WMT model (docs/results/profile-<device>.json), "profile-<model>-<seq_len>" otherwise."""
    return "profile" if workloads.is_wmt(workload.model) else f"profile-{workload.model}-{workload.size}"


def print_breakdowns(breakdowns: dict[str, Any], step_times_s: dict[str, float]) -> None:
    """The categories of every implementation side by side, in ms per step, and the timed step where known."""
    shown = list(breakdowns)
    print(f"{'category':22s}" + "".join(f"{impl:>16s}" for impl in shown) + "   (ms per step)")
    for category in (*CATEGORIES, "total"):
        row = [
            breakdowns[impl]["total_ms_per_step"] if category == "total" else breakdowns[impl]["ms_per_step"][category]
            for impl in shown
        ]
        print(f"{category:22s}" + "".join(f"{value:16.2f}" for value in row))
    if step_times_s:
        print(
            f"{'step time (timed)':22s}"
            + "".join(f"{step_times_s[impl] * 1e3:16.2f}" for impl in shown if impl in step_times_s)
        )
    with_stages = [impl for impl in shown if "stage_ms_per_step" in breakdowns[impl]]
    if with_stages:
        print(f"\n{'stage':26s}" + "".join(f"{impl:>16s}" for impl in with_stages) + "   (kernel ms per step)")
        for name in STAGES:
            row = [breakdowns[impl]["stage_ms_per_step"][name] for impl in with_stages]
            print(f"{name:26s}" + "".join(f"{value:16.2f}" for value in row))


def _title(header: dict[str, Any], device_kind: str) -> str:
    """The figure's title: the model and shape of a `profile_header` and the device."""
    shape = (
        f"{header['target_tokens']} target tokens"
        if "target_tokens" in header
        else f"{header['batch_rows']} x {header['seq_len']} tokens"
    )
    return f"{header['model']}, {shape}, {device_kind}: kernel time per step by stage"


def plot_stages(breakdowns: dict[str, Any], title: str, path: Path) -> None:
    """One horizontal bar per implementation with stages, its stages stacked left to right in the step's order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [impl for impl in breakdowns if "stage_ms_per_step" in breakdowns[impl]]
    if not shown:
        return
    figure, axes = plt.subplots(figsize=(11, 1.2 + 0.6 * len(shown)))
    left = [0.0] * len(shown)
    for name in STAGES:
        widths = [breakdowns[impl]["stage_ms_per_step"][name] for impl in shown]
        axes.barh(shown, widths, left=left, label=name)
        left = [start + width for start, width in zip(left, widths)]
    for row, total in enumerate(left):
        axes.text(total, row, f" {total:.1f} ms", va="center")
    axes.invert_yaxis()  # the first implementation on top
    axes.set_xlabel("kernel ms per step")
    axes.set_xlim(0, max(left) * 1.12)
    axes.set_title(title)
    axes.legend(ncol=4, fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.35 - 0.1 / len(shown)))
    figure.tight_layout()
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
