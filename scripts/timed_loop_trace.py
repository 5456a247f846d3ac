"""Where the time of ``train.bench e2e``'s timed steps goes: one of its samples traced, then its timeline.

``train.bench profile`` traces a few steps and sums their kernels; the e2e row times samples of steps dispatched
back to back. This traces such a sample (after e2e's warm-up and timing, so both numbers come from one process)
and runs ``train.bench timeline`` on it: the device's window per step against its busy time says whether the
timed step waits for the host (idle time between kernels) or for its kernels.

  python scripts/timed_loop_trace.py MODEL TOKENS IMPLEMENTATION OUT_DIR   (e.g. big-6e6d 8192 ls_jax_ffi /tmp/t)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax

from ls_jax import backend
from train.bench import common, e2e, timeline
from train.bench.steps import workloads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a WMT model of train.bench e2e, e.g. big-6e6d")
    parser.add_argument("tokens", type=int, help="target tokens a step")
    parser.add_argument("implementation", choices=workloads.ALL_IMPLEMENTATIONS)
    parser.add_argument("out", type=Path, help="folder for the trace and timeline-IMPLEMENTATION.json")
    args = parser.parse_args(argv)
    workload = workloads.wmt_workload(args.model, args.tokens)
    batch = workload.batch()
    steps = e2e.STEPS_PER_SAMPLE
    trace_dir = args.out / args.implementation
    with backend.use(workload.kernel_mode(args.implementation)):
        step = workload.build(args.implementation, batch)
        float(step.run(batch))
        timing = common.time_call(lambda: step.run(batch), warmup=3, samples=10, inner=steps)
        print(f"timed: median {1e3 * timing['median_s']:.3f} ms a step over samples of {steps} steps")
        with jax.profiler.trace(str(trace_dir)):
            start = time.perf_counter()
            for _ in range(steps):
                loss = step.run(batch)
            jax.block_until_ready(loss)
        print(f"traced sample: {1e3 * (time.perf_counter() - start) / steps:.3f} ms a step")
    out = args.out / f"timeline-{args.implementation}.json"
    return timeline.main([str(trace_dir), "--steps", str(steps), "--out", str(out)])


if __name__ == "__main__":
    raise SystemExit(main())
