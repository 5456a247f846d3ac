"""Token embedding: lookup x scale + position embedding + dropout, zero at padding tokens.

    y[b, t] = dropout(scale * table[tokens[b, t]] + pos_table[positions[b, t]]) * (tokens[b, t] != padding_id)

Shapes: tokens, positions (B, L) int; table (V, H); pos_table (P, H) or None. ``positions`` defaults to
``0..L-1`` in every row. Tables may be f32 while the output is bf16/f16 (``dtype``), so their gradients
accumulate in f32. Token ids outside [0, V) and positions outside [0, P) are clamped (a gather cannot raise
inside jit): validate data upstream. The backward scatters the output gradient into the tables:

    dtable[v]   = scale * sum_{(b,t): tokens = v, not pad} dy[b, t] * m[b, t]
    dpos[p]     =         sum_{(b,t): positions = p, not pad} dy[b, t] * m[b, t]

Implementations share:
  forward(tokens, positions, table, pos_table, seed) -> y
  backward(dy, tokens, positions, seed) -> (dtable, dpos_table)    (dpos_table None without pos_table)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.ops import _common, random

_f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything about one embed call that is fixed at trace time."""

    scale: float
    padding_id: int | None
    rate: float
    dtype: jnp.dtype
    table_shape: tuple[int, int]
    table_dtype: jnp.dtype
    pos_shape: tuple[int, int] | None
    pos_dtype: jnp.dtype | None


def _output_multiplier(tokens, seed, hidden, static: _Static):
    """f32 (B, L, H) or (B, L, 1) factor: dropout keep / (1 - p) times the non-padding indicator."""
    multiplier = random.dropout_multiplier(seed, tokens.shape + (hidden,), static.rate)
    if static.padding_id is None:
        return multiplier
    return multiplier * (tokens != static.padding_id)[..., None].astype(_f32)


def _forward_xla(tokens, positions, table, pos_table, seed, *, static: _Static):
    y = jnp.take(table, tokens, axis=0, mode="clip").astype(_f32) * static.scale
    if pos_table is not None:
        y = y + jnp.take(pos_table, positions, axis=0, mode="clip").astype(_f32)
    y = y * _output_multiplier(tokens, seed, table.shape[1], static)
    return y.astype(static.dtype)


def _backward_xla(dy, tokens, positions, seed, *, static: _Static):
    grad = dy.astype(_f32) * _output_multiplier(tokens, seed, dy.shape[-1], static)
    grad = grad.reshape(-1, dy.shape[-1])
    token_index = jnp.clip(tokens.reshape(-1), 0, static.table_shape[0] - 1)
    dtable = jnp.zeros(static.table_shape, _f32).at[token_index].add(grad * static.scale)
    dpos = None
    if static.pos_shape is not None:
        pos_index = jnp.clip(positions.reshape(-1), 0, static.pos_shape[0] - 1)
        dpos = jnp.zeros(static.pos_shape, _f32).at[pos_index].add(grad).astype(static.pos_dtype)
    return dtable.astype(static.table_dtype), dpos


def _kernel_attributes(static: _Static, token_scale: float) -> dict[str, np.generic | bool]:
    return {
        "token_scale": np.float32(token_scale),
        "has_padding": static.padding_id is not None,
        "padding_id": np.int64(0 if static.padding_id is None else static.padding_id),
        **random.dropout_attributes(static.rate),
    }


def _forward_ffi(tokens, positions, table, pos_table, seed, *, static: _Static):
    y = jax.ShapeDtypeStruct(tokens.shape + (table.shape[1],), static.dtype)
    attributes = _kernel_attributes(static, static.scale)
    if pos_table is None:
        call = jax.ffi.ffi_call("ls_embed_fwd", y, vmap_method="sequential")
        return call(tokens, table, random.seed_operand(seed), **attributes)
    call = jax.ffi.ffi_call("ls_embed_pos_fwd", y, vmap_method="sequential")
    return call(tokens, positions, table, pos_table, random.seed_operand(seed), **attributes)


def _table_grad_ffi(dy, tokens, rows, shape, dtype, token_scale, seed, static: _Static):
    """The gradient of one table of ``shape``: row ``rows[i]`` (clipped ids, (n,)) receives dy[i] * token_scale.

    XLA's stable sort groups equal ids with their token positions in order; the kernel sums each run of equal ids
    in that order (deterministic) into the run's first sorted position, and a scatter with one index per run
    puts the sums into the table (the other positions get distinct out-of-range indices and are dropped). XLA
    rewrites ``other + scatter(zeros, ...)`` as a scatter into ``other``, so where the table has other
    gradients (a tied output projection's) the sums are added to them in place.
    """
    n = rows.size
    position = jnp.arange(n, dtype=jnp.int32)
    keys, order, sorted_tokens = jax.lax.sort((rows, position, tokens), num_keys=1, is_stable=True)
    starts_run = jnp.ones(keys.shape, bool).at[1:].set(keys[1:] != keys[:-1])
    start_or_end = jnp.where(starts_run, position, n)
    following = jnp.concatenate([start_or_end[1:], jnp.full(start_or_end[:1].shape, n, jnp.int32)])
    run_end = jnp.where(starts_run, jax.lax.cummin(following, reverse=True), position)
    call = jax.ffi.ffi_call("ls_embed_grad", jax.ShapeDtypeStruct((n, shape[1]), _f32), vmap_method="sequential")
    sums = call(dy, sorted_tokens, order, run_end, random.seed_operand(seed), **_kernel_attributes(static, token_scale))
    indices = jnp.where(starts_run, keys, shape[0] + position)
    return jnp.zeros(shape, dtype).at[indices].add(sums.astype(dtype), mode="drop", unique_indices=True)


