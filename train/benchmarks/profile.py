"""Where one training step's GPU time goes, by category, for the plain Flax reference and for ls_jax.

``python -m train.bench profile [--model big-6e6d] [--tokens 8192] [--profile-steps 5]``

Each implementation of `train.benchmarks.transformer_steps` is measured as ``e2e`` measures it (its step time is
added to docs/results/e2e-<device>.json) and then traced with ``jax.profiler`` for a few more steps, its kernels
attributed to categories by `train.benchmarks.kernel_trace`. Writes docs/results/profile-<device>.json and prints
the breakdowns side by side: by kernel category, and by stage of the step (encoder and decoder forward, output
projection + loss, decoder and encoder backward, optimizer), as LightSeq2's step breakdown shows it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import jax

from train.benchmarks import common, e2e
from train.benchmarks.kernel_trace import CATEGORIES, STAGES, reanalyze
from train.benchmarks.transformer_steps import MODELS


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.bench profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="big-6e6d", choices=sorted(MODELS))
    parser.add_argument("--tokens", type=int, default=8192, help="target tokens per step")
    parser.add_argument("--steps", type=int, default=10,
                        help=f"timed samples of {e2e.STEPS_PER_SAMPLE} steps (the e2e measurement)")
    parser.add_argument("--profile-steps", type=int, default=5, help="traced steps")
    parser.add_argument("--implementations", default="reference,ls_jax_xla,ls_jax_ffi")
    common.add_out_argument(parser, "profile")
    parser.add_argument("--trace-dir", type=Path, help="keep each implementation's trace and compiled HLO here")
    parser.add_argument("--reanalyze", type=Path, metavar="RESULT_JSON",
                        help="no GPU work: recompute the breakdowns of RESULT_JSON from the traces in --trace-dir")
    args = parser.parse_args(argv)
    args.out = common.out_dir(args.out)
    if args.reanalyze:
        if args.trace_dir is None:
            parser.error("--reanalyze needs --trace-dir, the directory the profiled run kept its traces in")
        result = reanalyze(args.reanalyze, args.trace_dir)
        args.reanalyze.write_text(json.dumps(result, indent=2) + "\n")
        print_breakdowns(result["results"], {})
        return 0
    implementations = args.implementations.split(",")
    if jax.default_backend() != "gpu":
        parser.error("profiling attributes GPU kernels: it needs a GPU")
    measurements = e2e.ResultFile.open(args.out, e2e.header(), fresh=False)
    e2e.run([args.model], [args.tokens], implementations, args.steps, measurements, profile_steps=args.profile_steps,
            trace_dir=args.trace_dir)
    results = {impl: measurements.results[f"{args.model}/{args.tokens}/{impl}"] for impl in implementations}
    breakdowns = {impl: record["profile"] for impl, record in results.items() if "profile" in record}
    written = common.write_result(
        "profile",
        {"model": args.model, "target_tokens": args.tokens, "steps": args.profile_steps, "results": breakdowns},
        args.out,
    )
    print_breakdowns(breakdowns, {impl: record["step_time_s"] for impl, record in results.items()})
    print(f"wrote {written} and {measurements.path}")
    return 0


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
        print(f"{'step time (timed)':22s}" + "".join(f"{step_times_s[impl] * 1e3:16.2f}" for impl in shown))
    with_stages = [impl for impl in shown if "stage_ms_per_step" in breakdowns[impl]]
    if with_stages:
        print(f"\n{'stage':26s}" + "".join(f"{impl:>16s}" for impl in with_stages) + "   (kernel ms per step)")
        for name in STAGES:
            row = [breakdowns[impl]["stage_ms_per_step"][name] for impl in with_stages]
            print(f"{name:26s}" + "".join(f"{value:16.2f}" for value in row))
