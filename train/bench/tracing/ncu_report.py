"""Nsight Compute's raw CSV (``ncu --csv --page raw``): parsed, grouped and aggregated as the counter study does.

The CSV has a header row (``ID``, ``Kernel Name``, ... then one column per metric), a units row, then one row per
profiled kernel launch; numbers may carry thousands separators ("1,234.5") and the units may be scaled ("Kbyte",
"usecond"), which `parse_csv` brings back to bytes and nanoseconds. `aggregate` reduces a set of kernels the way
the study does: sums for counts, medians over kernels for efficiencies, and (fairer for efficiencies, since a
2 us kernel should not weigh as much as a 2 ms GEMM) means weighted by kernel time. `normalise` divides every
aggregate of an implementation by the reference's.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import statistics
from typing import Any, Callable, Iterable, Mapping

# The seed study's nvprof metrics in their Nsight Compute (Hopper) names.
TIME = "gpu__time_duration.sum"
DRAM_READ = "dram__bytes_read.sum"
DRAM_WRITE = "dram__bytes_write.sum"
SM_THROUGHPUT = "sm__throughput.avg.pct_of_peak_sustained_elapsed"
OCCUPANCY = "sm__warps_active.avg.pct_of_peak_sustained_active"
INSTRUCTIONS = "smsp__inst_executed.sum"
WARPS_LAUNCHED = "smsp__warps_launched.sum"
IPC = "sm__inst_executed.avg.per_cycle_active"
GLOBAL_LOADS = "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum"
GLOBAL_STORES = "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum"
HALF_OPS = {
    f"smsp__sass_thread_inst_executed_op_h{op}_pred_on.sum": 2 if op == "fma" else 1 for op in ("add", "mul", "fma")
}
SINGLE_OPS = {
    f"smsp__sass_thread_inst_executed_op_f{op}_pred_on.sum": 2 if op == "fma" else 1 for op in ("add", "mul", "fma")
}
# Tensor-core math ops (GEMMs and fused attention): the sass op counters above never see them. Hopper counts fp16
# sources over every accumulator type in one counter, and fp32 GEMMs run on the tensor cores as tf32.
TENSOR_OPS = (
    "sm__ops_path_tensor_src_bf16_dst_fp32.sum",
    "sm__ops_path_tensor_src_fp16.sum",
    "sm__ops_path_tensor_src_tf32_dst_fp32.sum",
)

METRICS = (
    TIME,
    DRAM_READ,
    DRAM_WRITE,
    SM_THROUGHPUT,
    OCCUPANCY,
    INSTRUCTIONS,
    WARPS_LAUNCHED,
    IPC,
    GLOBAL_LOADS,
    GLOBAL_STORES,
    *HALF_OPS,
    *SINGLE_OPS,
    *TENSOR_OPS,
)
FLOP_METRICS = (TIME, DRAM_READ, DRAM_WRITE, *HALF_OPS, *SINGLE_OPS, *TENSOR_OPS)
EFFICIENCIES = {"sm_throughput_pct": SM_THROUGHPUT, "achieved_occupancy_pct": OCCUPANCY, "ipc": IPC}

_UNIT_SCALE = {
    "byte": 1.0,
    "kbyte": 1e3,
    "mbyte": 1e6,
    "gbyte": 1e9,
    "tbyte": 1e12,
    "nsecond": 1.0,
    "usecond": 1e3,
    "msecond": 1e6,
    "second": 1e9,
}


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One profiled kernel launch: its ID in launch order, demangled name and metric values (None where n/a)."""

    id: int
    name: str
    metrics: Mapping[str, float | None]


def parse_number(text: str, unit: str) -> float | None:
    """A CSV cell as a float in base units (bytes, nanoseconds); None for an empty or "n/a" cell."""
    cleaned = text.strip().replace(",", "")
    if cleaned in ("", "n/a", "N/A"):
        return None
    try:
        value = float(cleaned)
    except ValueError:
        raise ValueError(f"ncu CSV cell {text!r} is not a number; request only numeric metrics") from None
    return value * _UNIT_SCALE.get(unit.strip().lower(), 1.0)


