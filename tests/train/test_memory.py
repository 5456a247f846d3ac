"""The memory anatomy of a run: parts from the train state and XLA's memory analysis of the compiled step, in the
summary of a tiny training run and in the comparison report."""

import contextlib
import io

import jax
import jax.numpy as jnp
import optax
import pytest

from train.compare import report as compare
from train.costs import memory
from train.harness.optimizer import make_optimizer
from train.harness.training import run_training
from train.imdb import task as imdb
from train.records import runlog


def test_optimizer_bytes_split_master_weights_from_moments():
    params = {"w": jnp.ones((8, 4), jnp.bfloat16), "b": jnp.ones((4,), jnp.bfloat16)}
    tx = make_optimizer(
        "adamw", optax.constant_schedule(1e-3), weight_decay=0.0, clip_norm=None, master_dtype=jnp.bfloat16
    )
    master, moments = memory.optimizer_bytes(tx.init(params))
    # bf16 master weights are kept as int16 low halves: 2 bytes per parameter; two f32 moments: 8, and a counter.
    assert master == 36 * 2
    assert moments >= 36 * 8


def test_gradients_count_in_f32_beside_bf16_params():
    """The step sums gradients in f32 and the optimizer reads them so: bf16 params with master weights hold 2 + 4 + 2
    (the master's low halves) + 8 bytes of state per parameter."""
    params = {"w": jnp.ones((8, 4), jnp.bfloat16), "b": jnp.ones((4,), jnp.bfloat16)}
    tx = make_optimizer(
        "adamw", optax.constant_schedule(1e-3), weight_decay=0.0, clip_norm=None, master_dtype=jnp.bfloat16
    )
    result = memory.anatomy(params, tx.init(params), None, measured_peak=None)
    assert result["params_bytes"] == 2 * 36 and result["grads_bytes"] == 4 * 36
    assert result["state_bytes_per_param"] == pytest.approx(16.0, abs=0.2)  # the moments' counter: a few bytes more


def test_anatomy_adds_up_and_compares_with_the_rule():
    params = {"w": jnp.ones((64, 64)), "b": jnp.ones((64,))}
    tx = make_optimizer("optax-adamw", optax.constant_schedule(1e-3), weight_decay=0.0, clip_norm=None)
    opt_state = tx.init(params)

    def step(params, x):
        grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(params)
        return jax.tree.map(lambda p, g: p - g, params, grads)

    analysis = jax.jit(step).lower(params, jnp.ones((256, 64))).compile().memory_analysis()
    result = memory.anatomy(params, opt_state, analysis, measured_peak=None)
    count = 64 * 64 + 64
    assert result["param_count"] == count
    assert result["params_bytes"] == result["grads_bytes"] == 4 * count
    assert result["optimizer_master_bytes"] == 0 and result["optimizer_moments_bytes"] >= 8 * count
    assert result["temporaries_bytes"] == analysis.temp_size_in_bytes > 0
    # The gradients are temporaries of the jitted step: counted once, inside the temporaries, not again in the total.
    assert result["temporaries_bytes"] >= result["grads_bytes"]
    assert result["total_bytes"] == sum(
        result[key]
        for key in ("params_bytes", "optimizer_master_bytes", "optimizer_moments_bytes", "temporaries_bytes")
    )
    assert result["bytes_per_param"] == pytest.approx(result["total_bytes"] / count)
    assert result["state_bytes_per_param"] == pytest.approx(16.0, abs=0.01)  # f32 params, grads and two moments
    assert result["measured_peak_bytes"] is None and result["rule_bytes_per_param"] == 18
    assert "16.0 for the state; rule 18" in memory.describe(result)


def test_training_summary_and_report_hold_the_anatomy(tmp_path, capsys):
    run_dir = tmp_path / "run"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        code = run_training(
            imdb.TASK,
            [
                "--steps",
                "2",
                "--log-every",
                "1",
                "--no-progress",
                "--no-tensorboard",
                "--batch-size",
                "4",
                "--max-seq-len",
                "16",
                "--run-dir",
                str(run_dir),
            ],
        )
    assert code == 0 and "  memory      params " in printed.getvalue()
    records = runlog.read(run_dir / "run.jsonl")
    summary = records[-1]["memory"]
    assert summary["param_count"] == records[0]["params"]
    assert summary["params_bytes"] == 4 * records[0]["params"]  # fp32 on CPU
    assert summary["temporaries_bytes"] > 0 and summary["total_bytes"] > summary["params_bytes"] * 3
    assert summary["xla_peak_bytes"] is None or summary["xla_peak_bytes"] > 0
    out = tmp_path / "report"
    assert compare.main([str(run_dir), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "## Memory anatomy" in text and f"{summary['params_bytes'] / 2**20:,.1f} MiB" in text
