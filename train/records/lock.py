"""One run per run directory: an exclusive OS file lock on ``RUN_DIR/run.lock``, held for the run's life.

The lock is `fcntl.flock` on an open file, so the kernel releases it when the process ends, however it ends
(``kill -9`` and out-of-memory kills included): a lock file left behind by a dead run never blocks the next one.
The holder writes its pid, host, start time and command into the file, so a run refused the directory can say
which process holds it.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from typing import IO

from train.records import runlog

LOCK_FILENAME = "run.lock"


class DirectoryInUse(Exception):
    """Another live process holds the run directory's lock; ``holder`` describes it (empty when unknown)."""

    def __init__(self, directory: Path, holder: str):
        self.directory, self.holder = directory, holder
        by = f" ({holder})" if holder else ""
        super().__init__(f"{directory} is in use by another run{by}; wait for it to end, or choose another --run-dir")


def _holder(file: IO[str]) -> str:
    """What the holder wrote into the lock file: ``pid N on HOST since TIME: COMMAND``, or "" before it wrote."""
    file.seek(0)
    return file.read().strip()


class RunDirectoryLock:
    """The exclusive lock of one run directory; `acquire` takes it or raises `DirectoryInUse`."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK_FILENAME
        self._file: IO[str] | None = None

    def acquire(self, command: str) -> None:
        """Takes the lock without waiting and writes who holds it; opening an existing lock file changes nothing.

        Raises:
          DirectoryInUse: a live process holds it.
          OSError: the lock file cannot be created (the directory is not writable).
        """
        file = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(file)
            file.close()
            raise DirectoryInUse(self.path.parent, holder) from None
        file.seek(0)
        file.truncate()
        file.write(f"pid {os.getpid()} on {socket.gethostname()} since {runlog.utc_now()}: {command}\n")
        file.flush()
        self._file = file

    def release(self) -> None:
        """Lets the next run in; the file stays (removing it would let two runs lock two different files)."""
        if self._file is not None:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None
