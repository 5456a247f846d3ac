"""FP8 matrix products with delayed scaling: Flax's FP8 scaling (``flax.linen.fp8_ops``), quantized by
`ls_jax.ops.fp8_quantize`.

With ``LayerConfig.fp8`` every ``Dense`` GEMM and the tied logits (``TransformerEmbedding.attend``) quantize their
inputs before multiplying (`Fp8Dot`, `fp8_product`):

    forward   y  = dq(q_e4m3(x / s_x) q_e4m3(W / s_W)) s_x s_W       (as Flax's ``Fp8DirectDotGeneralOp``)
    backward  dy is quantized to e5m2 by s_dy before both products of the backward
    scale     s = amax / fp8_max, amax the largest |value| over the last ``amax_history_length`` steps

Each quantization writes the FP8 tensor in both layouts with its amax in one pass, so every product contracts
axes that lie innermost, as cuBLASLt's FP8 GEMMs need, and XLA adds no transposing or reducing pass of its own.

(e4m3's largest value is 448, e5m2's 57344.) Each GEMM's scales and amax histories are variables of the
``_overwrite_with_gradient`` collection (`SCALING`): its "gradient" is its next value, which a training step
takes as it is instead of passing it to the optimizer (`new_scaling`), and which data-parallel replicas and
gradient-accumulation micro-batches combine by their maximum (`combine_scaling`). Everything else runs in
``LayerConfig.dtype``; the fused ops are unchanged.

The matrix products run as FP8 GEMMs on GPUs of compute capability 8.9 and up (Ada, Hopper); a CPU emulates them
(same numerics, to test them); `check_device` refuses the devices that have neither.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from ls_jax import ops

SCALING = fp8_ops.OVERWRITE_WITH_GRADIENT  # the collection of every GEMM's scales and amax histories
FORWARD_DTYPE = jnp.float8_e4m3fn
GRADIENT_DTYPE = jnp.float8_e5m2
MIN_COMPUTE_CAPABILITY = 8.9
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
"""XLA options for compiling a step with FP8 GEMMs on a GPU: the GEMMs go to cuBLAS(Lt) alone, without XLA's
Triton GEMMs among the autotuner's candidates. On one H200 (docs/results/README.md, "Compiling an FP8 step"),
autotuning Triton's FP8 GEMMs made ``train.wmt``'s transformer-base fp8 step shapes compile for 61-94 s each
against 10-12 s without them. Allowed, the autotuner may also pick a Triton GEMM for a backward product."""


class Fp8Dot(fp8_ops.Fp8DotGeneralBase):
    """One FP8 product's scaling state, Flax's variables under Flax's names (checkpoints of either load in the
    other), and the product itself through `fp8_product`."""

    def __call__(self, x: jax.Array, kernel: jax.Array, contract: int) -> jax.Array:
        """``x (rows, K)`` times the 2-D ``kernel``, contracted over the kernel's axis ``contract`` (0: (K, N); 1: a
        transposed (N, K) table), in FP8; in x's dtype. The kernel is quantized from its own dtype (`fp8_product`)."""
        return fp8_product(
            x,
            kernel,
            contract,
            (self.input_scale.value, self.kernel_scale.value, self.output_grad_scale.value),
            (self.input_amax_history.value, self.kernel_amax_history.value, self.output_grad_amax_history.value),
        )


_NT = (((1,), (1,)), ((), ()))  # a @ b.T: both operands' contracted axis innermost, as cuBLASLt's FP8 GEMMs take them


def _nt(a: jax.Array, b: jax.Array, scales: tuple[jax.Array, jax.Array], dtype: Any) -> jax.Array:
    """``(a @ b.T) * s_a * s_b`` in ``dtype`` for FP8 ``a``, ``b`` and float32[1] scales ``(s_a, s_b)``; XLA inserts no
    transpose.

    In float32 (the gradient of an f32 kernel) each operand is dequantized in f32 by its scale as a scalar, which
    XLA hands to cuBLASLt as it is. In a 16-bit dtype the product is scaled after the GEMM by ``s_a * s_b`` rounded
    to that dtype, as Flax's ops scale it: cuBLASLt takes f32 scales, so XLA computes that one in a kernel of its
    own, as it would a 16-bit scale of each operand.
    """
    scale_a, scale_b = scales
    if jnp.dtype(dtype) == jnp.float32:
        a, b = (q.astype(jnp.float32) * s.reshape(()) for q, s in ((a, scale_a), (b, scale_b)))
        return jax.lax.dot_general(a, b, _NT, preferred_element_type=jnp.float32)
    product = jax.lax.dot_general(a, b, _NT, preferred_element_type=dtype)
    return fp8_ops.dequantize(product, dtype, scale_a * scale_b)


