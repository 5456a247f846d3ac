"""train.bench.steps.hand_count: FLOPs and minimal DRAM bytes counted by hand, on shapes small enough to check."""

import jax
import jax.numpy as jnp
import pytest

from train.bench.steps import hand_count
from train.bench.steps.hand_count import Gemm
from train.costs import metrics


def test_a_gemm_costs_2mnk_and_reads_and_writes_each_matrix_once():
    gemm = Gemm(m=2, n=3, k=4)
    assert gemm.flops == 2 * 2 * 3 * 4
    assert gemm.dram_bytes(element_bytes=2) == 2 * (2 * 4 + 4 * 3 + 2 * 3)
    assert Gemm(2, 3, 4, batch=5).flops == 5 * 48


def test_backward_of_a_gemm_is_two_gemms_of_its_size():
    d_a, d_b = Gemm(m=2, n=3, k=4).backward()
    assert (d_a.m, d_a.n, d_a.k) == (2, 4, 3)  # dC (2x3) B^T (3x4)
    assert (d_b.m, d_b.n, d_b.k) == (4, 3, 2)  # A^T (4x2) dC (2x3)
    assert hand_count.training_flops([Gemm(2, 3, 4)]) == 3 * 48


def test_encoder_block_gemm_flops_by_hand():
    # B 1, S 2, H 4, F 8, 2 heads (d 2). Forward projections: 2*2*(3*16 + 16 + 32 + 32) = 512;
    # scores and context: 2 heads x (2*2*2*2 + 2*2*2*2) = 64; training = 3 x 576.
    count = hand_count.encoder_block(batch=1, seq_len=2, hidden=4, ffn=8, heads=2)
    assert count.gemm_flops == 3 * 576


def test_encoder_block_minimal_bytes_by_hand():
    # B 1, S 2, H 4, F 8, bf16. QKV 2x12 by 4: A 8, B 48, C 24; out 2x4 by 4: 8, 16, 8; FFN1 2x8 by 4: 8, 32, 16;
    # FFN2 2x4 by 8: 16, 32, 8 -> forward 224 elements; each backward GEMM pair moves 2 x its forward's elements.
    # Fused attention: forward q + 2kv + out = 4 x 8, backward 5 x 8 read + 3 x 8 written = 64 elements.
    count = hand_count.encoder_block(batch=1, seq_len=2, hidden=4, ffn=8, heads=2, element_bytes=2)
    projections = 224 * 3
    assert count.dram_bytes == 2 * (projections + 32 + 64)


@pytest.mark.parametrize(
    "batch, src, tgt, hidden, ffn, heads, enc, dec, vocab",
    [
        (3, 8, 6, 16, 32, 4, 2, 2, 50),
        (32, 64, 64, 1024, 4096, 16, 6, 6, 32768),
    ],
)
def test_hand_count_of_a_step_matches_the_run_logs_analytic_count(batch, src, tgt, hidden, ffn, heads, enc, dec, vocab):
    count = hand_count.training_step(batch, src, tgt, hidden, ffn, heads, enc, dec, vocab)
    analytic = metrics.transformer_train_flops(
        batch=batch,
        src_len=src,
        tgt_len=tgt,
        hidden=hidden,
        ffn=ffn,
        encoder_layers=enc,
        decoder_layers=dec,
        vocab=vocab,
    )
    assert count.gemm_flops == analytic
    assert count.elementwise_flops > 0 and count.flops > analytic


def test_encoder_block_matches_the_analytic_count_of_one_encoder_layer():
    count = hand_count.encoder_block(batch=4, seq_len=16, hidden=32, ffn=64, heads=4)
    assert count.gemm_flops == metrics.transformer_train_flops(
        batch=4, src_len=16, tgt_len=0, hidden=32, ffn=64, encoder_layers=1, decoder_layers=0, vocab=0
    )


def test_parameter_count_is_the_reference_models():
    from train.reference.transformer import ReferenceConfig, ReferenceTransformer

    config = ReferenceConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=3
    )
    tokens = jnp.ones((1, 4), jnp.int32)
    shapes = jax.eval_shape(ReferenceTransformer(config).init, jax.random.PRNGKey(0), tokens, tokens)
    actual = sum(leaf.size for leaf in jax.tree.leaves(shapes))
    assert hand_count.parameters(16, 32, 2, 3, 50) == actual


def test_step_bytes_include_adamw_over_every_parameter():
    with_optimizer = hand_count.training_step(2, 8, 8, 16, 32, 4, 1, 1, 50)
    without = hand_count.training_step(2, 8, 8, 16, 32, 4, 1, 1, 50, optimizer_bytes_per_param=0)
    assert with_optimizer.dram_bytes - without.dram_bytes == 28 * hand_count.parameters(16, 32, 1, 1, 50)
