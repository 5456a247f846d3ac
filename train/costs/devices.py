"""The device table: per kind of JAX device, the datasheet's dense peak TFLOP/s per precision, its price per hour,
its power where no meter reads it (TPU, CPU) and its maximum board power, each with its source.

A JAX device is one GPU, one TPU v4/v5 chip, or one TPU v2/v3 TensorCore (two per chip), and the numbers are per
JAX device accordingly; a CPU's price and power are per logical CPU (vCPU), and its JAX devices share the logical
CPUs this process may run on (`logical_cpus`). Every lookup returns None where a number is not known, never a
guess.
"""

from __future__ import annotations

import dataclasses
import os
import re

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")


@dataclasses.dataclass(frozen=True)
class Price:
    usd_per_hour: float  # per JAX device (per logical CPU for an entry with per_logical_cpu)
    source: str  # where and when the list price was read


@dataclasses.dataclass(frozen=True)
class Power:
    watts: float  # per JAX device (per logical CPU for an entry with per_logical_cpu)
    source: str


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """Numbers for one kind of JAX device. ``pattern`` is matched (case-insensitively) against device_kind."""

    name: str
    pattern: str
    peak_tflops: dict[str, float | None]  # dense datasheet peak per precision
    peak_source: str
    price: Price | None = None
    power: Power | None = None
    per_logical_cpu: bool = False  # price and power per logical CPU (vCPU), not per JAX device
    max_power_w: float | None = None  # the datasheet's maximum board power: no measured average can exceed it

    def matches(self, device_kind: str) -> bool:
        return re.search(self.pattern, device_kind, re.IGNORECASE) is not None


# "fp32" means what JAX runs for float32 matmuls at its default precision: TF32 tensor cores on Ampere and
# newer GPUs, plain FP32 on Volta/Turing, one bfloat16 pass on TPU. "fp8" is the FP8 tensor-core rate (Hopper),
# which a run in --precision fp8 reaches in its matrix products only.
_NV = "NVIDIA {} datasheet, dense (without sparsity)"
_GCP_GPU = "Google Cloud GPU pricing, on-demand us-central1, GPU only (no VM), listed 2024"
_AWS_CB = "AWS EC2 Capacity Blocks pricing, effective accelerator rate, US East (Ohio), listed 2024-12"
_GCP_TPU = "Google Cloud TPU pricing, on-demand us-central1, listed 2024"
_TPU_ARCH = "Google Cloud TPU system architecture docs, per chip"
_V4_PAPER = "Jouppi et al., TPU v4, ISCA 2023, Table 1: mean power"
_LESSONS = (
    "Jouppi et al., Ten Lessons from Three Generations of TPUs, ISCA 2021, Table 1: TDP (no mean published; an upper "
    "bound)"
)
# JAX names no CPU model ("cpu"), so a CPU's figures are per logical CPU of a typical cloud machine.
_CPU_PRICE = (
    "AWS EC2 On-Demand pricing, m6a.large (2 vCPUs of a 3rd-generation AMD EPYC, 8 GiB), Linux, US East "
    "(N. Virginia): USD 0.0864 per hour, i.e. 0.0432 per vCPU-hour with its memory; listed since 2021, "
    "read 2026-11"
)
_CPU_POWER = (
    "Cloud Carbon Footprint, AWS average power of a fully busy vCPU (MAX_WATTS_AVG of "
    "AwsFootprintEstimationConstants.ts, from SPECpower_ssj2008 results), read 2026-11; the CPU's model is "
    "unknown, so an estimate"
)

