"""Input validation and backend dispatch shared by every op module.

Dtype rule for all ops: activations (the tensors an op normalizes, masks or adds) share one floating dtype
(f32, bf16 or f16); parameters (gamma, beta, bias, embedding tables) are either that dtype or f32. Arithmetic
is f32. Every op validates at trace time and raises ``ValueError`` naming the offending argument.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

import ffi_kernels
from ls_jax import backend

logger = logging.getLogger("ls_jax.ops")

ACTIVATION_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
LOW_PRECISION_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_activation(name: str, x: jax.Array, min_rank: int = 1) -> None:
    if jnp.dtype(x.dtype) not in ACTIVATION_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if x.ndim < min_rank:
        raise ValueError(f"{name} must have rank >= {min_rank}, got shape {x.shape}")


def check_same_dtype(name: str, x: jax.Array, ref_name: str, ref: jax.Array) -> None:
    if x.dtype != ref.dtype:
        raise ValueError(f"{name} has dtype {x.dtype} but {ref_name} has {ref.dtype}; they must match")


def check_param(name: str, p: jax.Array, shape: tuple[int, ...], activation_dtype: Any) -> None:
    if tuple(p.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(p.shape)}")
    allowed = tuple(dict.fromkeys((jnp.dtype(jnp.float32), jnp.dtype(activation_dtype))))
    if jnp.dtype(p.dtype) not in allowed:
        raise ValueError(f"{name} must be {' or '.join(d.name for d in allowed)}, got {p.dtype}")


def check_integer(name: str, x: jax.Array) -> None:
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array, got {x.dtype}")


def check_dropout(rate: float, seed: jax.Array | None) -> None:
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {rate}")
    if rate > 0.0:
        if seed is None:
            raise ValueError("dropout_rate > 0 needs a seed: a uint32[2] array, e.g. ls_jax.ops.dropout_seed(key)")
        if tuple(seed.shape) != (2,) or seed.dtype != jnp.uint32:
            raise ValueError(f"seed must be a uint32[2] array, got {seed.dtype}{list(seed.shape)}")


def vary_together(*arrays: jax.Array | None) -> tuple[jax.Array | None, ...]:
    """Marks every array as varying along each shard_map axis that any of them varies along.

    Inside ``shard_map`` a replicated parameter (gamma, a bias, an embedding table) used with per-device
    activations gets a per-device gradient; a ``custom_vjp`` must return it with its primal's type, so the
    parameter enters the op already varying and autodiff sums its gradient across devices (the transpose of
    the cast). A no-op outside ``shard_map``; None entries pass through.
    """
    axes: frozenset[str] = frozenset()
    for x in arrays:
        if x is not None:
            axes |= _varying_axes(x)
    if not axes:
        return arrays
    cast = getattr(jax.lax, "pcast", None)

    def vary(x):
        missing = () if x is None else tuple(sorted(axes - _varying_axes(x)))
        if not missing:
            return x
        return cast(x, missing, to="varying") if cast is not None else jax.lax.pvary(x, missing)

    return tuple(vary(x) for x in arrays)


def packed_width(n: int) -> int:
    """Bytes of a row of ``n`` mask bits, 8 to a byte."""
    return -(-n // 8)


def pack_mask(mask: jax.Array) -> jax.Array:
    """A boolean (..., n) mask as uint8 (..., packed_width(n)), in the bit order the CUDA kernels save their masks
    in: bit i of byte j is element 8 j + i (numpy's packbits, bitorder little), padding bits zero."""
    return jnp.packbits(mask, axis=-1, bitorder="little")


def unpack_mask(bits: jax.Array, n: int) -> jax.Array:
    """The boolean (..., n) mask of ``pack_mask``."""
    return jnp.unpackbits(bits, axis=-1, count=n, bitorder="little").astype(bool)


def rows(x: jax.Array) -> int:
    """Number of rows when every axis but the last is flattened."""
    count = 1
    for dim in x.shape[:-1]:
        count *= dim
    return count


# Most blocks of 256 threads an SM holds at once (2048 threads): the bound on a column-reducing kernel's blocks.
PARTIAL_ROWS_PER_SM = 8


def column_partials(rows: int) -> int:
    """Rows of the f32 scratch in which a backward kernel leaves per-block column sums (one per block).

    Kernels that reduce over rows (LayerNorm's dgamma/dbeta, bias gradients) run as many blocks as fit on the GPU
    at once (one wave, from CUDA's occupancy calculator), at most this many, each summing its rows into one
    partial row; a small kernel then adds the partials in a fixed order, so the gradients are deterministic.
    ``PARTIAL_ROWS_PER_SM`` per SM of CUDA device 0 covers every kernel's wave; scripts/partials_probe.py times
    smaller bounds.
    """
    return max(1, min(rows, PARTIAL_ROWS_PER_SM * ffi_kernels.sm_count()))


@functools.cache
def log_fallback_once(op: str, reason: str, instead: str = "the XLA implementation") -> None:
    """Logs once per (op, reason) that ``op`` runs ``instead`` of its kernels on CUDA, and why."""
    logger.warning("ls_jax.ops.%s: running %s on CUDA: %s", op, instead, reason)


def _stored_in_dtype(outputs: Any) -> Any:
    """``outputs`` with their 16-bit leaves passed through an optimization barrier, so XLA stores them in their
    dtype.

    XLA on GPU allows excess precision: it drops a round trip f32 -> bf16 -> f32 between an op's arithmetic and
    its consumer's, and then stores the f32 value, so activations (the residual stream, LayerNorm's saved input,
    the FFN's hidden layer) take twice their bytes and skip the rounding the CUDA kernels do. The barrier makes a
    Transformer step both faster and smaller in memory (docs/results).
    """
    leaves, tree = jax.tree.flatten(outputs)
    low = [i for i, x in enumerate(leaves) if jnp.dtype(x.dtype) in LOW_PRECISION_DTYPES]
    for i, x in zip(low, jax.lax.optimization_barrier([leaves[i] for i in low])):
        leaves[i] = x
    return jax.tree.unflatten(tree, leaves)


def dispatch(
    op: str,
    xla_impl: Callable[..., Any],
    ffi_impl: Callable[..., Any] | None,
    args: Sequence[Any],
    unsupported: str | None = None,
) -> Any:
    """Calls ``ffi_impl(*args)`` when lowering for CUDA with kernels enabled, else ``xla_impl(*args)``.

    Both implementations take the same arguments and return the same pytree of shapes and dtypes, so one
    ``jax.custom_vjp`` serves both. ``unsupported`` is a reason the kernels cannot take these shapes; the
    op then runs XLA everywhere and logs the reason once. On CUDA the XLA implementation's 16-bit outputs are
    stored in their dtype (``_stored_in_dtype``). Without the kernels the XLA implementation is traced once, for
    every platform. The op's name becomes a named scope, so profiles and HLO metadata attribute the work to it.
    """
    with jax.named_scope(op):
        kernels = backend.kernels_enabled() and ffi_impl is not None
        if kernels and unsupported is not None:
            log_fallback_once(op, unsupported)
            kernels = False
        if not kernels:
            return jax.lax.platform_dependent(xla_impl(*args), cuda=_stored_in_dtype, default=lambda outputs: outputs)
        return jax.lax.platform_dependent(*args, cuda=_vary_like_inputs(ffi_impl), default=_vary_like_inputs(xla_impl))


def _varying_axes(x: Any) -> frozenset:
    """The shard_map mesh axes along which ``x`` differs per device (empty outside shard_map or for non-arrays)."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None) if isinstance(x, jax.Array) else None
    return frozenset(manual.varying) if manual is not None else frozenset()


def _vary_like_inputs(impl: Callable[..., Any]) -> Callable[..., Any]:
    """``impl`` whose outputs vary along every shard_map axis any input varies along.

    Inside ``jax.shard_map`` (vma checking on) both branches of ``platform_dependent`` must return the same types,
    varying axes included; an FFI call declares its results invariant, while XLA's ops propagate their inputs'
    axes. Every output of an op depends on its per-device inputs, so both are typed that way."""

    def typed(*args):
        axes = frozenset().union(*(_varying_axes(x) for x in jax.tree.leaves(args)))
        outputs = impl(*args)
        if not axes:
            return outputs
        return jax.tree.map(
            lambda y: (
                y
                if _varying_axes(y) >= axes
                else jax.lax.pcast(y, tuple(sorted(axes - _varying_axes(y))), to="varying")
            ),
            outputs,
        )

    return typed
