"""``--remat``: gradient checkpointing of each Transformer layer gives the same loss and gradients and keeps fewer
activations for the backward (the residuals of ``jax.vjp``); on a GPU the compiled step's temporaries shrink."""

import contextlib
import dataclasses
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ls_jax.layers import LayerConfig
from ls_jax.layers.transformer import TransformerDecoder, TransformerEncoder
from train.harness.training import run_training
from train.imdb import config as imdb_config
from train.imdb import model as imdb_model
from train.imdb import task as imdb
from train.records import runlog

MODES = ("none", "gemm-outputs", "layer")
BASE = LayerConfig(hidden_size=32, intermediate_size=128, nhead=4, max_seq_len=16, dtype=jnp.float32)
RNGS = {"dropout": jax.random.PRNGKey(3)}


def _causal_encoder_loss(remat):
    model = TransformerEncoder(dataclasses.replace(BASE, remat=remat), 3, causal=True)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 16, 32))
    params = jax.jit(model.init)({"params": jax.random.PRNGKey(0)}, x)
    return params, lambda p: jnp.mean(model.apply(p, x, deterministic=False, rngs=RNGS) ** 2)


def _decoder_loss(remat):
    model = TransformerDecoder(dataclasses.replace(BASE, remat=remat), 2)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 32))
    encoded = jax.random.normal(jax.random.PRNGKey(2), (2, 16, 32))
    params = jax.jit(model.init)({"params": jax.random.PRNGKey(0)}, x, encoded)
    return params, lambda p: jnp.mean(model.apply(p, x, encoded, deterministic=False, rngs=RNGS) ** 2)


def residual_bytes(loss, params):
    """Bytes ``jax.vjp`` keeps for the backward: the arrays its pullback closes over (traced, not run)."""
    pullback = jax.eval_shape(lambda p: jax.vjp(loss, p)[1], params)
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(pullback))


@pytest.mark.slow
@pytest.mark.parametrize("build", [_causal_encoder_loss, _decoder_loss], ids=["causal-encoder", "decoder"])
def test_remat_keeps_loss_and_gradients_and_fewer_activations(build):
    results = {}
    for mode in MODES:
        params, loss = build(mode)
        value, grads = jax.jit(jax.value_and_grad(loss))(params)
        results[mode] = (params, value, grads, residual_bytes(loss, params))
    params, value, grads, kept = results["none"]
    for mode in MODES[1:]:
        other_params, other_value, other_grads, _ = results[mode]
        assert jax.tree.structure(other_params) == jax.tree.structure(params)  # same parameter names: checkpoints load
        np.testing.assert_array_equal(other_value, value)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), other_grads, grads)
    assert results["layer"][3] < results["gemm-outputs"][3] < kept


def test_unknown_remat_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="remat must be one of none, layer, gemm-outputs, got 'all'"):
        dataclasses.replace(BASE, remat="all")


def test_train_cli_takes_remat(tmp_path, capsys):
    run_dir = tmp_path / "run"
    with contextlib.redirect_stdout(io.StringIO()):
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
                "--remat",
                "layer",
                "--run-dir",
                str(run_dir),
            ],
        )
    assert code == 0
    records = runlog.read(run_dir / "run.jsonl")
    assert "--remat layer" in records[0]["command"] and records[-1]["completed"]
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["remat"] == "layer"  # what the run resolved, and what resuming it builds the model from
    model_cfg, _ = imdb_model.build_model(
        imdb_config.resolve_config({}, saved), vocab_size=64, precision="fp32", rng=jax.random.PRNGKey(0)
    )
    assert model_cfg.layer.remat == "layer"
    with pytest.raises(SystemExit) as exit_info:
        run_training(imdb.TASK, ["--remat", "some", "--run-dir", str(tmp_path / "bad")])
    assert exit_info.value.code == 2 and "invalid choice: 'some'" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["layer", "gemm-outputs"])
def test_remat_shrinks_the_compiled_temporaries_on_gpu(mode):
    config = dataclasses.replace(BASE, hidden_size=256, intermediate_size=1024, max_seq_len=128, dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.PRNGKey(1), (32, 128, 256), jnp.bfloat16)

    def temporaries(remat):
        model = TransformerEncoder(dataclasses.replace(config, remat=remat), 6)
        params = model.init({"params": jax.random.PRNGKey(0)}, x)
        loss = lambda p: jnp.mean(model.apply(p, x, deterministic=False, rngs=RNGS).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes

    assert temporaries(mode) < temporaries("none")
