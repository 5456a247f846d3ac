"""End-to-end training-step benchmark: plain Flax reference vs ls_jax (xla backend) vs ls_jax (ffi backend).

``python -m train.bench e2e [--models big-6e6d,...] [--tokens 1024,8192] [--steps 20] [--fit] [--quick]``

One process builds the same Transformer three ways (`train.benchmarks.transformer_steps`: plain Flax reference,
ls_jax on XLA, ls_jax with the CUDA kernels) and trains each on the same random batches.
Per (model, target tokens per step, implementation) it records the median step time over ``--steps`` samples of 20
consecutive steps after warm-up, the host's time to dispatch one step, tokens/s, model TFLOP/s and MFU (against
the datasheet peak, against a bf16 GEMM measured in the same run and, on an H100 or H200, against the 790 TFLOP/s
the project's targets state MFU by) and the compiled step's memory (XLA memory analysis: arguments + outputs -
aliased + temporaries); per (model, implementation) with two or more measured batch sizes, the largest trainable
batch predicted from their memory (``--fit`` also verifies it by running one step). Results merge into
docs/results/e2e-<device>.json after every measurement (so runs split over several invocations build one file),
and a speedup plot is written next to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax import backend
from train import metrics, runlog
from train.benchmarks import common, kernel_trace
from train.benchmarks.transformer_steps import (
    IMPLEMENTATIONS, LABEL_SMOOTHING, MODELS, QUICK_MODEL, SEQ_LEN, VOCAB, TrainStep, build_step, kernel_mode,
    make_batch,
)

STEPS_PER_SAMPLE = 20
"""Consecutive steps per timed sample. A sample starts with the device idle, so it pays once for the host's
dispatch of its first step (`host_dispatch_seconds`, recorded with every measurement), which a training loop hides
by running steps ahead: 20 steps spread that cost thinly over the sample."""
TARGET_BASIS_TFLOPS = 790.0
"""The bf16 rate the project's end-to-end targets state MFU against: about what a large bf16 GEMM sustains on an
H100 or H200 SXM (docs/results has the measured rates), where the datasheet's dense peak is 989.4."""


def host_dispatch_seconds(train_step: TrainStep, batch, repeats: int = 5) -> float:
    """Median host time of dispatching one step to an idle device: what each timed sample waits for before its
    first kernel runs."""
    elapsed = []
    for _ in range(repeats):
        jax.block_until_ready(train_step.state)
        start = time.perf_counter()
        loss = train_step.run(batch)
        elapsed.append(time.perf_counter() - start)
        jax.block_until_ready(loss)
    return float(np.median(elapsed))


