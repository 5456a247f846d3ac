"""FLOPs and minimal DRAM bytes of Transformer blocks and of a whole training step, counted by hand GEMM by GEMM.

Conventions (as docs/flops.md): a multiply-add is 2 FLOPs, so a GEMM of an (m x k) by a (k x n) matrix costs
2mnk; the backward pass of C = A B computes dA = dC B^T and dB = A^T dC, two GEMMs of the forward's size, so a
training step's GEMMs cost 3 x forward. Attention's scores and context are batched GEMMs over batch x heads.

Elementwise FLOPs are an estimate per element, forward (backward taken as twice the forward):
softmax 5 per score (max, subtract, exp, sum, divide), LayerNorm 8 per element (mean, variance, normalise, scale,
shift), dropout 1 per element (attention probabilities, the activation and both sublayer outputs), the activation 1
per element of the feed-forward's inner layer, residual adds 1 per element (two per block).

Minimal DRAM bytes assume perfect fusion: every projection GEMM reads its two operands and writes its result once
(``element_bytes`` each, 2 for bf16), all elementwise work rides along, and attention is one fused kernel (reads
Q, K, V and writes the context forward; reads Q, K, V, the context and its gradient and writes dQ, dK, dV backward),
so the (S x S) scores never reach DRAM. A whole step adds AdamW: per parameter it reads the parameter, gradient,
first and second moment and writes the parameter and both moments (``optimizer_bytes_per_param``, 28 in f32).
"""

from __future__ import annotations

import dataclasses

SOFTMAX_FLOPS_PER_SCORE = 5
LAYER_NORM_FLOPS_PER_ELEMENT = 8
ADAMW_FLOPS_PER_PARAM = 12  # two moment updates (7), the bias-corrected step with sqrt and epsilon (3), decay (2)
BACKWARD_OVER_FORWARD = 2


@dataclasses.dataclass(frozen=True)
class Gemm:
    """``batch`` products of an (m x k) by a (k x n) matrix."""

    m: int
    n: int
    k: int
    batch: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k

    def dram_bytes(self, element_bytes: int) -> int:
        """Both operands read and the result written once: element_bytes x batch x (mk + kn + mn)."""
        return element_bytes * self.batch * (self.m * self.k + self.k * self.n + self.m * self.n)

    def backward(self) -> tuple[Gemm, Gemm]:
        """dA = dC B^T, (m x n) by (n x k); dB = A^T dC, (k x m) by (m x n)."""
        return Gemm(self.m, self.k, self.n, self.batch), Gemm(self.k, self.n, self.m, self.batch)


@dataclasses.dataclass(frozen=True)
class Count:
    """Hand count of some work: GEMM FLOPs, estimated elementwise FLOPs and the minimal DRAM bytes."""

    gemm_flops: int
    elementwise_flops: int
    dram_bytes: int

    @property
    def flops(self) -> int:
        return self.gemm_flops + self.elementwise_flops

    def __add__(self, other: Count) -> Count:
        return Count(
            self.gemm_flops + other.gemm_flops,
            self.elementwise_flops + other.elementwise_flops,
            self.dram_bytes + other.dram_bytes,
        )

    def times(self, factor: int) -> Count:
        return Count(self.gemm_flops * factor, self.elementwise_flops * factor, self.dram_bytes * factor)


def attention_gemms(batch: int, queries: int, keys: int, hidden: int, heads: int) -> list[Gemm]:
    """Scores Q K^T, (queries x d) by (d x keys), and context P V, (queries x keys) by (keys x d), d = hidden/heads."""
    d = hidden // heads
    return [Gemm(queries, keys, d, batch * heads), Gemm(queries, d, keys, batch * heads)]


def encoder_block_projections(tokens: int, hidden: int, ffn: int) -> list[Gemm]:
    """Fused QKV (H x 3H), attention output (H x H), feed-forward (H x F) and (F x H) over ``tokens`` rows."""
    return [
        Gemm(tokens, 3 * hidden, hidden),
        Gemm(tokens, hidden, hidden),
        Gemm(tokens, ffn, hidden),
        Gemm(tokens, hidden, ffn),
    ]


def decoder_block_projections(target_tokens: int, source_tokens: int, hidden: int, ffn: int) -> list[Gemm]:
    """The encoder block's projections over the target, plus cross-attention's Q and output (over the target)
    and its K, V (2H wide, over the source)."""
    return [
        *encoder_block_projections(target_tokens, hidden, ffn),
        Gemm(target_tokens, hidden, hidden),
        Gemm(target_tokens, hidden, hidden),
        Gemm(source_tokens, 2 * hidden, hidden),
    ]


def training_flops(forward: list[Gemm]) -> int:
    """FLOPs of the forward GEMMs and of both backward GEMMs of each."""
    return sum(g.flops + sum(b.flops for b in g.backward()) for g in forward)


def _projection_bytes(forward: list[Gemm], element_bytes: int) -> int:
    return sum(g.dram_bytes(element_bytes) + sum(b.dram_bytes(element_bytes) for b in g.backward()) for g in forward)


