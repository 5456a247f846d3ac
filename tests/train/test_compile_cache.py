"""XLA's persistent compilation cache in the training tools: a second identical run loads every compiled program
from the cache, the tiny model's too, its training step without tracing it, trains as the first did, and its
summary says so; ``--no-compile-cache`` compiles everything again."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLAGS = [
    "--steps",
    "2",
    "--log-every",
    "1",
    "--eval-every",
    "0",
    "--no-progress",
    "--no-tensorboard",
    "--backend",
    "xla",
]


def _run(run_dir: Path, cache: Path, *extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache))
    result = subprocess.run(
        [sys.executable, "-m", "train.imdb", *FLAGS, "--run-dir", str(run_dir), *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "run.jsonl").read_text().splitlines()[-1])
    return summary["compile_cache"] | {"output": result.stdout}


def _losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "run.jsonl").read_text().splitlines()]
    return [record["loss"] for record in records if record["type"] == "interval"]


def test_a_second_run_loads_its_programs_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    first = _run(tmp_path / "first", cache)
    assert first["directory"] == str(cache) and first["requests"] > 0 and first["hits"] == 0
    second = _run(tmp_path / "second", cache)
    # The training step loads whole, untraced (`train.harness.executable_cache`); the other programs from XLA's cache.
    assert first["steps_loaded"] == 0 and second["steps_loaded"] == 1
    assert second["hits"] == second["requests"] == first["requests"] - 1
    assert (
        f"{second['hits']} of {second['requests']} compiled programs loaded from the cache and the training step "
        "without tracing" in second["output"]
    )
    assert _losses(tmp_path / "second") == _losses(tmp_path / "first")
    # Loading a program costs less than compiling it; both runs trace and lower every program.
    assert 0 < second["backend_compile_s"] < first["backend_compile_s"]
    assert first["trace_s"] > 0 and second["trace_s"] > 0 and second["lower_s"] > 0
    off = _run(tmp_path / "off", cache, "--no-compile-cache")
    assert off["directory"] is None and off["hits"] == 0 and "compilation cache off" in off["output"]


def test_a_step_that_xla_loaded_from_its_cache_is_not_kept_on_a_cpu(tmp_path):
    """XLA:CPU serializes a program it loaded from its cache without the program's functions: kept, such a step
    would fail at the next run's first step. It is compiled from XLA's cache again instead."""
    cache = tmp_path / "cache"
    _run(tmp_path / "first", cache)
    shutil.rmtree(cache / "ls_jax_steps")
    from_xla = _run(tmp_path / "from-xla-cache", cache)
    assert from_xla["steps_loaded"] == 0 and from_xla["hits"] == from_xla["requests"]
    assert not list((cache / "ls_jax_steps").glob("*.pkl"))
    again = _run(tmp_path / "again", cache)
    assert again["steps_loaded"] == 0 and again["hits"] == again["requests"]
    assert _losses(tmp_path / "again") == _losses(tmp_path / "first")
