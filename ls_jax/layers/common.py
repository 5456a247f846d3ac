"""Pieces every layer uses: LayerNorm over ``ls_jax.ops.layer_norm``, the deferred residual sum of pre-LN
sublayers, GEMMs, per-call dropout seeds and the decode-mode cache index."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from ls_jax import ops
from ls_jax.layers import fp8
from ls_jax.layers.config import LayerConfig


@flax.struct.dataclass
class DeferredResidual:
    """``residual + dropout(update + bias)``: a pre-LN sublayer's output, not yet formed.

    Sublayers called with ``defer_residual=True`` return it, and the next LayerNorm forms and normalizes the sum
    in one kernel each way (``ops.layer_norm`` with ``bias``), saving a pass over the activations in each
    direction. ``resolve()`` forms it alone (``ops.bias_dropout_residual``). update, residual (..., H) in the
    compute dtype; bias (H,) f32; seed None when dropout_rate is 0.
    """

    update: jax.Array
    bias: jax.Array
    residual: jax.Array
    seed: jax.Array | None
    dropout_rate: float = flax.struct.field(pytree_node=False)

    def resolve(self) -> jax.Array:
        return ops.bias_dropout_residual(
            self.update, self.bias, self.residual, dropout_rate=self.dropout_rate, seed=self.seed
        )


class LayerNorm(nn.Module):
    """``y = (x - mean) / sqrt(var + eps) * scale + bias`` over the last axis; params f32 (H,), y in x's dtype.

    ``return_input=True`` returns ``(y, x)`` (``ops.layer_norm``): a pre-LN sublayer takes its residual from
    there so that the residual's gradient joins the LayerNorm backward kernel. A ``DeferredResidual`` input is
    formed in the same kernel and always returns ``(y, sum)``.
    """

    eps: float = 1e-5

    @nn.compact
    def __call__(
        self, x: jax.Array | DeferredResidual, *, return_input: bool = False
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        deferred = isinstance(x, DeferredResidual)
        hidden = (x.update if deferred else x).shape[-1]
        scale = self.param("scale", nn.initializers.ones, (hidden,), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (hidden,), jnp.float32)
        if not deferred:
            return ops.layer_norm(x, scale, bias, eps=self.eps, return_input=return_input)
        return ops.layer_norm(
            x.update,
            scale,
            bias,
            eps=self.eps,
            residual=x.residual,
            bias=x.bias,
            dropout_rate=x.dropout_rate,
            seed=x.seed,
        )


def pre_norm(config: LayerConfig, x: jax.Array | DeferredResidual) -> tuple[jax.Array, jax.Array]:
    """A sublayer's ``(input to its body, residual)``: ``(LN(x), x)`` for pre-LN (the module is named
    "layer_norm"; a deferred x is formed there), ``(x, x)`` for post-LN. Call it inside the sublayer's compact
    ``__call__``."""
    if not config.pre_layer_norm:
        x = x.resolve() if isinstance(x, DeferredResidual) else x.astype(config.dtype)
        return x, x
    if isinstance(x, DeferredResidual):
        return LayerNorm(config.layer_norm_eps, name="layer_norm")(x)
    return LayerNorm(config.layer_norm_eps, name="layer_norm")(x.astype(config.dtype), return_input=True)


def sublayer_output(
    config: LayerConfig,
    module: nn.Module,
    update: jax.Array,
    bias: jax.Array,
    residual: jax.Array,
    *,
    deterministic: bool,
    defer_residual: bool,
) -> jax.Array | DeferredResidual:
    """A sublayer's ``residual + dropout(update + bias)`` (hidden dropout, seeded from ``module``): deferred for
    the next LayerNorm when pre-LN and ``defer_residual``, else formed (and, post-LN, normalized by the
    module's "layer_norm")."""
    rate, seed = dropout_args(module, config.hidden_dropout_ratio, deterministic)
    deferred = DeferredResidual(update, bias, residual, seed, rate)
    if not config.pre_layer_norm:
        return LayerNorm(config.layer_norm_eps, name="layer_norm")(deferred.resolve())
    return deferred if defer_residual else deferred.resolve()


def dropout_args(module: nn.Module, rate: float, deterministic: bool) -> tuple[float, jax.Array | None]:
    """``(rate, seed)`` for one fused op: a fresh seed from the module's "dropout" rng, or no dropout at all.

    Every op call draws its own seed, so no two dropout masks in a step are correlated.
    """
    if deterministic or rate == 0.0:
        return 0.0, None
    return rate, ops.dropout_seed(module.make_rng("dropout"))


class Dense(nn.Module):
    """``ops.dense`` with f32 parameters: x (..., *in) -> (..., *features) in ``dtype``; with ``fp8`` the GEMM
    runs in FP8 (`ls_jax.layers.fp8`, its scaling state under "fp8" in the SCALING collection).

    The parameters are ``nn.DenseGeneral``'s ("kernel" (*in, *features), ``kernel_init`` over the flattened
    (prod(in), prod(features)); "bias" (*features), zeros), so checkpoints of either load into the other.
    """

    features: int | tuple[int, ...]
    input_axes: int = 1
    use_bias: bool = True
    dtype: Any = jnp.float32
    kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()
    fp8: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
        in_shape = x.shape[x.ndim - self.input_axes :]

        def kernel_init(key, shape, dtype):
            flat = self.kernel_init(key, (math.prod(in_shape), math.prod(features)), dtype)
            return flat.reshape(shape)

        kernel = self.param("kernel", kernel_init, (*in_shape, *features), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, features, jnp.float32) if self.use_bias else None
        if not self.fp8:
            return ops.dense(x, kernel, bias, input_axes=self.input_axes, dtype=self.dtype)
        rows = x.reshape(-1, math.prod(in_shape)).astype(self.dtype)
        y = fp8.Fp8Dot(name="fp8")(rows, kernel.reshape(rows.shape[1], -1), contract=0)
        if bias is not None:
            y = y + bias.reshape(-1).astype(self.dtype)
        return y.reshape(*x.shape[: x.ndim - self.input_axes], *features)


def dense(config: LayerConfig, features, *, name: str, input_axes: int = 1, use_bias: bool = True) -> Dense:
    """A GEMM in the compute dtype with f32 parameters, its kernel drawn as ``config.initializer_range`` says."""
    std = config.initializer_range
    kernel_init = nn.initializers.lecun_normal() if std is None else nn.initializers.normal(stddev=std)
    return Dense(
        features,
        input_axes=input_axes,
        use_bias=use_bias,
        dtype=config.dtype,
        kernel_init=kernel_init,
        fp8=config.fp8,
        name=name,
    )


class CacheIndex(nn.Module):
    """How many positions a decode-mode layer has consumed; lives in the "cache" collection.

    Returns the index before this call and advances it by ``length``. The call that creates the cache returns
    None: that call (``Transformer.init_cache``) runs as a plain forward pass whose input length sets the cache
    length, and leaves the index at 0.
    """

    @nn.compact
    def __call__(self, length: int) -> jax.Array | None:
        if not self.has_variable("cache", "index"):
            self.put_variable("cache", "index", jnp.zeros((), jnp.int32))
            return None
        start = self.get_variable("cache", "index")
        self.put_variable("cache", "index", start + length)
        return start
