"""Attention benchmark: ls_jax self-attention against cuDNN's attention as JAX calls it, side by side in one process.

``python -m train.bench attention [--out DIR] [--quick] [--cases B,L,H,D ...]``

Each case is one self-attention (bf16, no mask, not causal) at (batch, length, heads, head_dim), timed for one
forward plus one backward pass (``jax.vjp`` on a fixed cotangent, jitted) in four variants:
  ffi          ``ops.self_attention`` with the kernels (L <= 128 and head_dim 64: the fused kernels; else cuDNN's flash
               attention from ls_jax's FFI handlers), no dropout
  ffi_dropout  the same with dropout 0.1 on the probabilities
  xla          ``ops.self_attention`` on the XLA backend (two einsums around the softmax; stores L x L probabilities)
  cudnn        ``jax.nn.dot_product_attention(implementation="cudnn")`` on q, k, v sliced from the same packed qkv,
               the reference (it has no dropout)
ls_jax's variants take the packed (B, L, 3, H, D) qkv and its f32 projection bias (3, H, D), as the layers pass
them; the reference gets q, k and v with the bias added by XLA. Reported per variant: median milliseconds, the
ratio to the reference, the FFI targets the ffi variants called (a silent fallback shows), and the pass's peak
memory: the bytes XLA allocates for it (``memory_analysis``: arguments, outputs and temporaries, which hold the
unfused variant's L x L probabilities and the reference's cuDNN workspace) plus, for the ffi variants, the most
the cuDNN handlers' workspace pool (outside XLA) had in use. The default cases keep batch x length at 16384 tokens,
so a variant whose memory is linear in L keeps its peak while the unfused one grows with L. Results go to
docs/results/attention-<device>.json.

``--quick`` divides batch and length by 8 (at least 1 and 16): a smoke test that runs on CPU with xla alone.
``--kernel-times`` also traces a few passes of each variant with ``jax.profiler`` and records the device time of each
kernel (``kernel_ms``, per pass): which kernels dropout makes slower.
"""

from __future__ import annotations

import argparse
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax import backend, ops
from ls_jax.ops import attention_cudnn
from train.bench import common
from train.bench.tracing import kernel_trace

DTYPE = jnp.bfloat16
DROPOUT = 0.1
CASES: tuple[tuple[int, int, int, int], ...] = tuple(
    (16384 // length, length, 1024 // head_dim, head_dim)
    for head_dim in (64, 128)
    for length in (512, 1024, 2048, 4096)
)
QUICK_DIVISOR = 8
TRACED_PASSES = 5


def _normal(seed: int, shape: Sequence[int], dtype: Any) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(tuple(shape), np.float32), dtype)


def variants(on_gpu: bool) -> dict[str, tuple[backend.KernelMode, Callable[..., jax.Array]]]:
    """name -> (kernel mode, op(qkv, bias)); ffi variants and the cuDNN reference only on a GPU."""
    seed = ops.dropout_seed(jax.random.key(0))

    def reference(qkv, bias):
        qkv = qkv + bias.astype(qkv.dtype)
        return jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], implementation="cudnn")

    table = {"xla": ("xla", lambda qkv, bias: ops.self_attention(qkv, bias=bias))}
    if on_gpu:
        table = {
            "ffi": ("ffi", lambda qkv, bias: ops.self_attention(qkv, bias=bias)),
            "ffi_dropout": ("ffi", lambda qkv, bias: ops.self_attention(qkv, bias=bias, dropout_rate=DROPOUT,
                                                                        seed=seed)),
            **table,
            "cudnn": ("xla", reference),
        }
    return table


def _xla_bytes(memory: Any) -> int | None:
    """Bytes XLA allocates for a compiled pass: arguments, outputs and temporaries, less what outputs alias."""
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
    sizes = [getattr(memory, field, None) for field in fields]
    if any(size is None for size in sizes):
        return None
    arguments, outputs, temps, aliased = sizes
    return arguments + outputs + temps - aliased


