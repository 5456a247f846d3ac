"""Device probe: the kernel library builds, loads and runs one op bit-exactly against XLA."""

import time

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax import backend, ops

start = time.perf_counter()
backend.kernel_targets()
print(f"load (build) {time.perf_counter() - start:.1f}s", flush=True)
x = jax.random.normal(jax.random.PRNGKey(0), (4096, 1027), jnp.bfloat16)
seed = ops.dropout_seed(jax.random.PRNGKey(1))
results = {}
for mode in ("xla", "ffi"):
    with backend.use(mode):
        f = jax.jit(lambda x, s: ops.dropout(x, rate=0.1, seed=s))
        g = jax.jit(jax.grad(lambda x, s: (ops.dropout(x, rate=0.1, seed=s).astype(jnp.float32) ** 2).sum()))
        results[mode] = (np.asarray(f(x, seed), np.float32), np.asarray(g(x, seed), np.float32))
        print(mode, "hlo has ls_dropout:", "ls_dropout" in f.lower(x, seed).as_text())
print("fwd max abs diff", np.abs(results["xla"][0] - results["ffi"][0]).max())
print("bwd max abs diff", np.abs(results["xla"][1] - results["ffi"][1]).max())
print("keep fraction", (results["ffi"][0] != 0).mean())
