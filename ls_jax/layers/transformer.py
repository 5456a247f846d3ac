"""Transformer encoder and decoder layers and stacks (LightSeq's layer structure)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from ls_jax.layers import fp8
from ls_jax.layers.attention import MultiHeadAttention
from ls_jax.layers.common import DeferredResidual, LayerNorm, dense
from ls_jax.layers.config import LayerConfig
from ls_jax.layers.feed_forward import FeedForward
from ls_jax.optim.gradient_sync import layer_order_requested

SOURCE_CACHE_NAMES = ("cross_key_value", "src_mask")
"""Decoder cache entries computed from the source alone: every beam-search hypothesis of a row shares them."""


class TransformerEncoderLayer(nn.Module):
    """Self-attention then feed-forward, (B, S, H) -> (B, S, H).

    ``causal`` makes it a decoder-only (GPT) block: self-attention over earlier positions, no cross-attention.
    Pre-LN, each sublayer's residual sum is formed by the next LayerNorm (``DeferredResidual``); x may be one,
    and ``defer_residual=True`` returns the output as one, as the stacks chain their layers.
    """

    config: LayerConfig
    causal: bool = False
    LENGTHS_ARGUMENT = "key_lengths"  # the keyword of the key lengths (stacks pass them by name)

    @nn.compact
    def __call__(
        self,
        x: jax.Array | DeferredResidual,
        key_mask: jax.Array | None = None,
        *,
        key_lengths: jax.Array | None = None,
        decode: bool = False,
        deterministic: bool = True,
        defer_residual: bool = False,
    ) -> jax.Array | DeferredResidual:
        """x (B, S, H); key_mask (B, S) boolean, False at padding, or key_lengths (B,) integer for right padding
        (at most one; ``MultiHeadAttention``); decode: causal KV-cache step."""
        x = MultiHeadAttention(self.config, causal=self.causal, name="self_attention")(
            x,
            key_mask=key_mask,
            key_lengths=key_lengths,
            decode=decode,
            deterministic=deterministic,
            defer_residual=True,
        )
        return FeedForward(self.config, name="feed_forward")(
            x, deterministic=deterministic, defer_residual=defer_residual
        )


class TransformerDecoderLayer(nn.Module):
    """Causal self-attention, cross-attention over precomputed encoder K/V, feed-forward: (B, T, H) -> (B, T, H).

    Residual sums are deferred to the next LayerNorm as in ``TransformerEncoderLayer``.
    """

    config: LayerConfig
    LENGTHS_ARGUMENT = "src_lengths"  # the keyword of the source key lengths (stacks pass them by name)

    @nn.compact
    def __call__(
        self,
        x: jax.Array | DeferredResidual,
        cross_key_value: jax.Array,
        src_mask: jax.Array | None = None,
        *,
        src_lengths: jax.Array | None = None,
        decode: bool = False,
        deterministic: bool = True,
        defer_residual: bool = False,
    ) -> jax.Array | DeferredResidual:
        """x (B, T, H); cross_key_value (B, S, 2, heads, head_dim); src_mask (B, S) boolean, False at padding, or
        src_lengths (B,) integer for right padding (at most one)."""
        x = MultiHeadAttention(self.config, causal=True, name="self_attention")(
            x, decode=decode, deterministic=deterministic, defer_residual=True
        )
        x = MultiHeadAttention(self.config, self_attention=False, name="cross_attention")(
            x, cross_key_value, src_mask, key_lengths=src_lengths, deterministic=deterministic, defer_residual=True
        )
        return FeedForward(self.config, name="feed_forward")(
            x, deterministic=deterministic, defer_residual=defer_residual
        )


class _PositionalEncoderLayer(TransformerEncoderLayer):
    """The encoder layer with its switches positional, so that ``nn.remat`` can hold them static."""

    def __call__(self, x, key_mask, key_lengths, decode, deterministic, defer_residual):
        return super().__call__(
            x,
            key_mask,
            key_lengths=key_lengths,
            decode=decode,
            deterministic=deterministic,
            defer_residual=defer_residual,
        )


class _PositionalDecoderLayer(TransformerDecoderLayer):
    """The decoder layer with its switches positional, so that ``nn.remat`` can hold them static."""

    def __call__(self, x, cross_key_value, src_mask, src_lengths, decode, deterministic, defer_residual):
        return super().__call__(
            x,
            cross_key_value,
            src_mask,
            src_lengths=src_lengths,
            decode=decode,
            deterministic=deterministic,
            defer_residual=defer_residual,
        )


# What the backward keeps of a checkpointed layer: its inputs only ("layer"), or also every matmul output.
_REMAT_POLICIES = {"layer": None, "gemm-outputs": jax.checkpoint_policies.dots_saveable}


def _layer(
    config: LayerConfig,
    decode: bool,
    plain: type[nn.Module],
    positional: type[nn.Module],
    *attributes,
    name: str,
    arguments: tuple,
    static: tuple,
):
    """Calls a layer as ``config.remat`` says: plain, or checkpointed (``nn.remat``, the switches ``static`` held
    static). ``arguments`` end with the key lengths (or None). Cached decoding never checkpoints. The parameters are
    named and shaped alike either way."""
    if config.remat == "none" or decode:
        decode_, deterministic, defer_residual = static
        module = plain(config, *attributes, name=name)

        def call(layer, *arguments):
            *arguments, lengths = arguments
            return layer(
                *arguments,
                **{plain.LENGTHS_ARGUMENT: lengths},
                decode=decode_,
                deterministic=deterministic,
                defer_residual=defer_residual,
            )

    else:
        first_static = 1 + len(arguments)  # argument 0 is the module
        module = nn.remat(
            positional,
            policy=_REMAT_POLICIES[config.remat],
            static_argnums=tuple(range(first_static, first_static + len(static))),
        )(config, *attributes, name=name)

        def call(layer, *arguments):
            return layer(*arguments, *static)

    if decode or not layer_order_requested():
        return call(module, *arguments)
    return _in_layer_order(call)(module, *arguments)


def _in_layer_order(call):
    """``call(layer, *arguments)`` whose backward hands the gradient of its inputs on only once the layer's parameter
    gradients exist too (one optimization barrier over both), so the backward of the layers below waits for them:
    a data-parallel step's collective of this layer's gradients then runs under that backward
    (`ls_jax.optim.gradient_sync.backward_in_layer_order`). The values are the same as ``call``'s.

    The FP8 scaling state is differentiated with the parameters (its "gradient" is its next value, `fp8.SCALING`):
    left out, the layer's VJP would close over the step's scaling tracers and leak them."""
    differentiated = ["params", fp8.SCALING]

    def forward(layer, *arguments):
        return nn.vjp(call, layer, *arguments, vjp_variables=differentiated)

    def backward(vjp_fn, cotangent):
        return _barrier(vjp_fn(cotangent))

    return nn.custom_vjp(call, forward_fn=forward, backward_fn=backward, grad_vars=differentiated)


def _barrier(tree):
    """``tree`` through one ``optimization_barrier`` over its floating-point leaves (integer inputs' cotangents are
    float0 and stay out)."""
    leaves, treedef = jax.tree.flatten(tree)
    inexact = [i for i, leaf in enumerate(leaves) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    for i, leaf in zip(inexact, jax.lax.optimization_barrier([leaves[i] for i in inexact])):
        leaves[i] = leaf
    return jax.tree.unflatten(treedef, leaves)


def _final_layer_norm(config: LayerConfig, x: jax.Array | DeferredResidual) -> jax.Array:
    """A stack's output: the last layer's, normalized by "final_layer_norm" when pre-LN (a deferred x is formed
    in the same kernel and the sum dropped). Call it inside the stack's compact ``__call__``."""
    if not config.pre_layer_norm:
        return x
    y = LayerNorm(config.layer_norm_eps, name="final_layer_norm")(x)
    return y[0] if isinstance(x, DeferredResidual) else y