def _fused_attention_bytes(batch: int, queries: int, keys: int, hidden: int, element_bytes: int) -> int:
    """Forward reads Q (queries) and K, V (keys), writes the context; backward reads Q, K, V, context and its
    gradient, writes dQ, dK, dV."""
    q, kv = batch * queries * hidden, batch * keys * hidden
    forward = q + 2 * kv + q
    backward = (q + 2 * kv + 2 * q) + (q + 2 * kv)
    return element_bytes * (forward + backward)


def _elementwise(tokens: int, hidden: int, ffn: int, scores: int, layer_norms: int, attentions: int) -> int:
    """Estimated forward + backward elementwise FLOPs of one block over ``tokens`` positions with ``scores``
    attention scores in all (see the module docstring)."""
    forward = (
        SOFTMAX_FLOPS_PER_SCORE * scores
        + LAYER_NORM_FLOPS_PER_ELEMENT * layer_norms * tokens * hidden
        + scores
        + tokens * ffn
        + (1 + attentions) * tokens * hidden  # dropout
        + tokens * ffn
        + (1 + attentions) * tokens * hidden
    )  # activation and residual adds
    return forward * (1 + BACKWARD_OVER_FORWARD)


def encoder_block(batch: int, seq_len: int, hidden: int, ffn: int, heads: int, element_bytes: int = 2) -> Count:
    """Forward + backward of one encoder block on (batch, seq_len, hidden) activations."""
    tokens = batch * seq_len
    projections = encoder_block_projections(tokens, hidden, ffn)
    attention = attention_gemms(batch, seq_len, seq_len, hidden, heads)
    return Count(
        gemm_flops=training_flops(projections + attention),
        elementwise_flops=_elementwise(tokens, hidden, ffn, batch * heads * seq_len**2, layer_norms=2, attentions=1),
        dram_bytes=_projection_bytes(projections, element_bytes)
        + _fused_attention_bytes(batch, seq_len, seq_len, hidden, element_bytes),
    )


def decoder_block(
    batch: int, tgt_len: int, src_len: int, hidden: int, ffn: int, heads: int, element_bytes: int = 2
) -> Count:
    """Forward + backward of one decoder block (self-attention, cross-attention over src_len, feed-forward)."""
    projections = decoder_block_projections(batch * tgt_len, batch * src_len, hidden, ffn)
    attention = attention_gemms(batch, tgt_len, tgt_len, hidden, heads) + attention_gemms(
        batch, tgt_len, src_len, hidden, heads
    )
    return Count(
        gemm_flops=training_flops(projections + attention),
        elementwise_flops=_elementwise(
            batch * tgt_len, hidden, ffn, batch * heads * tgt_len * (tgt_len + src_len), layer_norms=3, attentions=2
        ),
        dram_bytes=_projection_bytes(projections, element_bytes)
        + _fused_attention_bytes(batch, tgt_len, tgt_len, hidden, element_bytes)
        + _fused_attention_bytes(batch, tgt_len, src_len, hidden, element_bytes),
    )


def parameters(hidden: int, ffn: int, encoder_layers: int, decoder_layers: int, vocab: int) -> int:
    """Parameters of the encoder-decoder: one shared (vocab x hidden) embedding, per block its weights, biases and
    LayerNorms (encoder 4H^2 + 2HF + 9H + F, decoder adds cross-attention's 4H^2 + 4H and a LayerNorm), and the
    two final LayerNorms."""
    encoder = 4 * hidden**2 + 2 * hidden * ffn + 9 * hidden + ffn
    decoder = encoder + 4 * hidden**2 + 4 * hidden + 2 * hidden
    return vocab * hidden + encoder_layers * encoder + decoder_layers * decoder + 4 * hidden


def training_step(
    batch: int,
    src_len: int,
    tgt_len: int,
    hidden: int,
    ffn: int,
    heads: int,
    encoder_layers: int,
    decoder_layers: int,
    vocab: int,
    element_bytes: int = 2,
    optimizer_bytes_per_param: int = 28,
) -> Count:
    """A whole encoder-decoder training step: the blocks, the tied output projection (B T x H by H x V) with its
    softmax cross entropy, and AdamW over every parameter."""
    logits = Gemm(batch * tgt_len, vocab, hidden)
    logit_elements = batch * tgt_len * vocab
    output = Count(
        gemm_flops=training_flops([logits]),
        elementwise_flops=SOFTMAX_FLOPS_PER_SCORE * logit_elements * (1 + BACKWARD_OVER_FORWARD),
        dram_bytes=_projection_bytes([logits], element_bytes) + element_bytes * logit_elements,  # the loss reads them
    )
    params = parameters(hidden, ffn, encoder_layers, decoder_layers, vocab)
    optimizer = Count(
        gemm_flops=0, elementwise_flops=ADAMW_FLOPS_PER_PARAM * params, dram_bytes=optimizer_bytes_per_param * params
    )
    return (
        encoder_block(batch, src_len, hidden, ffn, heads, element_bytes).times(encoder_layers)
        + decoder_block(batch, tgt_len, src_len, hidden, ffn, heads, element_bytes).times(decoder_layers)
        + output
        + optimizer
    )
