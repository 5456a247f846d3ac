"""The BERT and GPT-2 rows of train.bench.e2e: the plain Flax references are the ls_jax models (same
parameters, same function), the workloads' shapes and errors, and a --quick run of both on CPU."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.bench import e2e, profile
from train.bench.steps import workloads, zoo_steps
from train.reference.zoo import ZooConfig


def _param_count(init) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(jax.eval_shape(init, jax.random.PRNGKey(0))))


@pytest.mark.parametrize("name", list(zoo_steps.MODELS))
@pytest.mark.parametrize("attention", ["einsum", "xla"])  # "xla" is the "cudnn" model's call on a CPU
def test_references_have_the_ls_jax_models_parameter_count(name, attention):
    batch = zoo_steps.make_batch(name, 2, 16, seed=0)
    reference = zoo_steps.reference_model(name, attention)
    ls_jax = zoo_steps.ls_jax_model(name)
    reference_count = _param_count(lambda key: reference.init(key, **zoo_steps._init_args(reference, batch)))
    ls_jax_count = _param_count(lambda key: ls_jax.init(key, batch["input_ids"], batch.get("attention_mask")))
    assert reference_count == ls_jax_count
    if name == "bert-base":  # Hugging Face's bert-base-uncased (109,482,240) plus the 768 x 2 classifier
        assert reference_count == 109_482_240 + 768 * 2 + 2
    if name == "gpt2-small":  # Hugging Face's gpt2
        assert reference_count == 124_439_808


def _ls_jax_params(reference: dict, kind: str) -> dict:
    """The reference's parameters laid out as the ls_jax model's (fused QKV, biases beside their kernels)."""

    def attention(block):
        a = block["self_attention"]
        return {
            "qkv": {"kernel": jnp.stack([a[p]["kernel"] for p in ("query", "key", "value")], axis=1)},
            "qkv_bias": jnp.stack([a[p]["bias"] for p in ("query", "key", "value")]),
            "out": {"kernel": a["out"]["kernel"]},
            "out_bias": a["out"]["bias"],
            "layer_norm": block["attention_layer_norm"],
        }

    def feed_forward(block):
        f = block["feed_forward"]
        return {
            "fc1": {"kernel": f["fc1"]["kernel"]},
            "fc1_bias": f["fc1"]["bias"],
            "fc2": {"kernel": f["fc2"]["kernel"]},
            "fc2_bias": f["fc2"]["bias"],
            "layer_norm": block["output_layer_norm"],
        }

    layers = {
        name: {"self_attention": attention(block), "feed_forward": feed_forward(block)}
        for name, block in reference.items()
        if name.startswith("layer_")
    }
    if kind == "gpt":
        return {
            "embedding": {
                "embedding": reference["token_embedding"]["embedding"],
                "position_embedding": reference["position_embedding"]["embedding"],
            },
            "decoder": {**layers, "final_layer_norm": reference["final_layer_norm"]},
        }
    return {
        "embeddings": {
            "word_embedding": reference["word_embedding"]["embedding"],
            "position_embedding": reference["position_embedding"]["embedding"],
            "token_type_embedding": reference["token_type_embedding"]["embedding"],
            "layer_norm": reference["embedding_layer_norm"],
        },
        "encoder": layers,
        "pooler": reference["pooler"],
        "classifier": reference["classifier"],
    }


@pytest.mark.parametrize("name", ["bert-tiny", "gpt2-tiny"])
@pytest.mark.parametrize("attention", ["einsum", "xla"])
def test_references_compute_the_ls_jax_models_function(name, attention):
    """In f32 without dropout, the reference with the ls_jax model's weights gives its logits: padding masked
    (BERT, rows of 5 to 16 real tokens) or causal (GPT-2), through either attention core."""
    batch = zoo_steps.make_batch(name, 3, 16, seed=1)
    config = zoo_steps.ls_jax_config(name)
    ls_jax = type(zoo_steps.ls_jax_model(name))(
        dataclasses.replace(config, layer=dataclasses.replace(config.layer, dtype=jnp.float32))
    )
    reference = type(zoo_steps.reference_model(name, attention))(
        dataclasses.replace(zoo_steps.reference_config(name, attention), dtype=jnp.float32)
    )
    variables = reference.init(jax.random.PRNGKey(2), **zoo_steps._init_args(reference, batch))
    ls_jax_variables = {"params": _ls_jax_params(variables["params"], zoo_steps.MODELS[name].kind)}
    expected = zoo_steps.ls_jax_apply(ls_jax, ls_jax_variables, batch)
    got = zoo_steps.reference_apply(reference, variables, batch)
    assert got.shape == expected.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-4, atol=2e-5)
    # the comparison sees the mask: a padded token changes nothing, a real one changes the logits
    if zoo_steps.MODELS[name].kind == "bert":
        mask = np.asarray(batch["attention_mask"])
        row = int(np.argmin(mask.sum(-1)))
        changed = {**batch, "input_ids": batch["input_ids"].at[row, -1].set(7)}
        np.testing.assert_allclose(
            np.asarray(zoo_steps.reference_apply(reference, variables, changed))[row],
            np.asarray(got)[row],
            rtol=1e-5,
            atol=1e-6,
        )
        real_changed = {**batch, "input_ids": batch["input_ids"].at[row, 1].set(7)}
        assert not np.allclose(
            np.asarray(zoo_steps.reference_apply(reference, variables, real_changed))[row],
            np.asarray(got)[row],
            rtol=1e-5,
            atol=1e-6,
        )


def test_the_cudnn_core_refuses_attention_dropout():
    with pytest.raises(ValueError, match="has no dropout: set attention_dropout_rate=0"):
        ZooConfig(
            vocab_size=8,
            hidden_size=8,
            intermediate_size=8,
            num_heads=2,
            num_layers=1,
            max_positions=8,
            attention="cudnn",
        )
    with pytest.raises(ValueError, match="attention must be one of einsum, cudnn, xla"):
        ZooConfig(
            vocab_size=8,
            hidden_size=8,
            intermediate_size=8,
            num_heads=2,
            num_layers=1,
            max_positions=8,
            attention="flash",
        )


def test_model_families_expand_and_unknown_names_are_named():
    assert workloads.expand_models(["bert", "gpt"]) == ["bert-base", "gpt2-small"]
    assert workloads.expand_models(["wmt", "bert", "gpt"], quick=True) == ["tiny-2e2d", "bert-tiny", "gpt2-tiny"]
    assert workloads.expand_models(["big-6e6d", "wmt"])[0] == "big-6e6d"
    with pytest.raises(ValueError, match="unknown model 'bart'"):
        workloads.expand_models(["bart"])


def test_zoo_workloads_use_each_models_lengths_and_rows():
    rows = {(w.model, w.size, w.rows) for w in workloads.workloads(["bert-base", "gpt2-small", "base-6e6d"], [8192])}
    assert rows == {("bert-base", 128, 32), ("bert-base", 512, 32), ("gpt2-small", 1024, 8), ("base-6e6d", 8192, 128)}
    bert = workloads.zoo_workload("bert-base", 512)
    assert bert.key("ls_jax_ffi") == "bert-base/512/ls_jax_ffi"
    assert bert.describe() == {"batch_rows": 32, "seq_len": 512, "tokens_per_step": 32 * 512, "token_ids": "uniform"}
    # 6 N t + 12 layers L H t, the pooler and classifier (docs/flops.md)
    assert bert.flops() > 6 * 85e6 * 32 * 512
    with pytest.raises(ValueError, match="sequence length 1024 is outside 1..512"):
        workloads.zoo_workload("bert-base", 1024)


def test_profile_takes_bert_and_gpt_and_names_a_bad_length(capsys):
    workload = profile.workload_of("gpt2-small", 8192, None, None)
    assert (workload.size, workload.rows) == (1024, 8)
    assert profile.profile_stem(workload) == "profile-gpt2-small-1024"
    assert profile.profile_stem(profile.workload_of("big-6e6d", 8192, None, None)) == "profile"
    with pytest.raises(SystemExit):
        profile.main(["--model", "bert-base", "--seq-len", "2048"])
    assert "sequence length 2048 is outside 1..512" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        profile.main(["--model", "bert-base", "--implementations", "reference"])
    assert "bert-base has no implementation reference" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_run_measures_bert_and_gpt_against_plain_flax(tmp_path):
    assert e2e.main(["--quick", "--models", "bert,gpt", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "e2e-cpu.json").read_text())
    timed = report["results"]
    assert set(timed) == {
        f"{model}/64/{implementation}"
        for model in ("bert-tiny", "gpt2-tiny")
        for implementation in ("flax", "ls_jax_xla", "torch_compile")  # torch_compile: CPU inductor
    }
    for key, record in timed.items():
        model = zoo_steps.MODELS[key.split("/")[0]]
        assert (record["batch_rows"], record["seq_len"]) == (model.rows, 64)
        assert record["tokens_per_step"] == model.rows * 64
        assert record["step_time_s"] > 0 and record["flops_per_step"] > 0
        # XLA's memory analysis; PyTorch's CPU allocator keeps no peak
        assert record["memory_bytes"] is None if key.endswith("torch_compile") else record["memory_bytes"] > 0
        assert math.isclose(record["tokens_per_s"], record["tokens_per_step"] / record["step_time_s"])
        assert math.isfinite(record["first_loss"]) and math.isfinite(record["loss_after_timing"])
    # 2 labels: the first loss is near ln 2; the language model starts near ln(vocab)
    assert abs(timed["bert-tiny/64/flax"]["first_loss"] - math.log(2)) < 0.3
    assert abs(timed["gpt2-tiny/64/ls_jax_xla"]["first_loss"] - math.log(512)) < 0.5
    for model in ("bert-tiny/64", "gpt2-tiny/64"):
        ratio = report["speedup_vs_reference"][model]["ls_jax_xla"]
        assert math.isclose(ratio, timed[f"{model}/flax"]["step_time_s"] / timed[f"{model}/ls_jax_xla"]["step_time_s"])
    assert report["speedup_vs_flax_cudnn"] == {}  # cuDNN attention needs a GPU
    assert set(report["speedup_vs_torch_compile"]["gpt2-tiny/64"]) == {"flax", "ls_jax_xla"}
    assert (tmp_path / "e2e-cpu.png").stat().st_size > 0


def test_largest_batch_prediction_leaves_sequence_lengths_alone():
    """BERT's sizes are sequence lengths, whose memory grows faster than the tokens: no prediction from them."""
    results = {f"bert-base/{n}/flax": {"memory_bytes": 10**9 * n // 128} for n in (128, 512)}
    results.update({f"base-6e6d/{t}/reference": {"memory_bytes": 10**9 + 10**5 * t} for t in (1024, 8192)})
    assert list(e2e.predicted_largest_batches(results, capacity=4 * 10**9)) == ["base-6e6d"]
