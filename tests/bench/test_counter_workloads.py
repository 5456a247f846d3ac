"""train.benchmarks.counter_workloads on CPU: the encoder block the flops suite profiles computes its gradients."""

import jax
import jax.numpy as jnp
import pytest

from train.benchmarks import counter_workloads


@pytest.mark.parametrize("implementation", ["reference", "ls_jax_xla"])
def test_encoder_block_returns_gradients_of_params_and_input(implementation):
    workload = counter_workloads.build("encoder-block", implementation, batch=1, seq_len=8)
    param_grads, input_grad = jax.block_until_ready(workload())
    assert input_grad.shape == (1, 8, 768) and bool(jnp.all(jnp.isfinite(input_grad.astype(jnp.float32))))
    kernels = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(param_grads)
               if "kernel" in jax.tree_util.keystr(path)]
    # QKV (fused or not), the attention output and the two feed-forward matrices: 4H^2 + 2HF weights.
    assert sum(leaf.size for leaf in kernels) == 4 * 768**2 + 2 * 768 * 3072
    assert "HloModule" in workload.compiled.as_text()
