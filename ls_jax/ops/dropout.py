"""Dropout (kernel: dropout.cu); the bias fusions around GEMMs are in ``ls_jax.ops.bias``.

    dropout(x) = x * keep / (1 - p),   dx = dy * keep / (1 - p)

Any shape. ``keep`` comes from the Philox seed (``ls_jax.ops.random``) and is regenerated in the backward, so
only the seed is saved. Both implementations (XLA here, CUDA in ffi_kernels) are one function applied to x in the
forward and to dy in the backward: ``apply(x, seed) -> x * keep / (1 - p)`` in x's dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ls_jax.ops import _common, random

_f32 = jnp.float32


def _dropout_xla(x, seed, *, rate):
    return (x.astype(_f32) * random.dropout_multiplier(seed, x.shape, rate)).astype(x.dtype)


def _dropout_ffi(x, seed, *, rate):
    call = jax.ffi.ffi_call("ls_dropout", jax.ShapeDtypeStruct(x.shape, x.dtype), vmap_method="sequential")
    return call(x, seed, **random.dropout_attributes(rate))


def _apply(x, seed, rate):
    """``x * keep / (1 - rate)`` by the backend ``_common.dispatch`` picks."""
    xla = functools.partial(_dropout_xla, rate=rate)
    ffi = functools.partial(_dropout_ffi, rate=rate)
    return _common.dispatch("dropout", xla, ffi, (x, seed))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dropout(x, seed, rate):
    return _apply(x, seed, rate)


def _dropout_fwd(x, seed, rate):
    return _apply(x, seed, rate), seed


def _dropout_bwd(rate, seed, dy):
    return _apply(dy, seed, rate), None


_dropout.defvjp(_dropout_fwd, _dropout_bwd)


def dropout(x: jax.Array, *, rate: float, seed: jax.Array | None = None) -> jax.Array:
    """Zeroes each element of ``x`` with probability ``rate`` and scales the rest by ``1 / (1 - rate)``.

    Args:
      x: any shape, f32, bf16 or f16.
      rate: in [0, 1); 0 returns ``x`` unchanged.
      seed: uint32[2] dropout seed (``ls_jax.ops.dropout_seed``); required when ``rate > 0``.
    """
    _common.check_activation("x", x)
    _common.check_dropout(rate, seed)
    if rate == 0.0:
        return x
    x, seed = _common.vary_together(x, seed)
    return _dropout(x, seed, float(rate))
