"""Times the fused ops whose backward sums columns (LayerNorm, bias gradients) under several grid bounds.

    python3 scripts/partials_probe.py [--rows-per-sm 2,4,8] [--out DIR]

The backward kernels that reduce over rows run one wave of blocks (as many as fit on the GPU at once), at most
``ls_jax.ops._common.column_partials`` of them (``PARTIAL_ROWS_PER_SM`` per SM): the bound also sets how many rows
are in flight, since at hidden 1024 a block's 256 threads cover two rows. Each bound is set in turn and every case
of ``train.bench ops`` that has such a backward is compiled and timed again in ffi mode (device time of forward +
backward, the same measurement as the ops benchmark). Writes partials-<device>.json.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ls_jax import backend  # noqa: E402
from ls_jax.ops import _common as op_common  # noqa: E402
from train.bench import common, ops  # noqa: E402

CASES = (
    "layer_norm",
    "layer_norm+residual",
    "layer_norm+bias_dropout_residual",
    "bias_dropout_residual",
    "bias_act_dropout[relu]",
    "bias_act_dropout[gelu]",
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows-per-sm", default="2,4,8", help="comma-separated bounds (default 2,4,8)")
    common.add_out_argument(parser, "partials")
    args = parser.parse_args(argv)
    factors = [int(value) for value in args.rows_per_sm.split(",")]
    if not backend.cuda_visible():
        parser.error("the probe times the CUDA kernels: it needs a CUDA device visible to JAX")
    args.out = common.out_dir(args.out, parser)
    cases = [case for case in ops.CASES if case.op in CASES]
    copy = common.copy_bandwidth(1 << 30)
    print(f"copy bandwidth {copy / 1e9:.0f} GB/s; ffi device ms (% of copy bandwidth) per bound of partial rows per SM")
    print(f"{'op':<34} " + " ".join(f"{factor:>16}" for factor in factors))
    rows = []
    for case in cases:
        timings = {}
        for factor in factors:
            op_common.PARTIAL_ROWS_PER_SM = factor
            timings[factor] = ops.run_case(case, ("ffi",), copy, quick=False)["ffi"]
        cells = " ".join(
            f"{t['device_ms']:8.4f} ({t['device_fraction_of_copy_bandwidth']:4.0%})" for t in timings.values()
        )
        print(f"{case.op:<34} {cells}", flush=True)
        rows.append({"op": case.op, "by_partial_rows_per_sm": {str(f): t for f, t in timings.items()}})
    path = common.write_result("partials", {"copy_bandwidth_GBps": copy / 1e9, "cases": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
