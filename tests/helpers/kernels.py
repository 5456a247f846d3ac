"""Helpers shared by the GPU kernel tests tests/kernels/test_kernels_*.py (this module holds no tests).

Each kernel test runs an op under ``backend.use("ffi")`` and under ``backend.use("xla")`` in one process, on
freshly jitted functions (a jitted function keeps the backend it was traced with), and compares outputs and
gradients by relative error: max |ffi - xla| / max |xla| per leaf. Inputs and cotangents come from
helpers.ops (normal, random_cotangent, seed_array).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax import backend

# Relative error allowed between the two backends, by the dtype the activations are stored in.
TOLERANCE = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 1e-2}


def on_backend(mode: backend.KernelMode, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` compiled fresh with kernel mode ``mode``."""
    with backend.use(mode):
        return jax.jit(lambda *a: fn(*a))(*args)


def kernel_targets(fn: Callable[..., Any], *args: Any) -> set[str]:
    """The ls_* FFI targets that ``fn(*args)`` calls when traced in mode ``ffi``."""
    with backend.use("ffi"):
        text = jax.jit(lambda *a: fn(*a)).lower(*args).as_text()
    return set(re.findall(r"custom_call @(ls_\w+)", text))


def value_and_grads(op: Callable[..., Any]) -> Callable[..., Any]:
    """``(primals, cotangent) -> (op(*primals), vjp(cotangent))``: one forward and one backward pass."""

    def run(primals: Sequence[jax.Array], cotangent: Any) -> tuple[Any, Any]:
        outputs, vjp = jax.vjp(op, *primals)
        return outputs, vjp(cotangent)

    return run


def relative_error(actual: jax.Array, expected: jax.Array) -> float:
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    scale = np.max(np.abs(expected)) if expected.size else 0.0
    difference = np.max(np.abs(actual - expected)) if expected.size else 0.0
    return float(difference / scale) if scale > 0 else float(difference)


def assert_backends_agree(ffi_out: Any, xla_out: Any, dtype: Any, label: str = "") -> None:
    """Same tree, shapes and dtypes, finite values, and relative error within TOLERANCE[dtype] per leaf."""
    tolerance = TOLERANCE[jnp.dtype(dtype)]
    ffi_leaves, ffi_tree = jax.tree.flatten(ffi_out)
    xla_leaves, xla_tree = jax.tree.flatten(xla_out)
    assert ffi_tree == xla_tree, f"{label}: {ffi_tree} != {xla_tree}"
    for index, (got, want) in enumerate(zip(ffi_leaves, xla_leaves)):
        where = f"{label} leaf {index}"
        assert (got.shape, got.dtype) == (want.shape, want.dtype), f"{where}: {got.dtype} vs {want.dtype}"
        assert bool(jnp.all(jnp.isfinite(jnp.asarray(got, jnp.float32)))), f"{where}: non-finite values"
        error = relative_error(got, want)
        assert error <= tolerance, f"{where}: relative error {error:.3g} > {tolerance}"


def keep_rate_bounds(rate: float, count: int) -> tuple[float, float]:
    """The 3-sigma interval of the kept fraction of ``count`` Bernoulli(1 - rate) draws."""
    sigma = np.sqrt(rate * (1.0 - rate) / count)
    return 1.0 - rate - 3.0 * sigma, 1.0 - rate + 3.0 * sigma
