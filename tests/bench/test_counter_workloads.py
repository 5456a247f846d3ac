"""train.bench.steps.counter_workloads on CPU: the encoder block the flops suite profiles computes its gradients."""

import math
import re

import jax
import jax.numpy as jnp
import pytest

from train.bench.steps import counter_workloads


def compiled_dot_flops(hlo: str) -> int:
    """2 x output elements x contracted size, summed over the dot instructions of an optimized HLO module."""
    shapes = {
        name: [int(d) for d in dims.split(",") if d]
        for name, dims in re.findall(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*\w+\[([\d,]*)\]", hlo, re.MULTILINE)
    }
    total = 0
    for out, lhs, attributes in re.findall(
        r"=\s*\w+\[([\d,]*)\]\S*\s+dot\(%([\w.\-]+),\s*%[\w.\-]+\),(.*)$", hlo, re.MULTILINE
    ):
        contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attributes).group(1)
        size = math.prod(shapes[lhs][int(d)] for d in contracted.split(","))
        total += 2 * math.prod(int(d) for d in out.split(",")) * size
    return total


@pytest.mark.parametrize("implementation", ["reference", "ls_jax_xla"])
def test_encoder_block_returns_gradients_of_params_and_input(implementation):
    workload = counter_workloads.build("encoder-block", implementation, batch=1, seq_len=8)
    loss, (param_grads, input_grad) = jax.block_until_ready(workload())
    assert bool(jnp.isfinite(loss))
    assert input_grad.shape == (1, 8, 768) and bool(jnp.all(jnp.isfinite(input_grad.astype(jnp.float32))))
    kernels = [
        leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(param_grads)
        if "kernel" in jax.tree_util.keystr(path)
    ]
    # QKV (fused or not), the attention output and the two feed-forward matrices: 4H^2 + 2HF weights.
    assert sum(leaf.size for leaf in kernels) == 4 * 768**2 + 2 * 768 * 3072
    assert "HloModule" in workload.compiled.as_text()


def test_the_compiled_encoder_block_runs_every_gemm_of_the_hand_count():
    # With gradients alone, XLA dropped the last feed-forward GEMM's forward product (it fed only the discarded
    # loss): 8 of 74 x tokens x H^2 FLOPs, the 0.89 slope of measured on hand-counted FLOPs.
    from train.bench import flops

    batch, seq_len = 2, 128
    workload = counter_workloads.build("encoder-block", "reference", batch=batch, seq_len=seq_len)
    estimate = flops.encoder_block_estimate(batch, seq_len)
    assert compiled_dot_flops(workload.compiled.as_text()) == estimate.gemm_flops
