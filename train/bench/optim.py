"""Optimizer-step benchmark: ls_jax's fused multi-tensor Adan/AdamW against optax, side by side in one process.

``python -m train.bench optim [--out DIR] [--quick] [--models NAME,...]``

One optimizer step (gradients already computed; the new parameters and state returned) on the leaf shapes of
a Transformer-big (6+6 layers, 1024/4096, 16 heads, one shared 32768 x 1024 embedding: 210M parameters), the
same with 12+12 layers (386M) and BERT-base (110M), f32 parameters and gradients. Implementations, each jitted
with params and optimizer state donated so the update can run in place:

  ls_jax_kernel         ls_jax.optim.fused_apply with the CUDA kernel (GPU with the kernels only)
  ls_jax_kernel_update  ls_jax's update + optax.apply_updates with the kernel: what fused_apply saves
  ls_jax_xla            ls_jax.optim.fused_apply with LS_JAX_KERNELS=xla (the TPU/CPU path)
  optax                 optax.adan / optax.adamw: update + optax.apply_updates

for adan, adamw and adan with global-norm clipping at 1.0 (folded into the ls_jax step; optax chains
clip_by_global_norm). Reported per run: median/p10/p90 milliseconds; the kernels the compiled program
launches (fusions and custom calls in the optimized HLO; the ls_optim_step call launches one kernel, two with
clipping) and the ls_* calls among them (so a silent fallback to XLA shows); the bytes a step must move at
least (params read + written, grads read, each moment read + written, one more grad read when clipping) and
that count over the median time against the measured copy bandwidth.
Targets on H100: ls_jax_kernel at least 3x optax.adan, at least 1.3x optax.adamw, at least 80% of copy
bandwidth. Results go to docs/results/optim-<device>.json.

The copy bandwidth is measured per model at the size of the buffers its step touches (params, grads, moments; at
most 1 GiB), in place, so the step and the copy run from the same level of the memory hierarchy.

``--quick`` measures small stand-ins under their own names, with few samples: a smoke test that runs on CPU
(without the kernel): transformer-2e2d-d64 and transformer-4e4d-d64 (2+2 and 4+4 layers of width 64, 1000-token
vocabulary) for the two Transformers and bert-2l-d64 (2 layers of width 64) for BERT-base.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
from typing import Any, Callable, Sequence

import jax
import numpy as np
import optax

import ls_jax.optim as lo
from ls_jax import backend
from train.bench import common

LEARNING_RATE = 1e-4
WEIGHT_DECAY = 0.01
MAX_NORM = 1.0
TARGETS = {"speedup_vs_optax_adan": 3.0, "speedup_vs_optax_adamw": 1.3, "fraction_of_copy_bandwidth": 0.8}


# ---- leaf shapes ------------------------------------------------------------------------------------------


def _attention(d: int) -> list[tuple[int, ...]]:
    return [(d, d), (d,)] * 4  # q, k, v, out: kernel and bias


def _feed_forward(d: int, ffn: int) -> list[tuple[int, ...]]:
    return [(d, ffn), (ffn,), (ffn, d), (d,)]


def _layer_norms(d: int, count: int) -> list[tuple[int, ...]]:
    return [(d,), (d,)] * count


def transformer_shapes(layers: int, d: int, ffn: int, vocab: int) -> list[tuple[int, ...]]:
    """Encoder-decoder Transformer (pre- or post-LN alike), one embedding shared by encoder, decoder and output."""
    shapes = [(vocab, d)]
    for _ in range(layers):
        shapes += _attention(d) + _layer_norms(d, 2) + _feed_forward(d, ffn)
    shapes += _layer_norms(d, 1)
    for _ in range(layers):
        shapes += _attention(d) + _attention(d) + _layer_norms(d, 3) + _feed_forward(d, ffn)
    return shapes + _layer_norms(d, 1)


def bert_shapes(layers: int, d: int, ffn: int, vocab: int, positions: int = 512) -> list[tuple[int, ...]]:
    """BERT encoder: word, position and token-type embeddings with LayerNorm, layers, pooler."""
    shapes = [(vocab, d), (positions, d), (2, d)] + _layer_norms(d, 1)
    for _ in range(layers):
        shapes += _attention(d) + _layer_norms(d, 2) + _feed_forward(d, ffn)
    return shapes + [(d, d), (d,)]


@dataclasses.dataclass(frozen=True)
class Model:
    """A benchmarked model's leaf shapes, and the small stand-in ``--quick`` measures under its own name."""

    shapes: Callable[[], list[tuple[int, ...]]]
    quick_name: str
    quick_shapes: Callable[[], list[tuple[int, ...]]]

    def measured(self, name: str, quick: bool) -> tuple[str, list[tuple[int, ...]]]:
        """(the name results are reported under, the leaf shapes measured)."""
        return (self.quick_name, self.quick_shapes()) if quick else (name, self.shapes())


