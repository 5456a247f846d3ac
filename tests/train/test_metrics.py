"""FLOPs and memory of train.costs.metrics, the device table of train.costs.devices, the energy meters of
train.costs.energy."""

import os
import time
import types
from pathlib import Path

import jax
import pytest
from helpers.flop_step import FLOP_TOLERANCE, tiny_transformer_step
from helpers.host_devices import run_checks

from ls_jax import backend
from train.costs import devices as device_table
from train.costs import energy, metrics
from train.costs.hardware import Hardware
from train.harness.step_compiler import StepCompiler


def test_flop_formula_by_hand():
    # One encoder and one decoder layer, B=2, S=3, T=4, H=8, F=16, V=10 (the terms of the docstring).
    encoder = 2 * 2 * 3 * (4 * 64 + 2 * 8 * 16) + 4 * 2 * 9 * 8
    decoder = (
        2 * 2 * 4 * (4 * 64 + 2 * 8 * 16) + 4 * 2 * 16 * 8 + 2 * 2 * 4 * 2 * 64 + 2 * 2 * 3 * 2 * 64 + 4 * 2 * 4 * 3 * 8
    )
    logits = 2 * 2 * 4 * 8 * 10
    expected = 3 * (encoder + decoder + logits)
    got = metrics.transformer_train_flops(
        batch=2, src_len=3, tgt_len=4, hidden=8, ffn=16, encoder_layers=1, decoder_layers=1, vocab=10
    )
    assert got == expected


def test_flop_formula_matches_xla_cost_analysis_of_the_training_step():
    compiler, state, batch, analytic = tiny_transformer_step()
    with backend.use("xla"):  # fused CUDA kernels are custom calls that XLA counts as 0 FLOPs
        compiler.compiled(state, batch)
    xla = compiler.xla_flops(StepCompiler.key(batch))
    assert xla is not None
    print(f"analytic {analytic:.4g} vs XLA {xla:.4g} FLOPs: {analytic / xla - 1:+.2%}")
    # The analytic count is matmuls only: an XLA count missing the matmuls would be a few % of it, far outside.
    assert abs(analytic - xla) / xla < FLOP_TOLERANCE, (analytic, xla)


def test_xla_flops_of_a_step_on_two_devices_count_the_whole_step():
    run_checks(Path(__file__).with_name("flop_count_checks.py"), devices=2)


def test_xla_flops_are_counted_before_optimization_and_by_the_host_where_the_device_has_no_analysis():
    compiler, state, batch, analytic = tiny_transformer_step()
    with backend.use("xla"):
        lowered = compiler.lower(state, batch)
        compiler.compiled(state, batch)
    before = lowered.cost_analysis()["flops"]
    assert compiler.xla_flops(StepCompiler.key(batch)) == before
    # The route a CUDA plugin takes (its lowered computation has no analysis): the same module, the CPU's analysis.
    assert metrics.host_cost_analysis(lowered)["flops"] == before


@pytest.mark.gpu
def test_xla_flops_of_a_gpu_step_count_its_matmuls():
    """On a GPU the compiled step's cost analysis misses matmuls that became cuBLAS calls; the count taken before
    optimization must still agree with the analytic (matmul) count."""
    compiler, state, batch, analytic = tiny_transformer_step()
    with backend.use("xla"):
        compiled = compiler.compiled(state, batch)
    xla = compiler.xla_flops(StepCompiler.key(batch))
    optimized = metrics.xla_flops(compiled)
    print(f"analytic {analytic:.4g}, before optimization {xla}, compiled {optimized}")
    assert xla is not None
    assert abs(analytic - xla) / xla < FLOP_TOLERANCE, (analytic, xla)
    assert optimized is None or optimized < (1 - FLOP_TOLERANCE) * xla, (
        f"the compiled step's analysis counts {optimized} FLOPs of {xla}: it is expected to miss cuBLAS matmuls, "
        "which is why the count is taken before optimization"
    )


def test_xla_flops_reads_dict_or_list_and_rejects_missing():
    class Lowered:  # a stand-in without a module: the host analysis finds nothing either
        def __init__(self, analysis):
            self.analysis = analysis

        def cost_analysis(self):
            return self.analysis

    assert metrics.xla_flops(Lowered({"flops": 12.0})) == 12.0
    assert metrics.xla_flops(Lowered([{"flops": 7.0}])) == 7.0
    assert metrics.xla_flops(Lowered({})) is None
    assert metrics.xla_flops(Lowered(None)) is None


