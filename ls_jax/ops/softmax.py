"""Attention softmax: scale, padding mask, causal mask and attention-probability dropout in one op.

    logits = scores * scale + mask          (a boolean mask sets masked logits to -inf)
    logits[..., q, k] = -inf  where causal and k > q + (K - Q)   (queries are the last Q of K positions)
    probs  = softmax(logits)                (a row whose logits are all -inf gives zeros, not NaN)
    y      = probs * keep / (1 - dropout_rate)

Shapes: scores (B, H, Q, K) (any rank >= 2 works; the last two axes are queries and keys); mask broadcastable
to scores. Residuals: probs (scores' dtype) and the seed. The backward is

    dp = dy * keep / (1 - dropout_rate)
    dscores = scale * probs * (dp - sum_k(dp * probs))

A float mask receives the gradient dscores / scale reduced to its shape; a boolean mask none.

Implementations share:
  forward(scores, mask, seed) -> (y, probs)        mask and seed may be None
  backward(dy, probs, seed) -> dscores             dscores in scores' dtype
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.ops import _common, random

_f32 = jnp.float32


def _forward_xla(scores, mask, seed, *, scale, causal, dropout_rate):
    logits = scores.astype(_f32) * scale
    if mask is not None:
        if mask.dtype == jnp.bool_:
            logits = jnp.where(mask, logits, -jnp.inf)
        else:
            logits = logits + mask.astype(_f32)
    if causal:
        num_q, num_k = scores.shape[-2:]
        q_index = jnp.arange(num_q)[:, None] + (num_k - num_q)
        logits = jnp.where(jnp.arange(num_k)[None, :] <= q_index, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    exp = jnp.exp(logits - row_max)
    total = jnp.sum(exp, axis=-1, keepdims=True)
    probs = jnp.where(total > 0, exp / jnp.where(total > 0, total, 1.0), 0.0)
    y = probs * random.dropout_multiplier(seed, scores.shape, dropout_rate)
    return y.astype(scores.dtype), probs.astype(scores.dtype)


def _backward_xla(dy, probs, seed, *, scale, dropout_rate):
    dp = dy.astype(_f32) * random.dropout_multiplier(seed, dy.shape, dropout_rate)
    p = probs.astype(_f32)
    dlogits = p * (dp - jnp.sum(dp * p, axis=-1, keepdims=True))
    return (dlogits * scale).astype(probs.dtype)


def _scores_view(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """The (B, H, Q, K) view the kernels take of scores of rank >= 2: leading axes merge into B, missing ones are 1."""
    *lead, queries, keys = shape
    heads = lead[-1] if lead else 1
    return math.prod(lead[:-1]), heads, queries, keys


def _mask_view(mask_shape: tuple[int, ...], scores_shape: tuple[int, ...]) -> tuple[int, int, int, int] | None:
    """The (B or 1, H or 1, Q or 1, K) view of a mask that broadcasts to scores, or None if the kernels cannot
    index it: a mask broadcast along the keys, or over some but not all of the axes merged into B."""
    padded = (1,) * (len(scores_shape) - len(mask_shape)) + tuple(mask_shape)
    if padded[-1] != scores_shape[-1]:
        return None
    mask_lead, scores_lead = padded[:-3], tuple(scores_shape[:-3])
    if all(dim == 1 for dim in mask_lead):
        batch = 1
    elif mask_lead == scores_lead:
        batch = math.prod(scores_lead)
    else:
        return None
    heads = padded[-3] if len(padded) >= 3 else 1
    return batch, heads, padded[-2], padded[-1]


def _unsupported(scores: jax.Array, mask: jax.Array | None) -> str | None:
    if _common.rows(scores) >= 2**31 or scores.shape[-1] >= 2**31:
        return f"scores of shape {scores.shape} exceed the kernels' 2**31 - 1 rows or keys"
    if mask is not None and _mask_view(mask.shape, scores.shape) is None:
        return (
            f"a mask of shape {mask.shape} over scores of shape {scores.shape} is broadcast along the keys or over "
            "only some leading axes; the kernels take masks of shape (B or 1, H or 1, Q or 1, K)"
        )
    return None


def _forward_ffi(scores, mask, seed, *, scale, causal, dropout_rate):
    """The ls_attn_softmax_fwd kernel on the (B, H, Q, K) view of scores. A float mask is passed as f32 (exact for
    every float dtype); without dropout the kernel writes only probs, which is then also y."""
    view = _scores_view(scores.shape)
    operands = [scores.reshape(view), random.seed_operand(seed)]
    if mask is not None:
        kernel_mask = mask if mask.dtype == jnp.bool_ else mask.astype(_f32)
        operands.append(kernel_mask.reshape(_mask_view(mask.shape, scores.shape)))
    out = jax.ShapeDtypeStruct(view, scores.dtype)
    call = jax.ffi.ffi_call("ls_attn_softmax_fwd", (out, out) if dropout_rate else (out,), vmap_method="sequential")
    attributes = random.dropout_attributes(dropout_rate)
    probs, *dropped = call(*operands, logit_scale=np.float32(scale), causal=causal, **attributes)
    probs = probs.reshape(scores.shape)
    return (dropped[0].reshape(scores.shape) if dropped else probs), probs


def _backward_ffi(dy, probs, seed, *, scale, dropout_rate):
    """The ls_attn_softmax_bwd kernel: dropout regenerated from the seed, one pass over each row."""
    out = jax.ShapeDtypeStruct(probs.shape, probs.dtype)
    call = jax.ffi.ffi_call("ls_attn_softmax_bwd", out, vmap_method="sequential")
    attributes = random.dropout_attributes(dropout_rate)
    return call(dy, probs, random.seed_operand(seed), logit_scale=np.float32(scale), **attributes)


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether an array of ``shape`` broadcasts to ``target`` (numpy rules) without enlarging it."""
    if len(shape) > len(target):
        return False
    return all(dim in (1, goal) for dim, goal in zip(reversed(shape), reversed(target)))


