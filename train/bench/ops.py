"""Fused-op benchmark: the CUDA kernels against the XLA implementations, side by side in one process.

``python -m train.bench ops [--out DIR] [--quick] [--ops NAME,...] [--backends ffi,xla]``

Every case is one op at a Transformer-big shape (bf16 activations, f32 parameters, dropout 0.1 where the op drops).
It times one forward plus one backward pass (``jax.vjp`` applied to a fixed cotangent, jitted; the forward alone for
``fp8_quantize``, which has no gradient) per backend and reports milliseconds, the ffi/xla speedup, the bytes the
pass has to move at least (every input read once, every output written once; counted per op below) and the achieved
bandwidth against the measured copy bandwidth. On a GPU it also traces ten calls with jax.profiler and reports the
device time: the sum of the GPU kernels' durations per call (``device_ms``, per kernel in ``kernel_ms``), which
leaves out the per-call launch overhead of an isolated jitted function that a training step, one executable, does
not pay per op. A result records the kernels the ffi run actually called (the ls_* custom calls in its HLO), so a
silent fallback to XLA shows. Results go to docs/results/ops-<device>.json.

``--quick`` divides the row counts by 64 and takes few samples: a smoke test that also runs on CPU, where only
the xla backend exists.

Adding an op: write a ``Workload`` factory and append ``Case`` entries to ``CASES`` (tests/bench/test_ops_bench.py
checks that every ls_jax.ops function and fused form has one).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax import backend, ops
from train.bench import common
from train.bench.tracing import kernel_trace

ACTIVATION = jnp.bfloat16
PARAM = jnp.float32
DROPOUT = 0.1
TOKENS = 8192
HIDDEN = 1024
FFN_HIDDEN = 4096
VOCAB = 32768
MAX_POSITIONS = 1024
QUICK_DIVISOR = 64


@dataclasses.dataclass(frozen=True)
class Workload:
    """``op(*primals)``, a description of its shape, and the minimum bytes its forward and backward move."""

    op: Callable[..., Any]
    primals: tuple[Any, ...]
    shape: str
    bytes_moved: int
    forward_only: bool = False  # an op without gradient: its forward alone is timed


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmarked op configuration; ``workload(divisor)`` builds it with the row counts divided by divisor."""

    op: str
    workload: Callable[[int], Workload]


def _itemsize(dtype: Any) -> int:
    return jnp.dtype(dtype).itemsize


def _normal(seed: int, shape: Sequence[int], dtype: Any) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(tuple(shape), np.float32), dtype)


def _seed() -> jax.Array:
    return ops.dropout_seed(jax.random.key(0))


# ---- workloads: one factory per op ----------------------------------------------------------------------


def layer_norm_workload(rows: int, hidden: int, residual: bool) -> Workload:
    """Forward reads x (and residual) and writes y (and s = x + residual) plus f32 mean and rstd per row; the
    backward reads dy and s (and the cotangent of s) and writes ds. Parameters are counted once each way."""
    x = _normal(0, (rows, hidden), ACTIVATION)
    gamma, beta = jnp.ones((hidden,), PARAM), jnp.zeros((hidden,), PARAM)
    a, p = _itemsize(ACTIVATION), _itemsize(PARAM)
    stats = 2 * 4 * rows
    if residual:
        op = lambda x, r, g, b: ops.layer_norm(x, g, b, residual=r)
        primals = (x, _normal(1, (rows, hidden), ACTIVATION), gamma, beta)
        activations = (4 + 4) * rows * hidden * a
    else:
        op = lambda x, g, b: ops.layer_norm(x, g, b)
        primals = (x, gamma, beta)
        activations = (2 + 3) * rows * hidden * a
    return Workload(op, primals, f"{rows}x{hidden}", activations + 2 * stats + 5 * hidden * p)


