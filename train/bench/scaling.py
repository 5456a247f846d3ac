"""Weak scaling of the harness's data-parallel training step: ``python -m train.bench scaling``.

For N = 1, 2, 4, ... devices (the first N of this host) each model trains the same batch per device, so the global
batch grows with N. The step is exactly the one `python -m train.wmt` / `train.imdb` run (`train.harness.step`,
`train.harness.parallel`: shard_map over the data axis, one gradient all-reduce, or ZeRO-1 with ``sharded``), on
synthetic tokens, bf16 with f32 master weights, gradients sent in bf16, and AdamW. Per (model, implementation,
optimizer mode, N): median step time, tokens per second, weak-scaling efficiency (step time at 1 device / at N),
XLA's memory analysis of the compiled step per device, and the optimizer state's bytes per device. An all-reduce
probe measures the bus bandwidth of a large psum at each N.

Unless ``--no-split``, per (model, implementation) the step's pieces are timed alone (`scaling_pieces`: forward,
forward + backward, optimizer on one device; the gradient all-reduce at each N), giving each replicated row a time
split, and one layer of each repeated kind is timed with its gradients' all-reduce, from which the overlap model of
`overlap` estimates the backward with its communication at each N, set against the measured one (step time minus
forward and optimizer).

``--variant-xla-flags FLAGS`` first runs, in a child process whose XLA_FLAGS add FLAGS, the ls_jax_ffi replicated
step of each model (or of ``--variant-models``) at the largest of ``--devices``; its rows join the results,
marked with their flags.

Models: ``big-6e6d`` (Transformer-big, 6 + 6 layers, ``--tokens-per-device`` target tokens per device in sentences
of ``--sentence-length``, a ``--vocab`` vocabulary; ``tiny-2e2d`` the same shape of step for a CPU) and
``bert-base`` (sequence classification, ``--bert-batch`` rows of ``--bert-length`` tokens; ``bert-tiny`` for a CPU).
Compilations run side by side (``--compile-threads``); set JAX_COMPILATION_CACHE_DIR to keep them for the next run.

One module on purpose: the sweep over device counts, the timed pieces and the tables of one report read the same
rows; the pieces it times and the overlap model live in `train.bench.steps`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from ls_jax import backend
from ls_jax.optim import shard_optimizer
from train.bench import common
from train.bench.steps import overlap, scaling_models, scaling_pieces
from train.costs.precision import gradient_comm_dtype
from train.harness.cli import GRAD_BUCKET_MB
from train.harness.optimizer import make_optimizer
from train.harness.parallel import DATA_AXIS, DataParallel, StateLayout
from train.harness.step import TrainState, make_train_step
from train.harness.step_compiler import StepCompiler

DEFAULT_MODELS = ("big-6e6d", "bert-base")
IMPLEMENTATIONS = {"ls_jax_ffi": "ffi", "ls_jax_xla": "xla"}
MODES = ("replicated", "sharded")
NVLINK_GB_PER_S = {"h100": 450.0, "h200": 450.0, "a100": 300.0}  # datasheet NVLink bandwidth per direction
SPLIT_METHOD = {
    "forward_ms": "the loss of one device's micro-batch (dropout on), jitted alone on one device",
    "backward_ms": "the gradients of that loss jitted alone on one device, minus forward_ms",
    "allreduce_ms": "psum under shard_map over the N devices of a tree with the gradients' shapes and dtype, "
    "jitted alone (0 at N = 1)",
    "optimizer_ms": "ls_jax.optim.fused_apply_scaled on f32 gradients (clipping and the gradient norm included), "
    "state donated, one device",
    "rest_ms": "step time minus the four pieces: negative where the step overlaps them",
}
ESTIMATE_METHOD = (
    "overlap.model_stages/overlapped_backward: per layer kind one layer's backward (its forward + backward jitted "
    "alone minus its forward, on one device's activations, 0 if negative) and the psum of its parameter-shaped "
    "gradients over N devices, jitted alone; the backward outside the repeated layers = backward_ms minus the layers' "
    "sum, run first; the other parameters' gradients all-reduced last. measured_ms = step time at N minus forward_ms "
    "and optimizer_ms. serial_ms: the same stages with no overlap. *_from_bandwidth: each all-reduce's time taken as "
    "2 (N - 1) / N * its bytes / the probe's bus bandwidth instead of timed."
)


def _optimizer(mode: str, devices: int) -> tuple[optax.GradientTransformation, Any]:
    tx = make_optimizer(
        "adamw", optax.constant_schedule(1e-4), weight_decay=0.01, clip_norm=1.0, master_dtype=jnp.bfloat16
    )
    sharded = shard_optimizer(tx, DATA_AXIS, num_shards=devices, average_gradients=False) if mode == "sharded" else None
    return tx, sharded


def _state(params: Any, tx: Any, sharded: Any, layout: StateLayout) -> TrainState:
    def create(params):
        return TrainState.create(
            params,
            tx,
            jax.random.PRNGKey(1),
            fp16=False,
            param_dtype=jnp.bfloat16,
            init_optimizer=None if sharded is None else sharded.init,
        )

    return jax.jit(create, out_shardings=layout.shardings(jax.eval_shape(create, params)))(params)


def step_row(
    key: tuple,
    model: scaling_models.BenchModel,
    params: Any,
    mode: str,
    devices: list[Any],
    steps: int,
    grad_bucket_bytes: int,
) -> scaling_pieces.Pending:
    """The compiled step of ``model`` on ``devices``, timed over 5 samples of ``steps`` steps after warm-up; the
    gradients summed in buckets of ``grad_bucket_bytes`` inside the backward."""
    parallel = DataParallel(Mesh(np.asarray(devices), (DATA_AXIS,)))
    tx, sharded = _optimizer(mode, len(devices))
    layout = StateLayout(parallel, sharded)
    holder = {"state": _state(params, tx, sharded, layout)}
    global_batch = {name: np.concatenate([value] * len(devices), axis=1) for name, value in model.batch.items()}
    batch = parallel.put_batch(global_batch, row_axis=1)
    step = make_train_step(
        model.loss_fn,
        tx,
        axis_name=DATA_AXIS,
        sharded_optimizer=sharded,
        grad_bucket_bytes=grad_bucket_bytes,
        grad_comm_dtype=gradient_comm_dtype(None, "bf16"),  # as the CLIs' bf16 runs send them
    )
    compiler = StepCompiler(step, layout, holder["state"])

    def finish(compiled) -> dict[str, Any]:
        def run(count: int):
            for _ in range(count):
                holder["state"], metrics = compiled(holder["state"], batch)
            return jax.block_until_ready(metrics)

        run(3)
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            metrics = run(steps)
            samples.append((time.perf_counter() - start) / steps)
        step_s = float(np.median(samples))
        memory = compiled.memory_analysis()
        opt_bytes = scaling_models.tree_bytes(holder["state"].opt_state) // (len(devices) if sharded else 1)
        holder.clear()  # the state's memory goes back before the next configuration runs
        return {
            "step_ms": 1e3 * step_s,
            "step_ms_samples": [1e3 * s for s in samples],
            "tokens_per_s": model.tokens_per_device * len(devices) / step_s,
            "loss": float(metrics["loss"] / max(float(metrics["weight"]), 1.0)),
            "memory_per_device_bytes": None
            if memory is None
            else int(
                memory.argument_size_in_bytes
                + memory.output_size_in_bytes
                + memory.temp_size_in_bytes
                - memory.alias_size_in_bytes
            ),
            "optimizer_state_bytes_per_device": opt_bytes,
        }

    return scaling_pieces.Pending(key, compiler.lower(holder["state"], batch), finish, parallel.compiler_options())


def allreduce_probe(devices: list[Any], num_bytes: int) -> scaling_pieces.Pending:
    """Bus bandwidth of a bf16 psum of ``num_bytes`` per device: 2 (N - 1) / N * bytes / time."""
    n = len(devices)
    like = jax.ShapeDtypeStruct((num_bytes // 2,), jnp.bfloat16)
    pending = scaling_pieces.allreduce(("probe", n), like, devices)
    kind = common.device_slug(devices[0].device_kind)

    def finish(compiled) -> dict[str, Any]:
        ms = pending.finish(compiled)["ms"]
        bus = 2 * (n - 1) / n * num_bytes / (ms / 1e3) / 1e9
        sheet = NVLINK_GB_PER_S.get(kind)
        return {
            "devices": n,
            "bytes": num_bytes,
            "ms": ms,
            "bus_gb_per_s": bus,
            "datasheet_gb_per_s": sheet,
            "fraction_of_datasheet": None if sheet is None else bus / sheet,
        }

    return scaling_pieces.Pending(pending.key, pending.lowered, finish)


def plan(args: argparse.Namespace, devices: list[Any], counts: list[int]) -> tuple[list[scaling_pieces.Pending], dict]:
    """Every measurement the run makes (lowered, not compiled) and each model's layers and rest of the params."""
    pending: list[scaling_pieces.Pending] = [
        allreduce_probe(devices[:n], args.allreduce_mb << 20) for n in counts if n > 1
    ]
    shapes: dict[str, Any] = {}
    buckets = bucket_sizes(args.grad_bucket_mb)
    for name in args.models.split(","):
        rows, length = scaling_models.rows_and_length(
            name, args.tokens_per_device, args.bert_batch, args.bert_length, args.sentence_length
        )
        model = scaling_models.build(name, rows, length, args.vocab)
        with backend.use("xla"):  # the same values whichever implementation trains them
            params = model.init_params()
        for implementation in args.implementations.split(","):
            with backend.use(IMPLEMENTATIONS[implementation]):
                for n in counts:
                    for mode in modes_of(args, name, implementation, n):
                        for mb in buckets if n > 1 else buckets[:1]:  # one device sums nothing over devices
                            pending.append(
                                step_row(
                                    ("step", name, implementation, mode, n, mb),
                                    model,
                                    params,
                                    mode,
                                    devices[:n],
                                    args.steps,
                                    int(mb * 2**20),
                                )
                            )
                if args.split:
                    pending.extend(_split_pieces(name, implementation, model, params, devices[0]))
        if args.split:
            state_params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.bfloat16), params)
            first, rest = scaling_models.layer_params(model, state_params)
            shapes[name] = {"model": model, "params": state_params, "layers": first, "rest": rest}
            for n in (n for n in counts if n > 1):
                pending.append(scaling_pieces.allreduce(("allreduce", name, n), state_params, devices[:n]))
                for kind, tree in [*first.items(), ("rest", rest)]:
                    pending.append(scaling_pieces.allreduce(("allreduce", name, n, kind), tree, devices[:n]))
    return pending, shapes


