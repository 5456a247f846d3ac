"""train.bench profile's attribution on the GPU: every kernel of a traced step lands in a category and a stage."""

import pytest

from ls_jax import backend
from train.bench.steps import zoo_steps
from train.bench.tracing import kernel_trace

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
STEPS = 2


@pytest.mark.parametrize("implementation", ["flax", "ls_jax_ffi"])
def test_stages_attribute_the_kernels_of_cublas_gemms_and_ffi_calls(implementation):
    model = zoo_steps.MODELS["bert-tiny"]
    batch = zoo_steps.make_batch("bert-tiny", model.rows, model.seq_lens[-1], seed=0)
    with backend.use(zoo_steps.kernel_mode(implementation)):
        step = zoo_steps.build_step(implementation, "bert-tiny", batch)
        for _ in range(3):
            step.run(batch)
        result = kernel_trace.step_breakdown(step, batch, STEPS)
    stages = result["stage_ms_per_step"]
    traced = sum(stages.values())
    assert traced > 0
    # Inside CUDA graphs the GEMMs' and FFI calls' kernels had no op_name: most of the step was "unattributed". What
    # stays so is the step's own bookkeeping (its random key split, the classifier head's tanh), microseconds that
    # weigh more in this tiny model than in BERT-base.
    assert stages["unattributed"] < 0.1 * traced, (stages, result["unattributed_kernels"])
    assert stages["encoder forward"] > 0 and stages["encoder backward"] > 0 and stages["optimizer"] > 0, stages
    assert result["ms_per_step"]["GEMM"] > 0


def test_attention_kernel_times_show_the_cudnn_kernels_of_each_variant():
    from train.bench import attention as attention_bench

    result = attention_bench.run_case((1, 512, 4, 64), on_gpu=True, quick=False, kernel_times=True)
    for variant in ("ffi", "ffi_dropout", "cudnn"):
        kernels = result[variant]["kernel_ms"]
        assert any("sdpa" in name or "flash" in name for name in kernels), (variant, list(kernels))
        assert 0 < sum(kernels.values()) <= 1.5 * result[variant]["median_ms"]


@pytest.mark.parametrize("implementation", ["reference", "ls_jax_ffi"])
def test_encoder_and_decoder_stages_each_keep_their_own_layers_kernels(implementation):
    """XLA compiles one kernel for identical fusions of the encoder and the decoder layer and names it after one of
    them; the stages must follow the launching instruction, not the kernel name. At big widths an encoder layer does
    12 H^2 of GEMM work per token, a decoder layer 16 H^2 (its cross-attention), so each encoder stage should take
    about 3/4 of its decoder stage; by kernel name, one of the two took the shared kernels of both."""
    from train.bench.steps import transformer_steps

    batch = transformer_steps.make_batch(32, seed=0)
    with backend.use(transformer_steps.kernel_mode(implementation)):
        step = transformer_steps.build_step(implementation, "big-6e6d", batch, layers_each=1)
        for _ in range(3):
            step.run(batch)
        stages = kernel_trace.step_breakdown(step, batch, STEPS)["stage_ms_per_step"]
    for encoder, decoder in (("encoder forward", "decoder forward"), ("encoder backward", "decoder backward")):
        assert 0.45 < stages[encoder] / stages[decoder] < 1.0, stages
