"""Flax linen Transformer layers whose non-GEMM work runs in the fused ops of ``ls_jax.ops``.

GEMMs are ``Dense`` (``ops.dense``: the weight gradients come out of the GEMM in f32); attention, LayerNorm,
bias + activation + dropout, bias + dropout + residual, embedding and the loss are fused ops, which run as CUDA
kernels on NVIDIA GPUs and as XLA elsewhere (``ls_jax.backend``). Parameters are float32; activations
run in ``LayerConfig.dtype``. Dropout needs a "dropout" rng when ``deterministic=False``::

    cfg = LayerConfig.preset("transformer-base", dtype=jnp.float32)
    layer = TransformerEncoderLayer(cfg)
    params = layer.init(jax.random.key(0), x, key_mask)["params"]
    y = layer.apply({"params": params}, x, key_mask, deterministic=False, rngs={"dropout": key})

Flax NNX: wrap any layer with the bridge and initialize it from a sample input::

    from flax import nnx
    layer = nnx.bridge.ToNNX(TransformerEncoderLayer(cfg), rngs=nnx.Rngs(params=0, dropout=1))
    nnx.bridge.lazy_init(layer, x, key_mask)
    y = layer(x, key_mask)                              # deterministic
    y = layer(x, key_mask, deterministic=False)         # draws from the "dropout" stream of the Rngs

Incremental decoding keeps keys, values and positions in the "cache" collection: the first ``decode=True``
call (with ``mutable=["cache"]`` and no cache yet) creates a cache as long as its input, later calls append to
it. ``ls_jax.models.Transformer.init_cache`` / ``decode`` wrap this.
"""

from ls_jax.layers.attention import MultiHeadAttention
from ls_jax.layers.common import DeferredResidual, Dense, LayerNorm
from ls_jax.layers.config import PRESETS, LayerConfig
from ls_jax.layers.criterion import CrossEntropyCriterion
from ls_jax.layers.embedding import TransformerEmbedding, sinusoidal_positions
from ls_jax.layers.feed_forward import FeedForward
from ls_jax.layers.transformer import (
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)

__all__ = [
    "PRESETS",
    "CrossEntropyCriterion",
    "DeferredResidual",
    "Dense",
    "FeedForward",
    "LayerConfig",
    "LayerNorm",
    "MultiHeadAttention",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEmbedding",
    "TransformerEncoder",
    "TransformerEncoderLayer",
    "sinusoidal_positions",
]
