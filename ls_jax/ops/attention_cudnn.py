"""Attention of any length on CUDA: cuDNN's fused flash attention (SDPA), forward and backward, called from this
library's FFI handlers (ffi_kernels/csrc/attention_cudnn.cu). Nothing of size L x L is stored.

    logits = q k^T / sqrt(d), -inf where key_mask is false or (causal) k > q + (K - Q)
    stats  = logsumexp_k(logits)                    (B, H, Q) f32, the backward's residual with out
    out    = (softmax(logits) * keep / (1 - dropout_rate)) v,   0 for a row with no visible key

The operands stay in the layouts of ``ops.attention``'s sources (a packed (B, L, 3, H, D) qkv, or a (B, Q, 1, H, D)
query and a packed (B, K, 2, H, D) key_value): cuDNN reads them, and writes their gradients, through strides.

Differences from the XLA implementation and the short-sequence kernels:
  - Dropout is cuDNN's Philox generator keyed by the seed array (element 0 the seed, element 1 the offset), read
    on the device, so a new seed each step needs neither a recompilation nor a host synchronization. It draws
    other elements than ``ls_jax.ops.random``: the same seed drops different attention probabilities here than
    in the XLA implementation. Both keep each probability with probability 1 - dropout_rate and scale the kept
    ones by 1 / (1 - dropout_rate); the GPU tests check that, and that one seed gives one result.
  - cuDNN has no input bias: the projection bias is added to the query source by XLA before the call (one pass
    over it; its gradient is XLA's sum of the source gradient over batch and length).
  - Key lengths (right padding, ``ops.attention_lengths``) become cuDNN's padding mask alone: seq_len_kv = the
    length (at least 1), seq_len_q = every query, no bias tensor, so cuDNN skips the padding and reads nothing else.
  - A key mask (any mask) becomes cuDNN's padding mask with seq_len_kv = 1 + the last visible key (the keys after
    it are skipped) plus an additive (B, 1, 1, K) bias, 0 at visible keys and ``MASKED_LOGIT`` elsewhere, so any
    mask is exact: a second input cuDNN reads for every (batch, head, query) tile.
  - A row without a visible key (length 0, or an all-False mask row) is given seq_len_kv = 1 and its output is set
    to 0 here, its output gradient to 0 before the backward, which then contributes nothing from it: 0 output and 0
    gradients, as in the XLA implementation.
  - Packed rows of several documents (GPT's training rows) have no segment ids in these ops: every query attends
    across the whole row, as GPT-2 trains. cuDNN's ragged (THD) layout could run each document as its own sequence,
    but it needs the documents as separate sequences with a static bound on their number per row and per-step
    offsets, which nothing here produces; an arbitrary block-diagonal mask would need a (B, 1, Q, K) bias, the
    L x L tensor flash attention avoids. So no document masking is built.
  - Causal attention takes queries == keys (the self-attention case), or queries < keys without a key mask and
    without dropout (cuDNN's bottom-right diagonal excludes both).

Implementations of ``ops.attention``'s cuDNN formulation:
  forward(sources, key_mask, key_lengths, seed) -> (out (B, Q, H, D), stats (B, H, Q) f32)
  backward(dout, sources, key_mask, key_lengths, seed, out, stats) -> d_sources
with ``sources`` already carrying the projection bias, and at most one of key_mask ((B, K) boolean) and key_lengths
(int32 (B,) in [0, K]).

The handlers build each configuration's cuDNN graph in XLA's initialize stage, before the executable's first
execution, not in the execute handler (ffi_kernels/csrc/attention_cudnn.cu says why not at compile time);
``graphs_built_in_execute`` counts the graphs an execute handler had to build itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import ffi_kernels
from ls_jax.ops import _common
from ls_jax.ops.random import seed_operand

_f32 = jnp.float32
FORWARD_TARGET = "ls_attention_cudnn_fwd"
BACKWARD_TARGET = "ls_attention_cudnn_bwd"
MASKED_LOGIT = -30000.0
"""The bias of a masked key: representable in f16, and exp(MASKED_LOGIT + logit - max) is 0 in f32 for any logit
a visible key can have; finite, so that a row with no visible key stays finite inside cuDNN."""
HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 128
MAX_HEAD_DIM_HOPPER = 256
_BIAS_ROW_MULTIPLE = 8  # mask_bias rows padded to 16 bytes, the alignment cuDNN loads with


def missing() -> str | None:
    """Why the kernel library has no cuDNN attention (the package that is missing), or None."""
    return ffi_kernels.cudnn_attention_missing()


def graphs_built_in_execute() -> int | None:
    """How many cuDNN graphs this process's execute handlers had to build themselves (0 while every one was built in
    XLA's initialize stage), or None when the library has no cuDNN attention."""
    return ffi_kernels.cudnn_graphs_built_in_execute()


