"""train.bench.tracing.kernel_trace: how GPU kernels of a trace are attributed to step categories (no GPU needed)."""

import jax
import pytest

from train.bench.tracing import kernel_trace

HLO = """
HloModule jit_step
%loop_add_fusion.49 = bf16[8192,1024] fusion(%a, %b), kind=kLoop, metadata={op_name="jit(step)/decoder/layer_norm/add"}
ROOT %input_reduce_fusion = f32[] fusion(%c), kind=kInput, metadata={op_name="jit(step)/criterion/reduce_sum"}
%gemm_fusion_dot.3 = bf16[8192,4096] fusion(%d, %e), metadata={op_name="jit(step)/ffn/dot_general"}
"""


@pytest.mark.parametrize(
    "kernel, op_name, category",
    [
        (
            "void ls::(anonymous namespace)::layer_norm_bwd_kernel<__nv_bfloat16, float, 8>(float const*)",
            "",
            "LayerNorm",
        ),
        ("void ls::(anonymous namespace)::softmax_fwd_group_kernel<__nv_bfloat16, 4>(int)", "", "softmax"),
        ("void ls::<unnamed>::layer_norm_fwd_kernel<__nv_bfloat16, float, 8>(float const*)", "", "LayerNorm"),
        ("void ls::(anonymous namespace)::cross_entropy_bwd_kernel<float>(float*)", "", "criterion"),
        ("void ls::(anonymous namespace)::embed_grad_kernel<__nv_bfloat16, 8>(__nv_bfloat16 const*)", "", "embedding"),
        (
            "void ls::(anonymous namespace)::step_kernel<(ls::(anonymous namespace)::Algorithm)0>(ls::LeafTable)",
            "",
            "optimizer",
        ),
        ("void ls::(anonymous namespace)::bias_bwd_kernel<__nv_bfloat16, float, 8>(float*)", "", "dropout/elementwise"),
        ("nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT", "jit(step)/criterion/dot_general", "GEMM"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "", "attention"),
        ("void ls::(anonymous namespace)::attention_bwd_kernel<__half, 64>(ls::Tensors)", "", "attention"),
        ("loop_exp_fusion_3", "jit(step)/decoder/self_attention/attention/exp", "softmax"),
        ("loop_add_fusion_7", "jit(step)/decoder/self_attention/bias_dropout_residual/add", "dropout/elementwise"),
        ("loop_transpose_fusion_70", "jit(step)/encoder/reshape", "copies/transposes"),
        ("loop_add_fusion_49", "jit(step)/decoder/LayerNorm_0/add", "LayerNorm"),
        ("loop_add_fusion_50", "jit(step)/decoder/mlp/add", "other"),
        ("void ls::(anonymous namespace)::quantize_kernel<__nv_bfloat16, 1>(__nv_bfloat16 const*)", "", "fp8 scaling"),
        ("input_reduce_fusion_206", "jit(step)/transpose(jvp(Transformer))/encoder/qkv/fp8/reduce_max", "fp8 scaling"),
        (
            "loop_convert_fusion",
            "jit(step)/transpose(jvp(Transformer))/source_embedding.attend/logits_fp8/convert_element_type",
            "fp8 scaling",
        ),
        ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_TNT", "jit(step)/encoder/qkv/fp8/dot_general", "GEMM"),
    ],
)
def test_categorize(kernel, op_name, category):
    assert kernel_trace.categorize(kernel, op_name) == category


def test_kernels_without_hlo_op_are_found_by_their_fusion_name():
    op_names = kernel_trace.hlo_op_names(HLO)
    kernels = [
        {"name": "loop_add_fusion_49", "ts": 0.0, "dur": 1000.0, "args": {}},  # "." of the HLO name became "_"
        {"name": "input_reduce_fusion", "ts": 1000.0, "dur": 500.0, "args": {}},
        {"name": "gemm_fusion_dot_3", "ts": 2000.0, "dur": 2000.0, "args": {}},  # 500 us idle before it
        {"name": "anything", "ts": 4000.0, "dur": 250.0, "args": {"hlo_op": "input_reduce_fusion"}},
    ]
    ms = kernel_trace.breakdown(kernels, op_names, steps=1)
    assert ms["LayerNorm"] == pytest.approx(1.0)
    assert ms["criterion"] == pytest.approx(0.75)
    assert ms["GEMM"] == pytest.approx(2.0)
    assert ms["idle"] == pytest.approx(0.5)
    assert ms["other"] == 0.0