def _split_pieces(
    name: str, implementation: str, model: scaling_models.BenchModel, params: Any, device: Any
) -> list[scaling_pieces.Pending]:
    tx, _ = _optimizer("replicated", 1)
    layout = StateLayout(DataParallel(Mesh(np.asarray([device]), (DATA_AXIS,))))
    state = _state(params, tx, None, layout)
    first, _ = scaling_models.layer_params(model, state.params)
    key = ("piece", name, implementation)
    return [
        *scaling_pieces.step_pieces(key, model, state, tx),
        *(p for kind in model.layers for p in scaling_pieces.layer_pieces(key, kind, first[kind.name])),
    ]


def bucket_sizes(text: str) -> list[float]:
    """The ``--grad-bucket-mb`` values, each a finite number > 0 (one line naming the bad one otherwise)."""
    try:
        sizes = [float(value) for value in text.split(",")]
    except ValueError:
        raise SystemExit(f"--grad-bucket-mb {text}: give MiB as numbers, comma-separated (e.g. 25,100000)") from None
    low, high = GRAD_BUCKET_MB
    bad = [size for size in sizes if not low <= size <= high]  # also refuses nan
    if bad:
        raise SystemExit(f"--grad-bucket-mb {text}: each size must be from {low:g} to {high:g} MiB, got {bad[0]:g}")
    return sizes


