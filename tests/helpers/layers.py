"""Helpers shared by the layer and model tests (this module holds no tests): test data from numpy, so no
per-shape XLA compilation is spent on random draws or on ``init``'s initializers."""

import jax
import jax.numpy as jnp
import numpy as np


def normal(seed, shape):
    """Standard normal f32 test data."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def random_params(model, *args, seed=1):
    """Parameters of the shapes ``model.init(key, *args)`` creates: kernels and tables N(0, 0.2^2), biases
    N(0, 0.1^2), LayerNorm scales 1 + N(0, 0.1^2), so every parameter's role shows in the outputs."""
    shapes = jax.eval_shape(model.init, jax.random.key(0), *args)["params"]
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        if jax.tree_util.keystr(path).endswith("['scale']"):
            return jnp.asarray(1.0 + 0.1 * noise)
        return jnp.asarray((0.2 if leaf.ndim >= 2 else 0.1) * noise)

    return jax.tree_util.tree_map_with_path(draw, shapes)
