"""GPU: the label-smoothed cross-entropy kernels (ls_cross_entropy_fwd / _bwd) against the XLA implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.kernels import assert_backends_agree, kernel_targets, on_backend
from helpers.ops import normal

from ls_jax import backend, ops

pytestmark = pytest.mark.gpu

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
TARGETS = {"ls_cross_entropy_fwd", "ls_cross_entropy_bwd"}
PAD = 1

# (rows shape, vocabulary): tiny and odd vocabularies (rows start off 16-byte boundaries), Transformer-big's 32768,
# GPT-2's 50257, 256k + 7 streamed through registers, and rows with two leading axes.
CASES = [((5,), 2), ((3, 4), 11), ((6,), 32768), ((2, 3), 50257), ((3,), 262151)]


def _labels(seed, shape, vocab):
    """Labels in [0, vocab) with about a quarter of them PAD."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, vocab, size=shape)
    labels[rng.random(shape) < 0.25] = PAD
    labels.flat[0] = 0  # at least one real token
    return jnp.asarray(labels, jnp.int32)


def _loss_and_grad(epsilon, pad_id, g_loss=0.7, g_nll=-1.3):
    """``(logits, labels) -> ((loss_sum, nll_sum, num_tokens), d(g_loss * loss_sum + g_nll * nll_sum)/dlogits)``.

    Distinct cotangents for the two sums exercise both terms of the backward kernel."""

    def objective(logits, labels):
        loss_sum, nll_sum, num_tokens = ops.label_smoothed_cross_entropy(logits, labels, epsilon=epsilon, pad_id=pad_id)
        return g_loss * loss_sum + g_nll * nll_sum, (loss_sum, nll_sum, num_tokens)

    def run(logits, labels):
        (_, outputs), dlogits = jax.value_and_grad(objective, has_aux=True)(logits, labels)
        return outputs, dlogits

    return run


def _cases(dtype):
    return [
        (normal(i, (*shape, vocab), dtype, scale=3.0), _labels(i, shape, vocab))
        for i, (shape, vocab) in enumerate(CASES)
    ]


@pytest.mark.parametrize("pad_id", [PAD, None])
@pytest.mark.parametrize("epsilon", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_cross_entropy_matches_xla(dtype, epsilon, pad_id):
    single = _loss_and_grad(epsilon, pad_id)
    run = lambda cases: [single(logits, labels) for logits, labels in cases]
    cases = _cases(dtype)
    assert kernel_targets(run, cases) == TARGETS
    got, want = on_backend("ffi", run, cases), on_backend("xla", run, cases)
    for (shape, vocab), got_case, want_case in zip(CASES, got, want):
        (got_sums, got_grad), (want_sums, want_grad) = got_case, want_case
        assert int(got_sums[2]) == int(want_sums[2])
        # Both backends sum in f32 from the same stored logits, so the sums agree to f32 accuracy in every dtype.
        assert_backends_agree(got_sums[:2], want_sums[:2], F32, f"sums {shape}x{vocab}")
        assert_backends_agree(got_grad, want_grad, dtype, f"dlogits {shape}x{vocab}")


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_pad_rows_contribute_nothing(dtype):
    shape, vocab = (4, 5), 1001
    logits, labels = normal(20, (*shape, vocab), dtype), _labels(20, shape, vocab)
    (loss, nll, count), dlogits = on_backend("ffi", _loss_and_grad(0.1, PAD), logits, labels)
    pad = np.asarray(labels) == PAD
    assert pad.any() and not pad.all()
    assert int(count) == int((~pad).sum())
    dlogits = np.asarray(dlogits, np.float32)
    assert np.all(dlogits[pad] == 0.0) and np.all(np.any(dlogits[~pad] != 0.0, axis=-1))
    # The same sums from the real rows alone, with no pad id.
    kept = (logits[jnp.asarray(~pad)], labels[jnp.asarray(~pad)])
    (loss_kept, nll_kept, _), _ = on_backend("ffi", _loss_and_grad(0.1, None), *kept)
    np.testing.assert_allclose([float(loss), float(nll)], [float(loss_kept), float(nll_kept)], rtol=1e-5)


def test_nll_is_the_textbook_cross_entropy():
    logits, labels = normal(30, (7, 300), F32, scale=4.0), _labels(30, (7,), 300)
    (_, nll, _), _ = on_backend("ffi", _loss_and_grad(0.0, None), logits, labels)
    expected = -np.sum(np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), np.asarray(labels)[:, None], -1))
    np.testing.assert_allclose(float(nll), expected, rtol=1e-5)


def test_vmap_matches_xla():
    logits, labels = normal(40, (3, 4, 777), BF16), _labels(40, (3, 4), 777)
    single = _loss_and_grad(0.1, PAD)
    run = jax.vmap(single)
    assert kernel_targets(run, logits, labels) == TARGETS
    got, want = on_backend("ffi", run, logits, labels), on_backend("xla", run, logits, labels)
    np.testing.assert_array_equal(np.asarray(got[0][2]), np.asarray(want[0][2]))
    assert_backends_agree(got[0][:2], want[0][:2], BF16, "vmap sums")
    assert_backends_agree(got[1], want[1], BF16, "vmap dlogits")


def _projected_loss(hidden, weight, labels):
    """The criterion over logits made in the step, as a model's output projection makes them."""
    logits = hidden @ weight
    loss_sum, _, _ = ops.label_smoothed_cross_entropy(logits, labels, epsilon=0.1, pad_id=PAD)
    return loss_sum, logits


def test_backward_overwrites_the_logits_in_place():
    """dlogits take the logits' buffer, uncopied: the compiled step's temporaries hold one (rows, V) buffer, not
    two (besides them only GEMM workspace and per-row values)."""
    rows, width, vocab = 4096, 64, 32768
    hidden, weight = normal(50, (rows, width), BF16), normal(51, (width, vocab), BF16, scale=0.1)
    labels = _labels(50, (rows,), vocab)
    step = jax.grad(lambda h, w: _projected_loss(h, w, labels)[0], argnums=(0, 1))
    with backend.use("ffi"):
        compiled = jax.jit(step).lower(hidden, weight).compile()
    [backward] = [line for line in compiled.as_text().splitlines() if '"ls_cross_entropy_bwd"' in line]
    assert "output_to_operand_aliasing={{}: (2, {})}" in backward, backward
    assert f"bf16[{rows},{vocab}]{{1,0}} copy(" not in compiled.as_text()
    logits_bytes, temp_bytes = rows * vocab * 2, compiled.memory_analysis().temp_size_in_bytes
    assert temp_bytes < 1.5 * logits_bytes, f"{temp_bytes} bytes of temporaries for {logits_bytes} of logits"
    assert_backends_agree(on_backend("ffi", step, hidden, weight), on_backend("xla", step, hidden, weight), BF16)


def test_logits_read_after_the_backward_are_intact():
    """Where the logits outlive the backward (here a step output), XLA copies them before the kernel overwrites."""
    hidden, weight = normal(60, (96, 32), BF16), normal(61, (32, 1001), BF16)
    labels = _labels(60, (96,), 1001)
    step = jax.value_and_grad(lambda h, w: _projected_loss(h, w, labels), argnums=(0, 1), has_aux=True)
    (_, got_logits), got_grads = on_backend("ffi", step, hidden, weight)
    (_, want_logits), want_grads = on_backend("xla", step, hidden, weight)
    np.testing.assert_array_equal(np.asarray(got_logits, np.float32), np.asarray(want_logits, np.float32))
    assert_backends_agree(got_grads, want_grads, BF16, "grads")