def modes_of(args: argparse.Namespace, model: str, implementation: str, devices: int) -> list[str]:
    """The optimizer modes of (model, implementation) on ``devices``: --modes, with sharded only where
    --sharded-for allows and on more than one device (on one it is the replicated step with extra copies; its
    rows' efficiency is against the replicated 1-device step)."""
    allowed = devices > 1 and (args.sharded_for == "all" or f"{model}:{implementation}" in args.sharded_for.split(","))
    return [mode for mode in args.modes.split(",") if mode != "sharded" or allowed]


def assemble(measured: dict[tuple, dict], shapes: dict, flags: str) -> dict[str, list]:
    """The rows, probes, pieces and estimates of the JSON from the measurements keyed as `plan` keys them."""
    results, pieces, estimates = [], [], []
    for key, value in measured.items():
        if key[0] == "step":
            _, name, implementation, mode, n, mb = key
            results.append(
                {
                    "model": name,
                    "implementation": implementation,
                    "mode": mode,
                    "devices": n,
                    "grad_bucket_mb": mb,
                    "xla_flags": flags,
                    **value,
                }
            )
    for name, info in shapes.items():
        for implementation in sorted({r["implementation"] for r in results if r["model"] == name}):
            piece = {
                part: measured[("piece", name, implementation, part)]["ms"]
                for part in ("forward", "forward_backward", "optimizer")
            }
            layers = {
                kind.name: {
                    "count": kind.count,
                    "forward_ms": measured[("piece", name, implementation, kind.name, "forward")]["ms"],
                    "forward_backward_ms": measured[("piece", name, implementation, kind.name, "forward_backward")][
                        "ms"
                    ],
                    "gradient_bytes": scaling_models.tree_bytes(info["layers"][kind.name]),
                }
                for kind in info["model"].layers
            }
            pieces.append(
                {
                    "model": name,
                    "implementation": implementation,
                    **{f"{k}_ms": v for k, v in piece.items()},
                    "layers": layers,
                    "rest_gradient_bytes": scaling_models.tree_bytes(info["rest"]),
                }
            )
            for row in results:
                if (row["model"], row["implementation"], row["mode"]) == (name, implementation, "replicated"):
                    n = row["devices"]
                    allreduce_ms = measured[("allreduce", name, n)]["ms"] if n > 1 else 0.0
                    row["split"] = scaling_pieces.split_of_step(row["step_ms"], piece, allreduce_ms)
                    estimates.append(estimate(row, piece, layers, measured, info))
    return {"results": results, "pieces": pieces, "backward_estimate": estimates}


