"""Label-smoothed cross entropy over the vocabulary, padding ignored (fairseq's definition).

For a row with logits z (V,), label y and log-probabilities lp = z - logsumexp(z):

    nll  = -lp[y]
    loss = (1 - eps) * nll - eps / (V - 1) * sum_{j != y} lp[j]

i.e. the cross entropy against a target putting 1 - eps on y and eps / (V - 1) on every other class. Rows
whose label is ``pad_id`` contribute nothing. The op returns the sums over rows and the count of non-pad rows,
so a trainer can normalize by tokens across devices and accumulation steps. With cotangents (gl, gn) of the
two sums, the backward for a non-pad row is

    dz = (gl + gn) * softmax(z) - gl * target - gn * onehot(y)

Residuals: the logits (kept in their dtype, never copied to f32), the labels, and logsumexp per row (f32).
The kernel backward writes dlogits over the logits, whose last reader it is in a training step: the step then
holds one (tokens, V) buffer instead of two.

Implementations share:
  forward(logits, labels) -> (loss_rows, nll_rows, lse_rows)   f32 of labels' shape, zero at pad rows
  backward(g_loss, g_nll, logits, labels, lse_rows) -> dlogits (logits' dtype; g_* are f32 scalars)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.ops import _common

_f32 = jnp.float32


def _row_valid(labels, pad_id):
    return jnp.ones(labels.shape, bool) if pad_id is None else labels != pad_id


def _forward_xla(logits, labels, *, epsilon, pad_id):
    z = logits.astype(_f32)
    vocab = z.shape[-1]
    lse = jax.nn.logsumexp(z, axis=-1)
    label_logit = jnp.take_along_axis(z, jnp.clip(labels, 0, vocab - 1)[..., None], axis=-1)[..., 0]
    nll = lse - label_logit
    sum_neg_logprob = vocab * lse - jnp.sum(z, axis=-1)
    off_label = epsilon / (vocab - 1)
    loss = (1.0 - epsilon - off_label) * nll + off_label * sum_neg_logprob
    valid = _row_valid(labels, pad_id)
    return jnp.where(valid, loss, 0.0), jnp.where(valid, nll, 0.0), lse


def _backward_xla(g_loss, g_nll, logits, labels, lse, *, epsilon, pad_id):
    z = logits.astype(_f32)
    vocab = z.shape[-1]
    probs = jnp.exp(z - lse[..., None])
    onehot = jax.nn.one_hot(labels, vocab, dtype=_f32)
    off_label = epsilon / (vocab - 1)
    target = (1.0 - epsilon - off_label) * onehot + off_label
    dz = (g_loss + g_nll) * probs - g_loss * target - g_nll * onehot
    valid = _row_valid(labels, pad_id)[..., None]
    return jnp.where(valid, dz, 0.0).astype(logits.dtype)


def _unsupported(logits: jax.Array) -> str | None:
    if _common.rows(logits) >= 2**31:
        return f"logits of shape {logits.shape} exceed the kernels' 2**31 - 1 rows"
    return None


def _smoothing_attributes(vocab: int, epsilon: float, pad_id: int | None) -> dict[str, np.generic | bool]:
    """FFI attributes: the target weights on and off the label, rounded to f32 from the same double-precision
    values the XLA implementation rounds, and the pad label (``ignore_pad`` False when every row counts)."""
    off_label = epsilon / (vocab - 1)
    return {
        "on_label": np.float32(1.0 - epsilon - off_label),
        "off_label": np.float32(off_label),
        "pad_id": np.int64(0 if pad_id is None else pad_id),
        "ignore_pad": pad_id is not None,
    }


def _forward_ffi(logits, labels, *, epsilon, pad_id):
    """The ls_cross_entropy_fwd kernel: one read of each non-pad row. Pad rows are skipped, so their lse is 0
    (the XLA implementation computes it; neither backward reads it)."""
    per_row = jax.ShapeDtypeStruct(labels.shape, _f32)
    call = jax.ffi.ffi_call("ls_cross_entropy_fwd", (per_row, per_row, per_row), vmap_method="sequential")
    return tuple(call(logits, labels, **_smoothing_attributes(logits.shape[-1], epsilon, pad_id)))


def _backward_ffi(g_loss, g_nll, logits, labels, lse, *, epsilon, pad_id):
    """The ls_cross_entropy_bwd kernel: reads each row and lse once, writes dlogits once (zeros at pad rows),
    in place over the logits (XLA copies them first where they are still read afterwards)."""
    out = jax.ShapeDtypeStruct(logits.shape, logits.dtype)
    call = jax.ffi.ffi_call("ls_cross_entropy_bwd", out, input_output_aliases={2: 0}, vmap_method="sequential")
    return call(g_loss, g_nll, logits, labels, lse, **_smoothing_attributes(logits.shape[-1], epsilon, pad_id))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _cross_entropy_sums(logits, labels, epsilon, pad_id):
    return _cross_entropy_sums_fwd(logits, labels, epsilon, pad_id)[0]


def _cross_entropy_sums_fwd(logits, labels, epsilon, pad_id):
    forward_xla = functools.partial(_forward_xla, epsilon=epsilon, pad_id=pad_id)
    forward_ffi = functools.partial(_forward_ffi, epsilon=epsilon, pad_id=pad_id)
    loss_rows, nll_rows, lse = _common.dispatch(
        "label_smoothed_cross_entropy", forward_xla, forward_ffi, (logits, labels), _unsupported(logits)
    )
    return (jnp.sum(loss_rows), jnp.sum(nll_rows)), (logits, labels, lse)


def _cross_entropy_sums_bwd(epsilon, pad_id, res, cotangents):
    logits, labels, lse = res
    g_loss, g_nll = (g.astype(_f32) for g in cotangents)
    backward_xla = functools.partial(_backward_xla, epsilon=epsilon, pad_id=pad_id)
    backward_ffi = functools.partial(_backward_ffi, epsilon=epsilon, pad_id=pad_id)
    dlogits = _common.dispatch(
        "label_smoothed_cross_entropy",
        backward_xla,
        backward_ffi,
        (g_loss, g_nll, logits, labels, lse),
        _unsupported(logits),
    )
    return dlogits, None


_cross_entropy_sums.defvjp(_cross_entropy_sums_fwd, _cross_entropy_sums_bwd)


def label_smoothed_cross_entropy(
    logits: jax.Array,
    labels: jax.Array,
    *,
    epsilon: float = 0.0,
    pad_id: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Summed label-smoothed cross entropy, summed NLL and the number of non-pad tokens.

    Args:
      logits: (..., V) in f32, bf16 or f16; V >= 2.
      labels: (...) integer class ids in [0, V) (or ``pad_id``).
      epsilon: label smoothing in [0, 1).
      pad_id: label value to ignore; None counts every row.

    Returns:
      ``(loss_sum, nll_sum, num_tokens)``: f32 scalars and an int32 scalar.
    """
    _common.check_activation("logits", logits)
    _common.check_integer("labels", labels)
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels have shape {labels.shape} but logits have {logits.shape}; expected {logits.shape[:-1]}"
        )
    if logits.shape[-1] < 2:
        raise ValueError(f"label smoothing needs a vocabulary of at least 2 classes, got {logits.shape[-1]}")
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"epsilon must be in [0, 1), got {epsilon}")
    logits, labels = _common.vary_together(logits, labels.astype(jnp.int32))
    pad = None if pad_id is None else int(pad_id)
    loss_sum, nll_sum = _cross_entropy_sums(logits, labels, float(epsilon), pad)
    num_tokens = jnp.sum(_row_valid(labels, pad), dtype=jnp.int32)
    return loss_sum, nll_sum, num_tokens