def measure(implementation: str, name: str, target_tokens: int, steps: int, profile_steps: int = 0,
            trace_dir: Path | None = None) -> dict[str, Any]:
    """Median step time and memory of one implementation at one batch size; with ``profile_steps``, also the
    per-category breakdown of that many traced steps (`kernel_trace.step_breakdown`), whose trace stays in
    ``trace_dir/<implementation>`` when given."""
    batch = make_batch(target_tokens // SEQ_LEN, seed=target_tokens)
    with backend.use(kernel_mode(implementation)):
        start = time.perf_counter()
        train_step = build_step(implementation, name, batch)
        first_loss = float(train_step.run(batch))
        compile_s = time.perf_counter() - start
        # Steps are dispatched back to back, as a training loop does, so the host's dispatch of a step overlaps the
        # device's work on the one before; blocking after every step would add a pytree-size-dependent host cost.
        timing = common.time_call(lambda: train_step.run(batch), warmup=3, samples=steps, inner=STEPS_PER_SAMPLE)
        dispatch_s = host_dispatch_seconds(train_step, batch)
        last_loss = float(train_step.run(batch))
        record = {
            "step_time_s": timing["median_s"],
            "p10_s": timing["p10_s"],
            "p90_s": timing["p90_s"],
            "steps_timed": steps * STEPS_PER_SAMPLE,
            "steps_per_sample": STEPS_PER_SAMPLE,
            "host_dispatch_s": dispatch_s,
            "init_compile_and_first_step_s": compile_s,
            "memory_bytes": train_step.memory_bytes(),
            "first_loss": first_loss,
            "loss_after_timing": last_loss,
        }
        if profile_steps:
            record["profile"] = kernel_trace.step_breakdown(
                train_step, batch, profile_steps, None if trace_dir is None else trace_dir / implementation)
    return record


def predict_largest_batch(memory_by_tokens: dict[int, int], capacity: int) -> int:
    """The largest multiple of 1024 target tokens whose step fits ``capacity`` bytes, from a least-squares fit
    memory = a + b * tokens over two or more measured batches (XLA's memory analysis is static, so the fit is
    close to linear)."""
    if len(memory_by_tokens) < 2:
        raise ValueError(f"predicting the largest batch needs two measured batch sizes, got {len(memory_by_tokens)}")
    tokens = np.array(sorted(memory_by_tokens), dtype=np.float64)
    memory = np.array([memory_by_tokens[t] for t in sorted(memory_by_tokens)], dtype=np.float64)
    slope, intercept = np.polyfit(tokens, memory, 1)
    return int((capacity - intercept) / slope) // 1024 * 1024


def predicted_largest_batches(results: dict[str, Any], capacity: int | None) -> dict[str, dict[str, Any]]:
    """Per model: each implementation's predicted largest batch (``predict_largest_batch`` over every batch
    size measured so far) and its ratio to the reference's."""
    if not capacity:
        return {}
    memory: dict[tuple[str, str], dict[int, int]] = {}
    for key, record in results.items():
        name, tokens, implementation = key.split("/")
        if tokens.isdigit() and "memory_bytes" in record:
            memory.setdefault((name, implementation), {})[int(tokens)] = record["memory_bytes"]
    table: dict[str, dict[str, Any]] = {}
    for (name, implementation), by_tokens in sorted(memory.items()):
        if len(by_tokens) >= 2:
            table.setdefault(name, {})[implementation] = predict_largest_batch(by_tokens, capacity)
    for row in table.values():
        for implementation in [i for i in row if i != "reference"]:
            if "reference" in row:
                row[f"{implementation}_vs_reference"] = row[implementation] / row["reference"]
    return table


def largest_batch(implementation: str, name: str, memory_by_tokens: dict[int, int], capacity: int) -> dict[str, Any]:
    """``predict_largest_batch``, verified by compiling and running one step at that size (stepping down 10% on
    failure, at most three tries)."""
    predicted = predict_largest_batch(memory_by_tokens, capacity)
    candidate = predicted
    for _ in range(3):
        try:
            batch = make_batch(candidate // SEQ_LEN, seed=0)
            with backend.use(kernel_mode(implementation)):
                train_step = build_step(implementation, name, batch)
                jax.block_until_ready(train_step.run(batch))
            return {"predicted_tokens": predicted, "verified_tokens": candidate}
        except Exception as err:  # noqa: BLE001 - out-of-memory surfaces as several exception types
            if "RESOURCE_EXHAUSTED" not in str(err) and "out of memory" not in str(err).lower():
                raise
            candidate = int(candidate * 0.9) // 1024 * 1024
    return {"predicted_tokens": predicted, "verified_tokens": None}


def _flops(name: str, target_tokens: int) -> float:
    shape = MODELS[name]
    sentences = target_tokens // SEQ_LEN
    return metrics.transformer_train_flops(
        hidden=shape.hidden,
        ffn=shape.intermediate,
        encoder_layers=shape.encoder_layers,
        decoder_layers=shape.decoder_layers,
        vocab=VOCAB,
        batch=sentences,
        src_len=SEQ_LEN,
        tgt_len=SEQ_LEN,
    )


def measured_gemm_tflops(size: int = 8192) -> float:
    """bf16 size^3 matrix product rate on this device, the practical ceiling for MFU."""
    a = jax.random.normal(jax.random.PRNGKey(0), (size, size), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(1), (size, size), jnp.bfloat16)
    matmul = jax.jit(jnp.matmul)
    timing = common.time_call(lambda: matmul(a, b), warmup=3, samples=20, inner=3)
    return 2 * size**3 / timing["median_s"] / 1e12


@dataclasses.dataclass
class ResultFile:
    """docs/results/e2e-<device>.json, rewritten after every measurement so an interrupted run keeps what it
    measured; measurements from earlier runs on the same device are kept unless measured again. Every record
    names its run (the time this process opened the file) and commit, and speedups pair records of one run only."""

    path: Path
    header: dict[str, Any]
    results: dict[str, Any]
    run: str
    commit: str | None

    @classmethod
    def open(cls, out_dir: Path, header: dict[str, Any], fresh: bool) -> "ResultFile":
        path = out_dir / f"e2e-{common.device_slug()}.json"
        results = {} if fresh or not path.exists() else json.loads(path.read_text())["results"]
        return cls(path, header, results, runlog.utc_now(), runlog.git_commit())

    def add(self, key: str, record: dict[str, Any]) -> None:
        self.results[key] = {**record, "run": self.run, "commit": self.commit}
        table = speedups(self.results)
        largest = predicted_largest_batches(self.results, self.header["memory_capacity_bytes"])
        written = common.write_result(
            "e2e",
            {**self.header, "results": self.results, "speedup_vs_reference": table,
             "largest_batch_tokens_predicted": largest},
            self.path.parent,
        )
        plot_speedups(table, written.with_suffix(".png"), jax.devices()[0].device_kind)


def run(
    models: list[str],
    token_counts: list[int],
    implementations: list[str],
    steps: int,
    out: ResultFile,
    fit_batch: bool = False,
    profile_steps: int = 0,
    trace_dir: Path | None = None,
) -> None:
    """Measures every (model, tokens, implementation) and adds each record to ``out`` as soon as it exists."""
    peak = out.header["peak_tflops"]
    target_basis = out.header["target_basis_tflops"]
    for name in models:
        for implementation in implementations:
            memory_by_tokens = {}
            for target_tokens in token_counts:
                key = f"{name}/{target_tokens}/{implementation}"
                try:
                    record = measure(implementation, name, target_tokens, steps, profile_steps, trace_dir)
                except Exception as err:  # noqa: BLE001 - record the failure (e.g. OOM) and go on
                    out.add(key, {"error": f"{type(err).__name__}: {str(err)[:500]}"})
                    print(f"{key}: FAILED {type(err).__name__}: {str(err)[:200]}", flush=True)
                    continue
                flops = _flops(name, target_tokens)
                tflops = flops / record["step_time_s"] / 1e12
                record.update(
                    target_tokens_per_s=target_tokens / record["step_time_s"],
                    tokens_per_s=2 * target_tokens / record["step_time_s"],
                    flops_per_step=flops,
                    tflops_per_s=tflops,
                    mfu=None if peak is None else tflops / peak,
                    mfu_vs_measured_gemm=tflops / out.header["measured_gemm_tflops"],
                    mfu_vs_target_basis=None if target_basis is None else tflops / target_basis,
                )
                out.add(key, record)
                memory_by_tokens[target_tokens] = record["memory_bytes"]
                mfu = "n/a" if record["mfu"] is None else f"{record['mfu']:.3f}"
                if target_basis is not None:
                    mfu += f" ({record['mfu_vs_target_basis']:.3f} against {target_basis:.0f} TFLOP/s)"
                print(f"{key}: {record['step_time_s'] * 1e3:.2f} ms  MFU {mfu}  "
                      f"memory {record['memory_bytes'] / 2**30:.1f} GiB", flush=True)
            capacity = out.header["memory_capacity_bytes"]
            if fit_batch and capacity and len(memory_by_tokens) >= 2:
                out.add(f"{name}/largest/{implementation}",
                        largest_batch(implementation, name, memory_by_tokens, capacity))


def target_basis_tflops(spec: metrics.DeviceSpec | None) -> float | None:
    """``TARGET_BASIS_TFLOPS`` on the H100 and H200 SXM the targets were set on, None elsewhere."""
    return TARGET_BASIS_TFLOPS if spec is not None and spec.name in ("H100-SXM", "H200-SXM") else None


def header(gemm_size: int = 8192) -> dict[str, Any]:
    """Device ceilings and the benchmark's fixed setup, measured once per run."""
    device = jax.devices()[0]
    spec = metrics.find_device(device.device_kind)
    return {
        "peak_tflops": metrics.peak_tflops(spec, "bf16"),
        "target_basis_tflops": target_basis_tflops(spec),
        "measured_gemm_tflops": measured_gemm_tflops(gemm_size),
        "memory_capacity_bytes": device.memory_stats().get("bytes_limit") if device.platform == "gpu" else None,
        "setup": {"vocab": VOCAB, "seq_len": SEQ_LEN, "dropout": 0.1, "label_smoothing": LABEL_SMOOTHING,
                  "optimizer": "adamw", "precision": "bf16 compute, f32 params",
                  "ls_jax_params": "f32 master weights split into the bf16 params and int16 low halves in the optimizer state",
                  "reference_attention_dropout": "Flax default (broadcast over batch and heads)",
                  "ls_jax_attention_dropout": "per element (fairseq / LightSeq)"},
    }


def speedups(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Reference step time over each ls_jax implementation's, per (model, tokens), where both were measured in the
    same run: the reference's speed depends on the host that dispatches its kernels, so a ratio across runs (or
    machines) is not a measurement."""
    table: dict[str, dict[str, float]] = {}
    for key, record in results.items():
        name, tokens, implementation = key.split("/")
        if implementation == "reference" or "step_time_s" not in record:
            continue
        reference = results.get(f"{name}/{tokens}/reference", {})
        if "step_time_s" in reference and reference.get("run") == record.get("run"):
            table.setdefault(f"{name}/{tokens}", {})[implementation] = reference["step_time_s"] / record["step_time_s"]
    return table


def plot_speedups(table: dict[str, dict[str, float]], path: Path, device_kind: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted(table, key=lambda k: (list(MODELS).index(k.split("/")[0]), int(k.split("/")[1])))
    if not labels:
        return
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(labels)), 4))
    width = 0.4
    for offset, implementation in ((-width / 2, "ls_jax_xla"), (width / 2, "ls_jax_ffi")):
        values = [table[k].get(implementation, np.nan) for k in labels]
        ax.bar(np.arange(len(labels)) + offset, values, width, label=implementation)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(np.arange(len(labels)), [k.replace("/", "\n") for k in labels], fontsize=7)
    ax.set_ylabel("speedup over plain Flax (step time ratio)")
    ax.set_title(f"Transformer training step, {device_kind}, bf16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.bench e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    measured_models = [name for name in MODELS if name != QUICK_MODEL]
    parser.add_argument("--models", default=",".join(measured_models), help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--tokens", default="1024,4096,8192,16384", help="target tokens per step, comma-separated")
    parser.add_argument("--implementations", default=",".join(IMPLEMENTATIONS))
    parser.add_argument("--steps", type=int, default=10,
                        help=f"timed samples of {STEPS_PER_SAMPLE} consecutive steps (after 3 warm-up steps)")
    parser.add_argument("--fit", action="store_true", help="also find the largest trainable batch per model")
    common.add_out_argument(parser, "e2e")
    parser.add_argument("--quick", action="store_true", help=f"a smoke run (CPU): {QUICK_MODEL}, 1024 tokens")
    args = parser.parse_args(argv)
    args.out = common.out_dir(args.out)
    models = args.models.split(",")
    token_counts = [int(t) for t in args.tokens.split(",")]
    implementations = args.implementations.split(",")
    if args.quick:
        models, token_counts, args.steps = [QUICK_MODEL], [1024], 2
        implementations = [i for i in implementations if i != "ls_jax_ffi" or backend.cuda_visible()]
    unknown = [m for m in models if m not in MODELS] + [i for i in implementations if i not in IMPLEMENTATIONS]
    if unknown:
        parser.error(f"unknown model or implementation: {', '.join(unknown)}")

    out = ResultFile.open(args.out, header(gemm_size=1024 if args.quick else 8192), fresh=args.quick)
    run(models, token_counts, implementations, args.steps, out, fit_batch=args.fit)
    for key, ratios in sorted(speedups(out.results).items()):
        print(f"{key:24s} " + "  ".join(f"{impl} {ratio:.2f}x" for impl, ratio in sorted(ratios.items())))
    print(f"wrote {out.path}")
    return 0
