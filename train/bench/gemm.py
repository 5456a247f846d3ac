"""Feed-forward GEMM benchmark: the FFN GEMMs alone and with their element-wise epilogues, side by side.

``python -m train.bench gemm [--out DIR] [--quick] [--models NAME,...] [--tokens T,...]``

At every FFN shape of the models (WMT base and big, BERT-base, GPT-2 small; bf16 activations, f32 weights, tokens
1024-16384), for each GEMM of the block as the layers run it (`ls_jax.layers.feed_forward`):
  fc1   (T, d) x (d, ff), epilogue ``dropout(act(. + b))`` (``ops.bias_act_dropout``, the model's activation)
  fc2   (T, ff) x (ff, d), epilogue ``residual + dropout(. + b)`` (``ops.bias_dropout_residual``)
one forward plus backward pass (``jax.vjp`` on a fixed cotangent, jitted) in three variants:
  gemm        ``ops.dense`` alone: XLA's dot (cuBLAS on a GPU) for the forward, input and weight gradients
  gemm+ffi    the GEMM then the epilogue's fused kernel: the layers' path on a GPU
  gemm+xla    the same on the XLA backend (XLA fuses what it can into the GEMM's epilogue or one loop)
Reported per variant: milliseconds, TFLOP/s (6 T d ff per pass: forward, input gradient, weight gradient) and its
share of the peak measured in the same run (the forward of a bf16 8192^3 GEMM, ``peak_tflops``); per case the
epilogue's cost, gemm+ffi minus gemm: what a GEMM carrying its epilogue can save at most. Results go to
docs/results/gemm-<device>.json.

``--quick`` divides the tokens by 16 and the widths by 4 and takes few samples: a smoke test that runs on CPU, with
the xla variants alone.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax import backend, ops
from train.bench import common

ACTIVATION = jnp.bfloat16
PARAM = jnp.float32
DROPOUT = 0.1
TOKENS = (1024, 4096, 16384)
PEAK_SIZE = 8192
QUICK_TOKENS, QUICK_WIDTH = 16, 4


@dataclasses.dataclass(frozen=True)
class FeedForward:
    """A model's FFN: width d, inner width ff, activation."""

    hidden: int
    inner: int
    activation: ops.Activation


MODELS = {
    "wmt-base": FeedForward(512, 2048, "relu"),
    "wmt-big": FeedForward(1024, 4096, "relu"),
    "bert-base": FeedForward(768, 3072, "gelu"),
    "gpt2-small": FeedForward(768, 3072, "gelu_tanh"),
}


def _normal(seed: int, shape: Sequence[int], dtype: Any) -> jax.Array:
    return jnp.asarray(0.05 * np.random.default_rng(seed).standard_normal(tuple(shape), np.float32), dtype)


def gemm_cases(ffn: FeedForward, tokens: int) -> dict[str, tuple[int, int, int, Callable, Callable, tuple]]:
    """``{layer: (T, K, N, gemm_op, with_epilogue_op, primals)}`` for fc1 and fc2; both ops take ``primals``."""
    seed = ops.dropout_seed(jax.random.key(0))
    d, ff = ffn.hidden, ffn.inner

    def fc1(x, w, b):
        return ops.bias_act_dropout(ops.dense(x, w), b, activation=ffn.activation, dropout_rate=DROPOUT, seed=seed)

    def fc2(x, w, b, r):
        return ops.bias_dropout_residual(ops.dense(x, w), b, r, dropout_rate=DROPOUT, seed=seed)

    fc1_primals = (_normal(0, (tokens, d), ACTIVATION), _normal(1, (d, ff), PARAM), _normal(2, (ff,), PARAM))
    fc2_primals = (
        _normal(3, (tokens, ff), ACTIVATION),
        _normal(4, (ff, d), PARAM),
        _normal(5, (d,), PARAM),
        _normal(6, (tokens, d), ACTIVATION),
    )
    return {
        "fc1": (tokens, d, ff, lambda x, w, b: ops.dense(x, w), fc1, fc1_primals),
        "fc2": (tokens, ff, d, lambda x, w, b, r: ops.dense(x, w), fc2, fc2_primals),
    }


def time_pass(op: Callable, primals: tuple, mode: backend.KernelMode, quick: bool) -> float:
    """Median seconds of one forward + backward pass of ``op`` compiled in kernel mode ``mode``."""
    fn, cotangent = common.forward_backward(op, primals)
    sampling = dict(warmup=2, samples=5, inner=2) if quick else dict(warmup=5, samples=30, inner=5)
    with backend.use(mode):  # the mode is read when the function is traced, at its first call
        return common.time_call(lambda: fn(primals, cotangent), **sampling)["median_s"]


