"""Attention benchmark: ls_jax attention against cuDNN's attention as JAX calls it, side by side in one process.

``python -m train.bench attention [--out DIR] [--quick] [--cases B,L,H,D ...] [--forms FORM ...] [--lengths L ...]
[--samples N]``

Form "self" (the default cases, ``--cases``): one self-attention (bf16, no mask, not causal) at (batch, length,
heads, head_dim), timed for one forward plus one backward pass (``jax.vjp`` on a fixed cotangent, jitted) in four
variants:
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

The other forms (``--forms``, at each of ``--lengths``, 16384 tokens per case, heads x head_dim = 1024, bf16, with the
projection bias as above) time one forward plus backward of ``ops.self_attention`` / ``ops.cross_attention`` against
``jax.nn.dot_product_attention`` on the same q, k, v and the same mask:
  masked        self-attention of right-padded rows (the rows' padding 0, 1/8, 1/4, 3/8 of L in turn), ls_jax with
                ``lengths=``; the references with ``query_seq_lengths=`` every query and ``key_value_seq_lengths=``
                the lengths, the same function (every query attends to its row's visible keys)
  causal        causal self-attention, no padding
  cross         cross attention of L queries over L right-padded keys (``key_lengths=``), as the encoder-decoder's
  head_dim_128, head_dim_256   self-attention without a mask at that head_dim (256: Hopper)
with the variants
  ffi      ls_jax with the kernels (cuDNN's flash attention from ls_jax's FFI handlers at these lengths)
  cudnn    ``jax.nn.dot_product_attention(..., implementation="cudnn")``, the reference of ``time_vs_cudnn``
  xla      ``jax.nn.dot_product_attention(..., implementation="xla")`` (stores the L x L scores)
and, for masked only, ``ffi_key_mask``: ls_jax with the boolean key mask the lengths stand for (cuDNN's padding mask
plus a bias tensor, the path of any mask), and ``cudnn_padded_queries``: cuDNN with ``query_seq_lengths=`` the lengths
as well (its own padding mask, which also skips the padded queries: a different function, padded query rows unused).

``--quick`` divides batch and length by 8 (at least 1 and 16): a smoke test that runs on CPU with xla alone.
``--samples`` sets the timed samples per variant (30; five calls each).
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
from ls_jax.ops import attention_cudnn, attention_lengths
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
SAMPLES = 30
FORMS = ("self", "masked", "causal", "cross", "head_dim_128", "head_dim_256")
FORM_LENGTHS = (512, 1024, 2048, 4096, 8192)
TOKENS, HIDDEN = 16384, 1024  # per case of the forms other than "self": batch = TOKENS // L, heads = HIDDEN // D


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
            "ffi_dropout": (
                "ffi",
                lambda qkv, bias: ops.self_attention(qkv, bias=bias, dropout_rate=DROPOUT, seed=seed),
            ),
            **table,
            "cudnn": ("xla", reference),
        }
    return table


def form_shape(form: str, length: int) -> tuple[int, int, int, int]:
    """(batch, length, heads, head_dim) of a case of ``form`` (not "self") at ``length``."""
    head_dim = {"head_dim_128": 128, "head_dim_256": 256}.get(form, 64)
    return max(TOKENS // length, 1), length, HIDDEN // head_dim, head_dim


def padded_lengths(batch: int, length: int) -> jax.Array:
    """int32 (batch,): rows with 0, 1/8, 1/4 and 3/8 of ``length`` as padding, in turn."""
    return jnp.array([length - (row % 4) * length // 8 for row in range(batch)], jnp.int32)


def _reference_qkv(sources, bias):
    """q, k, v (B, L, H, D) of the sources with the projection bias added by XLA, for jax.nn.dot_product_attention."""
    query_source = sources[0] + bias.astype(sources[0].dtype)
    key_value_source = query_source if len(sources) == 1 else sources[1]
    return query_source[:, :, 0], key_value_source[:, :, -2], key_value_source[:, :, -1]


def form_variants(
    form: str, batch: int, length: int, on_gpu: bool
) -> dict[str, tuple[backend.KernelMode, Callable[..., jax.Array]]]:
    """name -> (kernel mode, op(sources, bias)) for a case of ``form``; ffi and cuDNN variants only on a GPU."""
    lengths = padded_lengths(batch, length) if form in ("masked", "cross") else None
    causal = form == "causal"

    def reference(implementation: str, query_lengths: jax.Array | None = None) -> Callable[..., jax.Array]:
        masks = {}
        if lengths is not None:
            every_query = jnp.full((batch,), length, jnp.int32)
            masks = dict(
                query_seq_lengths=every_query if query_lengths is None else query_lengths, key_value_seq_lengths=lengths
            )
        return lambda sources, bias: jax.nn.dot_product_attention(
            *_reference_qkv(sources, bias), is_causal=causal, implementation=implementation, **masks
        )

    def ls_jax(sources, bias):
        if form == "cross":
            return ops.cross_attention(sources[0][:, :, 0], sources[1], key_lengths=lengths, bias=bias[0])
        return ops.self_attention(sources[0], lengths=lengths, bias=bias, causal=causal)

    table: dict[str, tuple[backend.KernelMode, Callable[..., jax.Array]]] = {}
    if on_gpu:
        table["ffi"] = ("ffi", ls_jax)
        table["cudnn"] = ("xla", reference("cudnn"))
        if form == "masked":
            table["ffi_key_mask"] = (
                "ffi",
                lambda sources, bias: ops.self_attention(
                    sources[0], attention_lengths.lengths_mask(lengths, length), bias=bias
                ),
            )
            table["cudnn_padded_queries"] = ("xla", reference("cudnn", lengths))
    table["xla"] = ("xla", reference("xla"))
    return table


def _xla_bytes(memory: Any) -> int | None:
    """Bytes XLA allocates for a compiled pass: arguments, outputs and temporaries, less what outputs alias."""
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
    sizes = [getattr(memory, field, None) for field in fields]
    if any(size is None for size in sizes):
        return None
    arguments, outputs, temps, aliased = sizes
    return arguments + outputs + temps - aliased


def measure(
    op: Callable[..., jax.Array],
    mode: backend.KernelMode,
    primals,
    quick: bool,
    on_gpu: bool,
    kernel_times: bool = False,
    samples: int = SAMPLES,
) -> dict[str, Any]:
    """Median time of one forward + backward of ``op`` traced in kernel mode ``mode``, its FFI targets and the
    pass's peak memory (XLA's bytes plus the cuDNN handlers' workspace); with ``kernel_times``, the device time per
    pass of each GPU kernel from a trace of `TRACED_PASSES` passes."""

    def run(primals, cotangent):
        out, vjp = jax.vjp(op, *primals)
        return out, vjp(cotangent)

    cotangent = jnp.ones(jax.eval_shape(op, *primals).shape, DTYPE)
    fn = jax.jit(run)
    sampling = dict(warmup=2, samples=5, inner=2) if quick else dict(warmup=5, samples=samples, inner=5)
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


def _with_ratios(result: dict[str, Any]) -> dict[str, Any]:
    """Each variant's ``time_vs_cudnn``: its median time over the cudnn variant's (when there is one)."""
    if "cudnn" in result:
        reference_ms = result["cudnn"]["median_ms"]
        for name, measured in result.items():
            if isinstance(measured, dict) and name != "cudnn":
                measured["time_vs_cudnn"] = measured["median_ms"] / reference_ms
    return result


def _quick_shape(batch: int, length: int, quick: bool) -> tuple[int, int]:
    return (max(batch // QUICK_DIVISOR, 1), max(length // QUICK_DIVISOR, 16)) if quick else (batch, length)


def run_case(
    shape: tuple[int, int, int, int], on_gpu: bool, quick: bool, kernel_times: bool = False, samples: int = SAMPLES
) -> dict[str, Any]:
    """One case of form "self" at ``shape`` (B, L, H, D)."""
    batch, length, heads, head_dim = shape
    batch, length = _quick_shape(batch, length, quick)
    primals = (_normal(0, (batch, length, 3, heads, head_dim), DTYPE), _normal(1, (3, heads, head_dim), jnp.float32))
    result: dict[str, Any] = {"form": "self", "batch": batch, "length": length, "heads": heads, "head_dim": head_dim}
    for name, (mode, op) in variants(on_gpu).items():
        result[name] = measure(op, mode, primals, quick, on_gpu, kernel_times, samples)
    return _with_ratios(result)


def run_form_case(
    form: str, length: int, on_gpu: bool, quick: bool, kernel_times: bool = False, samples: int = SAMPLES
) -> dict[str, Any]:
    """One case of ``form`` (not "self") at ``length``: the packed sources (qkv, or query and key_value) and the
    query source's f32 projection bias."""
    batch, length, heads, head_dim = form_shape(form, length)
    batch, length = _quick_shape(batch, length, quick)
    if form == "cross":
        sources = (
            _normal(0, (batch, length, 1, heads, head_dim), DTYPE),
            _normal(2, (batch, length, 2, heads, head_dim), DTYPE),
        )
    else:
        sources = (_normal(0, (batch, length, 3, heads, head_dim), DTYPE),)
    primals = (sources, _normal(1, (sources[0].shape[2], heads, head_dim), jnp.float32))
    result: dict[str, Any] = {"form": form, "batch": batch, "length": length, "heads": heads, "head_dim": head_dim}
    if form in ("masked", "cross"):
        result["key_lengths"] = [int(n) for n in padded_lengths(batch, length)]
    for name, (mode, op) in form_variants(form, batch, length, on_gpu).items():
        result[name] = measure(op, mode, primals, quick, on_gpu, kernel_times, samples)
    return _with_ratios(result)


