"""Weak scaling of the harness's data-parallel training step: ``python -m train.bench scaling``.

For N = 1, 2, 4, ... devices (the first N of this host) each model trains the same batch per device, so the global
batch grows with N. The step is exactly the one `python -m train.wmt` / `train.imdb` run (`train.step`,
`train.parallel`: shard_map over the data axis, one gradient all-reduce, or ZeRO-1 with ``sharded``), on
synthetic tokens, bf16 with f32 master weights and AdamW. Per (model, implementation, optimizer mode, N):
median step time, tokens per second, weak-scaling efficiency (step time at 1 device / at N), XLA's memory
analysis of the compiled step per device, and the optimizer state's bytes per device. An all-reduce probe
measures the bus bandwidth of a gradient-sized psum at each N.

Models: ``big-6e6d`` (Transformer-big, 6 + 6 layers, 64-token sentences, ``--tokens-per-device`` target tokens
per device; ``tiny-2e2d`` the same shape of step, small enough for a CPU) and ``bert-base`` (sequence classification, ``--bert-batch`` rows of ``--bert-length`` tokens).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec

from ls_jax import backend
from ls_jax.models import BertForSequenceClassification, Transformer
from ls_jax.optim import shard_optimizer
from train import imdb_model, wmt_model
from train.benchmarks import common
from train.optimizer import make_optimizer
from train.parallel import DATA_AXIS, DataParallel, StateLayout
from train.step import TrainState, make_train_step
from train.step_compiler import StepCompiler

MODELS = ("big-6e6d", "bert-base")
TRANSFORMER_PRESETS = {"big-6e6d": "transformer-big", "tiny-2e2d": "transformer-tiny"}  # tiny: CPU tests
IMPLEMENTATIONS = {"ls_jax_ffi": "ffi", "ls_jax_xla": "xla"}
MODES = ("replicated", "sharded")
VOCAB = 32768
SENTENCE = 64


def _model(name: str, rows: int, length: int) -> tuple[Any, Callable, dict[str, np.ndarray], int]:
    """(module, loss_fn, one device's batch (1, rows, length) per input, counted tokens per device)."""
    rng = np.random.default_rng(0)
    if name in TRANSFORMER_PRESETS:
        config = wmt_model.model_config({"preset": TRANSFORMER_PRESETS[name], "dropout": 0.1}, VOCAB, "bf16")
        module = Transformer(config)
        tokens = rng.integers(4, VOCAB, size=(1, rows, length), dtype=np.int32)
        batch = {"src": tokens, "tgt_in": tokens, "labels": np.roll(tokens, -1, axis=-1)}
        return module, wmt_model.make_loss_fn(module, 0.1), batch, rows * length
    config = imdb_model.preset_config("bert-base", vocab_size=30522, num_labels=2, dtype=jnp.bfloat16)
    module = BertForSequenceClassification(config)
    batch = {"input_ids": rng.integers(5, 30522, size=(1, rows, length), dtype=np.int32),
             "labels": rng.integers(0, 2, size=(1, rows), dtype=np.int32)}
    return module, imdb_model.make_loss_fn(module, pad_id=0), batch, rows * length


def _init_params(module: Any, batch: dict[str, np.ndarray]) -> Any:
    inputs = [jnp.asarray(batch[key][0, :1]) for key in (("src", "tgt_in") if "src" in batch else ("input_ids",))]
    return jax.jit(module.init)(jax.random.PRNGKey(0), *inputs)["params"]


def _tree_bytes(tree: Any) -> int:
    return int(sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree)))


def measure(name: str, implementation: str, mode: str, devices: list[Any], rows: int, length: int,
            steps: int) -> dict[str, Any]:
    """One configuration: the compiled step timed over ``steps`` steps after warm-up."""
    parallel = DataParallel(Mesh(np.asarray(devices), (DATA_AXIS,)))
    module, loss_fn, local, tokens_per_device = _model(name, rows, length)
    tx = make_optimizer("adamw", optax.constant_schedule(1e-4), weight_decay=0.01, clip_norm=1.0,
                        master_dtype=jnp.bfloat16)
    sharded = shard_optimizer(tx, DATA_AXIS, num_shards=len(devices), average_gradients=False) if mode == "sharded" else None
    layout = StateLayout(parallel, sharded)
    with backend.use(IMPLEMENTATIONS[implementation]):
        params = _init_params(module, local)

        def create(params):
            return TrainState.create(params, tx, jax.random.PRNGKey(1), fp16=False, param_dtype=jnp.bfloat16,
                                     init_optimizer=None if sharded is None else sharded.init)

        state = jax.jit(create, out_shardings=layout.shardings(jax.eval_shape(create, params)))(params)
        del params
        global_batch = {key: np.concatenate([value] * len(devices), axis=1) for key, value in local.items()}
        batch = parallel.put_batch(global_batch, row_axis=1)
        compiler = StepCompiler(make_train_step(loss_fn, tx, axis_name=DATA_AXIS, sharded_optimizer=sharded),
                                layout, state)
        compiled = compiler.compiled(state, batch)
    memory = compiled.memory_analysis()
    for _ in range(3):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(steps):
            state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        samples.append((time.perf_counter() - start) / steps)
    step_s = float(np.median(samples))
    opt_bytes = _tree_bytes(state.opt_state) // (len(devices) if sharded is not None else 1)
    return {
        "devices": len(devices),
        "step_ms": 1e3 * step_s,
        "step_ms_samples": [1e3 * s for s in samples],
        "tokens_per_s": tokens_per_device * len(devices) / step_s,
        "loss": float(metrics["loss"] / max(float(metrics["weight"]), 1.0)),
        "memory_per_device_bytes": None if memory is None else int(
            memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
            - memory.alias_size_in_bytes),
        "optimizer_state_bytes_per_device": opt_bytes,
    }


