"""What ``train.bench counters`` and ``train.bench flops`` run under Nsight Compute, and the child that runs it.

Workloads (each built for the plain Flax ``reference`` or ls_jax as ``ls_jax_xla`` / ``ls_jax_ffi``):
  wmt-big-6e6d   one training step of `train.bench.steps.transformer_steps` (Transformer big, 6+6 layers, AdamW),
                 ``batch`` sentences of 64 source and 64 target tokens (``--layers 2N``: N encoder + N decoder
                 layers of the same widths, embedding, output projection, loss and optimizer included);
  bert-base      forward + backward of a 12-layer BERT-base-shaped encoder stack (H 768, F 3072, 12 heads, pre-LN,
                 ReLU, dropout 0.1) on (batch, seq_len) positions, no embedding or optimizer;
  encoder-block  the same for one layer: the block whose FLOPs `train.bench.steps.hand_count` counts.
The child (``python -m train.bench.steps.counter_workloads ...``) compiles and warms up the workload, writes the
compiled HLO (for the kernel categories), then runs exactly one measured call between cuProfilerStart and
cuProfilerStop, so ``ncu --profile-from-start off`` profiles that call's kernels and nothing else.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from train.bench import common
from train.bench.steps import transformer_steps, zoo_steps
from train.reference.transformer import EncoderLayer, ReferenceConfig

_BERT_BASE = zoo_steps.MODELS["bert-base"]
ENCODER_SHAPE = transformer_steps.ModelShape(
    hidden=_BERT_BASE.hidden,
    intermediate=_BERT_BASE.intermediate,
    heads=_BERT_BASE.heads,
    encoder_layers=_BERT_BASE.layers,
    decoder_layers=0,
)
WARMUP_CALLS = 3


@dataclasses.dataclass(frozen=True)
class CounterWorkload:
    """What one counters workload runs: ``layers`` layers, its default shape, and whether it is a whole train step."""

    layers: int
    default_batch: int
    default_seq_len: int
    whole_step: bool


WORKLOADS = {
    "wmt-big-6e6d": CounterWorkload(
        layers=12, default_batch=16, default_seq_len=transformer_steps.SEQ_LEN, whole_step=True
    ),
    "bert-base": CounterWorkload(layers=12, default_batch=1, default_seq_len=512, whole_step=False),
    "encoder-block": CounterWorkload(layers=1, default_batch=16, default_seq_len=128, whole_step=False),
}


@dataclasses.dataclass
class Compiled:
    """A compiled workload (``compiled.as_text()`` is its HLO) and the no-argument call that runs it once."""

    compiled: Any
    call: Callable[[], Any]

    def __call__(self) -> Any:
        return self.call()


class _ReferenceStack(nn.Module):
    config: ReferenceConfig
    layers: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.layers):
            x = EncoderLayer(self.config)(x, None, False)
        return x


class _LsJaxStack(nn.Module):
    layers: int

    @nn.compact
    def __call__(self, x):
        from ls_jax.layers import LayerConfig, TransformerEncoderLayer

        config = LayerConfig.preset(
            "bert-base", pre_layer_norm=True, activation_fn="relu", activation_dropout_ratio=0.1, dtype=jnp.bfloat16
        )
        for _ in range(self.layers):
            x = TransformerEncoderLayer(config)(x, deterministic=False)
        return x


def encoder_stack(implementation: str, layers: int, batch: int, seq_len: int) -> Compiled:
    """Forward + backward (the loss, and gradients of params and input) of ``layers`` encoder blocks on
    (batch, seq_len, 768).

    The loss is returned as a training step returns it: with gradients alone, the last block's second feed-forward
    GEMM feeds nothing but the discarded loss, and XLA drops its forward product (8 of the 74 x tokens x H^2 FLOPs
    of a BERT-base block at 128 positions)."""
    shape = ENCODER_SHAPE
    if implementation == "reference":
        config = ReferenceConfig(
            vocab_size=1,
            hidden_size=shape.hidden,
            intermediate_size=shape.intermediate,
            num_heads=shape.heads,
            num_encoder_layers=layers,
            num_decoder_layers=0,
        )
        model: nn.Module = _ReferenceStack(config, layers)
    else:
        model = _LsJaxStack(layers)
    x = jax.random.normal(jax.random.PRNGKey(0), (batch, seq_len, shape.hidden), jnp.bfloat16)
    params = jax.jit(model.init)({"params": jax.random.PRNGKey(1), "dropout": jax.random.PRNGKey(2)}, x)

    def loss(p, inputs, rng):
        return jnp.sum(model.apply(p, inputs, rngs={"dropout": rng}).astype(jnp.float32))

    rng = jax.random.PRNGKey(3)  # made here: a key made inside the measured call would add its kernels
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x, rng).compile()
    return Compiled(grad, lambda: grad(params, x, rng))


def build(workload: str, implementation: str, batch: int, seq_len: int, layers: int | None = None) -> Compiled:
    """The workload compiled for ``implementation``'s kernel mode; ``layers`` overrides its depth (a whole step's
    encoder and decoder layers together, half each)."""
    from ls_jax import backend

    spec = WORKLOADS[workload]
    with backend.use(transformer_steps.kernel_mode(implementation)):
        if spec.whole_step:
            data = transformer_steps.make_batch(batch, seed=0)
            step = transformer_steps.build_step(
                implementation, workload.removeprefix("wmt-"), data, None if layers is None else layers // 2
            )
            return Compiled(step.compiled, lambda: step.run(data))
        return encoder_stack(implementation, layers or spec.layers, batch, seq_len)


def _driver_call(driver: ctypes.CDLL, name: str, *args: Any) -> None:
    status = getattr(driver, name)(*args)
    if status != 0:
        raise RuntimeError(f"{name} returned CUDA error {status}")


def profiler_range(start: bool) -> None:
    """cuProfilerStart / cuProfilerStop of the CUDA driver: the range ``ncu --profile-from-start off`` profiles.

    The profiler API acts on the calling thread's current CUDA context, and this thread has none (XLA makes its
    context current only on its own threads): the device's primary context, the one XLA runs on, is made current
    around the call."""
    driver = ctypes.CDLL("libcuda.so.1")
    device, context = ctypes.c_int(), ctypes.c_void_p()
    _driver_call(driver, "cuDeviceGet", ctypes.byref(device), 0)
    _driver_call(driver, "cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
    try:
        _driver_call(driver, "cuCtxPushCurrent_v2", context)
        try:
            _driver_call(driver, "cuProfilerStart" if start else "cuProfilerStop")
        finally:
            _driver_call(driver, "cuCtxPopCurrent_v2", ctypes.byref(ctypes.c_void_p()))
    finally:
        _driver_call(driver, "cuDevicePrimaryCtxRelease_v2", device)


def run_child(
    workload: str,
    implementation: str,
    batch: int,
    seq_len: int,
    hlo_path: Path,
    env_path: Path,
    layers: int | None = None,
) -> None:
    """Compile, warm up, write the HLO and the environment record, then one call inside the profiler range."""
    fn = build(workload, implementation, batch, seq_len, layers)
    hlo_path.write_text(fn.compiled.as_text())
    env_path.write_text(json.dumps(common.environment()))
    for _ in range(WARMUP_CALLS):
        jax.block_until_ready(fn())
    profiler_range(True)
    jax.block_until_ready(fn())
    profiler_range(False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("implementation", choices=transformer_steps.IMPLEMENTATIONS)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument(
        "--layers",
        type=int,
        help="layers to build: an encoder stack's, or a WMT step's encoder and decoder layers together "
        "(default: the workload's)",
    )
    parser.add_argument("--hlo", type=Path, required=True, help="where to write the compiled HLO text")
    parser.add_argument("--env", type=Path, required=True, help="where to write the environment record (JSON)")
    args = parser.parse_args()
    run_child(args.workload, args.implementation, args.batch, args.seq_len, args.hlo, args.env, args.layers)


if __name__ == "__main__":
    main()
