"""ls-jax: LightSeq-style fused kernels, Flax layers, optimizers and training for Transformers in JAX."""

from ls_jax import backend, ops

__version__ = "0.1.0"
__all__ = ["backend", "ops", "__version__"]
