"""Compiles the step-0 state creation of BERT-base (512 positions, AdamW) alone, for ls_jax's BERT and the plain
Flax one, with threefry as XLA operations and as JAX's kernel:

    python3 scripts/state_creation_probe.py             # both implementations, both threefry lowerings

Prints per implementation and lowering the compile time and the compiled HLO's fusions (one JSON line each).
"""

import json
import time
import types

import jax
import jax.numpy as jnp
import optax

from train.harness.step import TrainState
from train.imdb.model import build_classifier, preset_config

SEQ_LEN = 512


def compile_creation(implementation: str) -> dict:
    model_cfg = preset_config("bert-base", vocab_size=1000, num_labels=2, dtype=jnp.bfloat16, remat="none")
    config = types.SimpleNamespace(implementation=implementation, init_from=None)
    classifier, _ = build_classifier(config, model_cfg, None, pad_id=0)
    tx = optax.adamw(1e-4)

    def create(key):
        return TrainState.create(classifier.init(key, SEQ_LEN)["params"], tx, key, fp16=False, param_dtype=jnp.float32)

    lowered = jax.jit(create).lower(jax.random.PRNGKey(0))
    start = time.perf_counter()
    compiled = lowered.compile()
    return {"compile_s": round(time.perf_counter() - start, 2), "fusions": compiled.as_text().count(" fusion(")}


def main() -> None:
    for kernel in (False, True):
        jax.config.update("jax_threefry_gpu_kernel_lowering", kernel)
        for implementation in ("ls_jax", "flax"):
            result = {"implementation": implementation, "threefry_kernel": kernel, **compile_creation(implementation)}
            print(json.dumps({"device": jax.devices()[0].device_kind, **result}), flush=True)


if __name__ == "__main__":
    main()