def workspace_peak_bytes(device: int = 0) -> int | None:
    """The most bytes cuDNN attention's workspace on CUDA ``device`` took at once since the previous read (which
    resets the mark), or None when it never ran there. This memory lies outside XLA's allocator and its statistics."""
    return ffi_kernels.cudnn_workspace_peak_bytes(device)


def _compute_capability() -> str:
    """The first CUDA device's compute capability, e.g. "9.0" ("" when JAX does not report it)."""
    return str(getattr(jax.devices("cuda")[0], "compute_capability", ""))


def _head_dim_reason(head_dim: int) -> str | None:
    if head_dim % HEAD_DIM_MULTIPLE != 0:
        return f"cuDNN attention takes head_dim a multiple of {HEAD_DIM_MULTIPLE}, got {head_dim}"
    if head_dim <= MAX_HEAD_DIM:
        return None
    capability = _compute_capability()
    if head_dim <= MAX_HEAD_DIM_HOPPER and capability.startswith("9."):
        return None
    return (
        f"cuDNN attention takes head_dim up to {MAX_HEAD_DIM} (up to {MAX_HEAD_DIM_HOPPER} on compute "
        f"capability 9.x, forward and backward), got {head_dim} on compute capability {capability or 'unknown'}"
    )


def shape_reason(sources, masked: bool, causal: bool, dropout_rate: float) -> str | None:
    """Why cuDNN attention cannot take these operands (dtype, head_dim, lengths, causal layout), or None; ``masked``:
    a key mask or key lengths come with them."""
    q_source, kv_source = sources[0], sources[-1]
    if q_source.dtype not in _common.LOW_PRECISION_DTYPES:
        return f"cuDNN attention takes bfloat16 or float16, got {q_source.dtype}"
    queries, keys = q_source.shape[1], kv_source.shape[1]
    if queries == 1 and keys == 1:
        return "cuDNN's attention backward does not take a single query over a single key"
    if causal and queries != keys and (queries > keys or masked or dropout_rate > 0.0):
        return (
            f"cuDNN's causal attention with queries != keys ({queries} and {keys}) takes queries < keys, no key "
            f"mask and no dropout"
        )
    return _head_dim_reason(q_source.shape[-1])


def _seq_lengths(key_mask: jax.Array, queries: int) -> tuple[jax.Array, jax.Array]:
    """int32 (B,) seq_len_q (every query) and seq_len_kv: 1 + the last visible key, at least 1."""
    batch, keys = key_mask.shape
    extent = keys - jnp.argmax(key_mask[:, ::-1], axis=1)
    seq_len_kv = jnp.where(jnp.any(key_mask, axis=1), extent, 1).astype(jnp.int32)
    return jnp.full((batch,), queries, jnp.int32), seq_len_kv


def _mask_bias(key_mask: jax.Array, dtype) -> jax.Array:
    """(B, K rounded up to 8) additive bias: 0 at visible keys, MASKED_LOGIT elsewhere (padding never read)."""
    keys = key_mask.shape[1]
    padded = jnp.pad(key_mask, ((0, 0), (0, -keys % _BIAS_ROW_MULTIPLE)))
    return jnp.where(padded, 0.0, MASKED_LOGIT).astype(dtype)