class TransformerEncoder(nn.Module):
    """``num_layers`` encoder layers over embedded input, then a final LayerNorm when pre-LN.

    With ``causal`` this is a decoder-only (GPT) stack.
    """

    config: LayerConfig
    num_layers: int
    causal: bool = False

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        key_mask: jax.Array | None = None,
        *,
        key_lengths: jax.Array | None = None,
        decode: bool = False,
        deterministic: bool = True,
    ) -> jax.Array:
        """x (B, S, H) embedded tokens; key_mask (B, S) boolean, False at padding, or key_lengths (B,) integer for
        right padding (at most one). Returns (B, S, H)."""
        for index in range(self.num_layers):
            x = _layer(
                self.config,
                decode,
                TransformerEncoderLayer,
                _PositionalEncoderLayer,
                self.causal,
                name=f"layer_{index}",
                arguments=(x, key_mask, key_lengths),
                static=(decode, deterministic, True),
            )
        return _final_layer_norm(self.config, x)


class TransformerDecoder(nn.Module):
    """``num_layers`` decoder layers over embedded targets, then a final LayerNorm when pre-LN.

    The cross-attention keys and values of every layer come from one GEMM over the encoder output,
    (B, S, H) x (H, layers, 2, heads, head_dim) -> (B, S, layers, 2, heads, head_dim), and layer i attends over
    slice i (LightSeq2's layer-batched cross attention). In decode mode the call that creates the cache stores
    that projection and the source mask, so later steps neither recompute it nor need the encoder output.
    """

    config: LayerConfig
    num_layers: int

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        encoded: jax.Array | None = None,
        src_mask: jax.Array | None = None,
        *,
        src_lengths: jax.Array | None = None,
        decode: bool = False,
        deterministic: bool = True,
    ) -> jax.Array:
        """x (B, T, H) embedded targets; encoded (B, S, H); src_mask (B, S) boolean, False at padding, or src_lengths
        (B,) integer for right padding (at most one; decoding caches a mask, so it takes src_mask).

        With ``decode`` and an existing cache, ``encoded`` and ``src_mask`` are read from the cache.
        """
        cross_key_value, src_mask = self._cross_key_values(encoded, src_mask, decode)
        # Split rather than index: the gradient of L slices is L zero-padded arrays that XLA adds up, each
        # element L times, the gradient of a split one concatenation.
        layer_key_values = jax.lax.split(cross_key_value, (1,) * self.num_layers, axis=2)
        for index, key_value in enumerate(layer_key_values):
            x = _layer(
                self.config,
                decode,
                TransformerDecoderLayer,
                _PositionalDecoderLayer,
                name=f"layer_{index}",
                arguments=(x, jnp.squeeze(key_value, 2), src_mask, src_lengths),
                static=(decode, deterministic, True),
            )
        return _final_layer_norm(self.config, x)

    def _cross_key_values(self, encoded, src_mask, decode: bool) -> tuple[jax.Array, jax.Array | None]:
        """All layers' cross-attention K/V (B, S, layers, 2, heads, d) and the source mask, cached when decoding."""
        if decode and self.has_variable("cache", SOURCE_CACHE_NAMES[0]):
            return tuple(self.get_variable("cache", name) for name in SOURCE_CACHE_NAMES)
        if encoded is None:
            raise ValueError("encoded (the encoder output) is required unless a decode cache already holds it")
        cfg = self.config
        key_value = dense(cfg, (self.num_layers, 2, cfg.nhead, cfg.head_dim), name="cross_attention_kv")(encoded)
        if decode:
            if src_mask is None:
                src_mask = jnp.ones(encoded.shape[:2], bool)
            self.put_variable("cache", SOURCE_CACHE_NAMES[0], key_value)
            self.put_variable("cache", SOURCE_CACHE_NAMES[1], src_mask)
        return key_value, src_mask
