"""FP8 matrix products with delayed scaling, through Flax's FP8 ops (``flax.linen.fp8_ops``).

With ``LayerConfig.fp8`` every ``Dense`` GEMM and the tied logits (``TransformerEmbedding.attend``) quantize their
inputs before multiplying:

    forward   y  = dq(q_e4m3(x / s_x) q_e4m3(W / s_W)) s_x s_W       (Flax's ``Fp8DirectDotGeneralOp``)
    backward  dy is quantized to e5m2 by s_dy before both products of the backward
    scale     s = amax / fp8_max, amax the largest |value| over the last ``amax_history_length`` steps

(e4m3's largest value is 448, e5m2's 57344.) Each GEMM's scales and amax histories are variables of the
``_overwrite_with_gradient`` collection (`SCALING`): its "gradient" is its next value, which a training step
takes as it is instead of passing it to the optimizer (`new_scaling`), and which data-parallel replicas and
gradient-accumulation micro-batches combine by their maximum (`combine_scaling`). Everything else runs in
``LayerConfig.dtype``; the fused ops are unchanged.

The matrix products run as FP8 GEMMs on GPUs of compute capability 8.9 and up (Ada, Hopper); a CPU emulates them
(same numerics, to test them); `check_device` refuses the devices that have neither.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

SCALING = fp8_ops.OVERWRITE_WITH_GRADIENT  # the collection of every GEMM's scales and amax histories
FORWARD_DTYPE = jnp.float8_e4m3fn
GRADIENT_DTYPE = jnp.float8_e5m2
MIN_COMPUTE_CAPABILITY = 8.9
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
"""XLA options for compiling a step with FP8 GEMMs on a GPU: the GEMMs go to cuBLAS(Lt) alone, without XLA's
Triton GEMMs among the autotuner's candidates. On one H200 (docs/results/README.md, "Compiling an FP8 step"),
autotuning Triton's FP8 GEMMs made ``train.wmt``'s transformer-base fp8 step shapes compile for 61-94 s each
against 10-12 s without them; without them transformer-big's step at 8192 tokens is 8% slower (26.0 against
23.9 ms)."""


def fp8_dot(op: fp8_ops.Fp8DirectDotGeneralOp, x: jax.Array, kernel: jax.Array, contract: int) -> jax.Array:
    """``x (rows, K)`` times the 2-D ``kernel``, contracted over the kernel's axis ``contract`` (0: (K, N); 1: a
    transposed (N, K) table), as FP8 by ``op`` (which holds this GEMM's scaling state); in x's dtype.

    The kernel is cast to x's dtype first: Flax's op quantizes from the compute dtype.
    """
    return op(x, kernel.astype(x.dtype), (((1,), (contract,)), ((), ())))


def split_scaling(variables: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(variables without SCALING, the SCALING collection)`` of a module's variables (an empty dict without
    FP8)."""
    rest = {name: value for name, value in variables.items() if name != SCALING}
    return rest, variables.get(SCALING, {})


def with_scaling(variables: dict[str, Any], scaling: Any) -> dict[str, Any]:
    """``variables`` (e.g. ``{"params": ...}``) with ``scaling`` as their SCALING collection; unchanged when
    ``scaling`` is empty (a model without FP8)."""
    return {**variables, SCALING: scaling} if scaling else dict(variables)


def new_scaling(scaling_gradient: Any) -> Any:
    """The scaling state after a step: the gradient of the ``SCALING`` collection is its next value (the updated
    amax histories and the scales they give), not a direction to step in."""
    return scaling_gradient


def combine_scaling(a: Any, b: Any) -> Any:
    """The scaling state two micro-batches (or replicas) saw, combined: the larger scale and amax, element by
    element, so no one of them overflows next step."""
    return jax.tree.map(jnp.maximum, a, b)


def amax_ratios(scaling: dict[str, Any]) -> dict[str, jax.Array]:
    """For each quantized tensor of ``scaling`` (a SCALING collection after a step), its newest amax over the
    largest value its scale let FP8 hold, ``amax / (fp8_max * scale)``: above 1, that step clipped values. Keys are
    the paths of the ops joined by "/" plus ``input``, ``kernel`` or ``output_grad``."""
    ratios = {}
    flat = jax.tree_util.tree_flatten_with_path(scaling)[0]
    by_path = {"/".join(str(getattr(key, "key", key)) for key in path): leaf for path, leaf in flat}
    for path, history in by_path.items():
        if not path.endswith("_amax_history"):
            continue
        prefix, tensor = path.rsplit("/", 1)
        tensor = tensor.removesuffix("_amax_history")
        scale = by_path[f"{prefix}/{tensor}_scale"]
        fp8_max = jnp.finfo(GRADIENT_DTYPE if tensor == "output_grad" else FORWARD_DTYPE).max.astype(jnp.float32)
        ratios[f"{prefix}/{tensor}"] = history[0] / (fp8_max * scale[0])
    return ratios


def overflows(scaling: dict[str, Any]) -> dict[str, jax.Array]:
    """For each quantized tensor of ``scaling``, whether its newest amax exceeded what its scale let FP8 hold
    (`amax_ratios` above 1): the values clipped in that step."""
    return {name: ratio > 1.0 for name, ratio in amax_ratios(scaling).items()}


def device_has_fp8(device: Any) -> bool:
    """Whether ``device`` multiplies FP8: a GPU of compute capability 8.9 or higher, or a CPU (emulated)."""
    if device.platform == "cpu":
        return True
    if device.platform in ("gpu", "cuda"):
        capability = getattr(device, "compute_capability", None)
        return capability is not None and float(capability) >= MIN_COMPUTE_CAPABILITY
    return False


def check_device(device: Any) -> None:
    """Raises ValueError, naming ``device``, when it has no FP8 matrix products (`device_has_fp8`)."""
    if not device_has_fp8(device):
        capability = getattr(device, "compute_capability", None)
        has = f" (compute capability {capability})" if capability is not None else ""
        raise ValueError(
            f"{device.device_kind}{has} has no FP8 matrix products: FP8 needs a GPU of compute capability "
            f"{MIN_COMPUTE_CAPABILITY} or higher (Ada, Hopper); train in bf16 on this device"
        )


def compiler_options(platform: str) -> dict[str, Any]:
    """`GPU_COMPILER_OPTIONS` on a GPU (``platform`` "gpu" or "cuda"), less any option ``$XLA_FLAGS`` names (the
    user's value stands); nothing elsewhere."""
    if platform not in ("gpu", "cuda"):
        return {}
    given = os.environ.get("XLA_FLAGS", "")
    return {name: value for name, value in GPU_COMPILER_OPTIONS.items() if f"--{name}" not in given}
