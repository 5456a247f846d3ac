"""End-to-end training-step benchmark over the model zoo: plain Flax and PyTorch references vs ls_jax (xla and ffi
backends).

``python -m train.bench e2e [--models wmt,bert,gpt] [--tokens 1024,8192] [--seq-lens 512] [--steps 20] [--fit]
[--token-ids uniform|zipf] [--quick]``

One process builds each model several ways and trains each on the same random batches (token ids uniform over the
vocabulary, or with ``--token-ids zipf`` as frequent as in text: `train.bench.steps.token_ids`):
  the WMT Transformers (`train.bench.steps.transformer_steps`; sizes are target tokens per step): the plain Flax
    ``reference``, ``ls_jax_xla`` and ``ls_jax_ffi``;
  BERT-base sequence classification (128 and 512 tokens, 32 rows) and GPT-2 small (1024 tokens, 8 rows)
    (`train.bench.steps.zoo_steps`; sizes are sequence lengths): ``flax`` (einsum attention with dropout, as Flax
    and Hugging Face Flax write it), ``flax_cudnn`` (cuDNN's fused attention, without attention dropout),
    ``ls_jax_xla``, ``ls_jax_ffi`` and ``torch_compile`` (Hugging Face transformers' PyTorch model under
    ``torch.compile``, bf16 autocast, fused AdamW; `train.bench.steps.torch_steps`; needs torch and transformers,
    runs on the GPU when PyTorch sees CUDA, else on the CPU);
  named in ``--implementations`` only, the FP8 rows (GPUs with FP8 GEMMs, or a CPU): ``reference_fp8`` (WMT) and
    ``ls_jax_ffi_fp8``, every Dense and the tied logits through Flax's FP8 op.
Per (model, size, implementation), a row ``<model>/<size>/<implementation>``, it records the median step time over
``--steps`` samples of 20 consecutive steps after warm-up, the host's time to dispatch one step, tokens/s, model
TFLOP/s and MFU (against the datasheet peak, against a bf16 GEMM measured in the same run and, on an H100 or H200,
against the 790 TFLOP/s the project's targets state MFU by) and the compiled step's memory (XLA memory analysis:
arguments + outputs - aliased + temporaries; ``torch_compile`` records the peak of PyTorch's CUDA allocator
instead, none on a CPU, and no host dispatch time); per WMT (model, implementation) with two or more measured batch
sizes, the largest trainable batch predicted from their memory (``--fit`` also verifies it by running one step).
Results merge into docs/results/e2e-<device>.json (e2e-zipf-<device>.json with Zipf ids) after every measurement
(so runs split over several invocations build one file), with the speedups over plain Flax, over Flax with cuDNN
attention and over ``torch_compile``, and a plot of them is written next to it. In one process JAX holds the GPU
memory it preallocates (75% by default), so the PyTorch step has the rest; ``XLA_PYTHON_CLIENT_PREALLOCATE=false``
leaves it more.

One module on purpose: the suite's rows, its timing protocol and its report are one benchmark; the steps it
times live in `train.bench.steps`.
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
from train.bench import common
from train.bench.steps import token_ids as token_ids_lib
from train.bench.steps import workloads, zoo_steps
from train.bench.steps.transformer_steps import LABEL_SMOOTHING, SEQ_LEN, VOCAB, TrainStep
from train.bench.tracing import kernel_trace
from train.costs import devices as device_table
from train.records import runlog

STEPS_PER_SAMPLE = 20
"""Consecutive steps per timed sample. A sample starts with the device idle, so it pays once for the host's
dispatch of its first step (`host_dispatch_seconds`, recorded with every measurement), which a training loop hides
by running steps ahead: 20 steps spread that cost thinly over the sample."""
QUICK_TOKENS = 256  # target tokens of the WMT step in a --quick run
DEFAULT_TOKENS = "1024,4096,8192,16384"  # target tokens of the WMT steps otherwise
TARGET_BASIS_TFLOPS = 790.0
"""The bf16 rate the project's end-to-end targets state MFU against: about what a large bf16 GEMM sustains on an
H100 or H200 SXM (docs/results has the measured rates), where the datasheet's dense peak is 989.4."""