def bias_dropout_residual_layer_norm_workload(rows: int, hidden: int) -> Workload:
    """LayerNorm of ``residual + dropout(x + bias)`` in one op, as a pre-LN layer's LayerNorm forms its deferred
    residual. Forward reads x and the residual and writes y and the sum s plus f32 mean and rstd per row; the
    backward reads dy, the cotangent of s and s and writes ds and dx (they differ by the dropout mask, which is
    redrawn from the seed, not stored). Parameters: gamma, beta and bias read, gamma read again and their three
    gradients written."""
    seed = _seed()
    op = lambda x, r, g, b, bias: ops.layer_norm(x, g, b, residual=r, bias=bias, dropout_rate=DROPOUT, seed=seed)
    x, residual = _normal(0, (rows, hidden), ACTIVATION), _normal(1, (rows, hidden), ACTIVATION)
    gamma, beta, bias = jnp.ones((hidden,), PARAM), jnp.zeros((hidden,), PARAM), _normal(2, (hidden,), PARAM)
    stats = 2 * 4 * rows
    moved = (4 + 5) * rows * hidden * _itemsize(ACTIVATION) + 2 * stats + 7 * hidden * _itemsize(PARAM)
    return Workload(op, (x, residual, gamma, beta, bias), f"{rows}x{hidden}", moved)


def dropout_workload(rows: int, hidden: int) -> Workload:
    """Forward reads x, writes y; backward reads dy, writes dx."""
    seed = _seed()
    op = lambda x: ops.dropout(x, rate=DROPOUT, seed=seed)
    x = _normal(0, (rows, hidden), ACTIVATION)
    return Workload(op, (x,), f"{rows}x{hidden}", 4 * rows * hidden * _itemsize(ACTIVATION))


def bias_dropout_residual_workload(rows: int, hidden: int) -> Workload:
    """Forward reads x and the residual, writes y; backward reads dy, writes dx (the residual's gradient is dy
    itself) and the bias gradient."""
    seed = _seed()
    op = lambda x, b, r: ops.bias_dropout_residual(x, b, r, dropout_rate=DROPOUT, seed=seed)
    x, residual = _normal(0, (rows, hidden), ACTIVATION), _normal(1, (rows, hidden), ACTIVATION)
    bias = _normal(2, (hidden,), PARAM)
    moved = 5 * rows * hidden * _itemsize(ACTIVATION) + 2 * hidden * _itemsize(PARAM)
    return Workload(op, (x, bias, residual), f"{rows}x{hidden}", moved)


