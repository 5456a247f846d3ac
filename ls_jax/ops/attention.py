"""Fused multi-head attention with dropout on the probabilities, for short sequences (LightSeq's regime).

    logits = q k^T / sqrt(d), -inf where key_mask is false or (causal) k > q + (K - Q)
    lse    = logsumexp_k(logits)                    (+inf for a row with no visible key)
    probs  = exp(logits - lse)                      (rows with no visible key are zero)
    out    = (probs * keep / (1 - dropout_rate)) v

Shapes: q (B, Q, H, D), k and v (B, K, H, D), key_mask (B, K), out (B, Q, H, D). ``keep`` is the Philox mask of
``attn_softmax`` over the (B, H, Q, K) probabilities, so both ops drop the same elements for the same seed.
Scores and ``dout v^T`` are rounded to the activation dtype before the f32 softmax math, as the GEMMs of the
unfused composition round them. Residuals: the inputs, ``lse`` (B, H, Q) f32 and ``keep`` packed 8 to a byte
(``keep_bits``, uint8 (B, H, Q, ceil(K / 8)) as ``jnp.packbits(keep, axis=-1, bitorder="little")``; none without
dropout); the backward recomputes the probabilities instead of storing them, and reads keep instead of drawing it:

    dp      = (dout v^T) * keep / (1 - dropout_rate)
    dscores = probs * (dp - sum_k(dp * probs)) / sqrt(d)
    dq = dscores k,   dk = dscores^T q,   dv = (probs * keep / (1 - dropout_rate))^T dout

Inputs arrive as "sources" in the layouts the projections produce, so no slice or concatenation is copied:
``self_attention`` takes the packed (B, L, 3, H, D) qkv and returns its gradient packed;
``cross_attention`` takes q (B, Q, H, D) and the packed (B, K, 2, H, D) key_value. The query source's
projection bias comes along unapplied (qkv's (3, H, D), or the query's (H, D)): the fused kernels add it as they
load the tiles and return its gradient as partial sums, which saves a pass over qkv each way.

Three formulations:
  fused (CUDA kernels, bf16/f16, head_dim 64, at most 128 queries and keys): one block per (batch, head) keeps
    the scores on chip; implementations share
      forward(sources, bias, key_mask, seed) -> (out, lse, keep_bits)
      backward(dout, sources, bias, key_mask, keep_bits, lse) -> (d_sources, d_bias)
    and the XLA one (for a computation lowered for another platform) recomputes the probabilities from lse.
  cudnn (any length, bf16/f16, head_dim a multiple of 8 up to 128, or 256 on Hopper; ``ops.attention_cudnn``):
    cuDNN's flash attention from the library's FFI handlers, nothing of size L x L stored; the default where the
    library was built with it (``LS_JAX_CUDNN_ATTENTION=0`` runs the unfused attention instead). The projection bias
    is added by XLA first; the residuals are the biased sources, out and lse, and the seed, from which both
    directions draw the same dropout. cuDNN's dropout drops other elements than ``ls_jax.ops.random`` for the
    same seed (same keep probability and scale). Implementations share
      forward(sources, key_mask, key_lengths, seed) -> (out, lse)
      backward(dout, sources, key_mask, key_lengths, seed, out, lse) -> d_sources
    with at most one of key_mask (any mask: cuDNN adds a bias) and key_lengths (right padding: cuDNN's sequence
    lengths, no bias); the XLA one builds the mask the lengths stand for, draws its dropout with
    ``ls_jax.ops.random`` and recomputes the probabilities from lse.
  unfused (``attention_unfused``: two einsums around ``ops.attn_softmax``): the XLA backend, and the CUDA
    backend for shapes neither the fused kernels nor cuDNN take (then ``attn_softmax`` runs its kernels). On XLA
    it measured faster than the recomputing formulation.

One module on purpose: the short-sequence kernels, cuDNN's and the XLA composition are one op's
implementations behind one custom_vjp, so their shape checks and residuals stay side by side.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax import backend
from ls_jax.ops import _common, attention_cudnn, attention_lengths, random
from ls_jax.ops.softmax import attn_softmax

_f32 = jnp.float32
KERNEL_HEAD_DIM = 64
KERNEL_MAX_LENGTH = 128
CUDNN_ENV_VAR = "LS_JAX_CUDNN_ATTENTION"

Sources = tuple[jax.Array, ...]
"""``(qkv,)`` with qkv (B, L, 3, H, D), or ``(query, key_value)`` with query (B, Q, 1, H, D) and key_value
(B, K, 2, H, D). Their ``bias`` is the query source's, (3, H, D) or (1, H, D), or None."""