def fp8_product(x, kernel, contract, scales, histories):
    """``x (rows, K)`` times ``kernel`` ((K, N), contract 0; (N, K), contract 1) in FP8 with delayed scaling; in
    x's dtype.

    Forward: x and the kernel quantized to e4m3 (`ls_jax.ops.fp8_quantize`: each in both layouts, its scale and
    next history from one pass), their product an FP8 GEMM. Backward: dy quantized to e5m2 the same way; dx and
    the kernel's gradient FP8 GEMMs on the layouts saved, each operand with the contracted axis innermost.
    ``scales`` and ``histories`` (input, kernel, output gradient) get their next values as their "gradients", as
    Flax's FP8 ops give them (``flax.linen.fp8_ops``: the scale from the history before this step, the history
    with this step's amax added).

    The kernel is quantized from its own dtype and its gradient comes out of the GEMM in that dtype: f32
    parameters are rounded once, to FP8, where Flax's ops round them to the compute dtype first, and the step
    converts neither the kernel nor its gradient.
    """
    return _product(x, kernel, contract, jnp.dtype(kernel.dtype), scales, histories)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _product(x, kernel, contract, kernel_dtype, scales, histories):
    return _product_forward(x, kernel, contract, kernel_dtype, scales, histories)[0]


def _product_forward(x, kernel, contract, kernel_dtype, scales, histories):
    (x_scale, kernel_scale, grad_scale), (x_history, kernel_history, grad_history) = scales, histories
    q_x, q_x_t, x_scale, x_history = ops.fp8_quantize(x, x_history, x_scale, FORWARD_DTYPE)
    q_kernel, q_kernel_t, kernel_scale, kernel_history = ops.fp8_quantize(
        kernel, kernel_history, kernel_scale, FORWARD_DTYPE
    )
    forward_kernel, backward_kernel = (q_kernel_t, q_kernel) if contract == 0 else (q_kernel, q_kernel_t)
    y = _nt(q_x, forward_kernel, (x_scale, kernel_scale), x.dtype)
    saved = (
        q_x_t,
        backward_kernel,
        (x_scale, kernel_scale, grad_scale),
        (x_history, kernel_history, grad_history),
    )
    return y, saved


def _product_backward(contract, kernel_dtype, saved, dy):
    q_x_t, backward_kernel, (x_scale, kernel_scale, grad_scale), (x_history, kernel_history, grad_history) = saved
    q_dy, q_dy_t, grad_scale, grad_history = ops.fp8_quantize(dy, grad_history, grad_scale, GRADIENT_DTYPE)
    dx = _nt(q_dy, backward_kernel, (grad_scale, kernel_scale), dy.dtype)
    if contract == 0:  # (K, N): x_t (K, rows) @ dy_t (N, rows).T
        dkernel = _nt(q_x_t, q_dy_t, (x_scale, grad_scale), kernel_dtype)
    else:  # (N, K): dy_t (N, rows) @ x_t (K, rows).T
        dkernel = _nt(q_dy_t, q_x_t, (grad_scale, x_scale), kernel_dtype)
    scales = (x_scale, kernel_scale, grad_scale)
    histories = (x_history, kernel_history, grad_history)
    return dx, dkernel, scales, histories


_product.defvjp(_product_forward, _product_backward)


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


def amax_ratio_vector(scaling: dict[str, Any]) -> tuple[list[str], jax.Array]:
    """Every quantized tensor's newest amax over the largest value its scale let FP8 hold, ``amax / (fp8_max *
    scale)``, as one f32 vector (above 1, that step clipped values), and the tensors' names: the paths of the ops
    joined by "/" plus ``input``, ``kernel`` or ``output_grad``.

    The newest amaxes and the scales are gathered into vectors before the arithmetic, so a compiled step computes
    the ratios of all its tensors in a few kernels rather than one per tensor (transformer-big: 186)."""
    flat = jax.tree_util.tree_flatten_with_path(scaling)[0]
    by_path = {"/".join(str(getattr(key, "key", key)) for key in path): leaf for path, leaf in flat}
    names, newest, scales, limits = [], [], [], []
    for path, history in by_path.items():
        if not path.endswith("_amax_history"):
            continue
        prefix, tensor = path.rsplit("/", 1)
        tensor = tensor.removesuffix("_amax_history")
        names.append(f"{prefix}/{tensor}")
        newest.append(history[0])
        scales.append(by_path[f"{prefix}/{tensor}_scale"][0])
        limits.append(float(jnp.finfo(GRADIENT_DTYPE if tensor == "output_grad" else FORWARD_DTYPE).max))
    if not names:
        return [], jnp.zeros((0,), jnp.float32)
    fp8_max = jnp.asarray(limits, jnp.float32)
    return names, jnp.stack(newest) / (fp8_max * jnp.stack(scales))


def amax_ratios(scaling: dict[str, Any]) -> dict[str, jax.Array]:
    """`amax_ratio_vector` by name."""
    names, ratios = amax_ratio_vector(scaling)
    return dict(zip(names, ratios))


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