def _mask_operands(
    key_mask: jax.Array | None, key_lengths: jax.Array | None, queries: int, dtype
) -> tuple[jax.Array, ...]:
    """The handlers' trailing optional operands: (seq_len_q, seq_len_kv) for key lengths, (seq_len_q, seq_len_kv,
    mask_bias) for a key mask, or nothing."""
    if key_lengths is not None:
        batch = key_lengths.shape[0]
        return jnp.full((batch,), queries, jnp.int32), jnp.maximum(key_lengths, 1).astype(jnp.int32)
    if key_mask is None:
        return ()
    return (*_seq_lengths(key_mask, queries), _mask_bias(key_mask, dtype))


def _visible_rows(
    key_mask: jax.Array | None, key_lengths: jax.Array | None, queries: int, causal: bool
) -> jax.Array | None:
    """(B, Q) boolean: whether each query sees at least one key; None when every query does."""
    if key_lengths is not None:  # key 0 is visible to every query (causal: k = 0 <= q) of a row of length > 0
        return jnp.broadcast_to((key_lengths > 0)[:, None], (key_lengths.shape[0], queries))
    if key_mask is None:
        return None  # causal with queries < keys: query q sees keys 0 .. q + K - Q
    if causal:
        return jnp.cumsum(key_mask, axis=1, dtype=jnp.int32) > 0  # queries == keys: query q sees keys 0 .. q
    return jnp.broadcast_to(jnp.any(key_mask, axis=1, keepdims=True), (key_mask.shape[0], queries))


def _zero_invisible(x: jax.Array, visible: jax.Array | None) -> jax.Array:
    """x (B, Q, H, D) with the rows of queries that see no key set to 0."""
    return x if visible is None else jnp.where(visible[:, :, None, None], x, jnp.zeros((), x.dtype))


def _attributes(sources, causal: bool, dropout_rate: float) -> dict:
    return dict(
        causal=bool(causal), dropout_rate=np.float32(dropout_rate), logit_scale=np.float32(sources[0].shape[-1] ** -0.5)
    )


def forward(sources, key_mask, key_lengths, seed, *, causal: bool, dropout_rate: float):
    q_source, kv_source = sources[0], sources[-1]
    batch, queries, _, heads, head_dim = q_source.shape
    out_type = jax.ShapeDtypeStruct((batch, queries, heads, head_dim), q_source.dtype)
    stats_type = jax.ShapeDtypeStruct((batch, heads, queries, 1), _f32)
    call = jax.ffi.ffi_call(FORWARD_TARGET, (out_type, stats_type), vmap_method="sequential")
    # A packed qkv is passed as both sources.
    mask_operands = _mask_operands(key_mask, key_lengths, queries, q_source.dtype)
    out, stats = call(
        q_source, kv_source, seed_operand(seed), *mask_operands, **_attributes(sources, causal, dropout_rate)
    )
    return _zero_invisible(out, _visible_rows(key_mask, key_lengths, queries, causal)), stats[..., 0]


def backward(dout, sources, key_mask, key_lengths, seed, out, stats, *, causal: bool, dropout_rate: float):
    q_source, kv_source = sources[0], sources[-1]
    queries = q_source.shape[1]
    dout = _zero_invisible(dout, _visible_rows(key_mask, key_lengths, queries, causal))
    gradient_types = tuple(jax.ShapeDtypeStruct(source.shape, source.dtype) for source in sources)
    call = jax.ffi.ffi_call(BACKWARD_TARGET, gradient_types, vmap_method="sequential")
    d_sources = call(
        dout,
        q_source,
        kv_source,
        out,
        stats[..., None],
        seed_operand(seed),
        *_mask_operands(key_mask, key_lengths, queries, q_source.dtype),
        **_attributes(sources, causal, dropout_rate),
    )
    return tuple(d_sources)