def _reduce_to_shape(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Sums the broadcast axes of ``x`` back to ``shape`` (the transpose of broadcasting)."""
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, d in enumerate(shape) if d == 1 and x.shape[lead + i] != 1)
    return jnp.sum(x, axis=axes, keepdims=False).reshape(shape) if axes else x.reshape(shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attn_softmax(scores, mask, seed, scale, causal, dropout_rate):
    return _attn_softmax_fwd(scores, mask, seed, scale, causal, dropout_rate)[0]


def _attn_softmax_fwd(scores, mask, seed, scale, causal, dropout_rate):
    forward_xla = functools.partial(_forward_xla, scale=scale, causal=causal, dropout_rate=dropout_rate)
    forward_ffi = functools.partial(_forward_ffi, scale=scale, causal=causal, dropout_rate=dropout_rate)
    y, probs = _common.dispatch(
        "attn_softmax", forward_xla, forward_ffi, (scores, mask, seed), _unsupported(scores, mask)
    )
    return y, (probs, seed, mask)


def _attn_softmax_bwd(scale, causal, dropout_rate, res, dy):
    probs, seed, mask = res
    backward_xla = functools.partial(_backward_xla, scale=scale, dropout_rate=dropout_rate)
    backward_ffi = functools.partial(_backward_ffi, scale=scale, dropout_rate=dropout_rate)
    dscores = _common.dispatch("attn_softmax", backward_xla, backward_ffi, (dy, probs, seed), _unsupported(probs, None))
    dmask = None
    if mask is not None and mask.dtype != jnp.bool_:
        dmask = _reduce_to_shape(dscores.astype(_f32) / scale, mask.shape).astype(mask.dtype)
    return dscores, dmask, None


_attn_softmax.defvjp(_attn_softmax_fwd, _attn_softmax_bwd)


def attn_softmax(
    scores: jax.Array,
    mask: jax.Array | None = None,
    *,
    scale: float = 1.0,
    causal: bool = False,
    dropout_rate: float = 0.0,
    seed: jax.Array | None = None,
) -> jax.Array:
    """Masked, scaled softmax over the last axis of attention scores, with dropout on the probabilities.

    Args:
      scores: (B, H, Q, K) raw scores ``q . k`` in f32, bf16 or f16.
      mask: optional, broadcastable to ``scores``: boolean (True = attend) or float (added to the logits).
      scale: multiplies the scores before masking, e.g. ``1 / sqrt(head_dim)``; nonzero.
      causal: mask keys after each query; queries are aligned to the last Q of the K positions.
      dropout_rate: probability of zeroing an attention probability.
      seed: uint32[2] dropout seed (``ls_jax.ops.dropout_seed``); required when ``dropout_rate > 0``.

    Returns:
      Probabilities (after dropout) of scores' shape and dtype; fully masked rows are zero.
    """
    _common.check_activation("scores", scores, min_rank=2)
    _common.check_dropout(dropout_rate, seed)
    if not (scale != 0.0 and math.isfinite(scale)):
        raise ValueError(f"scale must be finite and nonzero, got {scale}")
    if mask is not None:
        if mask.dtype != jnp.bool_ and jnp.dtype(mask.dtype) not in _common.ACTIVATION_DTYPES:
            raise ValueError(f"mask must be boolean or float32/bfloat16/float16, got {mask.dtype}")
        if not _broadcasts_to(mask.shape, scores.shape):
            raise ValueError(f"mask of shape {mask.shape} does not broadcast to scores of shape {scores.shape}")
    if causal and scores.shape[-2] > scores.shape[-1]:
        raise ValueError(f"causal attention needs queries <= keys, got scores of shape {scores.shape}")
    if dropout_rate == 0.0:
        seed = None
    scores, mask, seed = _common.vary_together(scores, mask, seed)
    return _attn_softmax(scores, mask, seed, float(scale), bool(causal), float(dropout_rate))