def estimate(row: dict, piece: dict, layers: dict, measured: dict, info: dict) -> dict[str, Any]:
    """The overlap model's backward at the row's N against the measured one (`overlap.model_stages`), with each
    all-reduce timed alone and, as the study derives it, from its bytes and the probe's bus bandwidth."""
    name, n = row["model"], row["devices"]
    bytes_of = {
        **{kind: value["gradient_bytes"] for kind, value in layers.items()},
        "rest": scaling_models.tree_bytes(info["rest"]),
    }
    timed = lambda kind: measured[("allreduce", name, n, kind)]["ms"] if n > 1 else 0.0  # noqa: E731
    bus = measured[("probe", n)]["bus_gb_per_s"] if n > 1 else math.inf
    from_bandwidth = lambda kind: 2 * (n - 1) / n * bytes_of[kind] / (bus * 1e9) * 1e3  # noqa: E731
    backward = piece["forward_backward"] - piece["forward"]
    measured_ms = row["step_ms"] - piece["forward"] - piece["optimizer"]
    out = {
        "model": name,
        "implementation": row["implementation"],
        "devices": n,
        "grad_bucket_mb": row["grad_bucket_mb"],
        "xla_flags": row["xla_flags"],
        "measured_ms": measured_ms,
    }
    for suffix, comm in (("", timed), ("_from_bandwidth", from_bandwidth)):
        per_kind = [
            (kind.name, kind.count, layer_backward(layers[kind.name]), comm(kind.name)) for kind in info["model"].layers
        ]
        stages = overlap.model_stages(backward, per_kind, comm("rest"))
        compute, sends = [s[1] for s in stages], [s[2] for s in stages]
        estimated = overlap.overlapped_backward(compute, sends)
        out.update(
            {
                f"stages{suffix}": [{"name": s[0], "compute_ms": s[1], "comm_ms": s[2]} for s in stages],
                f"estimated{suffix}_ms": estimated,
                f"serial{suffix}_ms": sum(compute) + sum(sends),
                f"relative_error{suffix}": overlap.relative_error(estimated, measured_ms),
            }
        )
    return out


def layer_backward(layer: dict[str, float]) -> float:
    """One layer's backward: its forward + backward minus its forward, 0 where timing noise makes that negative
    (a layer too small to time, as on a CPU)."""
    return max(layer["forward_backward_ms"] - layer["forward_ms"], 0.0)


def efficiencies(results: list[dict[str, Any]]) -> None:
    """Adds ``efficiency`` = step time at 1 device / at N, against the 1-device row of the same model,
    implementation and mode without extra XLA flags, else the replicated one (named in ``efficiency_base``), and
    ``exposed_comm_ms`` = step time at N - at 1 device: the communication the backward did not hide."""
    base = {
        (r["model"], r["implementation"], r["mode"]): r["step_ms"]
        for r in results
        if r["devices"] == 1 and not r.get("variant")
    }
    for r in results:
        for mode in (r["mode"], "replicated"):
            one = base.get((r["model"], r["implementation"], mode))
            if one is not None:
                r["efficiency"], r["efficiency_base"] = one / r["step_ms"], f"{mode}, 1 device"
                r["exposed_comm_ms"] = r["step_ms"] - one
                break
        else:
            r["efficiency"], r["efficiency_base"], r["exposed_comm_ms"] = None, None, None


