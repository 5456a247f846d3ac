"""Where each device's time went in a traced stretch of training: ``python -m train.bench timeline TRACE_DIR``.

Reads the ``jax.profiler`` trace that ``--profile-steps`` writes (RUN_DIR/profile, one folder per process) or any
other trace directory, and reports per GPU over the traced window (first kernel start to last kernel end):

  busy       the union of every kernel's interval, on any stream
  compute    the union of the kernels that are not NCCL's
  nccl       the union of NCCL's kernels (the collectives)
  exposed    NCCL time not under any other kernel: communication the step waits for
  idle       window - busy: the device ran nothing, e.g. waiting for the host to launch the next work
  gaps       idle stretches of at least ``--gap-us``: how many, their sum, and the largest with the kernels around
  kernels    how many ran, and the kernels that took the most time, by name

per step (the window divided by the traced steps), and the host threads' longest events by total time (what the
host did meanwhile: launching executables, updating CUDA graphs, copying batches) with each one's longest call.
With ``--out`` the numbers go to a JSON file.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from train.records import rundir

DEFAULT_GAP_US = 20.0
LARGEST_GAPS = 5
LARGEST_KERNELS = 10
HOST_EVENTS = 15


def trace_files(directory: Path) -> list[Path]:
    """The trace JSON files under ``directory``, one per traced process, in path order."""
    files = sorted(directory.rglob("*.trace.json.gz")) or sorted(directory.rglob("perfetto_trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no jax.profiler trace (*.trace.json.gz, perfetto_trace.json.gz) under {directory}")
    return files


def read_events(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as handle:
        return json.load(handle)["traceEvents"]


def _names(events: Iterable[Mapping[str, Any]], kind: str) -> dict[Any, str]:
    """process_name (``kind`` "process_name", keyed by pid) or thread_name ("thread_name", by (pid, tid))."""
    names = {}
    for event in events:
        if event.get("ph") == "M" and event.get("name") == kind:
            key = event["pid"] if kind == "process_name" else (event["pid"], event.get("tid"))
            names[key] = str(event.get("args", {}).get("name", ""))
    return names


def gpu_processes(events: Iterable[Mapping[str, Any]]) -> dict[Any, str]:
    """The trace's GPU device processes: pid -> name (``/device:GPU:0``)."""
    return {pid: name for pid, name in _names(events, "process_name").items() if "GPU" in name}


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The disjoint, sorted intervals covering ``intervals``."""
    merged: list[tuple[float, float]] = []
    for start, stop in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def length(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(stop - start for start, stop in intervals)


def largest(durations: Iterable[tuple[Any, float]], limit: int) -> list[tuple[Any, float, int]]:
    """``(key, total duration, count)`` of the ``limit`` keys with the longest total, longest first."""
    totals: dict[Any, list[float]] = {}
    for key, duration in durations:
        entry = totals.setdefault(key, [0.0, 0])
        entry[0] += duration
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:limit]
    return [(key, total, int(count)) for key, (total, count) in ranked]


def is_nccl(name: str) -> bool:
    return "nccl" in name.lower()


def device_timeline(
    kernels: Sequence[Mapping[str, Any]], steps: int, gap_us: float, window: tuple[float, float] | None = None
) -> dict[str, Any]:
    """The numbers of one device's kernel events (trace time in microseconds), in milliseconds per step, over
    ``window`` (kernels clipped to it) or from the first kernel's start to the last one's end."""
    spans = [(float(k["ts"]), float(k["ts"]) + float(k["dur"]), str(k["name"])) for k in kernels]
    if window is not None:
        spans = [
            (max(a, window[0]), min(b, window[1]), name) for a, b, name in spans if b > window[0] and a < window[1]
        ]
    busy = union((start, stop) for start, stop, _ in spans)
    compute = union((start, stop) for start, stop, name in spans if not is_nccl(name))
    nccl = union((start, stop) for start, stop, name in spans if is_nccl(name))
    first, last = window or (busy[0][0], busy[-1][1])
    exposed = length(busy) - length(compute)
    edges = [first, *(edge for interval in busy for edge in interval), last]
    gaps = [(a, b) for a, b in zip(edges[::2], edges[1::2]) if b - a >= gap_us]
    by_end = sorted(spans, key=lambda span: span[1])
    by_start = sorted(spans)

    def around(gap: tuple[float, float]) -> dict[str, Any]:
        before = max((s for s in by_end if s[1] <= gap[0] + 1e-6), key=lambda s: s[1], default=None)
        after = next((s for s in by_start if s[0] >= gap[1] - 1e-6), None)
        return {
            "at_ms": (gap[0] - first) / 1e3,
            "length_us": gap[1] - gap[0],
            "after_kernel": before[2] if before else None,
            "before_kernel": after[2] if after else None,
        }

    per_step = 1e-3 / steps
    return {
        "steps": steps,
        "kernels": len(spans),
        "kernels_per_step": len(spans) / steps,
        "largest_kernels": [
            {"name": name, "ms_per_step": total * per_step, "count_per_step": count / steps}
            for name, total, count in largest(((name, stop - start) for start, stop, name in spans), LARGEST_KERNELS)
        ],
        "window_ms": (last - first) * per_step,
        "busy_ms": length(busy) * per_step,
        "compute_ms": length(compute) * per_step,
        "nccl_ms": length(nccl) * per_step,
        "exposed_nccl_ms": exposed * per_step,
        "idle_ms": (last - first - length(busy)) * per_step,
        "gaps": len(gaps) / steps,
        "gaps_ms": length(gaps) * per_step,
        "largest_gaps": [around(gap) for gap in sorted(gaps, key=lambda g: g[0] - g[1])[:LARGEST_GAPS]],
    }


def host_events(events: Sequence[Mapping[str, Any]], gpu_pids: set[Any], steps: int) -> list[dict[str, Any]]:
    """The host's complete events grouped by (thread, name), longest total first, in milliseconds per step, with
    the longest single call (``longest_ms``: a few slow launches among fast ones leave the device idle)."""
    threads = _names(events, "thread_name")
    durations = [
        (
            (threads.get((event["pid"], event.get("tid")), str(event.get("tid"))), str(event["name"])),
            float(event["dur"]),
        )
        for event in events
        if event.get("ph") == "X" and event.get("pid") not in gpu_pids and "dur" in event
    ]
    longest: dict[tuple[str, str], float] = {}
    for key, duration in durations:
        longest[key] = max(longest.get(key, 0.0), duration)
    return [
        {
            "thread": thread,
            "name": name,
            "ms_per_step": total / 1e3 / steps,
            "count_per_step": count / steps,
            "longest_ms": longest[thread, name] / 1e3,
        }
        for (thread, name), total, count in largest(durations, HOST_EVENTS)
    ]


def summarize(
    events: Sequence[Mapping[str, Any]], steps: int, gap_us: float = DEFAULT_GAP_US, step_kernel: str | None = None
) -> dict[str, Any]:
    """Per GPU (by its process name in the trace) `device_timeline`, and the host's `host_events`.

    With ``step_kernel`` (part of the name of a kernel each step runs once, such as the optimizer's ``step_kernel``)
    a device's window runs from the end of its first such kernel to the end of its last, and holds one step fewer
    than there are of them: whole steps, whatever the trace's edges cut.
    """
    processes = gpu_processes(events)
    gpu_pids = set(processes)
    devices = {}
    for pid in sorted(gpu_pids, key=lambda p: processes[p]):
        kernels = [e for e in events if e.get("pid") == pid and e.get("ph") == "X" and "dur" in e]
        ends = sorted(float(k["ts"]) + float(k["dur"]) for k in kernels if step_kernel and step_kernel in k["name"])
        if len(ends) > 1:
            devices[processes[pid]] = device_timeline(kernels, len(ends) - 1, gap_us, (ends[0], ends[-1]))
        elif kernels:
            devices[processes[pid]] = device_timeline(kernels, steps, gap_us)
    return {"steps": steps, "gap_us": gap_us, "devices": devices, "host": host_events(events, gpu_pids, steps)}


def traced_steps(trace_dir: Path) -> int | None:
    """The number of steps ``--profile-steps`` traced, from the run's config.json when ``trace_dir`` is (inside) a
    run's profile folder."""
    for directory in (trace_dir, *trace_dir.parents):
        config = rundir.config_path(directory)
        if config.is_file():
            steps = json.loads(config.read_text()).get("profile_steps")
            return None if steps is None else steps[1] - steps[0] + 1
    return None


def table(summary: Mapping[str, Any]) -> str:
    """The summary as text: one row per device, then the largest gaps and the host's longest events."""
    columns = ("window_ms", "busy_ms", "compute_ms", "nccl_ms", "exposed_nccl_ms", "idle_ms", "gaps", "gaps_ms")
    names = ("window", "busy", "compute", "nccl", "nccl alone", "idle", "gaps", "gap ms")
    lines = [f"per step (ms; gaps of at least {summary['gap_us']:g} us)"]
    lines.append(f"{'device':<22}{'steps':>6}" + "".join(f"{name:>12}" for name in names))
    for name, device in summary["devices"].items():
        lines.append(f"{name[:21]:<22}{device['steps']:>6}" + "".join(f"{device[c]:>12.3f}" for c in columns))
    for name, device in summary["devices"].items():
        lines.append(
            f"  {name[:20]} kernels per step {device['kernels_per_step']:.0f}; the largest (ms, count per step):"
        )
        for entry in device["largest_kernels"]:
            lines.append(f"    {entry['ms_per_step']:8.3f} {entry['count_per_step']:8.1f}  {entry['name'][:90]}")
    for name, device in summary["devices"].items():
        for gap in device["largest_gaps"]:
            lines.append(
                f"  {name[:20]} gap {gap['length_us']:.0f} us at {gap['at_ms']:.2f} ms: after "
                f"{str(gap['after_kernel'])[:50]}, before {str(gap['before_kernel'])[:50]}"
            )
    lines.append("host (ms per step, calls per step, the longest call in ms):")
    for event in summary["host"]:
        lines.append(
            f"  {event['ms_per_step']:8.3f} {event['count_per_step']:8.1f} {event['longest_ms']:8.3f}  "
            f"{event['thread'][:24]:<24} {event['name'][:80]}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.bench timeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("trace_dir", type=Path, help="a --profile-steps folder (RUN_DIR/profile) or any trace folder")
    parser.add_argument("--steps", type=int, help="steps in the trace (default: the run's --profile-steps)")
    parser.add_argument("--gap-us", type=float, default=DEFAULT_GAP_US, help="shortest idle stretch counted as a gap")
    parser.add_argument(
        "--step-kernel",
        help="part of the name of a kernel every step runs once (e.g. step_kernel, the fused optimizer's): each "
        "device's numbers then cover the whole steps between its first and last run",
    )
    parser.add_argument("--out", type=Path, help="also write the numbers to this JSON file")
    args = parser.parse_args(argv)
    if not args.trace_dir.is_dir():
        parser.error(f"trace folder not found: {args.trace_dir}")
    try:
        files = trace_files(args.trace_dir)
    except FileNotFoundError as err:
        parser.error(str(err))
    steps = args.steps or traced_steps(args.trace_dir)
    if (steps is None or steps < 1) and args.step_kernel is None:
        parser.error(
            "say how many steps the trace holds with --steps N or --step-kernel NAME (it is not a "
            "--profile-steps folder)"
        )
    results = {}
    for path in files:
        summary = summarize(read_events(path), steps, args.gap_us, args.step_kernel)
        results[str(path.relative_to(args.trace_dir))] = summary
        print(f"{path}\n{table(summary)}\n")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0