def _split(sources: Sources, bias: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q, k, v), each (B, L, H, D), of sources with the bias added in their dtype."""
    query_source = sources[0] if bias is None else sources[0] + bias.astype(sources[0].dtype)
    key_value_source = query_source if len(sources) == 1 else sources[1]
    return query_source[:, :, 0], key_value_source[:, :, -2], key_value_source[:, :, -1]


def _bias_grad(partial_sums: jax.Array, bias: jax.Array | None) -> jax.Array | None:
    """The bias gradient from (..., parts, H, D) partial sums of the query source's gradient."""
    if bias is None:
        return None
    axes = tuple(range(partial_sums.ndim - 3))
    return jnp.sum(partial_sums, axis=axes, dtype=_f32).astype(bias.dtype)


def _bias_operand(sources: Sources, bias: jax.Array | None) -> jax.Array:
    """The kernels' query_bias: the bias in the sources' dtype, zeros when there is none."""
    if bias is None:
        return jnp.zeros(sources[0].shape[2:], sources[0].dtype)
    return bias.astype(sources[0].dtype)


def _join(sources: Sources, dq: jax.Array, dk: jax.Array, dv: jax.Array) -> Sources:
    """Gradients of (q, k, v) in the layout of sources."""
    if len(sources) == 1:
        return (jnp.stack([dq, dk, dv], axis=2),)
    return dq[:, :, None], jnp.stack([dk, dv], axis=2)


def _logits(q, k, key_mask, causal):
    """(B, H, Q, K) f32 logits: scores rounded to the activation dtype, scaled, masked with -inf."""
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(_f32) * (q.shape[-1] ** -0.5)
    if key_mask is not None:
        logits = jnp.where(key_mask[:, None, None, :], logits, -jnp.inf)
    if causal:
        num_q, num_k = q.shape[1], k.shape[1]
        visible = jnp.arange(num_k)[None, :] <= jnp.arange(num_q)[:, None] + (num_k - num_q)
        logits = jnp.where(visible, logits, -jnp.inf)
    return logits


def _keep_bits_shape(sources: Sources, dropout_rate: float) -> tuple[int, ...]:
    """(B, H, Q, ceil(K / 8)), or (0,) without dropout."""
    if dropout_rate == 0.0:
        return (0,)
    batch, queries, _, heads, _ = sources[0].shape
    return batch, heads, queries, _common.packed_width(sources[-1].shape[1])


def _drawn_keep(seed, shape, dropout_rate):
    """The dropout multiplier of the (B, H, Q, K) probabilities and its keep mask packed for the backward."""
    if dropout_rate == 0.0:
        return 1.0, jnp.zeros((0,), jnp.uint8)
    keep = random.keep_mask(seed, shape, dropout_rate)
    return random.keep_multiplier(keep, dropout_rate), _common.pack_mask(keep)


def _stored_keep(keep_bits, keys, dropout_rate):
    """The dropout multiplier from the forward's packed keep mask."""
    if dropout_rate == 0.0:
        return 1.0
    return random.keep_multiplier(_common.unpack_mask(keep_bits, keys), dropout_rate)


def _forward_xla(sources, bias, key_mask, seed, *, causal, dropout_rate):
    q, k, v = _split(sources, bias)
    logits = _logits(q, k, key_mask, causal)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    exp = jnp.exp(logits - row_max)
    total = jnp.sum(exp, axis=-1, keepdims=True)
    probs = jnp.where(total > 0, exp / jnp.where(total > 0, total, 1.0), 0.0)
    lse = jnp.where(total > 0, row_max + jnp.log(total), jnp.inf)
    multiplier, keep_bits = _drawn_keep(seed, logits.shape, dropout_rate)
    out = jnp.einsum("bhqk,bkhd->bqhd", (probs * multiplier).astype(q.dtype), v)
    return out, lse[..., 0], keep_bits