def allreduce_probe(devices: list[Any], num_bytes: int) -> dict[str, float]:
    """Bus bandwidth of a bf16 psum of ``num_bytes`` over ``devices``: 2 (N - 1) / N * bytes / time."""
    mesh = Mesh(np.asarray(devices), (DATA_AXIS,))
    n = len(devices)
    x = jax.device_put(jnp.ones((n, num_bytes // 2 // n * n // n), jnp.bfloat16),
                       jax.sharding.NamedSharding(mesh, PartitionSpec(DATA_AXIS)))
    summed = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, DATA_AXIS), mesh=mesh, in_specs=PartitionSpec(DATA_AXIS),
                                   out_specs=PartitionSpec(DATA_AXIS)))
    timing = common.time_call(lambda: summed(x), warmup=3, samples=10, inner=5)
    seconds = timing["median_s"]
    per_device = x.nbytes // n
    return {"bytes": per_device, "ms": 1e3 * seconds, "bus_gb_per_s": 2 * (n - 1) / n * per_device / seconds / 1e9}


def efficiencies(results: list[dict[str, Any]]) -> None:
    """Adds ``efficiency`` (step time at 1 device / at N, same model, implementation and mode) in place."""
    base = {(r["model"], r["implementation"], r["mode"]): r["step_ms"] for r in results if r["devices"] == 1}
    for r in results:
        one = base.get((r["model"], r["implementation"], r["mode"]))
        r["efficiency"] = None if one is None else one / r["step_ms"]


def plot(results: list[dict[str, Any]], path: Path, device_kind: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key in sorted({(r["model"], r["implementation"], r["mode"]) for r in results}):
        rows = sorted((r for r in results if (r["model"], r["implementation"], r["mode"]) == key),
                      key=lambda r: r["devices"])
        n = [r["devices"] for r in rows]
        axes[0].plot(n, [r["tokens_per_s"] / 1e3 for r in rows], marker="o", label=" ".join(key))
        axes[1].plot(n, [r["efficiency"] for r in rows], marker="o", label=" ".join(key))
    axes[0].set(xlabel="devices", ylabel="tokens/s (thousands)", title="throughput")
    axes[1].set(xlabel="devices", ylabel="step time at 1 / at N", title="weak-scaling efficiency", ylim=(0, 1.1))
    axes[1].legend(fontsize=7)
    fig.suptitle(f"data-parallel training step, {device_kind}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def device_counts(available: int, requested: str | None) -> list[int]:
    """1, 2, 4, ... up to the devices there are, or the given comma-separated counts (each checked)."""
    if requested:
        counts = [int(c) for c in requested.split(",")]
        too_many = [c for c in counts if c > available or c < 1]
        if too_many:
            raise SystemExit(f"--devices {requested}: this host has {available} devices")
        return counts
    return [2**k for k in range(int(math.log2(available)) + 1)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.bench scaling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--implementations", default=",".join(IMPLEMENTATIONS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--devices", help="comma-separated device counts (default 1, 2, 4, ... up to all)")
    parser.add_argument("--tokens-per-device", type=int, default=8192, help="big-6e6d target tokens per device")
    parser.add_argument("--bert-batch", type=int, default=32)
    parser.add_argument("--bert-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed sample (5 samples)")
    parser.add_argument("--allreduce-mb", type=int, default=256)
    common.add_out_argument(parser, "scaling")
    args = parser.parse_args(argv)
    args.out = common.out_dir(args.out)
    devices = jax.devices()
    counts = device_counts(len(devices), args.devices)
    results, probes = [], []
    for n in counts:
        if n > 1:
            probes.append({"devices": n, **allreduce_probe(devices[:n], args.allreduce_mb << 20)})
            print(f"all-reduce over {n}: {probes[-1]['bus_gb_per_s']:.0f} GB/s bus bandwidth", flush=True)
        for name in args.models.split(","):
            rows, length = ((args.tokens_per_device // SENTENCE, SENTENCE) if name in TRANSFORMER_PRESETS
                            else (args.bert_batch, args.bert_length))
            for implementation in args.implementations.split(","):
                for mode in args.modes.split(","):
                    result = {"model": name, "implementation": implementation, "mode": mode,
                              **measure(name, implementation, mode, devices[:n], rows, length, args.steps)}
                    results.append(result)
                    efficiencies(results)
                    path = common.write_result("scaling", payload(results, probes, args), args.out)  # kept if cut off
                    print(f"{name:9s} {implementation:10s} {mode:10s} N={n}: {result['step_ms']:7.2f} ms, "
                          f"{result['tokens_per_s'] / 1e3:7.1f}k tok/s, memory "
                          f"{(result['memory_per_device_bytes'] or 0) / 2**30:.2f} GiB, optimizer state "
                          f"{result['optimizer_state_bytes_per_device'] / 2**30:.2f} GiB", flush=True)
    plot(results, path.with_suffix(".png"), jax.devices()[0].device_kind)
    print(f"wrote {path}")
    return 0


def payload(results: list[dict[str, Any]], probes: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    return {"results": results, "allreduce": probes, "config": {**vars(args), "out": str(args.out)}}