@pytest.mark.parametrize(
    "device_kind, name, bf16_peak",
    [
        ("NVIDIA H100 80GB HBM3", "H100-SXM", 989.4),
        ("NVIDIA H100 PCIe", "H100-PCIe", 756.0),
        ("NVIDIA H200", "H200-SXM", 989.4),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB", 312.0),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB", 312.0),
        ("Tesla V100-SXM2-16GB", "V100-SXM2", None),
        ("NVIDIA A10", "A10", 125.0),
        ("Tesla T4", "T4", None),
        ("TPU v2", "TPU-v2", 22.5),
        ("TPU v3", "TPU-v3", 61.5),
        ("TPU v4", "TPU-v4", 275.0),
        ("TPU v5 lite", "TPU-v5e", 197.0),
        ("TPU v5", "TPU-v5p", 459.0),
    ],
)
def test_device_table_matches_jax_device_kinds(device_kind, name, bf16_peak):
    spec = device_table.find_device(device_kind)
    assert spec is not None and spec.name == name
    assert device_table.peak_tflops(spec, "bf16") == bf16_peak
    assert spec.peak_source and spec.price is not None and spec.price.source


def test_every_table_entry_has_sources_for_its_numbers():
    for spec in device_table.DEVICES:
        assert set(spec.peak_tflops) == set(device_table.PRECISIONS)
        assert spec.peak_source
        if spec.price is not None:
            assert spec.price.usd_per_hour > 0 and "listed" in spec.price.source
        if spec.power is not None:
            assert spec.power.watts > 0 and spec.power.source


def test_unknown_devices_have_no_numbers_and_unknown_names_are_errors():
    assert device_table.find_device("Z80 accelerator") is None
    assert device_table.peak_tflops(None, "fp32") is None
    assert device_table.resolve_price(None, None) == (None, None)
    assert device_table.device_power(None) is None
    assert device_table.find_device("cpu", "t4").name == "T4"  # --device-name, case-insensitive
    with pytest.raises(ValueError, match="unknown device name 'Z80'; known: H100-PCIe"):
        device_table.find_device("cpu", "Z80")
    with pytest.raises(ValueError, match="precision"):
        device_table.peak_tflops(None, "int8")


def test_price_override_cost_and_mfu():
    spec = device_table.find_device("Tesla T4")
    assert device_table.resolve_price(spec, None) == (spec.price.usd_per_hour, f"T4: {spec.price.source}")
    assert device_table.resolve_price(spec, 1.5) == (1.5, "--price-per-hour")
    with pytest.raises(ValueError, match="price-per-hour"):
        device_table.resolve_price(spec, -1.0)
    assert device_table.cost_usd(1800.0, 4, 2.0) == pytest.approx(4.0)
    assert device_table.cost_usd(1800.0, 4, None) is None
    assert metrics.mfu(50.0, 100.0, 2) == pytest.approx(0.25)
    assert metrics.mfu(50.0, None, 2) is None


def test_cpu_price_and_power_are_per_logical_cpu_with_their_sources():
    cpu = device_table.find_device("cpu")
    assert cpu.name == "CPU" and cpu.per_logical_cpu and device_table.peak_tflops(cpu, "fp32") is None
    logical = len(os.sched_getaffinity(0))
    assert device_table.units_per_device(cpu, 2) == logical / 2
    price, source = device_table.resolve_price(cpu, None, device_table.units_per_device(cpu, 1))
    assert price == pytest.approx(0.0432 * logical)
    assert "m6a.large" in source and "0.0864 per hour" in source
    assert f"x {logical:g} logical CPUs per JAX device" in source
    assert device_table.resolve_price(cpu, 0.5, 8.0) == (0.5, "--price-per-hour")  # the flag's price is per device-hour
    power = device_table.device_power(cpu, 4.0)
    assert power.watts == pytest.approx(14.0) and "Cloud Carbon Footprint" in power.source
    # This process's CPU devices: priced and metered per logical CPU, estimated unless RAPL is readable.
    hardware = Hardware.detect("fp32")
    assert hardware.spec.name == "CPU" and hardware.peak_tflops_per_device is None
    assert hardware.price_per_device_hour * hardware.device_count == pytest.approx(0.0432 * logical)


