"""Stopping a multi-process run cleanly when one of its processes dies.

A process that dies (killed, out of memory, a lost host) leaves the others blocked in a collective. JAX's
distributed runtime notices only after its heartbeat timeout, and then aborts every process with a fatal log and
a stack trace. `PeerWatch` notices first: each process publishes a counter in the job's key-value store (the one
``jax.distributed`` runs on the coordinator) every ``timeout / 10`` seconds, and a thread of each process checks
that every other process's counter moved within ``timeout`` seconds. When one has not, or the store itself is gone
(the coordinator, process 0, died), the survivor removes any checkpoint left half-written (orbax writes into a
temporary directory that it renames when complete), prints one line naming the lost process and the command that
resumes the run, and exits with `train.errors.EXIT_PEER_LOST` at once, without the shutdown barrier that would wait
for the lost process. ``jax.distributed.initialize`` is given a heartbeat timeout of twice ``timeout``
(`train.harness.parallel.initialize_distributed`), so this watch speaks first.

Process 0 hosts JAX's coordination service: when it dies, JAX's client in every other process aborts at once with
its own fatal log (naming the leader task), before Python can act; the checkpoint it may have been writing is
removed when the run is opened again for the resume (`train.records.checkpoints.Checkpoints`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import jax

from train.errors import EXIT_PEER_LOST, Interrupted
from train.harness.cli import USER_ERRORS
from train.harness.parallel import job_client
from train.records.checkpoints import complete_steps, remove_partial_checkpoints

KEY_PREFIX = "ls_jax/alive/"
DONE = "done"


class PeerWatch:
    """Publishes this process's liveness and calls ``on_lost(process, reason)`` when another process's stops."""

    def __init__(
        self,
        client,
        process_id: int,
        num_processes: int,
        timeout_s: float,
        on_lost: Callable[[int, str], None],
        clock: Callable[[], float] = time.monotonic,
    ):
        self._client, self._id, self._count = client, process_id, num_processes
        self._timeout, self._on_lost, self._clock = timeout_s, on_lost, clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-watch", daemon=True)

    def start(self) -> PeerWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops watching and tells the others that this process is done (so its silence is no loss)."""
        self._stop.set()
        try:
            self._client.key_value_set(f"{KEY_PREFIX}{self._id}", DONE, allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to tell
            pass

    def settle(self) -> None:
        """Waits (up to twice the timeout) for the watch to find a lost process, which ends this process."""
        self._thread.join(2 * self._timeout)

    def _run(self) -> None:
        beat, seen = 0, {}
        now = self._clock()
        last_change = {peer: now for peer in range(self._count) if peer != self._id}
        while not self._stop.wait(self._timeout / 10):
            beat += 1
            try:
                self._client.key_value_set(f"{KEY_PREFIX}{self._id}", str(beat), allow_overwrite=True)
                values = dict(self._client.key_value_dir_get(KEY_PREFIX))
            except Exception as err:  # the coordinator's store is unreachable: process 0 is gone
                if self._id != 0 and not self._stop.is_set():
                    self._on_lost(0, f"the coordinator cannot be reached ({type(err).__name__})")
                return
            now = self._clock()
            for peer in list(last_change):
                value = values.get(f"{KEY_PREFIX}{peer}")
                if value == DONE:
                    del last_change[peer]
                elif value is not None and value != seen.get(peer):
                    seen[peer], last_change[peer] = value, now
                elif now - last_change[peer] > self._timeout and not self._stop.is_set():
                    self._on_lost(peer, f"no sign of life for {now - last_change[peer]:.0f} s")
                    return


def stop_run(process: int, reason: str, *, num_processes: int, checkpoint_dir: Path, resume_command: str) -> None:
    """What a survivor does: removes half-written checkpoints, says so in one line, exits with EXIT_PEER_LOST."""
    remove_partial_checkpoints(checkpoint_dir)
    steps = complete_steps(checkpoint_dir)
    kept = f"checkpoint {steps[-1]} in {checkpoint_dir}" if steps else "no checkpoint yet"
    print(
        f"error: lost process {process} of {num_processes} ({reason}): it died or hangs, so this process stops "
        f"too; the newest complete checkpoint is {kept}; start every process again with: {resume_command}",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(EXIT_PEER_LOST)  # no shutdown barrier: it would wait for the lost process


def watch_job(checkpoint_dir: Path, resume_command: str, timeout_s: float) -> PeerWatch | None:
    """Watches the other processes of this ``jax.distributed`` job (None with one process): a lost one stops this
    process by `stop_run`."""
    if jax.process_count() == 1:
        return None

    def on_lost(process: int, reason: str) -> None:
        stop_run(
            process,
            reason,
            num_processes=jax.process_count(),
            checkpoint_dir=checkpoint_dir,
            resume_command=resume_command,
        )

    return PeerWatch(job_client(), jax.process_index(), jax.process_count(), timeout_s, on_lost).start()


@contextlib.contextmanager
def watching(distributed: bool, checkpoint_dir: Path, resume_command: str, timeout_s: float) -> Iterator[None]:
    """Runs the body with the other processes watched (`watch_job`; nothing without ``distributed``).

    An error in the body other than bad input or a signal may be a collective, barrier or checkpoint write that
    failed (in whatever error its library raises) because another process died: the watch gets up to twice the
    timeout to say so in one line and exit before the error is raised.
    """
    watch = watch_job(checkpoint_dir, resume_command, timeout_s) if distributed else None
    try:
        yield
    except Exception as err:
        if watch is not None and not isinstance(err, (*USER_ERRORS, Interrupted)):
            watch.settle()
        raise
    finally:
        if watch is not None:
            watch.stop()
