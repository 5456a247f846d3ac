"""Shared test setup. GPU tests (``-m gpu``) are skipped, with the reason shown, where JAX sees no CUDA device;
where one is present they run and a kernel library that fails to build or load fails them. Tests marked ``slow``
run only where the marker expression names them."""

import os
import shutil
import subprocess
import tempfile

# Without a GPU, every test compiles for XLA's CPU backend, and most compile more than they run: LLVM's lighter
# optimization compiles about a third faster. Set before JAX starts, so the tests' own processes inherit it.
if shutil.which("nvidia-smi") is None:
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

# The training tools keep compiled programs in XLA's persistent cache (`train.harness.compile_cache`); the tests'
# programs go to a directory of their own, not the user's.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="ls_jax-tests-xla-cache-"))

import jax  # noqa: E402
import pytest  # noqa: E402

from ls_jax import backend


def pytest_collection_modifyitems(config, items):
    _keep_slow_tests_to_their_tier(config, items)
    if backend.cuda_visible():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device visible to JAX")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _keep_slow_tests_to_their_tier(config, items):
    """Deselects the tests marked ``slow`` unless the marker expression names them: ``-m gpu`` is the kernels'
    tier (minutes on one GPU), ``-m "gpu and slow"`` the whole-model steps, ``-m slow`` the end-to-end jobs."""
    if "slow" in (config.option.markexpr or ""):
        return
    slow = [item for item in items if "slow" in item.keywords]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if "slow" not in item.keywords]


@pytest.fixture(autouse=True)
def _highest_matmul_precision():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (needs root); skipped, with the reason, where mounting is not allowed."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "--lazy", str(mount)], check=True)  # lazy: a failed test may hold a file open