def peak_tflops(size: int, quick: bool) -> float:
    """TFLOP/s of the forward of a bf16 ``size``^3 GEMM: the roof the FFN GEMMs are set against."""
    a, b = _normal(0, (size, size), ACTIVATION), _normal(1, (size, size), ACTIVATION)
    matmul = jax.jit(jnp.matmul)
    sampling = dict(warmup=2, samples=5, inner=2) if quick else dict(warmup=5, samples=30, inner=5)
    seconds = common.time_call(lambda: matmul(a, b), **sampling)["median_s"]
    return 2 * size**3 / seconds / 1e12


def run_case(model: str, ffn: FeedForward, tokens: int, layer: str, modes: Sequence[str], peak: float, quick: bool):
    """The variants of one GEMM (``layer``: fc1 or fc2) of ``model``'s FFN at ``tokens`` tokens."""
    rows, k, n, gemm_op, with_epilogue, primals = gemm_cases(ffn, tokens)[layer]
    flops = 6 * rows * k * n
    timed = {"gemm": time_pass(gemm_op, primals, "xla", quick)}
    for mode in modes:
        timed[f"gemm+{mode}"] = time_pass(with_epilogue, primals, mode, quick)
    result: dict[str, Any] = {"model": model, "layer": layer, "tokens": rows, "k": k, "n": n, "flops": flops}
    for name, seconds in timed.items():
        tflops = flops / seconds / 1e12
        result[name] = {"median_ms": 1e3 * seconds, "tflops": tflops, "share_of_peak": tflops / peak}
    base = "gemm+ffi" if "ffi" in modes else "gemm+xla"
    result["epilogue_ms"] = result[base]["median_ms"] - result["gemm"]["median_ms"]
    return result


def _format_row(result: dict[str, Any]) -> str:
    cells = "  ".join(
        f"{name} {result[name]['median_ms']:8.3f} ms {result[name]['tflops']:6.1f} TF/s "
        f"{result[name]['share_of_peak']:4.0%}"
        for name in ("gemm", "gemm+ffi", "gemm+xla")
        if name in result
    )
    shape = f"{result['tokens']}x{result['k']}x{result['n']}"
    return f"{result['model']:<11} {result['layer']} {shape:<17} {cells}  epilogue {result['epilogue_ms']:.3f} ms"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.bench gemm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common.add_out_argument(parser, "gemm")
    parser.add_argument("--quick", action="store_true", help="tokens / 16, widths / 4, few samples (runs on CPU)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    parser.add_argument(
        "--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts (--quick divides them by 16)"
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.models.split(",")) - set(MODELS))
    if unknown:
        parser.error(f"unknown models: {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    try:
        token_counts = [int(value) for value in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens takes comma-separated integers, got {args.tokens}")
    if any(count < 1 for count in token_counts):
        parser.error(f"--tokens must be positive, got {args.tokens}")
    args.out = common.out_dir(args.out, parser)

    modes = ("ffi", "xla") if backend.cuda_visible() else ("xla",)
    peak = peak_tflops(PEAK_SIZE // QUICK_WIDTH if args.quick else PEAK_SIZE, args.quick)
    print(f"peak {peak:.1f} TFLOP/s (bf16 GEMM forward); forward + backward per GEMM")
    results = []
    for model in args.models.split(","):
        ffn = MODELS[model]
        if args.quick:
            ffn = dataclasses.replace(ffn, hidden=ffn.hidden // QUICK_WIDTH, inner=ffn.inner // QUICK_WIDTH)
        for tokens in token_counts:
            rows = max(tokens // QUICK_TOKENS, 1) if args.quick else tokens
            for layer in ("fc1", "fc2"):
                results.append(run_case(model, ffn, rows, layer, modes, peak, args.quick))
                print(_format_row(results[-1]), flush=True)
    path = common.write_result(
        "gemm",
        {
            "quick": args.quick,
            "activation_dtype": jnp.dtype(ACTIVATION).name,
            "param_dtype": jnp.dtype(PARAM).name,
            "dropout_rate": DROPOUT,
            "peak_tflops": peak,
            "cases": results,
        },
        args.out,
    )
    print(f"wrote {path}")
    return 0
