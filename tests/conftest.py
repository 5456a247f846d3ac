"""Shared test setup. GPU tests (``-m gpu``) are skipped, with the reason shown, where JAX sees no CUDA device;
where one is present they run and a kernel library that fails to build or load fails them."""

import jax
import pytest

from ls_jax import backend


def pytest_collection_modifyitems(config, items):
    if backend.cuda_visible():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device visible to JAX")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _highest_matmul_precision():
    with jax.default_matmul_precision("highest"):
        yield