def test_cpu_energy_without_readable_rapl_counters_is_an_estimate(tmp_path):
    cpu = device_table.find_device("cpu")
    cpus = [types.SimpleNamespace(platform="cpu")]
    meter = energy.energy_meter(cpus, cpu, powercap=tmp_path / "no-powercap")
    logical = len(os.sched_getaffinity(0))
    assert isinstance(meter, energy.EstimatedEnergy) and meter.source == "estimated"
    assert f"{3.5 * logical:g} W per device x 1 devices" in meter.method and "SPECpower" in meter.method
    zone = tmp_path / "powercap" / "intel-rapl:0"
    zone.mkdir(parents=True)
    (zone / "name").write_text("package-0\n")
    (zone / "energy_uj").mkdir()  # a zone whose counter cannot be read is passed over
    (zone / "max_energy_range_uj").write_text("262143328850\n")
    assert energy.rapl_packages(tmp_path / "powercap") == []
    assert energy.energy_meter(cpus, cpu, powercap=tmp_path / "powercap").source == "estimated"


def _zone(root, name, kind, counter, counter_range):
    zone = root / name
    zone.mkdir(parents=True)
    (zone / "name").write_text(kind + "\n")
    (zone / "energy_uj").write_text(f"{counter}\n")
    (zone / "max_energy_range_uj").write_text(f"{counter_range}\n")
    return zone


def test_rapl_sums_the_package_counters_and_adds_back_a_wrap(tmp_path):
    """A powercap directory as Linux lays it out: two packages, a core subzone and a psys zone (parts of the
    packages, or holding them: never summed with them)."""
    package0 = _zone(tmp_path, "intel-rapl:0", "package-0", 990_000, 1_000_000)
    package1 = _zone(tmp_path, "intel-rapl:1", "package-1", 100, 1_000_000)
    _zone(tmp_path, "intel-rapl:0:0", "core", 5, 1_000_000)
    _zone(tmp_path, "intel-rapl:2", "psys", 7, 1_000_000)
    assert energy.rapl_packages(tmp_path) == [package0, package1]
    cpu = device_table.find_device("cpu")
    meter = energy.energy_meter([types.SimpleNamespace(platform="cpu")], cpu, powercap=tmp_path)
    assert isinstance(meter, energy.RaplEnergy) and meter.source == "rapl"
    assert "intel-rapl:0, intel-rapl:1" in meter.method
    assert meter.joules() == 0.0
    (package0 / "energy_uj").write_text("5000\n")  # wrapped past 1,000,000 uJ: 10,000 + 5,000 uJ
    (package1 / "energy_uj").write_text("300\n")
    assert meter.joules() == pytest.approx(15_200e-6)
    (package0 / "energy_uj").write_text("7000\n")
    assert meter.joules() == pytest.approx(17_200e-6)
    meter.start()
    assert meter.joules() == 0.0
    assert energy.counter_advance(999, 1, 1000) == 2 and energy.counter_advance(10, 30, 1000) == 20


class FakeNvml:
    """pynvml's energy API over fake GPUs whose counters (mJ) advance by a fixed amount per read."""

    def __init__(self, start_mj, step_mj):
        self.counters = list(start_mj)
        self.step_mj = step_mj
        self.shut_down = False

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shut_down = True

    def nvmlDeviceGetCount(self):
        return len(self.counters)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetUUID(self, handle):
        return f"GPU-{handle:04d}"

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        value = self.counters[handle]
        self.counters[handle] += self.step_mj[handle]
        return value


def fake_gpus(*ordinals):
    return [types.SimpleNamespace(platform="gpu", local_hardware_id=i) for i in ordinals]


