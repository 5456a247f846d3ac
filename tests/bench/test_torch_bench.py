"""The torch_compile row of train.bench.e2e: Hugging Face transformers' PyTorch BERT and GPT-2 on the JAX rows'
batches and settings, its step training, its record, and the one-line error where torch is missing."""

import json
import math
import subprocess
import sys

import jax
import numpy as np
import pytest

from train.bench import common, e2e, profile
from train.bench.steps import torch_steps, transformer_steps, workloads, zoo_steps


def _reference_param_count(name: str) -> int:
    batch = zoo_steps.make_batch(name, 2, 16, seed=0)
    model = zoo_steps.reference_model(name, "einsum")
    init = lambda key: model.init(key, **zoo_steps._init_args(model, batch))
    return sum(leaf.size for leaf in jax.tree.leaves(jax.eval_shape(init, jax.random.PRNGKey(0))))


@pytest.mark.parametrize("name", list(zoo_steps.MODELS))
def test_hf_models_have_the_flax_references_shape_and_dropout(name):
    torch = pytest.importorskip("torch")
    with torch.device("meta"):  # shapes only: no weights are made
        model = torch_steps.hf_model(name)
    assert model.training
    assert sum(p.numel() for p in model.parameters()) == _reference_param_count(name)
    config = model.config
    assert config._attn_implementation == "sdpa"
    if zoo_steps.MODELS[name].kind == "bert":
        assert (config.hidden_dropout_prob, config.attention_probs_dropout_prob) == (zoo_steps.DROPOUT,) * 2
        assert (config.hidden_act, config.layer_norm_eps, config.num_labels) == ("gelu", 1e-12, 2)
    else:
        assert (config.resid_pdrop, config.embd_pdrop, config.attn_pdrop) == (zoo_steps.DROPOUT,) * 3
        assert (config.activation_function, config.layer_norm_epsilon) == ("gelu_new", 1e-5)
        assert model.lm_head.weight is model.transformer.wte.weight  # logits tied to the token table


@pytest.mark.parametrize("name", ["bert-tiny", "gpt2-tiny"])
def test_the_torch_batch_is_the_jax_batch(name):
    torch = pytest.importorskip("torch")
    batch = zoo_steps.make_batch(name, 3, 16, seed=5)
    converted = torch_steps.torch_batch(batch, torch.device("cpu"))
    assert set(converted) == set(batch)
    for key, value in batch.items():
        assert converted[key].dtype == torch.int64
        np.testing.assert_array_equal(converted[key].numpy(), np.asarray(value))


