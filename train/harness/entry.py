"""What a training entry point (``python -m train.wmt``, ``train.imdb``, ``train.gpt``) does before it imports JAX:
take SIGINT and SIGTERM (`train.harness.signals.stop_at_start_up`) and check that the packages the tools add to the
library are installed, so a missing one is one line, not a traceback from deep in an import."""

from __future__ import annotations

import importlib.util
import sys

from train.errors import EXIT_USAGE
from train.harness.signals import stop_at_start_up

TOOL_PACKAGES = ("orbax", "sentencepiece", "sacrebleu", "tensorboardX", "tqdm", "matplotlib")
"""The top-level modules of the ``train`` extra (pyproject.toml): ``pip install ls-jax`` alone leaves them out."""


def missing_tool_packages() -> list[str]:
    return [name for name in TOOL_PACKAGES if importlib.util.find_spec(name) is None]


def start() -> None:
    """Signals handled, then exits with one line (exit code 2) when a package of the ``train`` extra is missing."""
    stop_at_start_up()
    missing = missing_tool_packages()
    if missing:
        print(
            f"error: the training tools need the packages of ls-jax's train extra ({', '.join(missing)} missing): "
            "pip install -e '.[train]' in the checkout",
            file=sys.stderr,
        )
        sys.exit(EXIT_USAGE)
