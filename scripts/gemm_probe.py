"""Times Transformer-big's largest GEMMs alone, as XLA compiles them, to compare with their time inside a step.

    python3 scripts/gemm_probe.py                                              # XLA picks Triton or cuBLAS
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python3 scripts/gemm_probe.py  # cuBLAS only

Per GEMM: the library XLA chose, the median of 7 samples of 20 back-to-back calls, and TFLOP/s. Shapes at 8192
target tokens: the tied output projection's three GEMMs, the decoder's layer-batched cross-attention K/V
projection (6 layers x K and V) and its gradients, and one feed-forward GEMM.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

ROWS, MODEL, VOCAB, FFN, CROSS_KV = 8192, 1024, 32768, 4096, 12288


def product(contract_a: int, contract_b: int, f32_out: bool = False):
    dims = (((contract_a,), (contract_b,)), ((), ()))
    return lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32 if f32_out else None)


# name: (shape of a, shape of b, output columns, function)
CASES = {
    "logits x(R,D) . table(V,D)^T": ((ROWS, MODEL), (VOCAB, MODEL), VOCAB, product(1, 1)),
    "logits dx dy(R,V) . table(V,D)": ((ROWS, VOCAB), (VOCAB, MODEL), MODEL, product(1, 0)),
    "table dW dy(R,V)^T . x(R,D), f32": ((ROWS, VOCAB), (ROWS, MODEL), MODEL, product(0, 0, True)),
    "cross K/V x(R,D) . W(D,12288)": ((ROWS, MODEL), (MODEL, CROSS_KV), CROSS_KV, product(1, 0)),
    "cross K/V dW x(R,D)^T . dy(R,12288), f32": ((ROWS, MODEL), (ROWS, CROSS_KV), CROSS_KV, product(0, 0, True)),
    "cross K/V dx dy(R,12288) . W(D,12288)^T": ((ROWS, CROSS_KV), (MODEL, CROSS_KV), MODEL, product(1, 1)),
    "FFN x(R,D) . W(D,F)": ((ROWS, MODEL), (MODEL, FFN), FFN, product(1, 0)),
}


def library(compiled_text: str) -> str:
    return "triton" if "__triton" in compiled_text else "cublas" if "__cublas" in compiled_text else "other"


def median_seconds(fn, a, b, samples: int = 7, calls: int = 20) -> float:
    for _ in range(5):
        fn(a, b).block_until_ready()
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(a, b)
        out.block_until_ready()
        times.append((time.perf_counter() - start) / calls)
    return float(np.median(times))


def main() -> None:
    rng = np.random.default_rng(0)
    for name, (shape_a, shape_b, out_columns, fn) in CASES.items():
        a = jnp.asarray(rng.standard_normal(shape_a, np.float32), jnp.bfloat16)
        b = jnp.asarray(rng.standard_normal(shape_b, np.float32), jnp.bfloat16)
        jitted = jax.jit(fn)
        chosen = library(jitted.lower(a, b).compile().as_text())
        seconds = median_seconds(jitted, a, b)
        flops = 2 * np.prod(shape_a) * out_columns
        print(f"{name:42s} {chosen:7s} {seconds * 1e3:.3f} ms  {flops / seconds / 1e12:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