FP8_SETUP = (
    "*_fp8 rows: every Dense, attention projection and the tied logits in FP8 (e4m3 forward, e5m2 gradients, "
    "delayed scaling over 1024 steps of amax history; plain Flax through Flax's Fp8DirectDotGeneralOp, ls_jax "
    "through ls_jax.layers.fp8 on Flax's scaling), bf16 elsewhere"
)


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


def timed_record(workload: workloads.Workload, timing: dict[str, float], steps: int) -> dict[str, Any]:
    """The fields every record has: ``workload``'s shape and its step time from ``common.time_call``'s ``timing``
    over ``steps`` samples."""
    return {
        **workload.describe(),
        "step_time_s": timing["median_s"],
        "p10_s": timing["p10_s"],
        "p90_s": timing["p90_s"],
        "steps_timed": steps * STEPS_PER_SAMPLE,
        "steps_per_sample": STEPS_PER_SAMPLE,
    }


def measure(
    implementation: str, workload: workloads.Workload, steps: int, profile_steps: int = 0, trace_dir: Path | None = None
) -> dict[str, Any]:
    """Median step time and memory of one implementation of ``workload``; with ``profile_steps``, also the
    per-category breakdown of that many traced steps (`kernel_trace.step_breakdown`), whose trace stays in
    ``trace_dir/<implementation>`` when given. The PyTorch rows are measured by `measure_torch`."""
    if implementation in workloads.TORCH_IMPLEMENTATIONS:
        if profile_steps:
            raise ValueError(f"{implementation} is a PyTorch step: the JAX profiler cannot break it down")
        return measure_torch(workload, steps)
    batch = workload.batch()
    with backend.use(workload.kernel_mode(implementation)):
        start = time.perf_counter()
        train_step = workload.build(implementation, batch)
        first_loss = float(train_step.run(batch))
        compile_s = time.perf_counter() - start
        # Steps are dispatched back to back, as a training loop does, so the host's dispatch of a step overlaps the
        # device's work on the one before; blocking after every step would add a pytree-size-dependent host cost.
        timing = common.time_call(lambda: train_step.run(batch), warmup=3, samples=steps, inner=STEPS_PER_SAMPLE)
        dispatch_s = host_dispatch_seconds(train_step, batch)
        last_loss = float(train_step.run(batch))
        record = {
            **timed_record(workload, timing, steps),
            "host_dispatch_s": dispatch_s,
            "init_compile_and_first_step_s": compile_s,
            "memory_bytes": train_step.memory_bytes(),
            "first_loss": first_loss,
            "loss_after_timing": last_loss,
        }
        if profile_steps:
            record["profile"] = kernel_trace.step_breakdown(
                train_step, batch, profile_steps, None if trace_dir is None else trace_dir / implementation
            )
    return record


