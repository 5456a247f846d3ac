"""Whether a training step fits in memory, checked before compiling (`train.costs.memory_budget`): the estimate
against XLA's buffer assignment, the limit's sources, and the one line a start that cannot fit ends with."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ls_jax.models.gpt import GPTLMHeadModel
from train.costs import memory_budget
from train.errors import UsageError
from train.gpt import model as gpt_model

REPO = Path(__file__).resolve().parents[2]


def tanh_loss(params, batch, rng):
    return jnp.sum(jnp.tanh(batch["x"] @ params["w"]) ** 2), jnp.float32(1), {}


def test_activations_scale_with_the_rows_and_match_xla_buffers():
    params = {"w": jax.ShapeDtypeStruct((256, 256), jnp.float32)}
    sizes = {
        rows: memory_budget.residual_sizes(tanh_loss, params, {"x": jax.ShapeDtypeStruct((rows, 256), jnp.float32)})
        for rows in (512, 1024)
    }
    # The backward of w needs at least x and the tanh output: two (rows, 256) f32 arrays.
    assert sum(sizes[512]) >= 2 * 512 * 256 * 4
    assert sum(sizes[1024]) == 2 * sum(sizes[512])
    need = memory_budget.estimate(
        tanh_loss, params, {}, {"x": jax.ShapeDtypeStruct((1024, 256), jnp.float32)}, accumulated=False
    )
    step = jax.jit(jax.grad(lambda w, x: tanh_loss({"w": w}, {"x": x}, None)[0]))
    analysis = step.lower(jnp.ones((256, 256)), jnp.ones((1024, 256))).compile().memory_analysis()
    xla = analysis.argument_size_in_bytes + analysis.output_size_in_bytes + analysis.temp_size_in_bytes
    assert xla <= need.total <= 3 * xla  # x, tanh, its derivative and square counted apart: XLA fuses them


@pytest.mark.slow
def test_gpt2_small_at_1024_positions_and_batch_8_is_estimated_above_host_scale():
    """The real-data defaults of train.gpt, which a 2-core CPU host with 24 GB could not train (killed at ~24 GB
    resident); the synthetic defaults are small."""

    def need(preset, seq_len, rows):
        config = gpt_model.preset_config(preset, vocab_size=16000, max_seq_len=max(seq_len, 256), dtype=jnp.float32)
        model = GPTLMHeadModel(config)
        params = jax.eval_shape(
            lambda key: model.init(key, jnp.ones((1, seq_len), jnp.int32))["params"], jax.random.PRNGKey(0)
        )
        batch = {name: jax.ShapeDtypeStruct((rows, seq_len), jnp.int32) for name in ("input_ids", "labels")}
        moments = jax.tree.map(lambda p: jax.ShapeDtypeStruct((2, *p.shape), p.dtype), params)
        return memory_budget.estimate(gpt_model.make_loss_fn(model), params, moments, batch, accumulated=False)

    assert need("gpt2-small", 1024, 8).total > 14 * 2**30
    assert need("gpt2-tiny", 64, 32).total < 2**30


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1073741824", 2**30),
        ("512MiB", 512 * 2**20),
        ("16 GB", 16 * 10**9),
        ("1.5GiB", int(1.5 * 2**30)),
        ("100b", 100),
    ],
)
def test_limits_parse_with_units(text, expected):
    assert memory_budget.parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["lots", "-1GiB", "0", "12 parsecs", ""])
def test_a_limit_that_is_no_amount_is_one_line(text):
    with pytest.raises(UsageError, match=r"\$LS_JAX_MEMORY_LIMIT=.* is not an amount of memory"):
        memory_budget.parse_bytes(text)


def test_host_memory_is_meminfo_available(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683656 kB\nMemFree:        14964776 kB\nMemAvailable:   16596732 kB\n")
    assert memory_budget.host_available(meminfo) == 16596732 * 1024
    assert memory_budget.host_available(tmp_path / "absent") is None
    assert memory_budget.host_available() > 0  # this machine's /proc/meminfo


def test_the_limit_comes_from_the_variable_else_a_cpu_host(monkeypatch):
    cpu = jax.devices("cpu")[0]
    monkeypatch.setenv(memory_budget.ENV_VAR, "3GiB")
    assert memory_budget.available(cpu) == (3 * 2**30, "set by $LS_JAX_MEMORY_LIMIT")
    monkeypatch.delenv(memory_budget.ENV_VAR)
    free, where = memory_budget.available(cpu)
    assert free > 0 and "MemAvailable" in where


def test_a_step_over_the_limit_is_one_line_naming_sizes_and_flags():
    need = memory_budget.StepMemory(state=2**30, gradients=2**29, activations=14 * 2**30, batch=2**16)
    memory_budget.check(need, (16 * 2**30, "available on this host (MemAvailable)"), "lower --batch-size")
    memory_budget.check(need, None, "lower --batch-size")
    with pytest.raises(UsageError) as raised:
        memory_budget.check(need, (12 * 2**30, "available on this host (MemAvailable)"), "lower --batch-size")
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(
        "a training step needs about 15.50 GiB (parameters and optimizer 1.00 GiB, gradients "
        "512.0 MiB, activations kept for the backward 14.00 GiB), more than the 12.00 GiB "
        "available on this host (MemAvailable); lower --batch-size"
    )


@pytest.mark.slow
def test_gpt_on_a_small_text_file_stops_before_compiling_with_one_line(tmp_path):
    """``train.gpt --data text:FILE`` picks gpt2-small, 1024 positions and batch 8: more than the limit set here."""
    corpus = tmp_path / "small.txt"
    rng = np.random.default_rng(0)
    words = ["the", "model", "reads", "a", "line", "of", "text", "and", "learns", "from", "it"]
    corpus.write_text("\n".join(" ".join(rng.choice(words, 40)) for _ in range(300)) + "\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), memory_budget.ENV_VAR: "8GiB"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "train.gpt",
            "--data",
            f"text:{corpus}",
            "--run-dir",
            str(tmp_path / "run"),
            "--no-progress",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("error: a training step needs about ")
    assert "more than the 8.00 GiB set by $LS_JAX_MEMORY_LIMIT; lower --batch-size" in done.stderr
    assert "--preset gpt2-tiny --max-seq-len 256" in done.stderr
    assert not (tmp_path / "run").exists()