DEVICES: tuple[DeviceSpec, ...] = (
    DeviceSpec(
        "H100-PCIe",
        r"h100.*pcie",
        {"fp32": 378.0, "bf16": 756.0, "fp16": 756.0, "fp8": 1513.0},
        _NV.format("H100 PCIe"),
        Price(4.916, _AWS_CB + " (H100 SXM price)"),
        max_power_w=350,
    ),
    DeviceSpec(
        "H100-NVL",
        r"h100.*nvl",
        {"fp32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
        _NV.format("H100 NVL"),
        Price(4.916, _AWS_CB + " (H100 SXM price)"),
        max_power_w=400,
    ),
    DeviceSpec(
        "H100-SXM",
        r"h100",
        {"fp32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
        _NV.format("H100 SXM"),
        Price(4.916, _AWS_CB),
        max_power_w=700,
    ),
    DeviceSpec(
        "H200-NVL",
        r"h200.*nvl",
        {"fp32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
        _NV.format("H200 NVL"),
        Price(5.408, _AWS_CB + " (H200 SXM price)"),
        max_power_w=600,
    ),
    DeviceSpec(
        "H200-SXM",
        r"h200",
        {"fp32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
        _NV.format("H200 SXM"),
        Price(5.408, _AWS_CB),
        max_power_w=700,
    ),
    DeviceSpec(
        "A100-80GB",
        r"a100.*80",
        {"fp32": 156.0, "bf16": 312.0, "fp16": 312.0, "fp8": None},
        _NV.format("A100"),
        Price(3.93, _GCP_GPU),
        max_power_w=400,
    ),
    DeviceSpec(
        "A100-40GB",
        r"a100",
        {"fp32": 156.0, "bf16": 312.0, "fp16": 312.0, "fp8": None},
        _NV.format("A100"),
        Price(2.934, _GCP_GPU),
        max_power_w=400,
    ),
    DeviceSpec(
        "V100-PCIe",
        r"v100.*pcie",
        {"fp32": 14.0, "bf16": None, "fp16": 112.0, "fp8": None},
        _NV.format("V100 PCIe"),
        Price(2.48, _GCP_GPU),
        max_power_w=250,
    ),
    DeviceSpec(
        "V100-SXM2",
        r"v100",
        {"fp32": 15.7, "bf16": None, "fp16": 125.0, "fp8": None},
        _NV.format("V100 SXM2"),
        Price(2.48, _GCP_GPU),
        max_power_w=300,
    ),
    DeviceSpec(
        "A10",
        r"\ba10g?\b",
        {"fp32": 62.5, "bf16": 125.0, "fp16": 125.0, "fp8": None},
        _NV.format("A10"),
        Price(0.75, "Lambda GPU cloud pricing, 1x A10 on-demand, listed 2024"),
        max_power_w=150,
    ),
    DeviceSpec(
        "T4",
        r"\bt4\b",
        {"fp32": 8.1, "bf16": None, "fp16": 65.0, "fp8": None},
        _NV.format("T4"),
        Price(0.35, _GCP_GPU),
        max_power_w=70,
    ),
    DeviceSpec(
        "TPU-v2",
        r"tpu v2",
        {"fp32": 22.5, "bf16": 22.5, "fp16": None, "fp8": None},
        _TPU_ARCH + ": 45 TFLOP/s bf16 per chip, 2 TensorCores (JAX devices) per chip",
        Price(0.5625, _GCP_TPU + ": USD 4.50 per v2-8 (8 cores)"),
        Power(140.0, _LESSONS + ": 280 W per chip, 2 cores"),
    ),
    DeviceSpec(
        "TPU-v3",
        r"tpu v3",
        {"fp32": 61.5, "bf16": 61.5, "fp16": None, "fp8": None},
        _TPU_ARCH + ": 123 TFLOP/s bf16 per chip, 2 TensorCores (JAX devices) per chip",
        Price(1.00, _GCP_TPU + ": USD 8.00 per v3-8 (8 cores)"),
        Power(110.0, _V4_PAPER + " of TPU v3, 220 W per chip, 2 cores"),
    ),
    DeviceSpec(
        "TPU-v4",
        r"tpu v4",
        {"fp32": 275.0, "bf16": 275.0, "fp16": None, "fp8": None},
        _TPU_ARCH + ": 275 TFLOP/s bf16 per chip (one JAX device)",
        Price(3.22, _GCP_TPU + ", per chip"),
        Power(170.0, _V4_PAPER + " of TPU v4, 170 W per chip"),
    ),
    DeviceSpec(
        "TPU-v5e",
        r"tpu v5 ?lite|tpu v5e",
        {"fp32": 197.0, "bf16": 197.0, "fp16": None, "fp8": None},
        _TPU_ARCH + ": 197 TFLOP/s bf16 per chip (one JAX device)",
        Price(1.20, _GCP_TPU + ", per chip"),
    ),
    DeviceSpec(
        "TPU-v5p",
        r"tpu v5p?$|tpu v5p",
        {"fp32": 459.0, "bf16": 459.0, "fp16": None, "fp8": None},
        _TPU_ARCH + ": 459 TFLOP/s bf16 per chip (one JAX device)",
        Price(4.20, _GCP_TPU + ", per chip"),
    ),
    DeviceSpec(
        "CPU",
        r"^cpu$",
        {"fp32": None, "bf16": None, "fp16": None, "fp8": None},
        "no peak: a CPU's peak depends on its model, which JAX does not name",
        Price(0.0432, _CPU_PRICE),
        Power(3.5, _CPU_POWER),
        per_logical_cpu=True,
    ),
)
DEVICE_NAMES = tuple(spec.name for spec in DEVICES)


def find_device(device_kind: str, name: str | None = None) -> DeviceSpec | None:
    """The table entry for a JAX device_kind, or for an explicit table ``name`` (``--device-name``).

    Raises:
      ValueError: ``name`` is given but not in the table.
    """
    if name is not None:
        for spec in DEVICES:
            if spec.name.lower() == name.lower():
                return spec
        raise ValueError(f"unknown device name {name!r}; known: {', '.join(DEVICE_NAMES)}")
    return next((spec for spec in DEVICES if spec.matches(device_kind)), None)


def peak_tflops(spec: DeviceSpec | None, precision: str) -> float | None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return None if spec is None else spec.peak_tflops.get(precision)


def logical_cpus() -> int:
    """The logical CPUs (hardware threads; a cloud's vCPUs) this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this OS
        return os.cpu_count() or 1


def units_per_device(spec: DeviceSpec | None, device_count: int) -> float:
    """How many of ``spec``'s price and power units one JAX device stands for: 1, or for an entry priced per
    logical CPU, this process's logical CPUs shared among its ``device_count`` JAX devices."""
    if spec is None or not spec.per_logical_cpu:
        return 1.0
    return logical_cpus() / device_count


def _per_device(spec: DeviceSpec, source: str, units: float) -> str:
    """``source`` named after its table entry, with the logical CPUs per device where the entry counts those."""
    share = f"; x {units:g} logical CPUs per JAX device" if spec.per_logical_cpu else ""
    return f"{spec.name}: {source}{share}"


def resolve_price(
    spec: DeviceSpec | None, override: float | None, units: float = 1.0
) -> tuple[float | None, str | None]:
    """(USD per device-hour, its source): ``--price-per-hour`` if given, else the table's price x ``units``
    (`units_per_device`), else (None, None)."""
    if override is not None:
        if override < 0:
            raise ValueError(f"--price-per-hour must be >= 0, got {override}")
        return override, "--price-per-hour"
    if spec is None or spec.price is None:
        return None, None
    return spec.price.usd_per_hour * units, _per_device(spec, spec.price.source, units)


def device_power(spec: DeviceSpec | None, units: float = 1.0) -> Power | None:
    """The power of one JAX device: the table's x ``units`` (`units_per_device`), or None without a figure."""
    if spec is None or spec.power is None:
        return None
    return Power(spec.power.watts * units, _per_device(spec, spec.power.source, units))


def cost_usd(seconds: float, device_count: int, price_per_device_hour: float | None) -> float | None:
    return None if price_per_device_hour is None else seconds * device_count * price_per_device_hour / 3600.0