def measure_torch(workload: workloads.Workload, steps: int) -> dict[str, Any]:
    """`measure` of the ``torch_compile`` row (`torch_steps`) on the same batch, by the same protocol: build and
    compile with the first step, 3 warm-up steps, then ``steps`` samples of ``STEPS_PER_SAMPLE`` steps, each closed
    by waiting for the device. Its memory is the peak of PyTorch's CUDA allocator over all of that (None on a CPU);
    it has no host dispatch time."""
    from train.bench.steps import torch_steps

    batch = workload.batch()
    start = time.perf_counter()
    train_step = torch_steps.build_step(workload.model, batch)
    first_loss = float(train_step.run())
    compile_s = time.perf_counter() - start
    timing = common.time_call(train_step.run, warmup=3, samples=steps, inner=STEPS_PER_SAMPLE, wait=train_step.wait)
    last_loss = float(train_step.run())
    return {
        **timed_record(workload, timing, steps),
        "host_dispatch_s": None,
        "init_compile_and_first_step_s": compile_s,
        "memory_bytes": train_step.memory_bytes(),
        "first_loss": first_loss,
        "loss_after_timing": last_loss,
        "torch_device": train_step.device_name(),
        "versions": torch_steps.versions(),
    }


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
    """Per WMT model: each implementation's predicted largest batch (``predict_largest_batch`` over every batch
    size measured so far) and its ratio to the reference's. (BERT's and GPT-2's sizes are sequence lengths, whose
    memory is not linear in the tokens.)"""
    if not capacity:
        return {}
    memory: dict[tuple[str, str], dict[int, int]] = {}
    for key, record in results.items():
        name, tokens, implementation = key.split("/")
        if name not in zoo_steps.MODELS and tokens.isdigit() and record.get("memory_bytes") is not None:
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
            workload = workloads.wmt_workload(name, candidate)
            batch = workload.batch(seed=0)
            with backend.use(workload.kernel_mode(implementation)):
                train_step = workload.build(implementation, batch)
                jax.block_until_ready(train_step.run(batch))
            return {"predicted_tokens": predicted, "verified_tokens": candidate}
        except Exception as err:  # noqa: BLE001 - out-of-memory surfaces as several exception types
            if "RESOURCE_EXHAUSTED" not in str(err) and "out of memory" not in str(err).lower():
                raise
            candidate = int(candidate * 0.9) // 1024 * 1024
    return {"predicted_tokens": predicted, "verified_tokens": None}


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
    def open(
        cls, out_dir: Path, header: dict[str, Any], fresh: bool, token_ids: str = token_ids_lib.DEFAULT
    ) -> "ResultFile":
        """The results file of ``out_dir`` for batches of ``token_ids``: ``e2e-<device>.json`` for the default
        uniform ids, ``e2e-<token_ids>-<device>.json`` otherwise (their rows measure other batches)."""
        stem = "e2e" if token_ids == token_ids_lib.DEFAULT else f"e2e-{token_ids}"
        path = out_dir / f"{stem}-{common.device_slug()}.json"
        results = {} if fresh or not path.exists() else json.loads(path.read_text())["results"]
        return cls(path, header, results, runlog.utc_now(), runlog.git_commit())

    def add(self, key: str, record: dict[str, Any]) -> None:
        self.results[key] = {**record, "run": self.run, "commit": self.commit}
        table = speedups(self.results)
        cudnn_table = speedups(self.results, ("flax_cudnn",))
        torch_table = speedups(self.results, workloads.TORCH_IMPLEMENTATIONS)
        largest = predicted_largest_batches(self.results, self.header["memory_capacity_bytes"])
        written = common.write_result(
            "e2e",
            {
                **header_of(self.header, self.results),
                "results": self.results,
                "speedup_vs_reference": table,
                "speedup_vs_flax_cudnn": cudnn_table,
                "speedup_vs_torch_compile": torch_table,
                "largest_batch_tokens_predicted": largest,
            },
            self.path.parent,
            stem=self.path.name.removesuffix(f"-{common.device_slug()}.json"),
        )
        plot_speedups(table, written.with_suffix(".png"), jax.devices()[0].device_kind, cudnn_table, torch_table)


def run(
    workload_list: list[workloads.Workload],
    implementations: list[str],
    steps: int,
    out: ResultFile,
    fit_batch: bool = False,
    profile_steps: int = 0,
    trace_dir: Path | None = None,
) -> None:
    """Measures every workload with each of ``implementations`` it has (model by model, then implementation by
    implementation, then size by size) and adds each record to ``out`` as soon as it exists."""
    for model in dict.fromkeys(workload.model for workload in workload_list):
        group = [workload for workload in workload_list if workload.model == model]
        for implementation in [i for i in workloads.implementations_of(model) if i in implementations]:
            memory_by_tokens = {}
            for workload in group:
                record = measure_one(implementation, workload, steps, out, profile_steps, trace_dir)
                if record is not None and record["memory_bytes"] is not None:
                    memory_by_tokens[workload.size] = record["memory_bytes"]
            capacity = out.header["memory_capacity_bytes"]
            if fit_batch and workloads.is_wmt(model) and capacity and len(memory_by_tokens) >= 2:
                out.add(
                    f"{model}/largest/{implementation}",
                    largest_batch(implementation, model, memory_by_tokens, capacity),
                )