def run_variant(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The ls_jax_ffi replicated rows at the largest --devices from a child process whose XLA_FLAGS add
    --variant-xla-flags (XLA reads its flags once per process). Runs before this process uses a device."""
    if not args.devices:
        raise SystemExit("--variant-xla-flags needs --devices (the child runs at the largest count)")
    largest = max(int(c) for c in args.devices.split(","))
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable,
            "-m",
            "train.bench",
            "scaling",
            "--models",
            args.variant_models or args.models,
            "--implementations",
            "ls_jax_ffi",
            "--modes",
            "replicated",
            "--devices",
            str(largest),
            "--no-split",
            "--no-plot",
            "--steps",
            str(args.steps),
            "--tokens-per-device",
            str(args.tokens_per_device),
            "--bert-batch",
            str(args.bert_batch),
            "--bert-length",
            str(args.bert_length),
            "--allreduce-mb",
            str(args.allreduce_mb),
            "--grad-bucket-mb",
            str(args.grad_bucket_mb),
            "--compile-threads",
            str(args.compile_threads),
            "--out",
            out,
        ]
        flags = " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), args.variant_xla_flags]))
        print(f"variant: XLA_FLAGS={flags!r}", flush=True)
        subprocess.run(command, check=True, env={**os.environ, "XLA_FLAGS": flags})
        (path,) = Path(out).glob("scaling-*.json")
        rows = json.loads(path.read_text())["results"]
    return [{**row, "variant": args.variant_xla_flags} for row in rows]


def device_counts(available: int, requested: str | None) -> list[int]:
    """1, 2, 4, ... up to the devices there are, or the given comma-separated counts (each checked)."""
    if requested:
        counts = [int(c) for c in requested.split(",")]
        if any(c > available or c < 1 for c in counts):
            raise SystemExit(f"--devices {requested}: this host has {available} devices")
        return counts
    return [2**k for k in range(int(math.log2(available)) + 1)]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m train.bench scaling", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"of {', '.join(scaling_models.MODELS)}")
    parser.add_argument(
        "--implementations",
        help=f"comma-separated subset of {', '.join(IMPLEMENTATIONS)} (default: both with a CUDA device, else "
        "ls_jax_xla)",
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--sharded-for", default="all", help="MODEL:IMPLEMENTATION,... that get sharded rows")
    parser.add_argument("--devices", help="comma-separated device counts (default 1, 2, 4, ... up to all)")
    parser.add_argument("--tokens-per-device", type=int, default=8192, help="big-6e6d target tokens per device")
    parser.add_argument(
        "--sentence-length", type=int, default=64, help="big-6e6d tokens per sentence, source and target (default 64)"
    )
    parser.add_argument(
        "--vocab",
        type=int,
        default=32768,
        help="big-6e6d vocabulary (default 32768, a WMT vocabulary; `train.wmt --data synthetic` trains 512 pieces)",
    )
    parser.add_argument("--bert-batch", type=int, default=32)
    parser.add_argument("--bert-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed sample (5 samples)")
    parser.add_argument("--allreduce-mb", type=int, default=256)
    parser.add_argument(
        "--grad-bucket-mb",
        default="25",
        help="MiB of gradients per collective inside the backward; several, comma-separated (e.g. 25,100000), are "
        "timed side by side at each N > 1; one above the gradients' size sums them after the whole backward",
    )
    parser.add_argument("--no-split", dest="split", action="store_false", help="no pieces, no backward estimate")
    parser.add_argument("--variant-xla-flags", help="also run the ffi replicated rows with these XLA flags added")
    parser.add_argument("--variant-models", help="models of the variant rows (default: --models)")
    parser.add_argument("--compile-threads", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--tag", help="name the file scaling-<device>x<N>-<TAG>.json (N: devices of this host)")
    parser.add_argument("--no-plot", dest="plot", action="store_false")
    common.add_out_argument(parser, "scaling")
    args = parser.parse_args(argv)
    args.out = common.out_dir(args.out, parser)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    unknown = sorted(set((args.implementations or "").split(",")) - set(IMPLEMENTATIONS) - {""})
    if unknown:
        raise SystemExit(
            f"--implementations {args.implementations}: unknown {', '.join(unknown)}; choose from "
            f"{', '.join(IMPLEMENTATIONS)}"
        )
    bucket_sizes(args.grad_bucket_mb)  # a bad value stops the run before any child or compilation starts
    variant_rows = run_variant(args) if args.variant_xla_flags else []
    if args.implementations is None:  # the ffi implementation needs the CUDA kernels; asked once run_variant is done
        args.implementations = ",".join(IMPLEMENTATIONS) if backend.cuda_visible() else "ls_jax_xla"
    devices = jax.devices()
    counts = device_counts(len(devices), args.devices)
    started = time.perf_counter()
    pending, shapes = plan(args, devices, counts)
    print(f"compiling {len(pending)} programs, {args.compile_threads} at a time", flush=True)
    measured = scaling_pieces.compile_all(pending, args.compile_threads)
    tables = assemble(measured, shapes, os.environ.get("XLA_FLAGS", ""))
    tables["results"] += variant_rows
    efficiencies(tables["results"])
    probes = [measured[("probe", n)] for n in counts if n > 1]
    path = common.write_result(
        "scaling",
        {
            **tables,
            "allreduce": probes,
            "method": {"split": SPLIT_METHOD, "backward_estimate": ESTIMATE_METHOD},
            "wall_s": time.perf_counter() - started,
            "config": {**vars(args), "out": str(args.out)},
        },
        args.out,
    )
    named = path.with_name(f"scaling-{common.device_slug()}x{len(devices)}{'-' + args.tag if args.tag else ''}.json")
    path = path.rename(named)
    report(tables, probes)
    if args.plot:
        plot(tables["results"], path.with_suffix(".png"), devices[0].device_kind)
    print(f"wrote {path}")
    return 0


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value


def report(tables: dict[str, list], probes: list[dict]) -> None:
    for probe in probes:
        print(f"all-reduce over {probe['devices']}: {probe['bus_gb_per_s']:.0f} GB/s bus bandwidth")
    for r in tables["results"]:
        split = " ".join(f"{k[:-3]} {v:.2f}" for k, v in r.get("split", {}).items())
        print(
            f"{r['model']:9s} {r['implementation']:10s} {r['mode']:10s} N={r['devices']} buckets "
            f"{r['grad_bucket_mb']:g} MiB{' ' + r['variant'] if r.get('variant') else ''}: {r['step_ms']:7.2f} ms, "
            f"{r['tokens_per_s'] / 1e3:7.1f}k tok/s, efficiency {r['efficiency'] or float('nan'):.2f}, exposed "
            f"communication {_or_nan(r['exposed_comm_ms']):.2f} ms, memory "
            f"{(r['memory_per_device_bytes'] or 0) / 2**30:.2f} GiB {split}",
            flush=True,
        )
    for e in tables["backward_estimate"]:
        print(
            f"{e['model']:9s} {e['implementation']:10s} N={e['devices']}: backward estimated {e['estimated_ms']:.2f}"
            f" ms ({100 * e['relative_error']:+.1f}%; from bandwidth {e['estimated_from_bandwidth_ms']:.2f} ms, "
            f"{100 * e['relative_error_from_bandwidth']:+.1f}%), measured {e['measured_ms']:.2f} ms",
            flush=True,
        )


def plot(results: list[dict[str, Any]], path: Path, device_kind: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    label = lambda r: (r["model"], r["implementation"], r["mode"], r.get("variant") or "")  # noqa: E731
    several = len({r["grad_bucket_mb"] for r in results if r["devices"] > 1}) > 1
    for key in sorted({label(r) for r in results}):
        rows = [r for r in results if label(r) == key]
        one = [r for r in rows if r["devices"] == 1]
        for mb in sorted({r["grad_bucket_mb"] for r in rows if r["devices"] > 1}) or [None]:
            many = [r for r in rows if r["devices"] > 1 and r["grad_bucket_mb"] == mb]
            line = sorted(one + many, key=lambda r: r["devices"])
            name = " ".join(filter(None, (*key, f"buckets {mb:g} MiB" if several else "")))
            n = [r["devices"] for r in line]
            axes[0].plot(n, [r["tokens_per_s"] / 1e3 for r in line], marker="o", label=name)
            axes[1].plot(n, [r["efficiency"] for r in line], marker="o", label=name)
    axes[0].set(xlabel="devices", ylabel="tokens/s (thousands)", title="throughput")
    axes[1].set(xlabel="devices", ylabel="step time at 1 / at N", title="weak-scaling efficiency", ylim=(0, 1.1))
    axes[1].legend(fontsize=7)
    fig.suptitle(f"data-parallel training step, {device_kind}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
