"""What attention dropout costs inside cuDNN's SDPA kernels, measured with Nsight Compute.

    python3 scripts/attention_dropout_ncu.py [--case 4,4096,16,64] [--out docs/results]

One forward + backward pass of ls_jax's self-attention (bf16, the cuDNN SDPA graphs of its FFI handlers) without
dropout and with dropout 0.1 runs in two child processes, each under ncu and gated by cuProfilerStart/Stop, so
exactly that pass's kernels are profiled: time, instructions executed, issue slots busy, IPC, pipe utilisation,
tensor-core ops and DRAM bytes per kernel. Writes attention-dropout-ncu-<device>.json and prints the SDPA kernels
side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from train.bench import common
from train.bench.tracing import ncu_report, ncu_run

DROPOUT = 0.1
WARMUP_PASSES = 3
TIMEOUT_S = 300
EXTRA_METRICS = (
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
)
METRICS = (
    ncu_report.TIME,
    ncu_report.INSTRUCTIONS,
    ncu_report.IPC,
    ncu_report.SM_THROUGHPUT,
    ncu_report.OCCUPANCY,
    ncu_report.DRAM_READ,
    ncu_report.DRAM_WRITE,
    *ncu_report.TENSOR_OPS,
    *EXTRA_METRICS,
)


def child(case: tuple[int, int, int, int], rate: float) -> None:
    """Warm up, then one forward + backward pass inside the profiler range."""
    import jax
    import jax.numpy as jnp

    from ls_jax import backend, ops
    from train.bench.attention import _normal
    from train.bench.steps.counter_workloads import profiler_range

    batch, length, heads, head_dim = case
    qkv = _normal(0, (batch, length, 3, heads, head_dim), jnp.bfloat16)
    bias = _normal(1, (3, heads, head_dim), jnp.float32)
    seed = ops.dropout_seed(jax.random.key(0))

    def attention(qkv, bias):
        return ops.self_attention(qkv, bias=bias, dropout_rate=rate, seed=seed if rate else None)

    def run(qkv, bias, cotangent):
        out, vjp = jax.vjp(attention, qkv, bias)
        return out, vjp(cotangent)

    cotangent = jnp.ones(jax.eval_shape(attention, qkv, bias).shape, jnp.bfloat16)
    with backend.use("ffi"):
        fn = jax.jit(run)
        for _ in range(WARMUP_PASSES):
            jax.block_until_ready(fn(qkv, bias, cotangent))
    profiler_range(True)
    jax.block_until_ready(fn(qkv, bias, cotangent))
    profiler_range(False)


def profile(
    ncu: str, metrics: list[str], case: tuple[int, int, int, int], rate: float, work_dir: Path
) -> list[ncu_report.Kernel]:
    """The kernels of one pass at dropout ``rate``, profiled by ncu in a child process."""
    child = [sys.executable, __file__, "--child", "--rate", str(rate), "--case", ",".join(map(str, case))]
    report, _ = ncu_run.run_under_ncu(ncu, metrics, child, work_dir, TIMEOUT_S, f"attention at dropout {rate}")
    return ncu_report.parse_csv(report, metrics)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="4,4096,16,64", help="B,L,H,D (default 4,4096,16,64)")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    case = tuple(int(part) for part in args.case.split(","))
    if args.child:
        child(case, args.rate)
        return
    ncu = ncu_run.find_ncu(None)
    metrics, missing = ncu_run.split_supported(METRICS, ncu_run.available_metrics(ncu))
    with tempfile.TemporaryDirectory() as scratch:
        passes = {
            f"dropout {rate}": profile(ncu, metrics, case, rate, Path(scratch) / str(rate)) for rate in (0.0, DROPOUT)
        }
    kernels = {name: [{"kernel": k.name, **k.metrics} for k in found] for name, found in passes.items()}
    environment = common.environment()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"attention-dropout-ncu-{common.device_slug(environment['device_kind'])}.json"
    out.write_text(
        json.dumps(
            {
                "environment": environment,
                "case": dict(zip("BLHD", case)),
                "metrics": metrics,
                "metrics_not_available": missing,
                "passes": kernels,
            },
            indent=2,
        )
        + "\n"
    )
    for name, rows in kernels.items():
        print(name)
        for row in rows:
            if "sdpa" in row["kernel"]:
                cells = "  ".join(
                    f"{metric.split('.')[0].split('__')[-1]}={row[metric]:.4g}"
                    for metric in metrics
                    if row.get(metric) is not None
                )
                print(f"  {row['kernel'][:70]}\n    {cells}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
