"""Energy meters: the joules the devices of a run used since the meter started, and how that is known.

- NVIDIA GPUs: NVML's total-energy counter (millijoules since driver load), summed over the GPUs in use
  (``source`` ``nvml``), read by a background thread (`SampledEnergy`): a read can take milliseconds.
- CPUs: Linux's powercap RAPL counters of the CPU packages (``/sys/class/powercap/intel-rapl:N/energy_uj``, also
  AMD's on Linux 5.11 and newer) where this process may read them (``rapl``); they count every process on those
  packages. Elsewhere (the files are root-only on most systems since 2020) an estimate, as on TPUs.
- TPUs, and CPUs without readable RAPL counters: the table's power per device x devices x time (``estimated``).
- Other devices: None.
"""

from __future__ import annotations

import collections
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from train.costs.devices import DeviceSpec, Power, device_power, units_per_device

POWERCAP = Path("/sys/class/powercap")


class EnergyMeter:
    """Energy used by the devices since `start`, in joules; ``source`` says how it is known."""

    source: str | None = None
    method: str | None = None  # a sentence for the run log

    def start(self) -> None:
        pass

    def joules(self) -> float | None:
        return None

    def close(self) -> None:
        pass


class NvmlEnergy(EnergyMeter):
    """Sum over GPUs of NVML's total-energy counter, minus its value at `start`."""

    source = "nvml"
    method = "NVML nvmlDeviceGetTotalEnergyConsumption, summed over the GPUs in use, end minus start"

    def __init__(self, nvml: Any, indices: Sequence[int]):
        self._nvml = nvml
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
        self._start_mj = 0

    def _total_mj(self) -> int:
        return sum(self._nvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self._handles)

    def start(self) -> None:
        self._start_mj = self._total_mj()

    def joules(self) -> float:
        return (self._total_mj() - self._start_mj) / 1000.0

    def close(self) -> None:
        self._nvml.nvmlShutdown()


class SampledEnergy(EnergyMeter):
    """A meter whose reads are slow, read by a background thread every ``period_s``; `joules` answers at once.

    NVML's energy counter takes about 9 ms per GPU and read on some virtual machines (seen on H200s): read on the
    training loop's thread at every step, it held an H200 pair's 23 ms step back by a host that read 18 ms of meters
    per step. Here the loop reads two numbers instead: the value at the call is the latest sample extrapolated
    linearly by the rate between the two latest samples (each sample stamped at the middle of its read), never
    below a value returned before, so the energy of consecutive windows adds up to the meter's own difference. A
    read that fails stops the sampling, and the energy is unknown (None) from then on.
    """

    def __init__(self, meter: EnergyMeter, period_s: float = 0.02, clock: Callable[[], float] = time.monotonic):
        self._meter = meter
        self._period_s = period_s
        self._clock = clock
        self.source = meter.source
        self.method = (
            f"{meter.method}; read every {period_s * 1e3:g} ms by a background thread, each value extrapolated "
            "from the two latest reads"
        )
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=2)
        self._returned = 0.0
        self._failed = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        before = self._clock()
        value = self._meter.joules()
        stamp = (before + self._clock()) / 2
        with self._lock:
            self._samples.append((stamp, value))

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            try:
                self._sample()
            except Exception:  # noqa: BLE001 - a GPU gone, NVML shut down: the energy is unknown from here on
                with self._lock:
                    self._failed = True
                return

    def start(self) -> None:
        """Starts the inner meter and the sampling thread (raises what the inner meter's first reads raise)."""
        self._stop_thread()
        self._meter.start()
        self._samples.clear()
        self._returned, self._failed = 0.0, False
        self._sample()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="energy-meter", daemon=True)
        self._thread.start()

    def joules(self) -> float | None:
        with self._lock:
            if self._failed or not self._samples:
                return None
            (stamp, value), *older = reversed(self._samples)
            if older and stamp > older[0][0]:
                value += (value - older[0][1]) / (stamp - older[0][0]) * (self._clock() - stamp)
            self._returned = max(self._returned, value)
            return self._returned

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        self._stop_thread()
        self._meter.close()


class EstimatedEnergy(EnergyMeter):
    """Power per device x number of devices x wall time since `start`."""

    source = "estimated"

    def __init__(self, power: Power, device_count: int, clock: Callable[[], float] = time.monotonic):
        self._watts = power.watts * device_count
        self._clock = clock
        self._start = clock()
        self.method = f"{power.watts:g} W per device x {device_count} devices x time ({power.source})"

    def start(self) -> None:
        self._start = self._clock()

    def joules(self) -> float:
        return self._watts * (self._clock() - self._start)


