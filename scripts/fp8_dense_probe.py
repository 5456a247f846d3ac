"""One Dense layer's forward + backward, bf16 against FP8 (``LayerConfig.fp8``, Flax's FP8 ops), at transformer-big's
GEMM shapes: the median of 50 jit-compiled steps after 10, per shape, one line each.

    python3 scripts/fp8_dense_probe.py
"""

import jax
import jax.numpy as jnp

from ls_jax.layers import Dense
from train.bench import common

for rows, k, n in ((8192, 1024, 4096), (8192, 4096, 1024), (16384, 1024, 1024)):
    x = jax.random.normal(jax.random.PRNGKey(0), (rows, k), jnp.bfloat16)
    result = {}
    for use_fp8 in (False, True):
        dense = Dense(n, dtype=jnp.bfloat16, fp8=use_fp8)
        variables = dense.init(jax.random.PRNGKey(1), x)
        step = jax.jit(jax.grad(lambda v, x: jnp.sum(dense.apply(v, x).astype(jnp.float32)), argnums=(0, 1)))
        result[use_fp8] = common.time_call(lambda: step(variables, x), warmup=10, samples=50, inner=1)["median_s"] * 1e3
    print(
        f"{rows}x{k}->{n} fwd+bwd: bf16 {result[False]:.3f} ms, fp8 {result[True]:.3f} ms, "
        f"bf16/fp8 {result[False] / result[True]:.2f}x",
        flush=True,
    )