MODELS: dict[str, Model] = {
    "transformer-big": Model(
        lambda: transformer_shapes(6, 1024, 4096, 32768),
        "transformer-2e2d-d64",
        lambda: transformer_shapes(2, 64, 256, 1000),
    ),
    # Twice the leaves: the XLA fallback's fusion once slowed down with the leaf count (ls_jax/optim/_engine.py).
    "transformer-big-12e12d": Model(
        lambda: transformer_shapes(12, 1024, 4096, 32768),
        "transformer-4e4d-d64",
        lambda: transformer_shapes(4, 64, 256, 1000),
    ),
    "bert-base": Model(lambda: bert_shapes(12, 768, 3072, 30522), "bert-2l-d64", lambda: bert_shapes(2, 64, 256, 1000)),
}
COPY_BYTES = 1 << 30  # the largest copy measured: enough to reach a GPU's bandwidth


# ---- implementations --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    """One optimizer configuration: the ls_jax and the optax transformation computing the same step."""

    name: str
    moments: int  # f32 workspaces: adan m, v, n, previous gradient; adamw mu, nu
    clip: bool
    ls_jax: Callable[[], Any]
    optax: Callable[[], Any]


VARIANTS = [
    Variant(
        "adan",
        4,
        False,
        lambda: lo.adan(LEARNING_RATE, eps_root=1e-8, weight_decay=WEIGHT_DECAY),
        lambda: optax.adan(LEARNING_RATE, weight_decay=WEIGHT_DECAY),
    ),
    Variant(
        "adamw",
        2,
        False,
        lambda: lo.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY),
        lambda: optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY),
    ),
    Variant(
        "adan_clip",
        4,
        True,
        lambda: lo.adan(LEARNING_RATE, eps_root=1e-8, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_NORM),
        lambda: optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adan(LEARNING_RATE, weight_decay=WEIGHT_DECAY)),
    ),
]


@dataclasses.dataclass(frozen=True)
class Implementation:
    """How a variant runs: whose transformation, under which kernel mode, through fused_apply or update."""

    name: str
    library: str  # the Variant field holding the transformation: "ls_jax" or "optax"
    mode: backend.KernelMode
    fused: bool
    needs_kernels: bool


IMPLEMENTATIONS = [
    Implementation("ls_jax_kernel", "ls_jax", "ffi", fused=True, needs_kernels=True),
    Implementation("ls_jax_kernel_update", "ls_jax", "ffi", fused=False, needs_kernels=True),
    Implementation("ls_jax_xla", "ls_jax", "xla", fused=True, needs_kernels=False),
    Implementation("optax", "optax", "xla", fused=False, needs_kernels=False),
]


