"""How a training run ends: the errors an entry point reports as one ``error:`` line, and the exit code of each
class (docs/training.md lists them)."""

from __future__ import annotations

import argparse
from typing import NoReturn

EXIT_FINISHED = 0
EXIT_USAGE = 2  # bad flags, a missing optional package, an unusable run directory (argparse's errors use 2 too)
EXIT_DATA = 3  # the data the flags name cannot be used: missing, empty or malformed files, too little data
EXIT_NUMERICS = 4  # the loss or the state became non-finite
EXIT_IO = 5  # a checkpoint or the run log could not be written (full disk)
EXIT_PEER_LOST = 6  # another process of a multi-process run died or hangs (train.harness.peers)
EXIT_SIGNAL_BASE = 128  # interrupted: 128 + the signal number (130 SIGINT, 143 SIGTERM), as shells report it


class UsageError(Exception):
    """The command line asks for something impossible: a value out of range, flags that exclude each other, a
    missing optional package, a run directory that cannot be used, ..."""


class DataError(ValueError):
    """The data cannot be used as given: a missing, empty or malformed data file, labels the model cannot hold,
    too little data for a batch or a validation split, ..."""


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived while the run was in a phase that stops at once (setup, compilation,
    evaluation)."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by signal {signum}")
        self.signum = signum


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line (``prog: error: ...; see --help``), without the usage block, and
    whose flags are spelled out (``--step`` is not taken for ``--steps``)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if message.endswith("expected one argument"):  # also what a value like -1,0 (not a number) gets
            message += " (a value that starts with '-' is given as --flag=VALUE)"
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}; see --help\n")