def _backward_xla(dout, sources, bias, key_mask, keep_bits, lse, *, causal, dropout_rate):
    multiplier = _stored_keep(keep_bits, sources[-1].shape[1], dropout_rate)
    return _gradients(dout, sources, bias, key_mask, multiplier, lse, causal)


def _gradients(dout, sources, bias, key_mask, multiplier, lse, causal):
    """(d_sources, d_bias) from the probabilities recomputed from lse and the dropout ``multiplier``."""
    q, k, v = _split(sources, bias)
    logits = _logits(q, k, key_mask, causal)
    probs = jnp.exp(logits - lse[..., None])
    dp = jnp.einsum("bqhd,bkhd->bhqk", dout, v).astype(_f32) * multiplier
    dscores = probs * (dp - jnp.sum(dp * probs, axis=-1, keepdims=True)) * (q.shape[-1] ** -0.5)
    dscores, kept = dscores.astype(q.dtype), (probs * multiplier).astype(q.dtype)
    dq = jnp.einsum("bhqk,bkhd->bqhd", dscores, k)
    dk = jnp.einsum("bhqk,bqhd->bkhd", dscores, q)
    dv = jnp.einsum("bhqk,bqhd->bkhd", kept, dout)
    d_sources = _join(sources, dq, dk, dv)
    return d_sources, _bias_grad(d_sources[0], bias)


def _mask_operand(key_mask):
    """The kernels' trailing optional operand: ``(key_mask,)`` or nothing."""
    return () if key_mask is None else (key_mask,)


def _kernel_attributes(q_source, causal, dropout_rate):
    return dict(
        causal=causal, logit_scale=np.float32(q_source.shape[-1] ** -0.5), **random.dropout_attributes(dropout_rate)
    )


def _forward_ffi(sources, bias, key_mask, seed, *, causal, dropout_rate):
    batch, queries, _, heads, head_dim = sources[0].shape
    out = jax.ShapeDtypeStruct((batch, queries, heads, head_dim), sources[0].dtype)
    lse = jax.ShapeDtypeStruct((batch, heads, queries), _f32)
    keep_bits = jax.ShapeDtypeStruct(_keep_bits_shape(sources, dropout_rate), jnp.uint8)
    call = jax.ffi.ffi_call("ls_attention_fwd", (out, lse, keep_bits), vmap_method="sequential")
    # A packed qkv is passed as both sources.
    operands = (sources[0], sources[-1], _bias_operand(sources, bias), random.seed_operand(seed))
    return call(*operands, *_mask_operand(key_mask), **_kernel_attributes(sources[0], causal, dropout_rate))