def test_reanalyze_recomputes_a_result_file_from_kept_traces(tmp_path):
    import gzip
    import json

    trace_dir = tmp_path / "traces" / "ls_jax_xla" / "plugins" / "profile" / "run"
    trace_dir.mkdir(parents=True)
    events = [
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 7, "name": "loop_add_fusion_49", "ts": 0.0, "dur": 3000.0, "args": {}},
        {"ph": "X", "pid": 1, "name": "loop_add_fusion_49", "ts": 0.0, "dur": 9000.0, "args": {}},  # host: ignored
    ]
    with gzip.open(trace_dir / "host.trace.json.gz", "wt") as handle:
        json.dump({"traceEvents": events}, handle)
    (tmp_path / "traces" / "ls_jax_xla" / kernel_trace.HLO_FILENAME).write_text(HLO)
    result_path = tmp_path / "profile-h100.json"
    result_path.write_text(
        json.dumps({"environment": {"device_kind": "H100"}, "steps": 3, "results": {"ls_jax_xla": {"stale": True}}})
    )

    stage_dir = tmp_path / "traces" / "ls_jax_xla" / kernel_trace.STAGE_TRACE_DIR
    (stage_dir / "run").mkdir(parents=True)
    (stage_dir / kernel_trace.HLO_FILENAME).write_text(
        '%custom-call.2 = bf16[8] custom-call(%a), metadata={op_name="jit(step)/jvp(M)/encoder/layer_0/ln"}\n'
    )
    stage_events = [
        events[0],
        {
            "ph": "X",
            "pid": 7,
            "name": "ls::layer_norm_fwd_kernel",
            "ts": 0.0,
            "dur": 6000.0,
            "args": {"hlo_op": "custom-call.2"},
        },
    ]
    with gzip.open(stage_dir / "run" / "host.trace.json.gz", "wt") as handle:
        json.dump({"traceEvents": stage_events}, handle)

    result = kernel_trace.reanalyze(result_path, tmp_path / "traces")
    assert result["environment"] == {"device_kind": "H100"}
    summary = result["results"]["ls_jax_xla"]
    assert summary["ms_per_step"]["LayerNorm"] == pytest.approx(1.0)
    assert summary["kernels_per_step"] == pytest.approx(1 / 3)
    assert summary["top_kernels"][0]["op_name"] == "jit(step)/decoder/layer_norm/add"
    assert summary["stage_ms_per_step"]["encoder forward"] == pytest.approx(2.0)  # from the stage trace


def test_a_kernel_inside_a_cuda_graph_is_found_by_its_name_not_the_command_buffer():
    op_names = kernel_trace.hlo_op_names(HLO + '%command_buffer.1 = () call(), metadata={op_name="jit(step)/graph"}\n')
    event = {"name": "loop_add_fusion_49", "ts": 0.0, "dur": 1.0, "args": {"hlo_op": "command_buffer_1"}}
    assert kernel_trace.event_op_name(event, op_names) == "jit(step)/decoder/layer_norm/add"


@pytest.mark.parametrize(
    "op_name, stage",
    [
        (
            "jit(step)/jvp(ReferenceTransformer)/encoder/EncoderLayer_0/FeedForward_0/Dense_0/dot_general",
            "encoder forward",
        ),
        ("jit(step)/transpose(jvp(ReferenceTransformer))/encoder/Embed_0/jit(_take)/scatter-add", "encoder backward"),
        ("jit(step)/jvp(Transformer)/Transformer.encode/source_embedding/add", "encoder forward"),
        ("jit(step)/jvp(Transformer)/Transformer._decoder_hidden/decoder/source_embedding/add", "decoder forward"),
        (
            "jit(step)/transpose(jvp(Transformer))/Transformer._decoder_hidden/decoder/layer_1/cross_attention/mul",
            "decoder backward",
        ),
        (
            "jit(step)/transpose(jvp(Transformer))/Transformer._logits/output_projection/source_embedding.attend/dot",
            "output projection + loss",
        ),
        ("jit(step)/transpose(jvp(criterion))/jit(log_softmax)/exp", "output projection + loss"),
        ("jit(step)/optimizer/jit(clip)/max", "optimizer"),
        ("jit(step)/jvp(BertForSequenceClassification)/embeddings/layer_norm/ffi_call", "encoder forward"),
        ("jit(step)/transpose(jvp(BertForSequenceClassification))/pooler/dot_general", "output projection + loss"),
        ("jit(step)/jvp(GPTLMHeadModel)/embedding/ffi_call", "decoder forward"),
        ("jit(step)/transpose(jvp(GPTLMHeadModel))/embedding.attend/dot_general", "output projection + loss"),
        ("jit(step)/jit(_threefry_split)/slice", "unattributed"),
        ("", "unattributed"),
    ],
)
def test_stage_from_name_scopes(op_name, stage):
    assert kernel_trace.stage(op_name) == stage


