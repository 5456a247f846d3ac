"""Helpers shared by the tests/ops/test_ops_*.py files (this module holds no tests).

Every op test compares an ``ls_jax.ops`` function with a naive jax.numpy reference written in the test: outputs,
and the VJP of both for the same random cotangent (autodiff through the reference gives the reference gradients).
bf16 cases feed the op bf16 inputs and the reference the same values upcast to f32.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.ops import dropout_seed

F32 = jnp.float32
BF16 = jnp.bfloat16

# Relative tolerances; the absolute tolerance is the same fraction of the largest expected magnitude.
_TOLERANCE = {jnp.dtype(F32): 1e-5, jnp.dtype(BF16): 1e-2, jnp.dtype(jnp.float16): 2e-3}


def normal(seed: int, shape: Sequence[int], dtype: Any = F32, scale: float = 1.0) -> jax.Array:
    """Standard normal values (times ``scale``) of ``shape``, rounded to ``dtype``."""
    values = scale * np.random.default_rng(seed).standard_normal(tuple(shape), np.float32)
    return jnp.asarray(values, dtype)


def seed_array(value: int) -> jax.Array:
    """A uint32[2] dropout seed drawn from PRNG key ``value``."""
    return dropout_seed(jax.random.key(value))


def assert_close(actual: Any, expected: Any, dtype: Any) -> None:
    """Leaf-wise ``|actual - expected| <= tol * (|expected| + max|expected|)`` with tol chosen by ``dtype``."""
    tol = _TOLERANCE[jnp.dtype(dtype)]
    actual_leaves, actual_tree = jax.tree.flatten(actual)
    expected_leaves, expected_tree = jax.tree.flatten(expected)
    assert actual_tree == expected_tree, f"{actual_tree} != {expected_tree}"
    for got, want in zip(actual_leaves, expected_leaves):
        got = np.asarray(jnp.asarray(got, F32))
        want = np.asarray(jnp.asarray(want, F32))
        assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
        assert np.all(np.isfinite(got)), "result has non-finite values"
        scale = float(np.max(np.abs(want))) if want.size else 0.0
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale)


def random_cotangent(seed: int, outputs: Any) -> Any:
    """A random cotangent with the structure, shapes and dtypes of ``outputs``."""
    leaves, tree = jax.tree.flatten(outputs)
    return jax.tree.unflatten(tree, [normal(seed + i, leaf.shape, leaf.dtype) for i, leaf in enumerate(leaves)])


def upcast(tree: Any) -> Any:
    """Every leaf as f32: the reference sees exactly the values the op saw."""
    return jax.tree.map(lambda leaf: jnp.asarray(leaf, F32), tree)


def apply_vjp(fn: Callable[..., Any], primals: Sequence[jax.Array], cotangent: Any) -> tuple[Any, Any]:
    """``fn(*primals)`` and its VJP applied to ``cotangent``, run eagerly or traced as the caller does."""
    outputs, vjp = jax.vjp(fn, *primals)
    return outputs, vjp(cotangent)


def value_and_vjp(fn: Callable[..., Any], primals: Sequence[jax.Array], cotangent: Any) -> tuple[Any, Any]:
    """``apply_vjp`` compiled as one jitted computation."""
    return jax.jit(functools.partial(apply_vjp, fn))(tuple(primals), cotangent)


def check_vjp(
    op: Callable[..., Any],
    reference: Callable[..., Any],
    primals: Sequence[jax.Array],
    dtype: Any,
    seed: int = 100,
) -> tuple[Any, Any]:
    """Asserts ``op`` matches ``reference`` in outputs and in the VJP of one random cotangent.

    ``op`` gets ``primals`` as given; ``reference`` gets them upcast to f32. Each gradient of ``op`` must have
    its primal's dtype. Returns the op's outputs and gradients.
    """
    cotangent = random_cotangent(seed, jax.eval_shape(op, *primals))
    outputs, grads = value_and_vjp(op, primals, cotangent)
    expected, expected_grads = value_and_vjp(reference, upcast(tuple(primals)), upcast(cotangent))
    assert_close(outputs, expected, dtype)
    for grad, primal in zip(grads, primals):
        assert grad.dtype == primal.dtype, f"gradient dtype {grad.dtype} != primal dtype {primal.dtype}"
    assert_close(grads, expected_grads, dtype)
    return outputs, grads


def jaxpr_output_shapes(jaxpr: Any, primitive: str) -> list[tuple[int, ...]]:
    """Output shapes of every ``primitive`` equation in ``jaxpr`` and in the jaxprs nested in its equations."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == primitive:
            shapes += [tuple(var.aval.shape) for var in eqn.outvars]
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    shapes += jaxpr_output_shapes(inner, primitive)
    return shapes
