"""The compute precision of a run (fp32, bf16, fp16, fp8) and what it changes: the param dtype of
``--master-weights`` and the parts of a checkpoint's model signature that depend on it.

fp8 computes in bf16 except the models' Dense GEMMs and tied logits, which multiply in FP8 with delayed scaling
(`ls_jax.layers.fp8`)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

import ls_jax.optim
from train.costs import devices as device_table
from train.errors import UsageError

PRECISION_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16, "fp8": jnp.bfloat16}
"""The compute dtype of each precision (fp8's: of everything but its FP8 matrix products)."""


def fp8_gemms(precision: str) -> bool:
    """Whether the models multiply in FP8 (``LayerConfig.fp8``)."""
    return precision == "fp8"


def parse_precision(value: str, platform: str, spec: device_table.DeviceSpec | None) -> str:
    """The compute precision for ``--precision value`` on ``platform`` / device ``spec``.

    ``auto`` is fp32 on CPU (where bf16 matmuls are emulated and slow), else bf16, or fp16 on GPUs without
    bf16 tensor cores (V100, T4).

    Raises:
      ValueError: an unknown value, or bf16 on a device the table knows has no bf16 support.
    """
    no_bf16 = spec is not None and spec.peak_tflops.get("bf16") is None and platform == "gpu"
    if value == "auto":
        return "fp32" if platform == "cpu" else ("fp16" if no_bf16 else "bf16")
    if value not in PRECISION_DTYPES:
        raise ValueError(f"--precision must be auto, {', '.join(PRECISION_DTYPES)}; got {value!r}")
    if value in ("bf16", "fp8") and no_bf16:
        raise ValueError(f"{spec.name} has no bf16 support; use --precision fp16 or fp32")
    return value


def master_dtype(master_weights: bool, precision: str) -> Any:
    """The 16-bit param dtype of ``--master-weights`` (the compute dtype), or None without it.

    Raises:
      UsageError: ``--master-weights`` with fp32 compute.
    """
    if not master_weights:
        return None
    if precision == "fp32":
        raise UsageError("--master-weights needs --precision bf16 or fp16: with fp32 compute the params are f32")
    return PRECISION_DTYPES[precision]


def gradient_comm_dtype(choice: str | None, precision: str) -> Any:
    """The dtype data-parallel gradients are sent and summed in: ``--grad-comm-dtype`` when given, else bf16 in a
    bf16 run and None (the params' dtype) otherwise.

    A bf16 (or fp8) run's gradients come out of bf16 matrix products, so sending them in bf16 halves the traffic of f32
    params for little loss (LightSeq2's trainer likewise all-reduces 16-bit gradients); the sum is returned in f32.
    fp16 keeps f32: its loss-scaled gradients can overflow fp16 where their f32 sum would not.
    """
    if choice is not None:
        return PRECISION_DTYPES[choice]
    return jnp.bfloat16 if PRECISION_DTYPES[precision] == jnp.bfloat16 else None


def precision_signature(master_weights: bool, precision: str) -> dict[str, Any]:
    """The entries of a checkpoint's model signature that change the train state's structure with the precision.

    ``master_weights`` appears only when set, so checkpoints written before the flag existed still resume; for
    bf16 params it names the master's form, int16 low halves (``ls_jax.optim.master``), which the f32 masters of
    checkpoints written before that form do not restore into. ``fp8_scaling`` (the FP8 scaling state beside the
    params) appears only in fp8."""
    signature: dict[str, Any] = {"fp16_loss_scaling": precision == "fp16"}
    if fp8_gemms(precision):
        signature["fp8_scaling"] = True
    if master_weights:
        split = ls_jax.optim.master.is_split(master_dtype(master_weights, precision))
        signature["master_weights"] = "int16 low halves" if split else True
    return signature
