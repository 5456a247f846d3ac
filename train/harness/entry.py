"""What a training entry point (``python -m train.wmt``, ``train.imdb``, ``train.gpt``) does before it imports JAX:
take SIGINT and SIGTERM (`train.harness.signals.stop_at_start_up`), choose the GPU memory allocator
(`choose_allocator`) and check that the packages the tools add to the library are installed, so a missing one is
one line, not a traceback from deep in an import."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import MutableMapping
from typing import Sequence

from train.errors import EXIT_USAGE
from train.harness.signals import stop_at_start_up

TOOL_PACKAGES = ("orbax", "sentencepiece", "sacrebleu", "tensorboardX", "tqdm", "matplotlib")
"""The top-level modules of the ``train`` extra (pyproject.toml): ``pip install ls-jax`` alone leaves them out."""

SKIPPED_BY = {"tensorboardX": "--no-tensorboard"}
"""Packages a run does without when it is given the flag."""

ALLOCATOR_VAR = "XLA_PYTHON_CLIENT_ALLOCATOR"
STREAM_ORDERED = "cuda_async"


def choose_allocator(environ: MutableMapping[str, str] = os.environ) -> str:
    """Sets ``$XLA_PYTHON_CLIENT_ALLOCATOR`` to CUDA's stream-ordered allocator (`STREAM_ORDERED`) unless it is set;
    returns the allocator in effect. JAX reads the variable when it creates its GPU client; other platforms ignore
    it. A set value, even an empty one, is the user's choice and stays.

    Why: XLA launches a step as one CUDA graph and, before each launch, re-records every command whose buffers moved
    since the last one (a custom call or GEMM by capturing it again). Under JAX's default allocator (BFC) the step's
    temporary buffer came back at a new address every step, so the whole graph was re-recorded every step: on one
    H200 (transformer-big, 8192 tokens, ``train.wmt --backend ffi``, XLA's log of its updates) 7-14 ms a step for
    the fp8 step's 957 commands, 3-7 ms for bf16's 544. Under the stream-ordered allocator the same buffers return
    at the same addresses, XLA leaves about 520 of the 957 commands as they were, and an update takes 3.8 ms in fp8
    and 0.7 ms in bf16 (docs/results/README.md, "Through the CLIs").
    """
    return environ.setdefault(ALLOCATOR_VAR, STREAM_ORDERED)


def missing_tool_packages(argv: Sequence[str] = ()) -> list[str]:
    """The packages of the ``train`` extra that are not installed, less those a flag in ``argv`` turns off."""
    needed = [name for name in TOOL_PACKAGES if SKIPPED_BY.get(name) not in argv]
    return [name for name in needed if importlib.util.find_spec(name) is None]


def start(argv: Sequence[str] | None = None) -> None:
    """Signals handled and the allocator chosen, then exits with one line (exit code 2) when a package of the
    ``train`` extra that the run needs (``argv``, default the command line's flags) is missing."""
    stop_at_start_up()
    choose_allocator()
    missing = missing_tool_packages(sys.argv[1:] if argv is None else argv)
    if missing:
        skips = [f"{SKIPPED_BY[name]} runs without {name}" for name in missing if name in SKIPPED_BY]
        print(
            f"error: the training tools need the packages of ls-jax's train extra ({', '.join(missing)} missing): "
            f"pip install -e '.[train]' in the checkout{''.join(f'; {skip}' for skip in skips)}",
            file=sys.stderr,
        )
        sys.exit(EXIT_USAGE)
