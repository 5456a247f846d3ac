"""Checkpoint writes that do not stall training (`train.records.checkpoints`), and the library noise a run keeps
from the user unless ``--verbose`` (`train.harness.cli.quiet_libraries`)."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.records.checkpoints import Checkpoints, complete_steps

REPO = Path(__file__).resolve().parents[2]


def test_save_returns_while_the_files_are_written_and_keeps_the_saved_values(tmp_path):
    checkpoints = Checkpoints(tmp_path / "checkpoints")
    state = {"w": jnp.arange(30_000_000, dtype=jnp.float32)}  # 120 MB: its files take a while to write
    expected = np.asarray(state["w"]).copy()
    checkpoints.save(1, state, {"data": 0})
    assert complete_steps(tmp_path / "checkpoints") == []  # still being written: save did not wait for it
    step = jax.jit(lambda s: {"w": s["w"] * 2}, donate_argnums=0)
    for _ in range(3):  # training goes on: the saved buffers are donated and overwritten
        state = step(state)
    checkpoints.wait()
    assert complete_steps(tmp_path / "checkpoints") == [1]
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    abstract = {"w": jax.ShapeDtypeStruct(expected.shape, jnp.float32, sharding=sharding)}
    restored, progress = checkpoints.restore(1, abstract, None)
    assert progress["data"] == 0
    np.testing.assert_array_equal(np.asarray(restored["w"]), expected)
    checkpoints.close()


NOISE = """
import asyncio, gc, sys
from absl import logging
from train.harness import cli

cli.quiet_libraries(verbose=sys.argv[1] == "verbose")
logging.error("Failed to json parse Metadata file")


async def reader():
    try:
        await asyncio.sleep(0)
    finally:
        raise RuntimeError("a reader left behind")


left_behind = reader()
left_behind.send(None)  # suspended at its await
del left_behind  # closed by the collector: its finally raises where no one catches it
gc.collect()
print("the harness's own line", file=sys.stderr)
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_library_logs_and_exceptions_ignored_in_coroutines_only_with_verbose(verbose):
    done = subprocess.run(
        [sys.executable, "-c", NOISE, "verbose" if verbose else "quiet"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.endswith("the harness's own line\n")
    assert ("Failed to json parse Metadata file" in done.stderr) == verbose
    assert ("Exception ignored in" in done.stderr and "a reader left behind" in done.stderr) == verbose
    assert (done.stderr == "the harness's own line\n") != verbose  # quiet: nothing else at all