def bias_act_dropout_workload(rows: int, hidden: int, activation: ops.Activation) -> Workload:
    """Forward reads x, writes y; backward reads dy and x, writes dx and the bias gradient. relu's backward reads
    the forward's bit mask of y > 0 instead of x (written and read once: one bit per element)."""
    seed = _seed()
    op = lambda x, b: ops.bias_act_dropout(x, b, activation=activation, dropout_rate=DROPOUT, seed=seed)
    x, bias = _normal(0, (rows, hidden), ACTIVATION), _normal(1, (hidden,), PARAM)
    activations = 4 if activation == "relu" else 5
    mask = 2 * rows * ((hidden + 7) // 8) if activation == "relu" else 0
    moved = activations * rows * hidden * _itemsize(ACTIVATION) + mask + 3 * hidden * _itemsize(PARAM)
    return Workload(op, (x, bias), f"{rows}x{hidden}", moved)


def embed_workload(tokens: int, hidden: int, vocab: int, positions: int) -> Workload:
    """Forward reads one table row and one position row per token and writes the output; backward reads dy and
    writes both whole table gradients (rows no token touched are zeros, but still written)."""
    seed = _seed()
    length = min(positions, 128)
    ids = jnp.asarray(np.random.default_rng(0).integers(1, vocab, size=(tokens // length, length)), jnp.int32)
    op = lambda table, pos_table: ops.embed(
        ids, table, pos_table, scale=hidden**0.5, padding_id=0, dropout_rate=DROPOUT, seed=seed, dtype=ACTIVATION
    )
    table, pos_table = _normal(0, (vocab, hidden), PARAM), _normal(1, (positions, hidden), PARAM)
    a, p = _itemsize(ACTIVATION), _itemsize(PARAM)
    moved = tokens * hidden * (2 * p + 2 * a) + (vocab + positions) * hidden * p + 2 * tokens * 4
    return Workload(op, (table, pos_table), f"{tokens} tokens, {vocab}x{hidden} table", moved)


ATTENTION_HEADS = 16
ATTENTION_BATCH = 128


def attn_softmax_workload(batch: int, length: int, causal: bool) -> Workload:
    """Scores (B, 16, L, L) with a (B, 1, 1, L) key-padding mask (lengths L/2 .. L) and dropout. Forward reads
    the scores and the mask, writes y and the probabilities; backward reads dy and the probabilities and writes
    dscores."""
    seed = _seed()
    lengths = np.random.default_rng(0).integers(length // 2, length + 1, size=batch)
    mask = jnp.asarray(np.arange(length)[None, :] < lengths[:, None])[:, None, None, :]
    scale = (HIDDEN // ATTENTION_HEADS) ** -0.5
    op = lambda s: ops.attn_softmax(s, mask, scale=scale, causal=causal, dropout_rate=DROPOUT, seed=seed)
    shape = (batch, ATTENTION_HEADS, length, length)
    elements = batch * ATTENTION_HEADS * length * length
    moved = 6 * elements * _itemsize(ACTIVATION) + batch * length
    return Workload(
        op, (_normal(0, shape, ACTIVATION),), "x".join(map(str, shape)) + (" causal" if causal else ""), moved
    )


def self_attention_workload(batch: int, length: int) -> Workload:
    """qkv (B, L, 3, 16, 64) and its f32 projection bias (3, 16, 64), as the layers pass them, with a (B, L)
    key-padding mask (lengths L/2 .. L), causal, and dropout on the probabilities. Forward reads qkv and writes out
    and lse; backward reads dout, qkv and lse and writes dqkv."""
    seed = _seed()
    lengths = np.random.default_rng(0).integers(length // 2, length + 1, size=batch)
    mask = jnp.asarray(np.arange(length)[None, :] < lengths[:, None])
    op = lambda qkv, bias: ops.self_attention(qkv, mask, bias=bias, causal=True, dropout_rate=DROPOUT, seed=seed)
    shape = (batch, length, 3, ATTENTION_HEADS, HIDDEN // ATTENTION_HEADS)
    tokens = batch * length
    moved = 11 * tokens * HIDDEN * _itemsize(ACTIVATION) + 2 * batch * ATTENTION_HEADS * length * 4 + batch * length
    primals = (_normal(0, shape, ACTIVATION), _normal(1, shape[2:], jnp.float32))
    return Workload(op, primals, "x".join(map(str, shape)) + " causal", moved)


def cross_attention_workload(batch: int, queries: int, keys: int) -> Workload:
    """query (B, Q, 16, 64) with its f32 projection bias (16, 64) and key_value (B, K, 2, 16, 64), as the decoder's
    cross-attention passes them, with a (B, K) key-padding mask (lengths K/2 .. K) and dropout on the
    probabilities. Forward reads query and key_value and writes out and lse; backward reads dout, query, key_value
    and lse and writes dquery and dkey_value (the keep mask counts as redrawn, as for self_attention)."""
    seed = _seed()
    lengths = np.random.default_rng(0).integers(keys // 2, keys + 1, size=batch)
    mask = jnp.asarray(np.arange(keys)[None, :] < lengths[:, None])
    op = lambda query, key_value, bias: ops.cross_attention(
        query, key_value, mask, bias=bias, dropout_rate=DROPOUT, seed=seed
    )
    head_dim = HIDDEN // ATTENTION_HEADS
    query_shape = (batch, queries, ATTENTION_HEADS, head_dim)
    key_value_shape = (batch, keys, 2, ATTENTION_HEADS, head_dim)
    query_tokens, key_tokens = batch * queries, batch * keys
    moved = (
        (5 * query_tokens + 6 * key_tokens) * HIDDEN * _itemsize(ACTIVATION)
        + 2 * batch * ATTENTION_HEADS * queries * 4
        + batch * keys
    )
    primals = (
        _normal(0, query_shape, ACTIVATION),
        _normal(1, key_value_shape, ACTIVATION),
        _normal(2, query_shape[2:], jnp.float32),
    )
    return Workload(op, primals, f"B{batch} Q{queries} K{keys} {ATTENTION_HEADS}x{head_dim}", moved)


def fp8_quantize_workload(rows: int, cols: int) -> Workload:
    """The FFN's hidden activations quantized to e4m3 (no gradient) with a 1,024-step amax history: reads x, writes
    q and q_t (one byte each); the history's reads and writes are small beside them."""
    history = jnp.full((1024,), 100.0, jnp.float32)
    scale = jnp.full((1,), 0.5, jnp.float32)
    op = lambda x: ops.fp8_quantize(x, history, scale, jnp.float8_e4m3fn)
    moved = rows * cols * (_itemsize(ACTIVATION) + 2) + 4 * (2 * 1024 + 2)
    return Workload(op, (_normal(0, (rows, cols), ACTIVATION),), f"{rows}x{cols}", moved, forward_only=True)


def cross_entropy_workload(rows: int, vocab: int) -> Workload:
    """Logits (rows, V) with about 5% pad labels, label smoothing 0.1. Forward reads the real rows' logits and
    every label and writes loss, nll and lse (f32) per row; backward reads the real rows' logits, the labels and
    lse and writes dlogits for every row (zeros at pad rows)."""
    rng = np.random.default_rng(0)
    labels = rng.integers(1, vocab, size=rows)
    labels[rng.random(rows) < 0.05] = 0
    real = int(np.sum(labels != 0))
    labels = jnp.asarray(labels, jnp.int32)
    op = lambda logits: ops.label_smoothed_cross_entropy(logits, labels, epsilon=0.1, pad_id=0)[:2]
    moved = (2 * real + rows) * vocab * _itemsize(ACTIVATION) + 6 * 4 * rows
    return Workload(op, (_normal(0, (rows, vocab), ACTIVATION),), f"{rows}x{vocab}", moved)


CASES: list[Case] = [
    Case("layer_norm", lambda d: layer_norm_workload(TOKENS // d, HIDDEN, residual=False)),
    Case("layer_norm+residual", lambda d: layer_norm_workload(TOKENS // d, HIDDEN, residual=True)),
    Case("layer_norm+bias_dropout_residual", lambda d: bias_dropout_residual_layer_norm_workload(TOKENS // d, HIDDEN)),
    Case("dropout", lambda d: dropout_workload(TOKENS // d, HIDDEN)),
    Case("bias_dropout_residual", lambda d: bias_dropout_residual_workload(TOKENS // d, HIDDEN)),
    Case("bias_act_dropout[relu]", lambda d: bias_act_dropout_workload(TOKENS // d, FFN_HIDDEN, "relu")),
    Case("bias_act_dropout[gelu]", lambda d: bias_act_dropout_workload(TOKENS // d, FFN_HIDDEN, "gelu")),
    Case("bias_act_dropout[gelu_tanh]", lambda d: bias_act_dropout_workload(TOKENS // d, FFN_HIDDEN, "gelu_tanh")),
    Case("embed", lambda d: embed_workload(TOKENS // d, HIDDEN, VOCAB // d, MAX_POSITIONS)),
    Case("attn_softmax[L=64]", lambda d: attn_softmax_workload(ATTENTION_BATCH // d, 64, causal=False)),
    Case("attn_softmax[L=128]", lambda d: attn_softmax_workload(ATTENTION_BATCH // d, 128, causal=False)),
    Case("attn_softmax[L=512]", lambda d: attn_softmax_workload(ATTENTION_BATCH // d, 512, causal=False)),
    Case("attn_softmax_causal[L=512]", lambda d: attn_softmax_workload(ATTENTION_BATCH // d, 512, causal=True)),
    Case("self_attention[L=64]", lambda d: self_attention_workload(ATTENTION_BATCH // d, 64)),
    Case("self_attention[L=128]", lambda d: self_attention_workload(ATTENTION_BATCH // d, 128)),
    Case("cross_attention[L=64]", lambda d: cross_attention_workload(ATTENTION_BATCH // d, 64, 64)),
    Case("cross_attention[L=128]", lambda d: cross_attention_workload(ATTENTION_BATCH // d, 128, 128)),
    Case("cross_entropy", lambda d: cross_entropy_workload(TOKENS // d, VOCAB)),
    Case("fp8_quantize", lambda d: fp8_quantize_workload(TOKENS // d, FFN_HIDDEN)),
    # 341 sentences of 24 tokens: rows a multiple of 8 but not of 16, so q_t's rows are 8-byte aligned
    Case("fp8_quantize[8184 rows]", lambda d: fp8_quantize_workload(8184 // d, FFN_HIDDEN)),
]


# ---- measurement ----------------------------------------------------------------------------------------


def timed_pass(workload: Workload) -> tuple[Callable[[Any, Any], Any], Any]:
    """``(fn, cotangent)``: ``fn(workload.primals, cotangent)`` runs one forward + backward of ``workload`` (its
    forward alone if ``forward_only``), jitted; it compiles for the kernel mode in use at its first call."""
    if workload.forward_only:
        return jax.jit(lambda primals, _: workload.op(*primals)), None
    return common.forward_backward(workload.op, workload.primals)


def measure(workload: Workload, mode: backend.KernelMode, copy_bandwidth: float, quick: bool) -> dict[str, Any]:
    """Times one forward + backward of ``workload`` (its forward alone if ``forward_only``) compiled in kernel
    mode ``mode``."""
    fn, cotangent = timed_pass(workload)
    sampling = dict(warmup=2, samples=5, inner=2) if quick else dict(warmup=5, samples=30, inner=5)
    with backend.use(mode):  # the mode is read when the function is traced, i.e. at its first call
        hlo = fn.lower(workload.primals, cotangent).as_text()
        timing = common.time_call(lambda: fn(workload.primals, cotangent), **sampling)
        kernel_ms = {}
        if jax.default_backend() == "gpu":
            calls = 10
            kernel_ms = kernel_trace.kernel_time_by_name(
                kernel_trace.trace_gpu_kernels(lambda: fn(workload.primals, cotangent), calls), calls
            )
    seconds = timing["median_s"]
    bandwidth = workload.bytes_moved / seconds
    result = {
        "median_ms": 1e3 * seconds,
        "p10_ms": 1e3 * timing["p10_s"],
        "p90_ms": 1e3 * timing["p90_s"],
        "achieved_GBps": bandwidth / 1e9,
        "fraction_of_copy_bandwidth": bandwidth / copy_bandwidth,
        "kernels": sorted(set(re.findall(r"custom_call @(ls_\w+)", hlo))),
    }
    if kernel_ms:
        device_seconds = sum(kernel_ms.values()) / 1e3
        result.update(
            device_ms=1e3 * device_seconds,
            device_fraction_of_copy_bandwidth=workload.bytes_moved / device_seconds / copy_bandwidth,
            kernel_ms=kernel_ms,
        )
    return result


def run_case(case: Case, modes: Sequence[backend.KernelMode], copy_bandwidth: float, quick: bool) -> dict[str, Any]:
    workload = case.workload(QUICK_DIVISOR if quick else 1)
    result: dict[str, Any] = {
        "op": case.op,
        "shape": workload.shape,
        "bytes_moved": workload.bytes_moved,
        "floor_ms": 1e3 * workload.bytes_moved / copy_bandwidth,
    }
    for mode in modes:
        result[mode] = measure(workload, mode, copy_bandwidth, quick)
    if "ffi" in result and "xla" in result:
        result["speedup"] = result["xla"]["median_ms"] / result["ffi"]["median_ms"]
        if "device_ms" in result["ffi"] and "device_ms" in result["xla"]:
            result["device_speedup"] = result["xla"]["device_ms"] / result["ffi"]["device_ms"]
    return result


def _format_row(result: dict[str, Any]) -> str:
    def cell(mode: str) -> str:
        if mode not in result:
            return f"{'-':>24}"
        r = result[mode]
        device = (
            f" dev {r['device_ms']:7.3f} ms {r['device_fraction_of_copy_bandwidth']:6.1%}" if "device_ms" in r else ""
        )
        return f"{r['median_ms']:9.3f} ms {r['fraction_of_copy_bandwidth']:6.1%} copy{device}"

    speedup = f"{result['speedup']:6.2f}x" if "speedup" in result else f"{'-':>7}"
    if "device_speedup" in result:
        speedup += f" (dev {result['device_speedup']:.2f}x)"
    return (
        f"{result['op']:<34} {result['shape']:<28} {result['bytes_moved'] / 1e6:9.1f} MB "
        f"{cell('ffi')}  {cell('xla')}  {speedup}"
    )


def default_modes() -> tuple[backend.KernelMode, ...]:
    """ffi and xla where JAX sees a CUDA device, else xla alone."""
    return ("ffi", "xla") if backend.cuda_visible() else ("xla",)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.bench ops", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common.add_out_argument(parser, "ops")
    parser.add_argument("--quick", action="store_true", help="rows / 64 and few samples (smoke test, runs on CPU)")
    parser.add_argument("--ops", help=f"comma-separated subset of: {', '.join(c.op for c in CASES)}")
    parser.add_argument("--backends", help="comma-separated subset of ffi,xla (default: ffi,xla on CUDA, else xla)")
    args = parser.parse_args(argv)
    args.out = common.out_dir(args.out, parser)

    cases = CASES
    if args.ops is not None:
        wanted = [op for op in args.ops.split(",") if op]
        if not wanted:
            parser.error(f"--ops names no op; give a comma-separated subset of: {', '.join(c.op for c in CASES)}")
        unknown = sorted(set(wanted) - {c.op for c in CASES})
        if unknown:
            parser.error(f"unknown ops: {', '.join(unknown)}")
        cases = [c for c in CASES if c.op in wanted]
    modes = tuple(args.backends.split(",")) if args.backends else default_modes()
    if not set(modes) <= {"ffi", "xla"}:
        parser.error(f"--backends takes ffi and/or xla, got {args.backends}")
    if "ffi" in modes and not backend.cuda_visible():
        parser.error("the ffi backend needs a CUDA device visible to JAX")

    copy = common.copy_bandwidth(1 << 26 if args.quick else 1 << 30)
    print(f"copy bandwidth {copy / 1e9:.0f} GB/s; forward + backward, {', '.join(modes)}")
    print(f"{'op':<34} {'shape':<28} {'moved':>12} {'ffi':>24}  {'xla':>24}  speedup")
    results = []
    for case in cases:
        results.append(run_case(case, modes, copy, args.quick))
        print(_format_row(results[-1]), flush=True)
    path = common.write_result(
        "ops",
        {
            "quick": args.quick,
            "activation_dtype": jnp.dtype(ACTIVATION).name,
            "param_dtype": jnp.dtype(PARAM).name,
            "dropout_rate": DROPOUT,
            "copy_bandwidth_GBps": copy / 1e9,
            "cases": results,
        },
        args.out,
    )
    print(f"wrote {path}")
    return 0