def test_a_stage_follows_the_instruction_that_launched_a_shared_kernel():
    hlo = "\n".join(
        [
            '%fusion.1 = bf16[8] fusion(%a), metadata={op_name="jit(step)/jvp(M)/encoder/layer_0/add"}',
            '%fusion.7 = bf16[8] fusion(%a), metadata={op_name="jit(step)/transpose(jvp(M))/decoder/layer_1/add"}',
        ]
    )
    op_names = kernel_trace.hlo_op_names(hlo)
    # one kernel compiled for both identical fusions, named after the first
    kernels = [
        {"name": "fusion_1", "ts": 0.0, "dur": 1000.0, "args": {"hlo_op": "fusion.1"}},
        {"name": "fusion_1", "ts": 1000.0, "dur": 3000.0, "args": {"hlo_op": "fusion.7"}},
    ]
    stages = kernel_trace.stage_breakdown(kernels, op_names, steps=1)
    assert stages["encoder forward"] == pytest.approx(1.0)
    assert stages["decoder backward"] == pytest.approx(3.0)


def test_stage_breakdown_of_a_synthetic_trace():
    hlo = "\n".join(
        [
            '%fusion.1 = bf16[8] fusion(%a), metadata={op_name="jit(step)/jvp(M)/encoder/layer_0/add"}',
            '%fusion.2 = bf16[8] fusion(%a), metadata={op_name="jit(step)/jvp(M)/decoder/layer_0/add"}',
            '%fusion.3 = bf16[8] fusion(%a), metadata={op_name="jit(step)/transpose(jvp(M))/decoder/layer_0/mul"}',
            '%fusion.4 = bf16[8] fusion(%a), metadata={op_name="jit(step)/transpose(jvp(M))/encoder/layer_0/mul"}',
            '%custom-call.5 = bf16[8] custom-call(%a), metadata={op_name="jit(step)/optimizer/adam_step"}',
        ]
    )
    op_names = kernel_trace.hlo_op_names(hlo)
    kernels = [
        {"name": "fusion_1", "ts": 0.0, "dur": 1000.0, "args": {}},
        {"name": "fusion_2", "ts": 1000.0, "dur": 2000.0, "args": {}},
        {"name": "fusion_3", "ts": 3000.0, "dur": 4000.0, "args": {}},
        {"name": "fusion_4", "ts": 7000.0, "dur": 3000.0, "args": {}},
        {"name": "ls::step_kernel", "ts": 10000.0, "dur": 500.0, "args": {"hlo_op": "custom-call.5"}},
        {"name": "mystery", "ts": 11000.0, "dur": 100.0, "args": {}},
    ]
    stages = kernel_trace.stage_breakdown(kernels, op_names, steps=2)
    assert list(stages) == list(kernel_trace.STAGES)
    assert stages == pytest.approx(
        {
            "encoder forward": 0.5,
            "decoder forward": 1.0,
            "output projection + loss": 0.0,
            "decoder backward": 2.0,
            "encoder backward": 1.5,
            "optimizer": 0.25,
            "unattributed": 0.05,
        }
    )
    assert kernel_trace.summarize(kernels, op_names, 2)["stage_ms_per_step"] == stages


