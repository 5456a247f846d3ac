"""The devices a run uses and what `train.costs.devices` knows about them: peak FLOP/s at the run's precision, price per
device-hour and the energy meter."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from ls_jax.layers import fp8
from train.costs import devices as device_table
from train.costs import energy as energy_lib
from train.costs.precision import fp8_gemms, parse_precision
from train.errors import UsageError


@dataclasses.dataclass
class Hardware:
    """The devices a run uses and what the table in `train.costs.devices` knows about them."""

    devices: list[Any]  # all devices (every host)
    local_devices: list[Any]
    spec: device_table.DeviceSpec | None
    precision: str
    peak_tflops_per_device: float | None
    price_per_device_hour: float | None
    price_source: str | None
    energy: energy_lib.EnergyMeter  # started when the devices were detected

    @classmethod
    def detect(cls, precision: str, *, device_name: str | None = None, price_override: float | None = None) -> Hardware:
        """The devices JAX sees and their table entry; ``precision`` may be ``auto`` (see `parse_precision`).

        Raises:
          ValueError: an unknown ``device_name`` or precision, or bf16 or fp8 on a device without it.
        """
        devices = jax.devices()
        spec = device_table.find_device(devices[0].device_kind, device_name)
        precision = parse_precision(precision, devices[0].platform, spec)
        if fp8_gemms(precision):
            fp8.check_device(devices[0])
        local = jax.local_devices()
        units = device_table.units_per_device(spec, len(local))
        price, price_source = device_table.resolve_price(spec, price_override, units)
        return cls(
            devices=devices,
            local_devices=local,
            spec=spec,
            precision=precision,
            peak_tflops_per_device=device_table.peak_tflops(spec, precision),
            price_per_device_hour=price,
            price_source=price_source,
            energy=energy_lib.energy_meter(local, spec),
        )

    @property
    def device_count(self) -> int:
        return len(self.devices)

    def record_fields(self) -> dict[str, Any]:
        """The hardware part of the ``run`` record."""
        return {
            "platform": self.devices[0].platform,
            "device_kind": self.devices[0].device_kind,
            "device_count": self.device_count,
            "peak_tflops_per_device": self.peak_tflops_per_device,
            "peak_source": None if self.spec is None or self.peak_tflops_per_device is None else self.spec.peak_source,
            "price_per_device_hour_usd": self.price_per_device_hour,
            "price_source": self.price_source,
            "energy_method": self.energy.method,
        }

    def energy_joules(self) -> float | None:
        """Energy of every host's devices since the meter started (a collective when there are several hosts)."""
        return self.sum_over_hosts([self.energy.joules()])[0]

    def sum_over_hosts(self, values: list[float | None]) -> list[float | None]:
        """Each of ``values`` (this host's energies) summed over every host, None where a host lacks it (a
        collective when there are several hosts: every process calls it with as many values)."""
        if jax.process_count() == 1 or not values:
            return list(values)
        from jax.experimental import multihost_utils

        local = np.asarray([np.nan if value is None else value for value in values], np.float64)
        gathered = multihost_utils.process_allgather(local).reshape(-1, len(values))
        sums = gathered.sum(axis=0)
        return [None if np.isnan(value) else float(value) for value in sums]


def detect_hardware(precision: str, device_name: str | None, price_per_hour: float | None) -> Hardware:
    """`Hardware.detect` for the flags ``--precision``, ``--device-name`` and ``--price-per-hour``; a bad value is a
    UsageError."""
    try:
        return Hardware.detect(precision, device_name=device_name, price_override=price_per_hour)
    except ValueError as err:
        raise UsageError(str(err)) from err