def parse_csv(text: str, metrics: Iterable[str] | None = None) -> list[Kernel]:
    """The kernels of an ``ncu --csv --page raw`` report; lines before the header (``==PROF==`` notes, program
    output) are skipped. ``metrics``: the requested metrics, the columns read (the raw page adds launch and device
    attributes, some of them words such as "CachePreferNone"); default every metric column. Raises ValueError naming
    what is missing when the text holds no such report or a requested metric's column."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError(
            'no ncu raw CSV header (a row starting with "ID") in the report; was ncu run with '
            "--csv --page raw, and did it profile any kernel?"
        )
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, units, records = rows[0], rows[1], [row for row in rows[2:] if len(row) == len(rows[0])]
    if "Kernel Name" not in header:
        raise ValueError(f"the ncu CSV header has no 'Kernel Name' column: {header[:6]}")
    if metrics is None:
        first_metric = next((i for i, name in enumerate(header) if "__" in name), len(header))
        metric_columns = range(first_metric, len(header))
    else:
        missing = [metric for metric in metrics if metric not in header]
        if missing:
            raise ValueError(f"the ncu CSV has no column for {', '.join(missing)}")
        metric_columns = [header.index(metric) for metric in metrics]
    name_column, id_column = header.index("Kernel Name"), header.index("ID")
    return [
        Kernel(
            id=int(row[id_column].replace(",", "")),
            name=row[name_column],
            metrics={header[i]: parse_number(row[i], units[i]) for i in metric_columns},
        )
        for row in records
    ]


def _values(kernels: Iterable[Kernel], metric: str) -> list[float]:
    return [k.metrics[metric] for k in kernels if k.metrics.get(metric) is not None]


def _sum(kernels: list[Kernel], metric: str) -> float | None:
    values = _values(kernels, metric)
    return sum(values) if values else None


def _weighted_ops(kernels: list[Kernel], weights: Mapping[str, int]) -> float | None:
    """Sum over kernels of sum_op weight * count: FLOPs from sass op counters (an FMA is 2 FLOPs)."""
    parts = [(_sum(kernels, metric), weight) for metric, weight in weights.items()]
    known = [(value, weight) for value, weight in parts if value is not None]
    return sum(value * weight for value, weight in known) if known else None


def _median(kernels: list[Kernel], metric: str) -> float | None:
    values = _values(kernels, metric)
    return statistics.median(values) if values else None


def _time_weighted(kernels: list[Kernel], metric: str) -> float | None:
    """sum_k t_k x_k / sum_k t_k over the kernels that have both x and their time t."""
    pairs = [(k.metrics.get(TIME), k.metrics.get(metric)) for k in kernels]
    pairs = [(t, x) for t, x in pairs if t is not None and x is not None]
    total = sum(t for t, _ in pairs)
    return sum(t * x for t, x in pairs) / total if total else None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def aggregate(kernels: list[Kernel]) -> dict[str, float | None]:
    """The study's reduction of a set of kernels: counts summed, efficiencies as median and time-weighted mean.

    flops_half = hadd + hmul + 2 hfma (per thread), flops_single likewise, flops_tensor the tensor-core math ops;
    instructions_per_warp = sum of instructions / sum of warps launched."""
    instructions, warps = _sum(kernels, INSTRUCTIONS), _sum(kernels, WARPS_LAUNCHED)
    tensor = [value for value in (_sum(kernels, metric) for metric in TENSOR_OPS) if value is not None]
    result: dict[str, float | None] = {
        "kernels": float(len(kernels)),
        "time_ns": _sum(kernels, TIME),
        "dram_read_bytes": _sum(kernels, DRAM_READ),
        "dram_write_bytes": _sum(kernels, DRAM_WRITE),
        "instructions": instructions,
        "instructions_per_warp": _ratio(instructions, warps),
        "global_load_requests": _sum(kernels, GLOBAL_LOADS),
        "global_store_requests": _sum(kernels, GLOBAL_STORES),
        "flops_half": _weighted_ops(kernels, HALF_OPS),
        "flops_single": _weighted_ops(kernels, SINGLE_OPS),
        "flops_tensor": sum(tensor) if tensor else None,
    }
    for name, metric in EFFICIENCIES.items():
        result[f"{name}_median"] = _median(kernels, metric)
        result[f"{name}_time_weighted"] = _time_weighted(kernels, metric)
    return result


def by_category(kernels: list[Kernel], category_of: Callable[[Kernel], str]) -> dict[str, dict[str, float | None]]:
    """`aggregate` of the kernels of each category, categories in order of first appearance."""
    groups: dict[str, list[Kernel]] = {}
    for kernel in kernels:
        groups.setdefault(category_of(kernel), []).append(kernel)
    return {category: aggregate(members) for category, members in groups.items()}


def normalise(measured: Mapping[str, float | None], reference: Mapping[str, float | None]) -> dict[str, Any]:
    """measured / reference for every aggregate both have (None where either is missing or the reference is 0)."""
    return {name: _ratio(value, reference.get(name)) for name, value in measured.items()}