def test_bert_reads_the_attention_mask_as_right_padding():
    """A padded token (mask 0) changes no logit of its row; a real one does."""
    torch = pytest.importorskip("torch")
    batch = torch_steps.torch_batch(zoo_steps.make_batch("bert-tiny", 3, 16, seed=1), torch.device("cpu"))
    row = int(batch["attention_mask"].sum(-1).argmin())
    assert batch["attention_mask"][row, -1] == 0 and batch["input_ids"][row, -1] == 0
    torch.manual_seed(0)
    model = torch_steps.hf_model("bert-tiny").eval()
    logits = lambda ids: model(input_ids=ids, attention_mask=batch["attention_mask"]).logits[row].detach()
    padded, real = batch["input_ids"].clone(), batch["input_ids"].clone()
    padded[row, -1], real[row, 1] = 7, 7
    torch.testing.assert_close(logits(padded), logits(batch["input_ids"]), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(logits(real), logits(batch["input_ids"]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["bert-tiny", "gpt2-tiny"])
def test_the_eager_step_trains_with_the_flax_steps_optimizer(name):
    """The step `torch_steps.build_step` compiles, run eagerly: seeded, AdamW at the Flax steps' settings, the loss
    falling from its start at chance (ln 2 classes, ln vocab tokens)."""
    pytest.importorskip("torch")
    model = zoo_steps.MODELS[name]
    batch = zoo_steps.make_batch(name, model.rows, 32, seed=0)
    losses = []
    for _ in range(2):
        step = torch_steps.build_step(name, batch, compiled=False, seed=3)
        losses.append([float(step.run()) for _ in range(12)])
    assert losses[0] == losses[1]  # the seed fixes the weights and the dropout masks
    (group,) = step.optimizer.param_groups
    assert (group["lr"], group["weight_decay"]) == (transformer_steps.LEARNING_RATE, transformer_steps.WEIGHT_DECAY)
    assert not group["fused"]  # fused only on CUDA
    assert abs(losses[0][0] - math.log(2 if model.kind == "bert" else model.vocab)) < 0.3
    assert np.mean(losses[0][-3:]) < np.mean(losses[0][:3])
    assert all(p.grad is None for p in step.model.parameters())  # zero_grad after every step
    assert step.memory_bytes() is None and step.device_name() == "cpu"


def test_torch_rows_are_not_jax_steps_and_are_not_profiled():
    batch = zoo_steps.make_batch("bert-tiny", 2, 16, seed=0)
    with pytest.raises(ValueError, match="torch_compile is a PyTorch step"):
        zoo_steps.build_step("torch_compile", "bert-tiny", batch)
    with pytest.raises(ValueError, match="the JAX profiler cannot break it down"):
        e2e.measure("torch_compile", workloads.zoo_workload("bert-tiny", 16), steps=1, profile_steps=1)
    assert "torch_compile" in workloads.DEFAULT_IMPLEMENTATIONS and "torch_compile" in workloads.REFERENCES
    assert "torch_compile" not in workloads.NEEDS_GPU  # CPU inductor compiles bert-tiny in about a minute
    assert "torch_compile" in workloads.implementations_of("gpt2-small")
    assert "torch_compile" not in workloads.implementations_of("base-6e6d")
    assert profile.profiled_implementations_of("bert-base") == zoo_steps.JAX_IMPLEMENTATIONS
    assert "ls_jax_ffi" in zoo_steps.JAX_IMPLEMENTATIONS and "torch_compile" not in zoo_steps.JAX_IMPLEMENTATIONS


def test_speedups_over_torch_compile_pair_each_other_row_with_it():
    results = {
        "bert-base/512/flax": {"step_time_s": 0.06, "run": "a"},
        "bert-base/512/ls_jax_ffi": {"step_time_s": 0.02, "run": "a"},
        "bert-base/512/torch_compile": {"step_time_s": 0.04, "run": "a"},
        "gpt2-small/1024/ls_jax_ffi": {"step_time_s": 0.02, "run": "a"},  # no torch_compile record: no ratio
    }
    assert e2e.speedups(results, workloads.TORCH_IMPLEMENTATIONS) == {
        "bert-base/512": {"flax": pytest.approx(0.04 / 0.06), "ls_jax_ffi": pytest.approx(2.0)}
    }
    assert e2e.speedups(results)["bert-base/512"]["torch_compile"] == pytest.approx(1.5)  # over plain Flax


def _result_file(tmp_path) -> e2e.ResultFile:
    header = {"peak_tflops": None, "target_basis_tflops": None, "measured_gemm_tflops": 1.0}
    return e2e.ResultFile(tmp_path / "e2e-cpu.json", {**header, "memory_capacity_bytes": None}, {}, "run-1", None)


def test_a_record_without_memory_or_dispatch_time_gets_its_rates_and_prints(tmp_path, monkeypatch, capsys):
    """A CPU torch_compile record (no allocator peak, no host dispatch) gets the JAX rows' derived rates."""
    workload = workloads.zoo_workload("bert-tiny", 64)
    record = {
        **e2e.timed_record(workload, {"median_s": 0.01, "p10_s": 0.009, "p90_s": 0.011}, steps=2),
        "host_dispatch_s": None,
        "init_compile_and_first_step_s": 60.0,
        "memory_bytes": None,
    }
    monkeypatch.setattr(e2e, "measure", lambda *args, **kwargs: dict(record))
    out = _result_file(tmp_path)
    measured = e2e.measure_one("torch_compile", workload, 2, out)
    assert measured["tokens_per_s"] == pytest.approx(workload.tokens() / 0.01)
    assert measured["tflops_per_s"] == pytest.approx(workload.flops() / 0.01 / 1e12)
    assert measured["steps_timed"] == 2 * e2e.STEPS_PER_SAMPLE
    assert "bert-tiny/64/torch_compile: 10.00 ms  MFU n/a  memory n/a  compile 60.0 s" in capsys.readouterr().out
    written = json.loads(out.path.read_text())
    assert written["results"]["bert-tiny/64/torch_compile"]["memory_bytes"] is None
    assert written["speedup_vs_torch_compile"] == {}


def test_missing_torch_is_recorded_as_one_line_naming_the_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    out = _result_file(tmp_path)
    assert e2e.measure_one("torch_compile", workloads.zoo_workload("bert-tiny", 16), 1, out) is None
    error = out.results["bert-tiny/16/torch_compile"]["error"]
    assert error.startswith("ImportError: the torch_compile row needs PyTorch and Hugging Face transformers (")
    assert error.endswith("): pip install torch transformers") and "\n" not in error
    assert json.loads(out.path.read_text())["results"]["bert-tiny/16/torch_compile"]["error"] == error
    assert "bert-tiny/16/torch_compile: FAILED ImportError" in capsys.readouterr().out


def test_the_benchmark_imports_without_torch():
    """torch is imported when the torch_compile row runs, not before: the rest of the suite runs without it."""
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
        "from train.bench import e2e, profile\n"
        "from train.bench.steps import torch_steps\n"
        "assert 'torch_compile' in e2e.workloads.DEFAULT_IMPLEMENTATIONS"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=common.REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_quick_run_times_torch_compile_on_cpu_beside_flax(tmp_path):
    """The torch_compile row of bert-tiny through `e2e.main`: CPU inductor, the JAX rows' protocol and fields."""
    pytest.importorskip("torch")
    flags = ["--quick", "--models", "bert", "--implementations", "flax,torch_compile"]
    assert e2e.main([*flags, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "e2e-cpu.json").read_text())
    timed = report["results"]
    assert set(timed) == {"bert-tiny/64/flax", "bert-tiny/64/torch_compile"}
    record = timed["bert-tiny/64/torch_compile"]
    assert (record["batch_rows"], record["seq_len"]) == (zoo_steps.MODELS["bert-tiny"].rows, 64)
    assert record["steps_timed"] == 2 * e2e.STEPS_PER_SAMPLE
    assert 0 < record["step_time_s"] < record["init_compile_and_first_step_s"]
    assert record["memory_bytes"] is None and record["host_dispatch_s"] is None and record["torch_device"] == "cpu"
    assert record["flops_per_step"] == timed["bert-tiny/64/flax"]["flops_per_step"]
    assert math.isclose(record["tokens_per_s"], record["tokens_per_step"] / record["step_time_s"])
    assert abs(record["first_loss"] - math.log(2)) < 0.3 and math.isfinite(record["loss_after_timing"])
    assert set(record["versions"]) == {"torch", "transformers"}
    ratio = report["speedup_vs_torch_compile"]["bert-tiny/64"]["flax"]
    assert math.isclose(ratio, record["step_time_s"] / timed["bert-tiny/64/flax"]["step_time_s"])
    assert "torch.compile" in report["zoo_setup"]["torch_compile"]
    assert (tmp_path / "e2e-cpu.png").stat().st_size > 0
