"""Where a compiled step's collectives sit among its compute: ``python -m train.bench schedule HLO_FILE``.

Reads the scheduled HLO text XLA writes with ``XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text"`` (the
``*after_optimizations.txt`` of the step's module, e.g. ``jit_train_step``), whose entry computation lists the
instructions in the order the device runs them. Each is classed as a matrix product (a cuBLAS call or a GEMM
fusion), a fused kernel of this library (its FFI target without the ``ls_`` prefix), a concatenation, an asynchronous
all-reduce's start or end, or a synchronous all-reduce (``all-reduce``, which XLA makes of an asynchronous one
with nothing to overlap); everything else is left out. Prints the sequence with repeats collapsed (``gemm x6``),
from ``--start`` (a class, default the loss's backward kernel) on, and counts how many matrix products run after
the first all-reduce starts: the compute a gradient all-reduce can overlap with.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
from pathlib import Path
from typing import Any

_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%?(\S+) = (.*)")
_TARGET = re.compile(r'custom_call_target="ls_(\w+)"')


def entry_lines(text: str) -> list[str]:
    """The instruction lines of the module's entry computation, in schedule order."""
    start = text.find("\nENTRY ")
    if start < 0:
        raise ValueError("no ENTRY computation: give the *after_optimizations.txt dump of a module")
    return text[start:].split("\n}\n", 1)[0].splitlines()[1:]


def classify(line: str) -> str | None:
    """The class of one instruction line, None for those left out."""
    match = _INSTRUCTION.match(line)
    if match is None:
        return None
    name, rest = match.groups()
    if (name.startswith("all-reduce") and "async-start" in rest) or " all-reduce-start(" in rest:
        return "all-reduce-start"
    if (name.startswith("all-reduce") and "async-done" in rest) or " all-reduce-done(" in rest:
        return "all-reduce-done"
    if name.startswith("all-reduce") and " all-reduce(" in rest:
        return "all-reduce"
    if "__cublas" in rest or "gemm" in name:
        return "gemm"
    target = _TARGET.search(rest)
    if target:
        return target.group(1)
    if "concatenate" in name:
        return "concatenate"
    return None


def collapse(classes: list[str]) -> list[tuple[str, int]]:
    """Consecutive repeats as (class, count)."""
    return [(kind, len(list(group))) for kind, group in itertools.groupby(classes)]


def summarize(text: str, start: str = "cross_entropy_bwd") -> dict[str, Any]:
    """The classed schedule from the first ``start`` on (all of it when absent), with counts."""
    classes = [kind for kind in map(classify, entry_lines(text)) if kind is not None]
    if start in classes:
        classes = classes[classes.index(start) :]
    starts = [i for i, kind in enumerate(classes) if kind in ("all-reduce-start", "all-reduce")]
    gemms = [i for i, kind in enumerate(classes) if kind == "gemm"]
    first = starts[0] if starts else len(classes)
    return {
        "all_reduces": len(starts),
        "gemms": len(gemms),
        "gemms_after_first_all_reduce": sum(i > first for i in gemms),
        "sequence": [f"{kind} x{count}" if count > 1 else kind for kind, count in collapse(classes)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.bench schedule", description=__doc__)
    parser.add_argument("hlo", type=Path, help="a scheduled HLO text dump (*after_optimizations.txt)")
    parser.add_argument("--start", default="cross_entropy_bwd", help="the class the printed sequence starts at")
    parser.add_argument("--out", type=Path, help="also write the summary to this JSON file")
    args = parser.parse_args(argv)
    if not args.hlo.is_file():
        parser.error(f"no such file: {args.hlo}")
    try:
        summary = summarize(args.hlo.read_text(), args.start)
    except (ValueError, UnicodeDecodeError) as err:
        parser.error(f"{args.hlo}: {err}")
    print(" ".join(summary["sequence"]))
    print(
        f"{summary['all_reduces']} all-reduces; {summary['gemms_after_first_all_reduce']} of {summary['gemms']} "
        "matrix products run after the first all-reduce starts"
    )
    if args.out:
        args.out.write_text(json.dumps({"hlo": args.hlo.name, **summary}, indent=1) + "\n")
    return 0
