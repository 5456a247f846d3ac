"""Runs the ops benchmark's fused kernels a few times for Nsight Compute: ``ncu ... python3 scripts/ncu_ops.py OP...``.

Each named case of ``train.bench.ops`` (Transformer-big shapes) runs forward + backward, compiled in ffi
mode, ``--calls`` times, so ``ncu --kernel-name ...`` finds every kernel of the op that many times.
"""

import argparse

import jax

from ls_jax import backend
from train.bench import ops


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ops", nargs="+", help="case names of train.bench.ops")
    parser.add_argument("--calls", type=int, default=2)
    args = parser.parse_args()
    cases = {case.op: case for case in ops.CASES}
    for name in args.ops:
        workload = cases[name].workload(1)
        fn, cotangent = ops.forward_backward(workload)
        with backend.use("ffi"):
            for _ in range(args.calls):
                jax.block_until_ready(fn(workload.primals, cotangent))


if __name__ == "__main__":
    main()
