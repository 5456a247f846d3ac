"""What a run's work and memory come to: FLOPs, MFU and device memory.

Every lookup returns None where a number is not known, never a guess.

- `transformer_train_flops`: the analytic FLOP count of one training step (docs/flops.md derives it);
  `xla_flops`: XLA's own count of a lowered computation (before optimization), for cross-checking.
- `mfu`: model FLOP utilization against the device table's peak (`train.costs.devices`).
- Energy meters (NVML, RAPL, estimates) live in `train.costs.energy`.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

# ------------------------------------------------------------------------------------------------- FLOPs


def transformer_train_flops(
    *,
    batch: int,
    src_len: int,
    tgt_len: int,
    hidden: int,
    ffn: int,
    encoder_layers: int,
    decoder_layers: int,
    vocab: int,
) -> int:
    """Matmul FLOPs of one training step of an encoder-decoder Transformer on a (batch, src_len/tgt_len) batch.

    With B batch, S source and T target (padded) lengths, H hidden, F feed-forward, V vocabulary, counting a
    multiply-add as 2 FLOPs (see docs/flops.md):

        encoder layer   2BS(4H^2 + 2HF) + 4BS^2H
        decoder layer   2BT(4H^2 + 2HF) + 4BT^2H  +  2BT(2H^2) + 2BS(2H^2) + 4BTSH   (self + cross attention)
        output logits   2BTHV
        training step   3 x forward (the backward pass computes two matmuls per forward matmul)
    """
    encoder = 2 * batch * src_len * (4 * hidden**2 + 2 * hidden * ffn) + 4 * batch * src_len**2 * hidden
    decoder = (
        2 * batch * tgt_len * (4 * hidden**2 + 2 * hidden * ffn)
        + 4 * batch * tgt_len**2 * hidden
        + 2 * batch * tgt_len * 2 * hidden**2
        + 2 * batch * src_len * 2 * hidden**2
        + 4 * batch * tgt_len * src_len * hidden
    )
    logits = 2 * batch * tgt_len * hidden * vocab
    return 3 * (encoder_layers * encoder + decoder_layers * decoder + logits)


def xla_flops(lowered: Any) -> float | None:
    """FLOPs XLA's cost analysis counts in a lowered, not yet optimized computation (``jitted.lower(...)``), or None
    where no analysis is available.

    Not the compiled computation's count: optimization turns a GPU's matmuls into cuBLAS calls, which count 0.
    Where the backend is a PJRT plugin (JAX's CUDA plugin), which has no analysis before compilation, the same
    un-optimized module is analysed by the host (CPU) client: the count depends on the HLO, not on the device.
    """
    try:
        analysis = lowered.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without cost analysis
        analysis = None
    if not analysis:
        analysis = host_cost_analysis(lowered)
    if isinstance(analysis, (list, tuple)):  # older jax returns one dict per computation
        analysis = analysis[0] if analysis else None
    flops = analysis.get("flops") if analysis else None
    return float(flops) if flops is not None and flops > 0 else None


def host_cost_analysis(lowered: Any) -> dict[str, float] | None:
    """XLA's cost analysis of ``lowered``'s un-optimized HLO module run by the CPU client, or None when this jax
    does not expose the pieces (`jax.stages.Lowered` has no public route to another client's analysis)."""
    try:
        from jax._src.lib import _jax

        module = lowered._lowering.hlo().as_hlo_module()
        return dict(_jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module))
    except Exception:  # noqa: BLE001 - private API: absent or changed in another jax version
        return None


def mfu(tflops_per_s: float | None, peak_per_device: float | None, device_count: int) -> float | None:
    if tflops_per_s is None or not peak_per_device:
        return None
    return tflops_per_s / (peak_per_device * device_count)


# ------------------------------------------------------------------------------------------------ memory


def _memory_stats(devices: Sequence[Any]) -> list[dict[str, Any]]:
    """Each device's ``memory_stats()``, leaving out devices that report none."""
    reports = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 - not implemented on some platforms
            stats = None
        if stats:
            reports.append(stats)
    return reports


def free_memory_bytes(devices: Sequence[Any]) -> int | None:
    """The smallest ``bytes_limit - bytes_in_use`` over ``devices`` now, or None where devices do not report memory."""
    free = [
        int(stats["bytes_limit"]) - int(stats["bytes_in_use"])
        for stats in _memory_stats(devices)
        if "bytes_limit" in stats and "bytes_in_use" in stats
    ]
    return min(free) if free else None


def peak_memory_bytes(devices: Sequence[Any]) -> int | None:
    """The largest ``peak_bytes_in_use`` over ``devices``, or None where devices do not report memory."""
    peaks = [int(stats["peak_bytes_in_use"]) for stats in _memory_stats(devices) if "peak_bytes_in_use" in stats]
    return max(peaks) if peaks else None