def measure_one(
    implementation: str,
    workload: workloads.Workload,
    steps: int,
    out: ResultFile,
    profile_steps: int = 0,
    trace_dir: Path | None = None,
) -> dict[str, Any] | None:
    """`measure` with the rates derived from it, added to ``out``; a failure (e.g. out of memory) is added as an
    error record and gives None."""
    key = workload.key(implementation)
    try:
        record = measure(implementation, workload, steps, profile_steps, trace_dir)
    except Exception as err:  # noqa: BLE001 - record the failure and go on
        out.add(key, {"error": f"{type(err).__name__}: {str(err)[:500]}"})
        print(f"{key}: FAILED {type(err).__name__}: {str(err)[:200]}", flush=True)
        return None
    peak, target_basis = out.header["peak_tflops"], out.header["target_basis_tflops"]
    flops = workload.flops()
    tflops = flops / record["step_time_s"] / 1e12
    if workloads.is_wmt(workload.model):
        record["target_tokens_per_s"] = workload.size / record["step_time_s"]
    record.update(
        tokens_per_s=workload.tokens() / record["step_time_s"],
        flops_per_step=flops,
        tflops_per_s=tflops,
        mfu=None if peak is None else tflops / peak,
        mfu_vs_measured_gemm=tflops / out.header["measured_gemm_tflops"],
        mfu_vs_target_basis=None if target_basis is None else tflops / target_basis,
    )
    out.add(key, record)
    mfu = "n/a" if record["mfu"] is None else f"{record['mfu']:.3f}"
    if target_basis is not None:
        mfu += f" ({record['mfu_vs_target_basis']:.3f} against {target_basis:.0f} TFLOP/s)"
    memory = "n/a" if record["memory_bytes"] is None else f"{record['memory_bytes'] / 2**30:.1f} GiB"
    print(
        f"{key}: {record['step_time_s'] * 1e3:.2f} ms  MFU {mfu}  memory {memory}  "
        f"compile {record['init_compile_and_first_step_s']:.1f} s",
        flush=True,
    )
    return record


def target_basis_tflops(spec: device_table.DeviceSpec | None) -> float | None:
    """``TARGET_BASIS_TFLOPS`` on the H100 and H200 SXM the targets were set on, None elsewhere."""
    return TARGET_BASIS_TFLOPS if spec is not None and spec.name in ("H100-SXM", "H200-SXM") else None


def header(gemm_size: int = 8192) -> dict[str, Any]:
    """Device ceilings and the benchmark's fixed setup, measured once per run."""
    device = jax.devices()[0]
    spec = device_table.find_device(device.device_kind)
    return {
        "peak_tflops": device_table.peak_tflops(spec, "bf16"),
        "target_basis_tflops": target_basis_tflops(spec),
        "measured_gemm_tflops": measured_gemm_tflops(gemm_size),
        "memory_capacity_bytes": device.memory_stats().get("bytes_limit") if device.platform == "gpu" else None,
        "setup": {
            "vocab": VOCAB,
            "seq_len": SEQ_LEN,
            "dropout": 0.1,
            "label_smoothing": LABEL_SMOOTHING,
            "optimizer": "adamw",
            "precision": "bf16 compute, f32 params",
            "ls_jax_params": (
                "f32 master weights split into the bf16 params and int16 low halves in the optimizer state"
            ),
            "reference_attention_dropout": "Flax default (broadcast over batch and heads)",
            "ls_jax_attention_dropout": "per element (fairseq / LightSeq)",
            "fp8": FP8_SETUP,
        },
        "zoo_setup": {
            "dropout": zoo_steps.DROPOUT,
            "optimizer": "adamw",
            "precision": "bf16 compute, f32 params",
            "bert": "sequence classification, 2 labels, rows padded at the end (half to all real tokens)",
            "gpt": "next-token loss on full rows",
            "flax_attention": "flax.linen.dot_product_attention, dropout broadcast over batch and heads",
            "flax_cudnn_attention": "jax.nn.dot_product_attention(implementation='cudnn'), no dropout",
            "torch_compile": "Hugging Face transformers PyTorch model under torch.compile, bf16 autocast, fused AdamW",
            "torch_compile_setup": (
                "BertForSequenceClassification / GPT2LMHeadModel from a transformers config of the same shape "
                "(random init), f32 params, torch.optim.AdamW (fused on CUDA) at the Flax steps' learning rate and "
                "weight decay, the whole step under torch.compile's default mode, on the GPU when PyTorch sees CUDA"
            ),
            "torch_compile_attention": "transformers' sdpa (torch scaled_dot_product_attention), dropout per element",
            "torch_compile_memory": "torch.cuda.max_memory_allocated over build, compile and timing (None on a CPU)",
            "ls_jax_attention_dropout": "per element",
            "fp8": FP8_SETUP,
        },
    }