def test_nvml_energy_is_the_summed_counter_difference(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = FakeNvml(start_mj=[1_000_000, 5_000_000, 9_000_000], step_mj=[1500, 2500, 99999])
    meter = energy.NvmlEnergy(nvml, [0, 1])
    meter.start()
    # start() read each counter once; the next read is one step further: (1500 + 2500) mJ = 4 J.
    assert meter.joules() == pytest.approx(4.0)


def test_gpu_meter_samples_nvml_in_the_background(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = FakeNvml(start_mj=[0, 0], step_mj=[1000, 1000])
    meter = energy.energy_meter(fake_gpus(0, 1), None, nvml=nvml)
    assert isinstance(meter, energy.SampledEnergy) and meter.source == "nvml"
    assert "background thread" in meter.method
    deadline = time.monotonic() + 10
    while meter.joules() < 10.0 and time.monotonic() < deadline:  # 2 J per read of both GPUs, every 20 ms
        time.sleep(0.01)
    assert meter.joules() >= 10.0
    meter.close()
    reads = list(nvml.counters)
    time.sleep(0.1)
    assert nvml.counters == reads and nvml.shut_down  # the thread stopped before NVML was shut down


def test_nvml_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-0000")
    nvml = FakeNvml(start_mj=[0, 0, 0], step_mj=[1000, 50000, 3000])
    indices = energy._visible_nvml_indices(nvml, [0, 1])  # CUDA 0 -> NVML 2, CUDA 1 -> NVML 0
    assert indices == [2, 0]
    meter = energy.NvmlEnergy(nvml, indices)
    meter.start()
    assert meter.joules() == pytest.approx(4.0)


class ClockMeter(energy.EnergyMeter):
    """A meter of ``watts`` over the test's clock; each read takes 0.1 s of that clock and returns the energy at its
    middle. ``fail`` makes its reads raise."""

    source, method = "test", "a test meter"

    def __init__(self, clock, watts):
        self.clock, self.watts, self.fail, self.reads = clock, watts, False, 0

    def joules(self):
        if self.fail:
            raise OSError("the device is gone")
        value = self.watts * (self.clock[0] + 0.05)
        self.clock[0] += 0.1
        self.reads += 1
        return value


def test_sampled_meter_extrapolates_from_its_latest_reads_and_never_goes_back():
    clock = [0.0]
    inner = ClockMeter(clock, watts=100.0)
    meter = energy.SampledEnergy(inner, period_s=0.001, clock=lambda: clock[0])
    meter.start()
    deadline = time.monotonic() + 10
    while inner.reads < 5 and time.monotonic() < deadline:
        time.sleep(0.005)
    meter._stop_thread()
    reads = inner.reads
    clock[0] += 0.37
    assert meter.joules() == pytest.approx(100.0 * clock[0])  # on the 100 W line, past the last read
    clock[0] -= 0.3
    assert meter.joules() == pytest.approx(100.0 * (clock[0] + 0.3))  # a later call never reads less
    assert inner.reads == reads  # joules() itself never waits for the slow meter
    meter.close()


def test_sampled_meter_whose_read_fails_reports_unknown_energy():
    clock = [0.0]
    inner = ClockMeter(clock, watts=10.0)
    meter = energy.SampledEnergy(inner, period_s=0.005, clock=lambda: clock[0])
    meter.start()
    inner.fail = True
    deadline = time.monotonic() + 10
    while meter.joules() is not None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert meter.joules() is None
    meter.close()


def test_nvml_failure_means_unknown_energy():
    class Broken(FakeNvml):
        def nvmlDeviceGetTotalEnergyConsumption(self, handle):
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    meter = energy.energy_meter(fake_gpus(0), None, nvml=Broken([0], [0]))
    assert meter.joules() is None and meter.source is None


def test_tpu_energy_is_power_times_devices_times_time():
    spec = device_table.find_device("TPU v4")
    now = [100.0]
    meter = energy.EstimatedEnergy(spec.power, 4, clock=lambda: now[0])
    now[0] += 10.0
    assert meter.source == "estimated"
    assert meter.joules() == pytest.approx(170.0 * 4 * 10.0)
    assert "170 W per device x 4 devices" in meter.method and "ISCA 2023" in meter.method
    tpu_devices = [types.SimpleNamespace(platform="tpu")] * 2
    assert isinstance(energy.energy_meter(tpu_devices, spec), energy.EstimatedEnergy)
    assert energy.energy_meter(tpu_devices, device_table.find_device("TPU v5 lite")).source is None  # no power figure


def test_peak_memory_max_over_devices_or_none():
    def device(stats):
        return types.SimpleNamespace(memory_stats=lambda: stats)

    assert metrics.peak_memory_bytes([device({"peak_bytes_in_use": 10}), device({"peak_bytes_in_use": 30})]) == 30
    assert metrics.peak_memory_bytes([device(None)]) is None
    cpu_peak = metrics.peak_memory_bytes(jax.local_devices())
    assert cpu_peak is None or cpu_peak > 0