def _backward_ffi(dy, tokens, positions, seed, *, static: _Static):
    dy = dy.reshape(-1, dy.shape[-1])
    tokens = tokens.reshape(-1)
    token_rows = jnp.clip(tokens, 0, static.table_shape[0] - 1)
    dtable = _table_grad_ffi(dy, tokens, token_rows, static.table_shape, static.table_dtype, static.scale, seed, static)
    dpos = None
    if static.pos_shape is not None:
        pos_rows = jnp.clip(positions.reshape(-1), 0, static.pos_shape[0] - 1)
        dpos = _table_grad_ffi(dy, tokens, pos_rows, static.pos_shape, static.pos_dtype, 1.0, seed, static)
    return dtable, dpos


def _unsupported(tokens: jax.Array, static: _Static) -> str | None:
    rows = max(static.table_shape[0], 0 if static.pos_shape is None else static.pos_shape[0])
    if tokens.size + rows >= 2**31:
        return f"{tokens.size} tokens and {rows} table rows exceed the kernels' int32 indices"
    return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _embed(tokens, positions, table, pos_table, seed, static):
    return _embed_fwd(tokens, positions, table, pos_table, seed, static)[0]


def _embed_fwd(tokens, positions, table, pos_table, seed, static):
    forward_xla = functools.partial(_forward_xla, static=static)
    forward_ffi = functools.partial(_forward_ffi, static=static)
    y = _common.dispatch(
        "embed", forward_xla, forward_ffi, (tokens, positions, table, pos_table, seed), _unsupported(tokens, static)
    )
    return y, (tokens, positions, seed)


def _embed_bwd(static, res, dy):
    tokens, positions, seed = res
    backward_xla = functools.partial(_backward_xla, static=static)
    backward_ffi = functools.partial(_backward_ffi, static=static)
    dtable, dpos = _common.dispatch(
        "embed", backward_xla, backward_ffi, (dy, tokens, positions, seed), _unsupported(tokens, static)
    )
    return None, None, dtable, dpos, None


_embed.defvjp(_embed_fwd, _embed_bwd)


def embed(
    tokens: jax.Array,
    table: jax.Array,
    pos_table: jax.Array | None = None,
    *,
    scale: float = 1.0,
    padding_id: int | None = None,
    positions: jax.Array | None = None,
    dropout_rate: float = 0.0,
    seed: jax.Array | None = None,
    dtype: jnp.dtype | None = None,
) -> jax.Array:
    """Embeds ``tokens``: ``dropout(scale * table[tokens] + pos_table[positions])``, zero at padding.

    Args:
      tokens: (B, L) integer token ids.
      table: (V, H) token embeddings, f32 or ``dtype``.
      pos_table: optional (P, H) position embeddings (learned or sinusoidal), f32 or ``dtype``.
      scale: multiplies the token embedding (``sqrt(H)`` in the original Transformer).
      padding_id: tokens equal to it embed to zero and send no gradient to the tables.
      positions: (B, L) integer positions; defaults to 0..L-1 in every row.
      dropout_rate, seed: as in ``ls_jax.ops.dropout``.
      dtype: output dtype (f32, bf16, f16); defaults to the table's.

    Returns:
      (B, L, H) embeddings of ``dtype``.
    """
    _common.check_integer("tokens", tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must have shape (batch, length), got {tokens.shape}")
    _common.check_activation("table", table)
    dtype = jnp.dtype(table.dtype if dtype is None else dtype)
    if dtype not in _common.ACTIVATION_DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    if table.ndim != 2:
        raise ValueError(f"table must have shape (vocab, hidden), got {table.shape}")
    _common.check_param("table", table, table.shape, dtype)
    if pos_table is not None:
        _common.check_param("pos_table", pos_table, (pos_table.shape[0], table.shape[1]), dtype)
    if positions is None:
        if pos_table is not None and tokens.shape[1] > pos_table.shape[0]:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds the {pos_table.shape[0]} positions of pos_table"
            )
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    else:
        _common.check_integer("positions", positions)
        if positions.shape != tokens.shape:
            raise ValueError(f"positions has shape {positions.shape} but tokens has {tokens.shape}")
    _common.check_dropout(dropout_rate, seed)
    if dropout_rate == 0.0:
        seed = None
    static = _Static(
        scale=float(scale),
        padding_id=None if padding_id is None else int(padding_id),
        rate=float(dropout_rate),
        dtype=dtype,
        table_shape=tuple(table.shape),
        table_dtype=jnp.dtype(table.dtype),
        pos_shape=None if pos_table is None else tuple(pos_table.shape),
        pos_dtype=None if pos_table is None else jnp.dtype(pos_table.dtype),
    )
    tokens, positions, table, pos_table, seed = _common.vary_together(
        tokens.astype(jnp.int32), positions.astype(jnp.int32), table, pos_table, seed
    )
    return _embed(tokens, positions, table, pos_table, seed, static)