def measure(op: Callable[..., jax.Array], mode: backend.KernelMode, primals, quick: bool,
            on_gpu: bool, kernel_times: bool = False) -> dict[str, Any]:
    """Median time of one forward + backward of ``op`` traced in kernel mode ``mode``, its FFI targets and the
    pass's peak memory (XLA's bytes plus the cuDNN handlers' workspace); with ``kernel_times``, the device time per
    pass of each GPU kernel from a trace of `TRACED_PASSES` passes."""

    def run(primals, cotangent):
        out, vjp = jax.vjp(op, *primals)
        return out, vjp(cotangent)

    cotangent = jnp.ones(jax.eval_shape(op, *primals).shape, DTYPE)
    fn = jax.jit(run)
    sampling = dict(warmup=2, samples=5, inner=2) if quick else dict(warmup=5, samples=30, inner=5)
    with_workspace = on_gpu and mode == "ffi"
    with backend.use(mode):  # the mode is read when the function is traced
        lowered = fn.lower(primals, cotangent)
        memory = lowered.compile().memory_analysis()
        if with_workspace:
            attention_cudnn.workspace_peak_bytes()  # resets the mark
        timing = common.time_call(lambda: fn(primals, cotangent), **sampling)
    workspace = attention_cudnn.workspace_peak_bytes() if with_workspace else None
    xla_bytes = _xla_bytes(memory)
    per_kernel = {}
    if kernel_times and on_gpu:
        traced = kernel_trace.trace_gpu_kernels(lambda: fn(primals, cotangent), TRACED_PASSES)
        per_kernel = {"kernel_ms": kernel_trace.kernel_time_by_name(traced, TRACED_PASSES)}
    return {
        **per_kernel,
        "median_ms": 1e3 * timing["median_s"],
        "p10_ms": 1e3 * timing["p10_s"],
        "p90_ms": 1e3 * timing["p90_s"],
        "kernels": sorted(set(re.findall(r"custom_call @(ls_\w+)", lowered.as_text()))),
        "temp_bytes": getattr(memory, "temp_size_in_bytes", None),
        "xla_bytes": xla_bytes,
        "cudnn_workspace_bytes": workspace,
        "peak_bytes": None if xla_bytes is None else xla_bytes + (workspace or 0),
    }


def run_case(shape: tuple[int, int, int, int], on_gpu: bool, quick: bool, kernel_times: bool = False) -> dict[str, Any]:
    batch, length, heads, head_dim = shape
    if quick:
        batch, length = max(batch // QUICK_DIVISOR, 1), max(length // QUICK_DIVISOR, 16)
    primals = (_normal(0, (batch, length, 3, heads, head_dim), DTYPE), _normal(1, (3, heads, head_dim), jnp.float32))
    result: dict[str, Any] = {"batch": batch, "length": length, "heads": heads, "head_dim": head_dim}
    for name, (mode, op) in variants(on_gpu).items():
        result[name] = measure(op, mode, primals, quick, on_gpu, kernel_times)
    if "cudnn" in result:
        reference_ms = result["cudnn"]["median_ms"]
        for name in ("ffi", "ffi_dropout", "xla"):
            result[name]["time_vs_cudnn"] = result[name]["median_ms"] / reference_ms
    return result


def _format_row(result: dict[str, Any]) -> str:
    shape = f"{result['batch']},{result['length']},{result['heads']},{result['head_dim']}"
    cells = []
    for name in ("ffi", "ffi_dropout", "xla", "cudnn"):
        if name in result:
            r = result[name]
            ratio = f" ({r['time_vs_cudnn']:.2f}x)" if "time_vs_cudnn" in r else ""
            temp = f" peak {r['peak_bytes'] / 2**20:7.1f} MiB" if r["peak_bytes"] is not None else ""
            cells.append(f"{name} {r['median_ms']:8.3f} ms{ratio}{temp}")
    return f"{shape:<18} " + " | ".join(cells)


def _format_kernels(result: dict[str, Any], shown: int = 4) -> str:
    """Each variant's largest kernels, device ms per pass."""
    lines = []
    for name in ("ffi", "ffi_dropout", "xla", "cudnn"):
        per_kernel = result.get(name, {}).get("kernel_ms", {})
        lines += [f"    {name:<12} {ms:8.3f} ms  {kernel[:100]}" for kernel, ms in list(per_kernel.items())[:shown]]
    return "\n".join(lines)


def _parse_case(text: str) -> tuple[int, int, int, int]:
    parts = text.split(",")
    if len(parts) != 4 or not all(part.strip().isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"a case is B,L,H,D with four positive integers, got {text!r}")
    return tuple(int(part) for part in parts)  # type: ignore[return-value]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.bench attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_out_argument(parser, "attention")
    parser.add_argument("--quick", action="store_true", help="batch and length / 8, few samples (runs on CPU)")
    parser.add_argument("--cases", nargs="+", type=_parse_case, metavar="B,L,H,D",
                        help="shapes to run (default: " + " ".join(",".join(map(str, c)) for c in CASES) + ")")
    parser.add_argument("--kernel-times", action="store_true",
                        help="also trace each variant and record its device time per kernel (GPU)")
    args = parser.parse_args(argv)
    args.out = common.out_dir(args.out)
    on_gpu = backend.cuda_visible()
    print(f"self-attention forward + backward, {jnp.dtype(DTYPE).name}; variants: {', '.join(variants(on_gpu))}")
    results = []
    for shape in args.cases or CASES:
        results.append(run_case(shape, on_gpu, args.quick, args.kernel_times))
        print(_format_row(results[-1]), flush=True)
        if args.kernel_times:
            print(_format_kernels(results[-1]), flush=True)
    payload = {"quick": args.quick, "dtype": jnp.dtype(DTYPE).name, "dropout_rate": DROPOUT, "cases": results}
    print(f"wrote {common.write_result('attention', payload, args.out)}")
    return 0