def header_of(header: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    """The header a result file holding ``results`` (keyed model/size/implementation) writes: the WMT ``setup``
    only where it holds a WMT model's record."""
    if any(workloads.is_wmt(key.split("/")[0]) for key in results):
        return header
    return {name: value for name, value in header.items() if name != "setup"}


def speedups(
    results: dict[str, Any], against: tuple[str, ...] = workloads.PRIMARY_REFERENCES
) -> dict[str, dict[str, float]]:
    """A reference's step time over each other implementation's, per (model, size), where both were measured in
    the same run: the reference's speed depends on the host that dispatches its kernels, so a ratio across runs
    (or machines) is not a measurement. The reference is the first of ``against`` the model has (the WMT
    Transformers' "reference", BERT's and GPT-2's "flax"; ``("flax_cudnn",)`` for the cuDNN-attention one,
    ``("torch_compile",)`` for PyTorch)."""
    table: dict[str, dict[str, float]] = {}
    for key, record in results.items():
        name, size, implementation = key.split("/")
        if implementation in against or "step_time_s" not in record:
            continue
        for reference_name in against:
            reference = results.get(f"{name}/{size}/{reference_name}", {})
            if "step_time_s" in reference and reference.get("run") == record.get("run"):
                ratio = reference["step_time_s"] / record["step_time_s"]
                table.setdefault(f"{name}/{size}", {})[implementation] = ratio
                break
    return table


def _sort_key(label: str) -> tuple[int, int]:
    name, size = label.split("/")
    return workloads.MODEL_ORDER.index(name) if name in workloads.MODEL_ORDER else len(workloads.MODEL_ORDER), int(size)


def _bar_panel(ax, table: dict[str, dict[str, float]], ylabel: str) -> None:
    labels = sorted(table, key=_sort_key)
    colors = {
        "flax": "tab:gray",
        "flax_cudnn": "tab:blue",
        "ls_jax_xla": "tab:orange",
        "ls_jax_ffi": "tab:green",
        "torch_compile": "tab:red",
    }
    shown = [i for i in colors if any(i in table[k] for k in labels)]
    width = 0.8 / max(len(shown), 1)
    for index, implementation in enumerate(shown):
        values = [table[k].get(implementation, np.nan) for k in labels]
        ax.bar(
            np.arange(len(labels)) + (index - (len(shown) - 1) / 2) * width,
            values,
            width,
            label=implementation,
            color=colors[implementation],
        )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(np.arange(len(labels)), [k.replace("/", "\n") for k in labels], fontsize=7)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)