VARIANT_ORDER = ("ffi", "ffi_key_mask", "ffi_dropout", "xla", "cudnn", "cudnn_padded_queries")


def _format_row(result: dict[str, Any]) -> str:
    shape = f"{result['form']:<12} {result['batch']},{result['length']},{result['heads']},{result['head_dim']}"
    cells = []
    for name in VARIANT_ORDER:
        if name in result:
            r = result[name]
            ratio = f" ({r['time_vs_cudnn']:.2f}x)" if "time_vs_cudnn" in r else ""
            temp = f" peak {r['peak_bytes'] / 2**20:7.1f} MiB" if r["peak_bytes"] is not None else ""
            cells.append(f"{name} {r['median_ms']:8.3f} ms{ratio}{temp}")
    return f"{shape:<31} " + " | ".join(cells)


def _format_kernels(result: dict[str, Any], shown: int = 4) -> str:
    """Each variant's largest kernels, device ms per pass."""
    lines = []
    for name in VARIANT_ORDER:
        per_kernel = result.get(name, {}).get("kernel_ms", {})
        lines += [f"    {name:<12} {ms:8.3f} ms  {kernel[:100]}" for kernel, ms in list(per_kernel.items())[:shown]]
    return "\n".join(lines)


def _parse_case(text: str) -> tuple[int, int, int, int]:
    parts = text.split(",")
    if len(parts) != 4 or not all(part.strip().isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"a case is B,L,H,D with four positive integers, got {text!r}")
    return tuple(int(part) for part in parts)  # type: ignore[return-value]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.bench attention",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common.add_out_argument(parser, "attention")
    parser.add_argument("--quick", action="store_true", help="batch and length / 8, few samples (runs on CPU)")
    parser.add_argument(
        "--cases",
        nargs="+",
        type=_parse_case,
        metavar="B,L,H,D",
        help="shapes to run (default: " + " ".join(",".join(map(str, c)) for c in CASES) + ")",
    )
    parser.add_argument(
        "--forms",
        nargs="+",
        choices=FORMS,
        default=FORMS,
        metavar="FORM",
        help="forms to run (default: all): " + " ".join(FORMS),
    )
    parser.add_argument(
        "--lengths",
        nargs="+",
        type=int,
        default=FORM_LENGTHS,
        metavar="L",
        help="lengths of the forms other than self (default: " + " ".join(map(str, FORM_LENGTHS)) + ")",
    )
    parser.add_argument("--samples", type=int, default=SAMPLES, help=f"timed samples per variant (default {SAMPLES})")
    parser.add_argument(
        "--kernel-times",
        action="store_true",
        help="also trace each variant and record its device time per kernel (GPU)",
    )
    args = parser.parse_args(argv)
    if args.samples < 1 or any(length < 1 for length in args.lengths):
        parser.error("--samples and --lengths take positive integers")
    args.out = common.out_dir(args.out, parser)
    on_gpu = backend.cuda_visible()
    print(f"attention forward + backward, {jnp.dtype(DTYPE).name}; forms: {', '.join(args.forms)}")
    runs: list[Callable[[], dict[str, Any]]] = []
    if "self" in args.forms:
        runs += [
            lambda shape=shape: run_case(shape, on_gpu, args.quick, args.kernel_times, args.samples)
            for shape in args.cases or CASES
        ]
    runs += [
        lambda form=form, length=length: run_form_case(
            form, length, on_gpu, args.quick, args.kernel_times, args.samples
        )
        for form in args.forms
        if form != "self"
        for length in args.lengths
    ]
    results = []
    for run in runs:
        results.append(run())
        print(_format_row(results[-1]), flush=True)
        if args.kernel_times:
            print(_format_kernels(results[-1]), flush=True)
    payload = {"quick": args.quick, "dtype": jnp.dtype(DTYPE).name, "dropout_rate": DROPOUT, "cases": results}
    print(f"wrote {common.write_result('attention', payload, args.out)}")
    return 0
