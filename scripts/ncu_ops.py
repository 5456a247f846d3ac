"""Runs the ops benchmark's fused kernels a few times for Nsight Compute: ``ncu ... python3 scripts/ncu_ops.py OP...``.

Each named case of ``train.bench.ops`` (Transformer-big shapes) runs forward + backward (``ops.timed_pass``),
compiled in ffi mode (``--mode xla``: XLA's ops), ``--calls`` times, so ``ncu --kernel-name ...`` finds every kernel
of the op that many times.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ls_jax import backend  # noqa: E402
from train.bench import ops  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    cases = {case.op: case for case in ops.CASES}
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("ops", nargs="+", choices=sorted(cases), metavar="OP", help="case names of train.bench.ops")
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--mode", choices=("ffi", "xla"), default="ffi", help="kernel mode (default ffi)")
    parser.add_argument("--quick", action="store_true", help="the ops benchmark's small shapes (a CPU trial)")
    args = parser.parse_args(argv)
    for name in args.ops:
        workload = cases[name].workload(ops.QUICK_DIVISOR if args.quick else 1)
        fn, cotangent = ops.timed_pass(workload)
        with backend.use(args.mode):
            for _ in range(args.calls):
                jax.block_until_ready(fn(workload.primals, cotangent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