def counter_advance(previous: int, current: int, counter_range: int) -> int:
    """How far a counter that wraps to 0 after ``counter_range`` moved from ``previous`` to ``current``, assuming
    it wrapped at most once between the two reads."""
    return current - previous if current >= previous else current + counter_range - previous


class RaplEnergy(EnergyMeter):
    """The energy counters (µJ) of the CPU packages in ``domains`` (powercap zone directories), summed, since
    `start`. Each counter wraps at its ``max_energy_range_uj``; a wrap between two reads is added back, so the
    meter must be read at least once per wrap (about 262 kJ: over 20 minutes at 200 W)."""

    source = "rapl"

    def __init__(self, domains: Sequence[Path]):
        self._domains = list(domains)
        self._ranges = [int((domain / "max_energy_range_uj").read_text()) for domain in self._domains]
        self._last = self._counters()
        self._total_uj = 0
        names = ", ".join(domain.name for domain in self._domains)
        self.method = (
            f"RAPL package energy counters ({names}: powercap energy_uj), summed, end minus start; "
            "every process on those CPUs counts"
        )

    def _counters(self) -> list[int]:
        return [int((domain / "energy_uj").read_text()) for domain in self._domains]

    def _advance(self) -> None:
        current = self._counters()
        self._total_uj += sum(
            counter_advance(before, now, counter_range)
            for before, now, counter_range in zip(self._last, current, self._ranges)
        )
        self._last = current

    def start(self) -> None:
        self._advance()
        self._total_uj = 0

    def joules(self) -> float:
        self._advance()
        return self._total_uj / 1e6


def rapl_packages(root: Path = POWERCAP) -> list[Path]:
    """The readable package zones under a powercap ``root``: top-level ``intel-rapl:N`` zones named ``package-N``
    (their ``core``/``dram`` subzones are parts of them, and a ``psys`` zone holds them), in order."""
    if not root.is_dir():
        return []
    packages = []
    for zone in sorted(root.iterdir()):
        if not re.fullmatch(r"intel-rapl:\d+", zone.name):
            continue
        try:
            if (zone / "name").read_text().strip().startswith("package"):
                int((zone / "energy_uj").read_text())
                int((zone / "max_energy_range_uj").read_text())
                packages.append(zone)
        except (OSError, ValueError):  # not readable by this user, or not a counter
            continue
    return packages


def _visible_nvml_indices(nvml: Any, cuda_ordinals: Sequence[int]) -> list[int]:
    """NVML indices of the GPUs JAX uses, given their CUDA ordinals.

    NVML ignores CUDA_VISIBLE_DEVICES, so the ordinals are mapped through it (its entries are indices or UUIDs).
    CUDA numbers GPUs in the same order as NVML when CUDA_DEVICE_ORDER=PCI_BUS_ID, and on machines whose GPUs
    are all alike also by default.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(cuda_ordinals)
    by_uuid = {}
    for index in range(nvml.nvmlDeviceGetCount()):
        uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(index))
        by_uuid[uuid.decode() if isinstance(uuid, bytes) else uuid] = index
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    nvml_indices = [int(e) if e.isdigit() else by_uuid[e] for e in entries]
    return [nvml_indices[ordinal] for ordinal in cuda_ordinals]


def _gpu_meter(devices: Sequence[Any], nvml: Any) -> EnergyMeter:
    """NVML's meter for ``devices``, or none without NVML or without the energy counter (pre-Volta)."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return EnergyMeter()
    try:
        nvml.nvmlInit()
        meter = SampledEnergy(NvmlEnergy(nvml, _visible_nvml_indices(nvml, [d.local_hardware_id for d in devices])))
        meter.start()
    except Exception:  # noqa: BLE001 - no NVML, or a GPU without the energy counter
        return EnergyMeter()
    return meter


def energy_meter(
    devices: Sequence[Any], spec: DeviceSpec | None, *, nvml: Any = None, powercap: Path = POWERCAP
) -> EnergyMeter:
    """The best energy meter for ``devices`` (this host's JAX devices), started: NVML on GPUs, RAPL on CPUs where
    readable, else an estimate from the table's power (TPUs, CPUs), else none.

    ``nvml`` is the ``pynvml`` module (nvidia-ml-py), imported here when None and GPUs are in use; ``powercap``
    the directory of the RAPL zones.
    """
    platform = devices[0].platform
    if platform == "gpu":
        return _gpu_meter(devices, nvml)
    if platform == "cpu" and (packages := rapl_packages(powercap)):
        meter = RaplEnergy(packages)
        meter.start()
        return meter
    power = device_power(spec, units_per_device(spec, len(devices)))
    if platform in ("tpu", "cpu") and power is not None:
        return EstimatedEnergy(power, len(devices))
    return EnergyMeter()
