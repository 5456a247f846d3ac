"""What a training entry point (``python -m train.wmt``, ``train.imdb``, ``train.gpt``) does before it imports JAX:
take SIGINT and SIGTERM (`train.harness.signals.stop_at_start_up`) and check that the packages the tools add to the
library are installed, so a missing one is one line, not a traceback from deep in an import."""

from __future__ import annotations

import importlib.util
import sys
from typing import Sequence

from train.errors import EXIT_USAGE
from train.harness.signals import stop_at_start_up

TOOL_PACKAGES = ("orbax", "sentencepiece", "sacrebleu", "tensorboardX", "tqdm", "matplotlib")
"""The top-level modules of the ``train`` extra (pyproject.toml): ``pip install ls-jax`` alone leaves them out."""

SKIPPED_BY = {"tensorboardX": "--no-tensorboard"}
"""Packages a run does without when it is given the flag."""


def missing_tool_packages(argv: Sequence[str] = ()) -> list[str]:
    """The packages of the ``train`` extra that are not installed, less those a flag in ``argv`` turns off."""
    needed = [name for name in TOOL_PACKAGES if SKIPPED_BY.get(name) not in argv]
    return [name for name in needed if importlib.util.find_spec(name) is None]


def start(argv: Sequence[str] | None = None) -> None:
    """Signals handled, then exits with one line (exit code 2) when a package of the ``train`` extra that the run
    needs (``argv``, default the command line's flags) is missing."""
    stop_at_start_up()
    missing = missing_tool_packages(sys.argv[1:] if argv is None else argv)
    if missing:
        skips = [f"{SKIPPED_BY[name]} runs without {name}" for name in missing if name in SKIPPED_BY]
        print(
            f"error: the training tools need the packages of ls-jax's train extra ({', '.join(missing)} missing): "
            f"pip install -e '.[train]' in the checkout{''.join(f'; {skip}' for skip in skips)}",
            file=sys.stderr,
        )
        sys.exit(EXIT_USAGE)
