"""Greedy and beam-search decoding for ``ls_jax.models.Transformer`` with the KV cache, and for any encoder-decoder
Flax module with the same decoding interface (`Seq2Seq`).

Both return (B, max_len) int32 target tokens without the leading BOS: each row ends with EOS followed by
PAD, or fills all ``max_len`` positions when no EOS was produced; PAD and BOS are never generated. Each step
feeds only the newest token; earlier positions' keys and values come from the cache. Both are jitted with
``model`` and the sizes static.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Protocol

import jax
import jax.numpy as jnp

from ls_jax.layers.transformer import SOURCE_CACHE_NAMES
from ls_jax.models.tokens import BOS_ID, EOS_ID, PAD_ID, check_tokens

Variables = Mapping[str, Any]  # Flax variables: "params" and, for an FP8 model, its scaling state
Cache = Any


class Seq2Seq(Protocol):
    """What decoding calls, as ``ls_jax.models.Transformer`` defines them (through ``apply(..., method=NAME)``):

      encode(src (B, S)) -> (encoded, src_mask)
      init_cache(encoded, src_mask, max_len)        creates the "cache" collection (run with mutable=["cache"])
      decode(tokens (B, 1)) -> logits (B, 1, V)     one position, extending the cache

    and ``max_target_len``, the most target positions it can decode. Cache entries named in
    ``SOURCE_CACHE_NAMES`` and scalars are the same for every hypothesis of a row; the others have one row per
    hypothesis."""

    @property
    def max_target_len(self) -> int: ...


def _check_arguments(model: Seq2Seq, variables: Variables, max_len: int) -> None:
    """Raises ValueError for variables that are not a Flax variables dict (bare params) or a ``max_len`` out of
    range."""
    if not isinstance(variables, Mapping) or "params" not in variables:
        keys = ", ".join(map(str, list(variables)[:3])) if isinstance(variables, Mapping) else type(variables).__name__
        raise ValueError(
            f"variables must be Flax variables with a 'params' collection ({{'params': params}}), got {keys}"
        )
    limit = model.max_target_len
    if not 1 <= max_len <= limit:
        raise ValueError(f"max_len must be in [1, max_seq_len={limit}], got {max_len}")


def _start_decoding(model: Seq2Seq, variables: Variables, src_tokens: jax.Array, max_len: int, copies: int) -> Cache:
    """Encodes the source, repeats each row ``copies`` times (one per beam) and builds the decode cache."""
    encoded, src_mask = model.apply(variables, src_tokens, method="encode")
    encoded = jnp.repeat(encoded, copies, axis=0)
    src_mask = jnp.repeat(src_mask, copies, axis=0)
    _, state = model.apply(variables, encoded, src_mask, max_len, method="init_cache", mutable=["cache"])
    return state["cache"]


def _next_logits(model: Seq2Seq, variables: Variables, cache: Cache, tokens: jax.Array) -> tuple[jax.Array, Cache]:
    """Feeds tokens (N,) as the next position: -> (logits (N, V) f32, extended cache).

    PAD and BOS get -inf: a decoder never emits them (PAD only fills the output after EOS).
    """
    logits, state = model.apply({**variables, "cache": cache}, tokens[:, None], method="decode", mutable=["cache"])
    logits = logits[:, 0].astype(jnp.float32).at[:, jnp.array([PAD_ID, BOS_ID])].set(-jnp.inf)
    return logits, state["cache"]


@functools.partial(jax.jit, static_argnames=("model", "max_len"))
def greedy_decode(model: Seq2Seq, variables: Variables, src_tokens: jax.Array, *, max_len: int) -> jax.Array:
    """The most probable next token at every step, until every row has produced EOS or ``max_len`` tokens.

    Args:
      model: the Transformer, or another `Seq2Seq` (it fixes the compute dtype and max_target_len).
      variables: its Flax variables without the cache: ``{"params": params}`` (and an FP8 model's scaling
        collection, `ls_jax.layers.fp8`).
      src_tokens: (B, S) integer source tokens, PAD-padded.
      max_len: most target tokens to generate, at most ``model.max_target_len``.

    Returns:
      (B, max_len) int32.
    """
    check_tokens("src_tokens", src_tokens)
    _check_arguments(model, variables, max_len)
    batch = src_tokens.shape[0]
    cache = _start_decoding(model, variables, src_tokens, max_len, copies=1)

    def unfinished(state) -> jax.Array:
        step, _, _, _, finished = state
        return (step < max_len) & ~jnp.all(finished)

    def step_once(state):
        step, output, cache, last, finished = state
        logits, cache = _next_logits(model, variables, cache, last)
        token = jnp.where(finished, PAD_ID, jnp.argmax(logits, axis=-1).astype(jnp.int32))
        output = output.at[:, step].set(token)
        return step + 1, output, cache, token, finished | (token == EOS_ID)

    state = (
        jnp.zeros((), jnp.int32),
        jnp.full((batch, max_len), PAD_ID, jnp.int32),
        cache,
        jnp.full((batch,), BOS_ID, jnp.int32),
        jnp.zeros((batch,), bool),
    )
    return jax.lax.while_loop(unfinished, step_once, state)[1]


def length_penalty_factor(length: jax.Array, alpha: float) -> jax.Array:
    """GNMT length normalization ((5 + length) / 6) ** alpha; a hypothesis scores log P / factor."""
    return ((5.0 + length) / 6.0) ** alpha


def _gather_beams(tree: Any, beam_index: jax.Array) -> Any:
    """Selects beams along axis 1 of every (B, K', ...) leaf with indices (B, K): -> (B, K, ...)."""
    return jax.tree.map(lambda x: jax.vmap(lambda row, index: row[index])(x, beam_index), tree)


def _gather_cache(cache: Cache, beam_index: jax.Array) -> Cache:
    """Reorders the flat (B * K, ...) cache leaves by beam indices (B, K). Scalar counters and the entries
    computed from the source alone are the same for every hypothesis of a row and stay in place."""
    batch, beams = beam_index.shape
    flat_index = (beam_index + beams * jnp.arange(batch)[:, None]).reshape(-1)

    def gather(path, x):
        shared = x.ndim == 0 or getattr(path[-1], "key", None) in SOURCE_CACHE_NAMES
        return x if shared else x[flat_index]

    return jax.tree_util.tree_map_with_path(gather, cache)


@functools.partial(jax.jit, static_argnames=("model", "beam_size", "max_len", "length_penalty"))
def beam_search(
    model: Seq2Seq,
    variables: Variables,
    src_tokens: jax.Array,
    *,
    beam_size: int,
    max_len: int,
    length_penalty: float = 0.6,
) -> jax.Array:
    """The best hypothesis of a beam search, scored by log P / ((5 + length) / 6) ** length_penalty.

    Each step extends the K live hypotheses by every token and ranks the 2K most probable continuations. Those
    ending in EOS within the top K are finished (length counts the EOS); the K best others stay alive. A row is
    done once it has K finished hypotheses (fairseq's rule); decoding stops when every row is done or at
    ``max_len``. A row returns its best-scoring finished hypothesis, or its most probable live one if none
    finished. With beam_size=1 this is greedy decoding.

    Args:
      model, variables, src_tokens, max_len: as in ``greedy_decode``.
      beam_size: K >= 1 hypotheses kept per row.
      length_penalty: alpha >= 0; 0 ranks finished hypotheses by log P alone.

    Returns:
      (B, max_len) int32.
    """
    check_tokens("src_tokens", src_tokens)
    _check_arguments(model, variables, max_len)
    if beam_size < 1:
        raise ValueError(f"beam_size must be at least 1, got {beam_size}")
    if length_penalty < 0:
        raise ValueError(f"length_penalty must be >= 0, got {length_penalty}")
    batch, beams = src_tokens.shape[0], beam_size
    cache = _start_decoding(model, variables, src_tokens, max_len, copies=beams)

    def rows_done(finished_scores: jax.Array) -> jax.Array:
        return jnp.isfinite(finished_scores[:, -1])

    def unfinished(state) -> jax.Array:
        step, _, _, _, _, finished_scores, _ = state
        return (step < max_len) & ~jnp.all(rows_done(finished_scores))

    def step_once(state):
        step, alive_seqs, alive_logp, last, finished_seqs, finished_scores, cache = state
        logits, cache = _next_logits(model, variables, cache, last.reshape(-1))
        vocab = logits.shape[-1]
        logp = jax.nn.log_softmax(logits).reshape(batch, beams, vocab) + alive_logp[:, :, None]
        top_logp, top_index = jax.lax.top_k(logp.reshape(batch, beams * vocab), 2 * beams)
        top_beam, top_token = top_index // vocab, (top_index % vocab).astype(jnp.int32)
        top_seqs = _gather_beams(alive_seqs, top_beam).at[:, :, step].set(top_token)
        ends = top_token == EOS_ID

        alive_logp, keep = jax.lax.top_k(jnp.where(ends, -jnp.inf, top_logp), beams)
        alive_seqs, last, parent = _gather_beams((top_seqs, top_token, top_beam), keep)
        cache = _gather_cache(cache, parent)

        finishes = ends & (jnp.arange(2 * beams) < beams) & ~rows_done(finished_scores)[:, None]
        new_scores = jnp.where(finishes, top_logp / length_penalty_factor(step + 1.0, length_penalty), -jnp.inf)
        finished_scores, pick = jax.lax.top_k(jnp.concatenate([finished_scores, new_scores], axis=1), beams)
        finished_seqs = _gather_beams(jnp.concatenate([finished_seqs, top_seqs], axis=1), pick)
        return step + 1, alive_seqs, alive_logp, last, finished_seqs, finished_scores, cache

    empty_seqs = jnp.full((batch, beams, max_len), PAD_ID, jnp.int32)
    first_beam_only = jnp.where(jnp.arange(beams) == 0, 0.0, -jnp.inf)
    state = (
        jnp.zeros((), jnp.int32),
        empty_seqs,
        jnp.broadcast_to(first_beam_only, (batch, beams)),
        jnp.full((batch, beams), BOS_ID, jnp.int32),
        empty_seqs,
        jnp.full((batch, beams), -jnp.inf),
        cache,
    )
    _, alive_seqs, _, _, finished_seqs, finished_scores, _ = jax.lax.while_loop(unfinished, step_once, state)
    has_finished = jnp.isfinite(finished_scores[:, 0])
    return jnp.where(has_finished[:, None], finished_seqs[:, 0], alive_seqs[:, 0])
