"""A process of a multi-process run dies: the others stop within a bounded time with one line naming it and the
resume command, and leave no half-written checkpoint (`train.harness.peers`)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax.numpy as jnp
import pytest

from train.errors import EXIT_PEER_LOST
from train.harness import peers
from train.records.checkpoints import Checkpoints, complete_steps, remove_partial_checkpoints

ROOT = Path(__file__).resolve().parents[2]
PEER_TIMEOUT = 10


class Store:
    """The two calls `PeerWatch` makes of JAX's key-value store, over a dict; ``down`` makes them fail."""

    def __init__(self):
        self.values, self.down, self.lock = {}, False, threading.Lock()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.lock:
            if self.down:
                raise ConnectionError("coordinator unreachable")
            self.values[key] = value

    def key_value_dir_get(self, prefix):
        with self.lock:
            if self.down:
                raise ConnectionError("coordinator unreachable")
            return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def _watch(store, process, lost, timeout=0.5):
    report = lambda peer, reason: lost.append((process, peer, reason))  # noqa: E731
    return peers.PeerWatch(store, process, 3, timeout, report).start()


def test_a_silent_process_is_reported_and_a_finished_one_is_not():
    store, lost = Store(), []
    watches = [_watch(store, rank, lost) for rank in range(3)]
    time.sleep(0.3)
    watches[2].stop()  # finished: says "done"
    watches[1]._stop.set()  # dies: its counter stops without a word
    deadline = time.monotonic() + 10
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    watches[0].stop()
    assert lost and lost[0][:2] == (0, 1) and "no sign of life" in lost[0][2]
    assert all(peer == 1 for _, peer, _ in lost)


def test_losing_the_store_means_losing_the_coordinator():
    store, lost = Store(), []
    watch = _watch(store, 1, lost)
    store.down = True
    watch._thread.join(5)
    assert lost and lost[0][1] == 0 and "coordinator" in lost[0][2]


def test_partial_checkpoints_are_removed_and_complete_ones_kept(tmp_path):
    for name in ("3", "6", "9.orbax-checkpoint-tmp-1234"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "data").write_bytes(b"x")
    removed = remove_partial_checkpoints(tmp_path)
    assert [p.name for p in removed] == ["9.orbax-checkpoint-tmp-1234"]
    assert complete_steps(tmp_path) == [3, 6]


def test_opening_a_run_removes_what_a_crash_left_half_written(tmp_path):
    checkpoints = Checkpoints(tmp_path)
    checkpoints.save(3, {"w": jnp.arange(4.0)}, {"data": 0})
    checkpoints.close()
    partial = tmp_path / "6.orbax-checkpoint-tmp-1764151200"
    partial.mkdir()
    (partial / "state").write_bytes(b"half")
    reopened = Checkpoints(tmp_path)
    assert not partial.exists() and reopened.all_steps() == [3]
    reopened.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(run_dir: Path, port: int, rank: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env.update(
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES="2",
        JAX_PROCESS_ID=str(rank),
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
    )
    command = [
        sys.executable,
        "-m",
        "train.imdb",
        "--batch-size",
        "8",
        "--dropout",
        "0",
        "--precision",
        "fp32",
        "--backend",
        "xla",
        "--eval-every",
        "0",
        "--log-every",
        "1",
        "--checkpoint-every",
        "3",
        "--no-progress",
        "--no-tensorboard",
        "--steps",
        "100000",
        "--run-dir",
        str(run_dir),
        "--distributed",
        "--peer-timeout",
        str(PEER_TIMEOUT),
    ]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _intervals(run_dir: Path) -> int:
    path = run_dir / "run.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.strip() and json.loads(line)["type"] == "interval")


def _kill_mid_training(run_dir: Path, victim: int) -> tuple[subprocess.Popen, str, float]:
    """Starts 2 processes, SIGKILLs ``victim`` after 7 logged steps; (survivor, its stderr, seconds it took to end)."""
    port = _free_port()
    processes = [_start(run_dir, port, rank) for rank in range(2)]
    try:
        deadline = time.monotonic() + 600
        while _intervals(run_dir) < 7 and time.monotonic() < deadline:
            assert all(p.poll() is None for p in processes), processes[0].stderr.read()[-3000:]
            time.sleep(0.2)
        assert _intervals(run_dir) >= 7, "the run did not get going"
        processes[victim].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        survivor = processes[1 - victim]
        _, stderr = survivor.communicate(timeout=3 * PEER_TIMEOUT + 60)
        stopped_after = time.monotonic() - killed_at
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    return survivor, stderr, stopped_after


@pytest.mark.multiprocess
def test_a_killed_worker_stops_the_coordinator_with_one_line(tmp_path):
    victim, run_dir = 1, tmp_path / "run"
    survivor, stderr, stopped_after = _kill_mid_training(run_dir, victim)
    lines = [line for line in stderr.splitlines() if line.strip()]
    print(f"survivor stopped {stopped_after:.1f} s after the kill: {lines[-1] if lines else ''}")  # shown with -s
    assert survivor.returncode == EXIT_PEER_LOST, stderr[:2000] + "\n...\n" + stderr[-2000:]
    assert stopped_after < 2 * PEER_TIMEOUT + 30
    assert lines[-1].startswith(f"error: lost process {victim} of 2"), lines[-1]
    assert f"--resume {run_dir} --distributed" in lines[-1]
    assert "Traceback" not in stderr and "Check failure" not in stderr
    checkpoints = run_dir / "checkpoints"
    assert not list(checkpoints.glob("*.orbax-checkpoint-tmp*"))
    steps = complete_steps(checkpoints)
    assert steps and f"checkpoint {steps[-1]} in" in lines[-1]
    for step in steps:  # every checkpoint left is complete: orbax wrote its metadata last
        assert (checkpoints / str(step) / "_CHECKPOINT_METADATA").exists()


@pytest.mark.multiprocess
def test_a_killed_coordinator_stops_the_worker_at_once(tmp_path):
    """Process 0 hosts JAX's coordination service: when it dies, JAX's client in every other process aborts at once
    (a fatal log naming the leader task, before any Python code can run); opening the run again for the resume
    removes whatever checkpoint it was writing."""
    run_dir = tmp_path / "run"
    survivor, stderr, stopped_after = _kill_mid_training(run_dir, victim=0)
    print(f"survivor stopped {stopped_after:.1f} s after the kill, exit code {survivor.returncode}")  # shown with -s
    assert survivor.returncode != 0 and stopped_after < 2 * PEER_TIMEOUT + 30
    assert "the leader task was preempted/died" in stderr
    Checkpoints(run_dir / "checkpoints").close()
    assert not list((run_dir / "checkpoints").glob("*.orbax-checkpoint-tmp*"))