def _backward_ffi(dout, sources, bias, key_mask, keep_bits, lse, *, causal, dropout_rate):
    batch, queries, parts, heads, head_dim = sources[0].shape
    d_query_source = jax.ShapeDtypeStruct(sources[0].shape, sources[0].dtype)
    bias_partials = jax.ShapeDtypeStruct((batch, -(-queries // 16), parts, heads, head_dim), _f32)
    d_key_value_source = tuple(jax.ShapeDtypeStruct(source.shape, source.dtype) for source in sources[1:])
    call = jax.ffi.ffi_call(
        "ls_attention_bwd", (d_query_source, bias_partials, *d_key_value_source), vmap_method="sequential"
    )
    d_query_source, bias_partials, *d_key_value_source = call(
        dout,
        sources[0],
        sources[-1],
        _bias_operand(sources, bias),
        lse,
        keep_bits,
        *_mask_operand(key_mask),
        **_kernel_attributes(sources[0], causal, dropout_rate),
    )
    return (d_query_source, *d_key_value_source), _bias_grad(bias_partials, bias)


def _unsupported(sources: Sources) -> str | None:
    q_source, kv_source = sources[0], sources[-1]
    if q_source.dtype not in _common.LOW_PRECISION_DTYPES:
        return f"the fused attention kernels take bfloat16 or float16, got {q_source.dtype}"
    if q_source.shape[-1] != KERNEL_HEAD_DIM:
        return f"the fused attention kernels take head_dim {KERNEL_HEAD_DIM}, got {q_source.shape[-1]}"
    lengths = (q_source.shape[1], kv_source.shape[1])
    if not all(1 <= length <= KERNEL_MAX_LENGTH for length in lengths):
        return f"the fused attention kernels take 1 to {KERNEL_MAX_LENGTH} queries and keys, got {lengths}"
    return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(sources, bias, key_mask, seed, causal, dropout_rate):
    return _attention_fwd(sources, bias, key_mask, seed, causal, dropout_rate)[0]


def _attention_fwd(sources, bias, key_mask, seed, causal, dropout_rate):
    options = dict(causal=causal, dropout_rate=dropout_rate)
    out, lse, keep_bits = _common.dispatch(
        "attention",
        functools.partial(_forward_xla, **options),
        functools.partial(_forward_ffi, **options),
        (sources, bias, key_mask, seed),
    )
    return out, (sources, bias, key_mask, keep_bits, lse)


def _attention_bwd(causal, dropout_rate, residuals, dout):
    sources, bias, key_mask, keep_bits, lse = residuals
    options = dict(causal=causal, dropout_rate=dropout_rate)
    d_sources, d_bias = _common.dispatch(
        "attention",
        functools.partial(_backward_xla, **options),
        functools.partial(_backward_ffi, **options),
        (dout, sources, bias, key_mask, keep_bits, lse),
    )
    return d_sources, d_bias, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _with_bias(sources: Sources, bias: jax.Array | None) -> Sources:
    """Sources with the projection bias added to the query source (in its dtype)."""
    if bias is None:
        return sources
    return (sources[0] + bias.astype(sources[0].dtype), *sources[1:])


def _cudnn_forward_xla(sources, key_mask, key_lengths, seed, *, causal, dropout_rate):
    key_mask = _key_mask_of(key_mask, key_lengths, sources[-1].shape[1])
    out, lse, _ = _forward_xla(sources, None, key_mask, seed, causal=causal, dropout_rate=dropout_rate)
    return out, lse


def _cudnn_backward_xla(dout, sources, key_mask, key_lengths, seed, out, lse, *, causal, dropout_rate):
    del out  # cuDNN's backward reads it; the probabilities recomputed from lse give the same gradient
    key_mask = _key_mask_of(key_mask, key_lengths, sources[-1].shape[1])
    multiplier = random.dropout_multiplier(seed, (*lse.shape, sources[-1].shape[1]), dropout_rate)
    return _gradients(dout, sources, None, key_mask, multiplier, lse, causal)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _cudnn_attention(sources, bias, key_mask, key_lengths, seed, causal, dropout_rate):
    return _cudnn_attention_fwd(sources, bias, key_mask, key_lengths, seed, causal, dropout_rate)[0]


def _cudnn_attention_fwd(sources, bias, key_mask, key_lengths, seed, causal, dropout_rate):
    options = dict(causal=causal, dropout_rate=dropout_rate)
    biased = _with_bias(sources, bias)
    out, lse = _common.dispatch(
        "attention",
        functools.partial(_cudnn_forward_xla, **options),
        functools.partial(attention_cudnn.forward, **options),
        (biased, key_mask, key_lengths, seed),
    )
    return out, (biased, bias, key_mask, key_lengths, seed, out, lse)


def _cudnn_attention_bwd(causal, dropout_rate, residuals, dout):
    biased, bias, key_mask, key_lengths, seed, out, lse = residuals
    options = dict(causal=causal, dropout_rate=dropout_rate)
    d_sources = _common.dispatch(
        "attention",
        functools.partial(_cudnn_backward_xla, **options),
        functools.partial(attention_cudnn.backward, **options),
        (dout, biased, key_mask, key_lengths, seed, out, lse),
    )
    return d_sources, _bias_grad(d_sources[0], bias), None, None, None


_cudnn_attention.defvjp(_cudnn_attention_fwd, _cudnn_attention_bwd)


def cudnn_enabled() -> bool:
    """Whether attention beyond the fused kernels may run cuDNN's (default); ``LS_JAX_CUDNN_ATTENTION=0`` turns it
    off, to compare with the unfused attention."""
    value = os.environ.get(CUDNN_ENV_VAR, "1")
    if value not in ("0", "1"):
        raise ValueError(
            f"{CUDNN_ENV_VAR} must be 0 (the unfused attention beyond the fused kernels) or 1 (cuDNN's "
            f"flash attention, the default), got {value!r}"
        )
    return value == "1"


def _cudnn_reason(sources: Sources, masked: bool, causal: bool, dropout_rate: float) -> str | None:
    """Why cuDNN attention cannot run these operands, or None. A missing cuDNN package is an error when the kernels
    are required (LS_JAX_KERNELS=ffi), a logged fallback otherwise."""
    if not cudnn_enabled():
        return f"cuDNN attention is turned off ({CUDNN_ENV_VAR}=0)"
    reason = attention_cudnn.shape_reason(sources, masked, causal, dropout_rate)
    if reason is not None:
        return reason
    missing = attention_cudnn.missing()
    if missing is not None and backend.requested_mode() == "ffi":
        raise backend.KernelsUnavailableError(
            f"{backend.ENV_VAR}=ffi: attention of these shapes needs the cuDNN attention targets, which the kernel "
            f"library was built without: {missing}"
        )
    return missing


def _check_key_mask(key_mask: jax.Array | None, batch: int, keys: int) -> jax.Array | None:
    if key_mask is None:
        return None
    if tuple(key_mask.shape) != (batch, keys):
        raise ValueError(f"key_mask must have shape (batch, keys) = {(batch, keys)}, got {tuple(key_mask.shape)}")
    return key_mask.astype(bool)


def attention_unfused(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None = None,
    *,
    causal: bool = False,
    dropout_rate: float = 0.0,
    seed: jax.Array | None = None,
) -> jax.Array:
    """softmax(q k^T / sqrt(d) + mask) v as two einsums around ``ops.attn_softmax``, whose probabilities autodiff
    keeps for the backward. q (B, Q, H, D), k and v (B, K, H, D), mask boolean broadcastable to (B, H, Q, K)."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", query, key)
    probs = attn_softmax(
        scores, mask, scale=query.shape[-1] ** -0.5, causal=causal, dropout_rate=dropout_rate, seed=seed
    )
    return jnp.einsum("bhqk,bkhd->bqhd", probs, value)


def _check_bias(bias: jax.Array | None, shape: tuple[int, ...], query_source: jax.Array) -> jax.Array | None:
    """``bias`` checked against its documented ``shape``, as the query source's (parts, H, D)."""
    if bias is None:
        return None
    _common.check_param("bias", bias, shape, query_source.dtype)
    return bias.reshape(query_source.shape[2:])


def _key_mask_of(key_mask: jax.Array | None, key_lengths: jax.Array | None, keys: int) -> jax.Array | None:
    """The (B, K) boolean key mask that ``key_mask`` or ``key_lengths`` (at most one is given) stands for."""
    return key_mask if key_lengths is None else attention_lengths.lengths_mask(key_lengths, keys)


def _attend(sources: Sources, bias, key_mask, key_lengths, causal: bool, dropout_rate: float, seed) -> jax.Array:
    """Attention of the sources with at most one of ``key_mask`` (any mask: bias path) and ``key_lengths`` (checked
    int32 lengths of right-padded rows). The fused kernels and the unfused attention take the mask the lengths stand
    for; cuDNN takes the lengths as its padding mask's sequence lengths, with no bias tensor."""
    _common.check_dropout(dropout_rate, seed)
    keys = sources[-1].shape[1]
    key_mask = _check_key_mask(key_mask, sources[0].shape[0], keys)
    if dropout_rate == 0.0:
        seed = None
    if backend.kernels_enabled():
        reason = _unsupported(sources)
        if reason is None:
            *sources, bias, key_mask, seed = _common.vary_together(
                *sources, bias, _key_mask_of(key_mask, key_lengths, keys), seed
            )
            return _attention(tuple(sources), bias, key_mask, seed, bool(causal), float(dropout_rate))
        masked = key_mask is not None or key_lengths is not None
        reason = _cudnn_reason(sources, masked, causal, dropout_rate)
        if reason is None:
            *sources, bias, key_mask, key_lengths, seed = _common.vary_together(
                *sources, bias, key_mask, key_lengths, seed
            )
            return _cudnn_attention(
                tuple(sources), bias, key_mask, key_lengths, seed, bool(causal), float(dropout_rate)
            )
        _common.log_fallback_once("attention", reason, "the unfused attention (the attn_softmax kernels)")
    key_mask = _key_mask_of(key_mask, key_lengths, keys)
    mask = None if key_mask is None else key_mask[:, None, None, :]
    return attention_unfused(*_split(sources, bias), mask, causal=causal, dropout_rate=dropout_rate, seed=seed)


def self_attention(
    qkv: jax.Array,
    key_mask: jax.Array | None = None,
    *,
    lengths: jax.Array | None = None,
    bias: jax.Array | None = None,
    causal: bool = False,
    dropout_rate: float = 0.0,
    seed: jax.Array | None = None,
) -> jax.Array:
    """Attention of every position over every (causal: earlier) position of the same sequence.

    Args:
      qkv: (B, L, 3, H, D) queries, keys and values (``[:, :, 0]``, ``[:, :, 1]``, ``[:, :, 2]``), f32, bf16 or f16.
      key_mask: optional (B, L) boolean, True for positions that may be attended (False at padding): any mask.
      lengths: optional (B,) integer, the number of visible keys of each row when they are a prefix (right padding):
        the same as ``key_mask = arange(L) < lengths[:, None]``, which cuDNN's attention takes as sequence lengths
        without a bias tensor (``ls_jax.ops.attention_lengths``). At most one of ``key_mask`` and ``lengths``.
      bias: optional (3, H, D) projection bias added to qkv first, f32 or qkv's dtype.
      causal: each query attends only to itself and earlier positions.
      dropout_rate: probability of zeroing an attention probability.
      seed: uint32[2] dropout seed (``ls_jax.ops.dropout_seed``); required when ``dropout_rate > 0``.

    Returns:
      (B, L, H, D) in qkv's dtype; a query with no visible key gets zeros.

    Raises:
      ValueError: bad shapes or dtypes, both ``key_mask`` and ``lengths``, or concrete lengths outside [0, L].
    """
    _common.check_activation("qkv", qkv)
    if qkv.ndim != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must have shape (batch, length, 3, heads, head_dim), got {qkv.shape}")
    lengths = attention_lengths.check_lengths(
        lengths, batch=qkv.shape[0], keys=qkv.shape[1], name="lengths", key_mask=key_mask
    )
    return _attend((qkv,), _check_bias(bias, qkv.shape[2:], qkv), key_mask, lengths, causal, dropout_rate, seed)


def cross_attention(
    query: jax.Array,
    key_value: jax.Array,
    key_mask: jax.Array | None = None,
    *,
    key_lengths: jax.Array | None = None,
    bias: jax.Array | None = None,
    dropout_rate: float = 0.0,
    seed: jax.Array | None = None,
) -> jax.Array:
    """Attention of each query over every key of another sequence (a decoder over its encoder's output).

    Args:
      query: (B, Q, H, D), f32, bf16 or f16.
      key_value: (B, K, 2, H, D) keys ``[:, :, 0]`` and values ``[:, :, 1]``, query's dtype.
      key_mask: optional (B, K) boolean, True for keys that may be attended (False at padding): any mask.
      key_lengths: optional (B,) integer, the number of visible keys of each row when they are a prefix, as
        ``self_attention``'s ``lengths``. At most one of ``key_mask`` and ``key_lengths``.
      bias: optional (H, D) projection bias added to query first, f32 or query's dtype.
      dropout_rate, seed: as for ``self_attention``.

    Returns:
      (B, Q, H, D) in query's dtype; a query with no visible key gets zeros.

    Raises:
      ValueError: bad shapes or dtypes, both ``key_mask`` and ``key_lengths``, or concrete lengths outside [0, K].
    """
    _common.check_activation("query", query)
    _common.check_same_dtype("key_value", key_value, "query", query)
    if query.ndim != 4:
        raise ValueError(f"query must have shape (batch, queries, heads, head_dim), got {query.shape}")
    batch, _, heads, head_dim = query.shape
    if key_value.ndim != 5 or tuple(key_value.shape[i] for i in (0, 2, 3, 4)) != (batch, 2, heads, head_dim):
        raise ValueError(
            f"key_value must have shape (batch, keys, 2, heads, head_dim) = ({batch}, keys, 2, {heads}, {head_dim}), "
            f"got {key_value.shape}"
        )
    key_lengths = attention_lengths.check_lengths(
        key_lengths, batch=batch, keys=key_value.shape[1], name="key_lengths", key_mask=key_mask
    )
    query_source = query[:, :, None]
    bias = _check_bias(bias, query.shape[2:], query_source)
    return _attend((query_source, key_value), bias, key_mask, key_lengths, False, dropout_rate, seed)