def plot_speedups(
    table: dict[str, dict[str, float]],
    path: Path,
    device_kind: str,
    cudnn_table: dict[str, dict[str, float]] | None = None,
    torch_table: dict[str, dict[str, float]] | None = None,
) -> None:
    """Bars of ``table`` (speedups over plain Flax) and, each where given, of ``cudnn_table`` (over Flax with cuDNN
    attention) and ``torch_table`` (over PyTorch under torch.compile) in panels beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not table:
        return
    panels = [(table, "speedup over plain Flax (step time ratio)")]
    if cudnn_table:
        panels.append((cudnn_table, "speedup over Flax with cuDNN attention"))
    if torch_table:
        panels.append((torch_table, "speedup over PyTorch under torch.compile"))
    fig, axes = plt.subplots(1, len(panels), figsize=(len(panels) * max(6, 0.7 * len(table)), 4), squeeze=False)
    for ax, (values, ylabel) in zip(axes[0], panels):
        _bar_panel(ax, values, ylabel)
    fig.suptitle(f"Training step, {device_kind}, bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.bench e2e", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models",
        default=",".join(workloads.FAMILIES),
        help="comma-separated families ("
        + ", ".join(f"{family}: {' '.join(names)}" for family, names in workloads.FAMILIES.items())
        + ") or models: "
        + ", ".join(workloads.MODEL_ORDER),
    )
    parser.add_argument(
        "--tokens", help=f"WMT models: target tokens per step, comma-separated (default: {DEFAULT_TOKENS})"
    )
    parser.add_argument(
        "--seq-lens",
        default=None,
        help="BERT and GPT-2: sequence lengths, comma-separated (default: "
        + "; ".join(f"{name} {','.join(map(str, zoo_steps.MODELS[name].seq_lens))}" for name in workloads.ZOO)
        + ")",
    )
    parser.add_argument(
        "--rows",
        type=int,
        default=None,
        help="BERT and GPT-2: rows per batch (default: "
        + "; ".join(f"{name} {zoo_steps.MODELS[name].rows}" for name in workloads.ZOO)
        + ")",
    )
    implementations_known = workloads.ALL_IMPLEMENTATIONS
    parser.add_argument(
        "--implementations",
        default=",".join(workloads.DEFAULT_IMPLEMENTATIONS),
        help="comma-separated; each model runs those it has: "
        + ", ".join(implementations_known)
        + " (default: all but the FP8 rows, "
        + ", ".join(workloads.FP8_IMPLEMENTATIONS)
        + ", which need a GPU with FP8 GEMMs or a CPU); "
        + ", ".join(workloads.TORCH_IMPLEMENTATIONS)
        + " needs torch and transformers (pip install torch transformers) and runs on the GPU when PyTorch sees "
        "CUDA, else on the CPU",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=10,
        help=f"timed samples of {STEPS_PER_SAMPLE} consecutive steps (after 3 warm-up steps)",
    )
    parser.add_argument(
        "--token-ids",
        choices=token_ids_lib.DISTRIBUTIONS,
        default=token_ids_lib.DEFAULT,
        help="how the batches' token ids are drawn: uniform over the vocabulary (default), or zipf, the k-th "
        "most frequent id 1/k as often as the first, as in text (its rows go to e2e-zipf-<device>.json)",
    )
    parser.add_argument("--fit", action="store_true", help="also find the largest trainable batch per WMT model")
    common.add_out_argument(parser, "e2e")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run (CPU): each family of --models as its tiny model ("
        + ", ".join(workloads.QUICK_MODELS.values())
        + f"), WMT at {QUICK_TOKENS} tokens, 2 samples; "
        "without a GPU, no ls_jax_ffi or flax_cudnn (torch_compile runs, compiling for the CPU in about a minute "
        "a model)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        given = [
            flag
            for flag, value in (("--tokens", args.tokens), ("--seq-lens", args.seq_lens), ("--rows", args.rows))
            if value is not None
        ]
        if given:
            parser.error(f"--quick runs its own small shapes; drop {', '.join(given)}")
    args.tokens = args.tokens or DEFAULT_TOKENS
    args.out = common.out_dir(args.out, parser)
    implementations = args.implementations.split(",")
    unknown = [i for i in implementations if i not in implementations_known]
    if unknown:
        parser.error(f"unknown implementation: {', '.join(unknown)}; known: {', '.join(implementations_known)}")
    try:
        models = workloads.expand_models(args.models.split(","), quick=args.quick)
        token_counts = [QUICK_TOKENS] if args.quick else [int(t) for t in args.tokens.split(",")]
        seq_lens = None if args.quick or not args.seq_lens else [int(n) for n in args.seq_lens.split(",")]
        workload_list = workloads.workloads(
            models, token_counts, seq_lens, None if args.quick else args.rows, token_ids=args.token_ids
        )
    except ValueError as err:
        parser.error(str(err))
    try:
        workloads.check_fp8_device(implementations)
    except ValueError as err:
        parser.error(str(err))
    if args.quick:
        args.steps = 2
        gpu = jax.default_backend() == "gpu" and backend.cuda_visible()
        implementations = [i for i in implementations if gpu or i not in workloads.NEEDS_GPU]

    out = ResultFile.open(args.out, header(gemm_size=1024 if args.quick else 8192), args.quick, args.token_ids)
    run(workload_list, implementations, args.steps, out, fit_batch=args.fit)
    for title, table in (
        ("over plain Flax", speedups(out.results)),
        ("over Flax with cuDNN attention", speedups(out.results, ("flax_cudnn",))),
        ("over PyTorch under torch.compile", speedups(out.results, workloads.TORCH_IMPLEMENTATIONS)),
        ("over plain Flax in FP8", speedups(out.results, ("reference_fp8",))),
        ("over ls_jax ffi in bf16", speedups(out.results, ("ls_jax_ffi",))),
    ):
        if table:
            print(f"speedup {title}")
        for key, ratios in sorted(table.items(), key=lambda item: _sort_key(item[0])):
            print(f"  {key:24s} " + "  ".join(f"{impl} {ratio:.2f}x" for impl, ratio in sorted(ratios.items())))
    print(f"wrote {out.path}")
    return 0
