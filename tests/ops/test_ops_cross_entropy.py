"""ls_jax.ops.label_smoothed_cross_entropy against fairseq's label-smoothed NLL written out by hand, and optax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.ops import BF16, F32, assert_close, check_vjp, normal

from ls_jax.ops import label_smoothed_cross_entropy


def fairseq_label_smoothed_nll(logits, labels, epsilon, pad_id):
    """fairseq's label_smoothed_nll_loss, summed: (1 - eps - eps_i) * nll + eps_i * smooth, eps_i = eps / (V-1)."""
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    lprobs = shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
    safe_labels = jnp.where(labels == pad_id, 0, labels)
    nll = -jnp.take_along_axis(lprobs, safe_labels[..., None], axis=-1)[..., 0]
    smooth = -jnp.sum(lprobs, axis=-1)
    is_pad = labels == pad_id
    nll, smooth = jnp.where(is_pad, 0.0, nll), jnp.where(is_pad, 0.0, smooth)
    eps_i = epsilon / (logits.shape[-1] - 1)
    loss = (1.0 - epsilon - eps_i) * nll + eps_i * smooth
    return jnp.sum(loss), jnp.sum(nll)


def _labels(shape, vocab, pad_id, num_pad):
    """Random labels in [0, vocab) other than pad_id, the last ``num_pad`` of the flat order set to pad_id."""
    rng = np.random.default_rng(vocab)
    labels = rng.integers(0, vocab, shape).reshape(-1)
    if pad_id is not None:
        labels[labels == pad_id] = (pad_id + 1) % vocab
        labels[labels.size - num_pad :] = pad_id
    return jnp.asarray(labels.reshape(shape), jnp.int32)


CASES = [  # (logits shape, pad_id, padded rows, epsilon)
    ((2, 5, 11), 1, 3, 0.1),
    ((1, 1, 7), None, 0, 0.0),
    ((3, 4, 1023), 0, 5, 0.3),
    ((6, 2), 0, 2, 0.5),
]


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("shape, pad_id, num_pad, epsilon", CASES)
def test_matches_fairseq(shape, pad_id, num_pad, epsilon, dtype):
    labels = _labels(shape[:-1], shape[-1], pad_id, num_pad)
    _, (dlogits,) = check_vjp(
        lambda z: label_smoothed_cross_entropy(z, labels, epsilon=epsilon, pad_id=pad_id)[:2],
        lambda z: fairseq_label_smoothed_nll(z, labels, epsilon, pad_id),
        (normal(0, shape, dtype, scale=3.0),),
        dtype,
    )
    if num_pad:
        is_pad = np.asarray(labels == pad_id)
        np.testing.assert_array_equal(np.asarray(dlogits, np.float32)[is_pad], 0.0)


def test_num_tokens_counts_non_pad_labels():
    labels = _labels((4, 6), 9, pad_id=2, num_pad=7)
    _, _, num_tokens = label_smoothed_cross_entropy(normal(0, (4, 6, 9)), labels, epsilon=0.1, pad_id=2)
    assert num_tokens.dtype == jnp.int32 and int(num_tokens) == 24 - 7
    _, _, every_row = label_smoothed_cross_entropy(normal(0, (4, 6, 9)), labels)
    assert int(every_row) == 24


@pytest.mark.parametrize("epsilon", [0.0, 0.2])
def test_matches_optax_cross_entropy_against_smoothed_targets(epsilon):
    """The loss is the cross entropy with 1 - eps on the label and eps / (V - 1) on every other class."""
    logits, labels = normal(0, (5, 8, 13), scale=2.0), _labels((5, 8), 13, pad_id=0, num_pad=6)
    loss, nll, _ = label_smoothed_cross_entropy(logits, labels, epsilon=epsilon, pad_id=0)
    onehot = jax.nn.one_hot(labels, 13)
    targets = (1 - epsilon) * onehot + epsilon / 12 * (1 - onehot)
    not_pad = labels != 0
    expected_loss = jnp.sum(jnp.where(not_pad, optax.softmax_cross_entropy(logits, targets), 0.0))
    expected_nll = jnp.sum(jnp.where(not_pad, optax.softmax_cross_entropy_with_integer_labels(logits, labels), 0.0))
    assert_close((loss, nll), (expected_loss, expected_nll), F32)


def test_pad_id_outside_vocabulary():
    """fairseq-style pad ids inside the vocabulary and HF-style -100 both ignore those rows."""
    logits = normal(0, (2, 4, 6))
    labels = _labels((2, 4), 6, pad_id=None, num_pad=0)
    padded = labels.at[1, 2:].set(-100)
    loss, nll, count = label_smoothed_cross_entropy(logits, padded, epsilon=0.1, pad_id=-100)
    expected = fairseq_label_smoothed_nll(logits, padded, 0.1, -100)
    assert_close((loss, nll), expected, F32)
    assert int(count) == 6


def test_all_pad_batch_is_zero_with_zero_gradient():
    logits = normal(0, (3, 5))
    labels = jnp.zeros(3, jnp.int32)
    loss, nll, count = label_smoothed_cross_entropy(logits, labels, epsilon=0.1, pad_id=0)
    dlogits = jax.grad(lambda z: sum(label_smoothed_cross_entropy(z, labels, epsilon=0.1, pad_id=0)[:2]))(logits)
    assert float(loss) == float(nll) == 0.0 and int(count) == 0
    np.testing.assert_array_equal(dlogits, 0.0)


@pytest.mark.parametrize(
    "logits, labels, kwargs, message",
    [
        (jnp.zeros((2, 5), jnp.int32), jnp.zeros(2, jnp.int32), {}, "logits must be float32, bfloat16 or float16"),
        (np.zeros((2, 5), np.float64), jnp.zeros(2, jnp.int32), {}, "got float64"),
        (jnp.zeros((2, 5), F32), jnp.zeros(2, F32), {}, "labels must be an integer array, got float32"),
        (jnp.zeros((2, 3, 5), F32), jnp.zeros((3, 2), jnp.int32), {}, r"labels have shape \(3, 2\) but logits have"),
        (jnp.zeros((2, 5), F32), jnp.zeros((2, 1), jnp.int32), {}, r"expected \(2,\)"),
        (jnp.zeros((2, 1), F32), jnp.zeros(2, jnp.int32), {}, "at least 2 classes, got 1"),
        (jnp.zeros((2, 5), F32), jnp.zeros(2, jnp.int32), dict(epsilon=1.0), r"epsilon must be in \[0, 1\), got 1.0"),
        (jnp.zeros((2, 5), F32), jnp.zeros(2, jnp.int32), dict(epsilon=-0.1), r"epsilon must be in \[0, 1\)"),
    ],
)
def test_bad_inputs_raise_value_error(logits, labels, kwargs, message):
    with pytest.raises(ValueError, match=message):
        label_smoothed_cross_entropy(logits, labels, **kwargs)