def test_profile_prints_the_stages_side_by_side(capsys):
    from train.bench import profile

    def record(scale):
        return {
            "ms_per_step": dict.fromkeys(kernel_trace.CATEGORIES, 1.0),
            "total_ms_per_step": 11.0,
            "stage_ms_per_step": {name: scale * (i + 1) for i, name in enumerate(kernel_trace.STAGES)},
        }

    profile.print_breakdowns({"reference": record(1.0), "ls_jax_ffi": record(0.5)}, {})
    lines = capsys.readouterr().out.splitlines()
    assert next(line for line in lines if line.startswith("encoder forward")).split()[-2:] == ["1.00", "0.50"]
    stage_table = lines[next(i for i, line in enumerate(lines) if line.startswith("stage")) :]
    assert next(line for line in stage_table if line.startswith("optimizer")).split()[-2:] == ["6.00", "3.00"]


@pytest.mark.parametrize("name, part", [("bert-tiny", "encoder"), ("gpt2-tiny", "decoder")])
def test_the_plain_flax_zoo_steps_attribute_their_ops_to_stages(name, part):
    from train.bench.steps import zoo_steps

    model = zoo_steps.MODELS[name]
    batch = zoo_steps.make_batch(name, model.rows, model.seq_lens[0], seed=0)
    step = zoo_steps.build_step("flax", name, batch)
    stages = {kernel_trace.stage(op_name) for op_name in kernel_trace.hlo_op_names(step.compiled.as_text()).values()}
    assert {f"{part} forward", f"{part} backward", "output projection + loss"} <= stages, stages


def test_step_breakdown_traces_the_stages_from_a_recompiled_step_and_hands_its_state_back(tmp_path):
    from train.bench.steps import transformer_steps

    def step(state, batch):
        loss, grad = jax.value_and_grad(lambda w: jax.numpy.sum((batch * w) ** 2))(state)
        return state - 0.1 * grad, loss

    batch = jax.numpy.arange(4.0)
    train_step = transformer_steps.compile_step(step, jax.numpy.ones(4), batch)
    train_step.run(batch)
    before = train_step.state

    result = kernel_trace.step_breakdown(train_step, batch, steps=1, trace_dir=tmp_path)
    assert list(result["stage_ms_per_step"]) == list(kernel_trace.STAGES)
    assert (tmp_path / kernel_trace.STAGE_TRACE_DIR / kernel_trace.HLO_FILENAME).read_text().startswith("HloModule")
    # the staged step ran on the step's state (donating it) and handed back the state it advanced
    assert before.is_deleted()
    assert float(train_step.state[1]) == pytest.approx(0.8**5, rel=1e-6)  # 5 steps of w *= 1 - 0.2 b^2


def test_the_stage_figure_stacks_each_implementations_stages(tmp_path):
    import matplotlib.image

    from train.bench import profile

    stages = {name: float(i + 1) for i, name in enumerate(kernel_trace.STAGES)}
    breakdowns = {
        "reference": {"stage_ms_per_step": stages},
        "ls_jax_ffi": {"stage_ms_per_step": {name: ms / 2 for name, ms in stages.items()}},
        "old_trace": {"ms_per_step": {}},
    }  # a breakdown without stages gets no bar
    path = tmp_path / "profile-h100.png"
    profile.plot_stages(breakdowns, "title", path)
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 1000
    assert (image[..., :3] < 0.9).any()  # something was drawn
    profile.plot_stages({"old_trace": {"ms_per_step": {}}}, "title", tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_profiles_of_one_shape_run_one_after_another_add_up():
    from train.bench import profile
    from train.bench.steps import workloads

    workload = profile.workload_of("bert-base", 8192, 512, None)
    other_shape = profile.workload_of("bert-base", 8192, 128, None)
    records = {
        workload.key("ls_jax_ffi"): {"profile": "ffi"},
        workload.key("flax"): {"profile": "flax"},
        workload.key("ls_jax_xla"): {"step_time_s": 0.04},  # timed by e2e alone: no profile
        other_shape.key("flax_cudnn"): {"profile": "another shape"},
    }
    found = profile.profiled_records(records, workload, workloads.implementations_of("bert-base"))
    assert {impl: record["profile"] for impl, record in found.items()} == {"flax": "flax", "ls_jax_ffi": "ffi"}
    assert list(found) == ["flax", "ls_jax_ffi"]  # the model's order, whichever ran first