def _update_then_apply(tx):
    def step(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


# ---- measurement ------------------------------------------------------------------------------------------


def kernel_count(hlo_text: str) -> int:
    """Kernels the optimized HLO launches: fusions and custom calls (fused computations hold neither)."""
    return len(re.findall(r"\s(?:fusion|custom-call)\(", hlo_text))


def working_set_bytes(shapes: Sequence[tuple[int, ...]]) -> int:
    """The f32 buffers the largest variant's step touches: params, grads and every moment."""
    return sum(int(np.prod(shape)) for shape in shapes) * 4 * (2 + max(variant.moments for variant in VARIANTS))


def step_bytes(shapes: Sequence[tuple[int, ...]], moments: int, clip: bool) -> int:
    """The least a step moves with f32 params and grads: p read + written, g read (twice when clipping),
    every f32 moment read + written."""
    elements = sum(int(np.prod(shape)) for shape in shapes)
    return elements * (4 * 2 + 4 * (2 if clip else 1) + 4 * 2 * moments)


def _tree(shapes: Sequence[tuple[int, ...]], seed: int, scale: float) -> dict[str, jax.Array]:
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return {f"{i:04d}": scale * jax.random.normal(key, shape) for i, (key, shape) in enumerate(zip(keys, shapes))}


def measure(
    shapes, variant: Variant, implementation: Implementation, copy_bandwidth: float, quick: bool
) -> dict[str, Any]:
    params, grads = _tree(shapes, 0, 0.02), _tree(shapes, 1, 1e-3)
    tx = getattr(variant, implementation.library)()
    step_fn = functools.partial(lo.fused_apply, tx) if implementation.fused else _update_then_apply(tx)
    with backend.use(implementation.mode):
        step = jax.jit(step_fn, donate_argnums=(1, 2))
        state = tx.init(params)
        compiled = step.lower(grads, state, params).compile()
    hlo = compiled.as_text()
    carry = {"params": params, "state": state}

    def call():
        carry["params"], carry["state"] = compiled(grads, carry["state"], carry["params"])
        return carry["params"]

    timing = common.time_call(call, warmup=2 if quick else 5, samples=3 if quick else 30, inner=1 if quick else 5)
    moved = step_bytes(shapes, variant.moments, variant.clip)
    bandwidth = moved / timing["median_s"]
    return {
        "median_ms": timing["median_s"] * 1e3,
        "p10_ms": timing["p10_s"] * 1e3,
        "p90_ms": timing["p90_s"] * 1e3,
        "kernels": kernel_count(hlo),
        "ls_kernels": sorted(set(re.findall(r'custom_call_target="(ls_\w+)"', hlo))),
        "bytes": moved,
        "GBps": bandwidth / 1e9,
        "fraction_of_copy_bandwidth": bandwidth / copy_bandwidth,
    }


def _speedups(results: dict[str, dict[str, dict[str, Any]]], best: str) -> dict[str, float]:
    """Median-time ratios of the optax runs (and of adan's kernel run without fused apply) to ``best``."""
    ratios = {}
    for variant in results:
        mine = results[variant].get(best)
        if mine is None:
            continue
        for other in ("optax", "ls_jax_xla", "ls_jax_kernel_update"):
            if other in results[variant] and other != best:
                ratios[f"{variant}: {best} vs {other}"] = results[variant][other]["median_ms"] / mine["median_ms"]
    if best in results.get("adan", {}) and "optax" in results.get("adamw", {}):
        adamw_optax, adan_best = results["adamw"]["optax"]["median_ms"], results["adan"][best]["median_ms"]
        ratios[f"adan {best} vs adamw optax"] = adamw_optax / adan_best
    return ratios


def _targets(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The H100 targets, judged on the kernel runs (None where the kernel did not run)."""
    kernel = {v: r["ls_jax_kernel"] for v, r in results.items() if "ls_jax_kernel" in r}
    if "adan" not in kernel or "adamw" not in kernel:
        return {"evaluated": False}
    achieved = {
        "speedup_vs_optax_adan": results["adan"]["optax"]["median_ms"] / kernel["adan"]["median_ms"],
        "speedup_vs_optax_adamw": results["adamw"]["optax"]["median_ms"] / kernel["adamw"]["median_ms"],
        "fraction_of_copy_bandwidth": min(r["fraction_of_copy_bandwidth"] for r in kernel.values()),
    }
    met = {name: achieved[name] >= target for name, target in TARGETS.items()}
    return {"evaluated": True, "achieved": achieved, "target": TARGETS, "met": met}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.bench optim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common.add_out_argument(parser, "optim")
    parser.add_argument("--quick", action="store_true", help="small models and few samples (smoke test, runs on CPU)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of: {', '.join(MODELS)}")
    args = parser.parse_args(argv)
    args.out = common.out_dir(args.out, parser)
    models = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")

    kernels = jax.default_backend() == "gpu" and backend.kernels_enabled()
    print(f"kernels {'on' if kernels else 'off'}", flush=True)
    report = {}
    for chosen in models:
        model, shapes = MODELS[chosen].measured(chosen, args.quick)
        copy_bytes = min(working_set_bytes(shapes), COPY_BYTES)
        copy = common.copy_bandwidth(copy_bytes)
        print(f"{model}: copy bandwidth {copy / 1e9:.1f} GB/s over {copy_bytes / 2**20:.1f} MiB", flush=True)
        results: dict[str, dict[str, dict[str, Any]]] = {}
        for variant in VARIANTS:
            results[variant.name] = {}
            for implementation in IMPLEMENTATIONS:
                if implementation.needs_kernels and not kernels:
                    continue
                result = measure(shapes, variant, implementation, copy, args.quick)
                results[variant.name][implementation.name] = result
                print(
                    f"{model:16s} {variant.name:10s} {implementation.name:21s} {result['median_ms']:9.3f} ms "
                    f"{result['kernels']:5d} kernels {result['fraction_of_copy_bandwidth']:6.1%} of copy",
                    flush=True,
                )
        best = "ls_jax_kernel" if kernels else "ls_jax_xla"
        report[model] = {
            "parameters": int(sum(np.prod(shape) for shape in shapes)),
            "leaves": len(shapes),
            "copy_bandwidth_GBps": copy / 1e9,
            "copy_bytes": copy_bytes,
            "results": results,
            "speedups": _speedups(results, best),
            "targets": _targets(results),
        }
        for label, ratio in report[model]["speedups"].items():
            print(f"{model:16s} {label}: {ratio:.2f}x", flush=True)
    path = common.write_result(
        "optim",
        {
            "quick": args.quick,
            "kernels": kernels,
            "dtype": "float32",
            "learning_rate": LEARNING_RATE,
            "weight_decay": WEIGHT_DECAY,
            "max_grad_norm": MAX_NORM,
            "models": report,
        },
        args.out,
    )
    print(f"wrote {path}")
    return 0
