"""Benchmarks: ``python -m train.bench SUITE [options]``; each suite writes <suite>-<device>.json to --out DIR
(default docs/results when JAX sees a GPU, runs/bench otherwise).

Suites: ops (fused kernels vs XLA), gemm (the FFN GEMMs alone and with their epilogues), attention (self-attention
vs cuDNN's as JAX calls it), optim (fused optimizers vs optax), e2e (training step vs plain Flax: the WMT
Transformers, BERT-base, GPT-2 small; the last two also vs Hugging Face PyTorch under torch.compile), profile
(per-category and per-stage step breakdown), scaling (data parallel), counters (Nsight Compute counters vs plain
Flax), flops (hand-counted FLOPs and DRAM bytes against measured); timeline (where each device's time went in a
trace of a training run's steps, ``--profile-steps``), cli-scaling (weak scaling of the training commands
themselves, their own summaries at 1, 2, 4 ... devices), schedule (where a compiled step's all-reduces sit among
its matrix products, from XLA's scheduled HLO).
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUITES = {
    "ops": "train.bench.ops",
    "gemm": "train.bench.gemm",
    "attention": "train.bench.attention",
    "optim": "train.bench.optim",
    "e2e": "train.bench.e2e",
    "profile": "train.bench.profile",
    "scaling": "train.bench.scaling",
    "counters": "train.bench.counters",
    "flops": "train.bench.flops",
    "timeline": "train.bench.timeline",
    "cli-scaling": "train.bench.cli_scaling",
    "schedule": "train.bench.schedule",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SUITES:  # the suite parses everything after its name, --help included
        return importlib.import_module(SUITES[argv[0]]).main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m train.bench",
        description=__doc__,
        epilog="python -m train.bench SUITE --help shows the options of SUITE",
    )
    parser.add_argument("suite", choices=sorted(SUITES))
    args, rest = parser.parse_known_args(argv)
    module = importlib.import_module(SUITES[args.suite])
    return module.main(rest)
