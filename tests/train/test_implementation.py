"""``--implementation flax|ls_jax``: the plain Flax baselines of train/reference/ compute the ls_jax models'
functions (BERT and GPT-2 on the same weights, the criteria on the same logits), decode with a cache as the full
forward does, and train through the same harness: each task end to end, resumed, its run record naming the
implementation, a checkpoint of one refused by the other."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from test_train_imdb import csv_data, csv_job  # noqa: F401 - csv_data is a fixture
from test_train_wmt import SMALL, compilation_cache, corpus_dir  # noqa: F401 - fixtures

from ls_jax.layers import fp8
from ls_jax.models import PAD_ID, BertConfig, TransformerConfig
from ls_jax.models.decoding import beam_search, greedy_decode
from ls_jax.models.gpt import GPTConfig
from ls_jax.ops import label_smoothed_cross_entropy
from train.errors import EXIT_USAGE
from train.gpt import model as gpt_model
from train.gpt import task as gpt
from train.harness.training import run_training
from train.imdb import config as imdb_config
from train.imdb import model as imdb_model
from train.imdb import task as imdb
from train.records import runlog
from train.reference import from_ls_jax
from train.reference.losses import label_smoothed_sums
from train.wmt import model as wmt_model
from train.wmt import task as wmt

QUIET = ["--no-progress", "--no-tensorboard"]


def tiny_bert_config(**changes) -> BertConfig:
    config = imdb_model.preset_config("bert-tiny", vocab_size=40, num_labels=3, dtype=jnp.float32)
    return dataclasses.replace(config, **changes)


def padded_rows(rng, rows, length, vocab, pad_id):
    """Token ids (rows, length) in 1..vocab-1, each row's tail after a random length (>= 2) set to ``pad_id``."""
    ids = rng.integers(1, vocab, (rows, length))
    lengths = rng.integers(2, length + 1, rows)
    return jnp.asarray(np.where(np.arange(length)[None] < lengths[:, None], ids, pad_id), jnp.int32)


# ------------------------------------------------------------------------------------ same function, same weights


def test_flax_and_ls_jax_bert_give_the_same_logits_for_the_same_weights():
    """The imdb task's two classifiers on ls_jax's parameters and their mapping onto the reference's layout, rows
    padded at the end; the comparison sees the tokens (changing a real one changes the logits)."""
    model_cfg = tiny_bert_config()
    pad_id = 0
    config = imdb_config.ImdbConfig()
    ls_jax, _ = imdb_model.build_classifier(config, model_cfg, None, pad_id)
    flax, _ = imdb_model.build_classifier(config.replace(implementation="flax"), model_cfg, None, pad_id)
    variables = ls_jax.init(jax.random.PRNGKey(0), 12)
    reference = {"params": from_ls_jax.bert_params(variables["params"])}
    input_ids = padded_rows(np.random.default_rng(0), 5, 12, 40, pad_id)
    expected = ls_jax.logits(variables, input_ids, deterministic=True)
    got = flax.logits(reference, input_ids, deterministic=True)
    assert got.shape == (5, 3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-4, atol=2e-5)
    changed = input_ids.at[0, 1].set(int(input_ids[0, 1]) % 39 + 1)
    assert not np.allclose(
        np.asarray(flax.logits(reference, changed, deterministic=True))[0],
        np.asarray(got)[0],
        rtol=1e-5,
        atol=1e-6,
    )


def test_flax_bert_takes_the_random_init_in_its_own_layout():
    """Random initialization of the flax implementation makes the reference's tree, with ls_jax's sizes."""
    model_cfg = tiny_bert_config()
    config = imdb_config.ImdbConfig(implementation="flax")
    flax, pretrained = imdb_model.build_classifier(config, model_cfg, None, 0)
    assert pretrained is None
    params = flax.init(jax.random.PRNGKey(0), 12)["params"]
    ls_jax, _ = imdb_model.build_classifier(imdb_config.ImdbConfig(), model_cfg, None, 0)
    mapped = from_ls_jax.bert_params(ls_jax.init(jax.random.PRNGKey(0), 12)["params"])
    assert jax.tree.structure(params) == jax.tree.structure(mapped)
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, mapped)


def test_both_bert_implementations_multiply_in_fp8_with_the_same_scaling_ops():
    """--precision fp8 with either implementation: the same GEMMs quantized (the attention projections, fused in
    ls_jax and three in plain Flax, its output and the two feed-forward ones; not the pooler's and classifier's one
    row per sequence), the logits within FP8's error of the bf16 ones."""
    model_cfg = tiny_bert_config(layer=dataclasses.replace(tiny_bert_config().layer, dtype=jnp.bfloat16, fp8=True))
    plain_cfg = tiny_bert_config(layer=dataclasses.replace(model_cfg.layer, fp8=False))
    input_ids = padded_rows(np.random.default_rng(0), 5, 12, 40, 0)
    for implementation, ops_per_layer in (("ls_jax", 4), ("flax", 6)):
        config = imdb_config.ImdbConfig(implementation=implementation)
        classifier, _ = imdb_model.build_classifier(config, model_cfg, None, 0)
        plain, _ = imdb_model.build_classifier(config, plain_cfg, None, 0)
        variables = classifier.init(jax.random.PRNGKey(0), 12)
        ops = {path[:-1] for path in flatten_dict(variables[fp8.SCALING])}
        assert len(ops) == ops_per_layer * plain_cfg.num_layers, (implementation, sorted(ops))
        got = classifier.logits(variables, input_ids, deterministic=True).astype(jnp.float32)
        expected = plain.logits({"params": variables["params"]}, input_ids, deterministic=True).astype(jnp.float32)
        error = float(jnp.linalg.norm(got - expected) / jnp.linalg.norm(expected))
        assert 1e-3 < error < 0.1, (implementation, error)


def test_flax_and_ls_jax_gpt_give_the_same_logits_for_the_same_weights():
    model_cfg = gpt_model.preset_config("gpt2-tiny", vocab_size=50, dtype=jnp.float32, max_seq_len=16)
    ls_jax = gpt_model.build_model("ls_jax", model_cfg)
    flax = gpt_model.build_model("flax", model_cfg)
    input_ids = jnp.asarray(np.random.default_rng(1).integers(0, 50, (3, 16)), jnp.int32)
    params = ls_jax.init(jax.random.PRNGKey(2), input_ids)["params"]
    expected = ls_jax.apply({"params": params}, input_ids)
    got = flax.apply({"params": gpt_model.params_for("flax", params)}, input_ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-4, atol=2e-5)
    assert flax.max_positions == ls_jax.max_positions == 16


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(activation_fn="relu"), "activation_fn 'relu' (the reference's: 'gelu')"),
        (dict(activation_dropout_ratio=0.1), "activation_dropout_ratio 0.1 (the reference's: 0.0)"),
    ],
)
def test_a_bert_the_reference_cannot_compute_is_named(change, message):
    model_cfg = tiny_bert_config()
    model_cfg = dataclasses.replace(model_cfg, layer=dataclasses.replace(model_cfg.layer, **change))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        imdb_model.reference_config(model_cfg)


def test_the_plain_criteria_compute_the_fused_ops_sums():
    """WMT's label-smoothed loss and GPT's token NLL: the optax criterion of the flax implementation against
    ls_jax's fused op (XLA on CPU), padding and ignored labels included, values and gradients."""
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(4, 6, 11)), jnp.float32)
    labels = jnp.asarray(rng.integers(1, 11, (4, 6)), jnp.int32).at[:, -2:].set(PAD_ID)
    for implementation in ("flax", "ls_jax"):
        sums = wmt_model.make_criterion(implementation, 0.1)(logits, labels)
        assert float(sums[2]) == 4 * 4
        np.testing.assert_allclose(
            np.asarray(sums),
            np.asarray(label_smoothed_cross_entropy(logits, labels, epsilon=0.1, pad_id=PAD_ID)),
            rtol=1e-5,
        )
    grad = lambda criterion: jax.grad(lambda z: criterion(z, labels)[0])(logits)  # noqa: E731
    np.testing.assert_allclose(
        grad(wmt_model.make_criterion("flax", 0.1)), grad(wmt_model.make_criterion("ls_jax", 0.1)), rtol=1e-5, atol=1e-7
    )
    ignored = labels.at[0].set(-1)
    np.testing.assert_allclose(
        np.asarray(gpt_model.LM_SUMS["flax"](logits, ignored)),
        np.asarray(gpt_model.LM_SUMS["ls_jax"](logits, ignored)),
        rtol=1e-5,
    )
    assert float(label_smoothed_sums(logits, ignored, epsilon=0.0, ignore_label=-1)[2]) == 3 * 6


# ------------------------------------------------------------------------------------------- decoding with a cache


@pytest.mark.slow
def test_the_plain_gpt_decodes_a_prompt_then_tokens_as_the_full_forward():
    model_cfg = gpt_model.preset_config("gpt2-tiny", vocab_size=50, dtype=jnp.float32, max_seq_len=16)
    model = gpt_model.build_model("flax", model_cfg)
    ids = jnp.asarray(np.random.default_rng(4).integers(0, 50, (2, 10)), jnp.int32)
    params = model.init(jax.random.PRNGKey(5), ids)["params"]
    full = model.apply({"params": params}, ids)
    _, cache = model.apply({"params": params}, 2, 12, method="init_cache", mutable=["cache"])
    pieces = []
    for start, stop in ((0, 6), (6, 7), (7, 8), (8, 10)):
        logits, cache = model.apply({"params": params, **cache}, ids[:, start:stop], method="decode", mutable=["cache"])
        pieces.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(pieces, 1)), np.asarray(full), rtol=1e-4, atol=1e-5)
    greedy = gpt_model.generate(
        model, {"params": params}, ids[:, :3], max_new_tokens=4, rng=jax.random.key(0), temperature=0.0
    )
    tokens = ids[:, :3]
    for _ in range(4):  # greedy by full forwards
        tokens = jnp.concatenate([tokens, jnp.argmax(model.apply({"params": params}, tokens)[:, -1:], -1)], 1)
    np.testing.assert_array_equal(np.asarray(greedy), np.asarray(tokens[:, 3:]))


@pytest.mark.slow
def test_the_plain_transformer_decodes_through_ls_jax_decoding():
    """Greedy decoding of the reference through ls_jax.models.decoding equals argmax over full forwards; beam 1
    is greedy; the cache's steps give the teacher-forced logits."""
    model_cfg = TransformerConfig.preset(
        "transformer-tiny",
        30,
        dtype=jnp.float32,
        hidden_dropout_ratio=0.0,
        attn_prob_dropout_ratio=0.0,
        activation_dropout_ratio=0.0,
        max_seq_len=12,
    )
    model = wmt_model.build_model("flax", model_cfg)
    assert model.max_target_len == 12
    src = jnp.asarray([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]], jnp.int32)
    tgt = jnp.asarray([[1, 20, 21, 22, 23], [1, 24, 25, 26, 27]], jnp.int32)
    params = model.init(jax.random.PRNGKey(6), src, tgt)["params"]
    full = model.apply({"params": params}, src, tgt)
    encoded, src_mask = model.apply({"params": params}, src, method="encode")
    _, state = model.apply({"params": params}, encoded, src_mask, 8, method="init_cache", mutable=["cache"])
    steps = []
    for index in range(tgt.shape[1]):
        logits, state = model.apply(
            {"params": params, **state}, tgt[:, index : index + 1], method="decode", mutable=["cache"]
        )
        steps.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1)), np.asarray(full), rtol=1e-4, atol=1e-5)

    decoded = np.asarray(greedy_decode(model, {"params": params}, src, max_len=6))
    sequence = jnp.ones((2, 1), jnp.int32)
    for _ in range(6):
        logits = model.apply({"params": params}, src, sequence)[:, -1].at[:, jnp.array([0, 1])].set(-jnp.inf)
        sequence = jnp.concatenate([sequence, jnp.argmax(logits, -1)[:, None].astype(jnp.int32)], 1)
    expected = np.asarray(sequence[:, 1:])
    for row in range(2):  # after EOS (2) the decoder writes padding
        ends = np.flatnonzero(expected[row] == 2)
        if len(ends):
            expected[row, ends[0] + 1 :] = PAD_ID
    np.testing.assert_array_equal(decoded, expected)
    np.testing.assert_array_equal(
        np.asarray(beam_search(model, {"params": params}, src, beam_size=1, max_len=6)), decoded
    )
    with pytest.raises(ValueError, match="max_len must be in"):
        greedy_decode(model, {"params": params}, src, max_len=13)


# ------------------------------------------------------------------------------------------------- flags


@pytest.mark.parametrize("task", [imdb.TASK, wmt.TASK, gpt.TASK], ids=["imdb", "wmt", "gpt"])
def test_remat_with_the_flax_implementation_is_one_line(task, tmp_path, capsys):
    assert (
        run_training(task, ["--implementation", "flax", "--remat", "layer", "--run-dir", str(tmp_path / "r")])
        == EXIT_USAGE
    )
    err = capsys.readouterr().err
    assert err.startswith("error: --remat layer needs --implementation ls_jax") and err.count("\n") == 1


def test_gpt_config_reference_refuses_another_embedding_dropout():
    model_cfg = dataclasses.replace(GPTConfig.preset("gpt2-tiny", vocab_size=50), embedding_dropout=0.3)
    with pytest.raises(ValueError, match="embedding dropout 0.3"):
        gpt_model.build_model("flax", model_cfg)


# ------------------------------------------------------------------------------------------- end to end


def implementations(run_dir):
    records = runlog.read(run_dir / runlog.LOG_FILENAME)
    return [r["implementation"] for r in records if r["type"] == "run"], records


def train_resume_refuse(task, args, run_dir, capsys):
    """2 steps with --implementation flax (a checkpoint at 1 and 2), resumed to 4, then refused as ls_jax."""
    assert (
        run_training(
            task,
            [
                *args,
                "--implementation",
                "flax",
                "--steps",
                "2",
                "--log-every",
                "1",
                "--checkpoint-every",
                "1",
                "--run-dir",
                str(run_dir),
                *QUIET,
            ],
        )
        == 0
    )
    assert run_training(task, ["--resume", str(run_dir), "--steps", "4", *QUIET]) == 0
    recorded, records = implementations(run_dir)
    assert recorded == ["flax"] and records[0]["config"]["implementation"] == "flax"
    assert [r["step"] for r in records if r["type"] == "interval"] == [1, 2, 3, 4]
    assert records[-1]["type"] == "summary" and records[-1]["completed"] and records[-1]["steps"] == 4
    capsys.readouterr()
    assert (
        run_training(task, ["--resume", str(run_dir), "--implementation", "ls_jax", "--steps", "6", *QUIET])
        == EXIT_USAGE
    )
    err = capsys.readouterr().err
    assert err.startswith("error: checkpoint ") and "implementation: checkpoint 'flax' vs now 'ls_jax'" in err
    assert err.count("\n") == 1
    return records


def final_evals(records):
    """The evaluation records of the last step (each run's last step is evaluated: 2, then 4 after resuming)."""
    return [r for r in records if r["type"] == "eval" and r["step"] == records[-1]["steps"]]


@pytest.mark.slow
def test_imdb_trains_resumes_and_records_flax(tmp_path, csv_data, compilation_cache, capsys):  # noqa: F811
    records = train_resume_refuse(
        imdb.TASK, csv_job(csv_data, tmp_path / "run", "--eval-every", "0"), tmp_path / "run", capsys
    )
    finals = final_evals(records)
    assert [r["split"] for r in finals] == ["valid", "test"] and all(0 <= r["metrics"]["accuracy"] <= 1 for r in finals)


@pytest.mark.slow
def test_wmt_trains_resumes_and_scores_bleu_with_flax(tmp_path, corpus_dir, compilation_cache, capsys):  # noqa: F811
    records = train_resume_refuse(wmt.TASK, ["--data", f"text:{corpus_dir}", *SMALL], tmp_path / "run", capsys)
    finals = final_evals(records)
    assert {r["split"] for r in finals} == {"valid", "test"}
    assert all(r["metrics"]["bleu"] >= 0 for r in finals)  # decoded by the reference's cache


@pytest.mark.slow
def test_gpt_trains_resumes_and_samples_with_flax(tmp_path, compilation_cache, capsys):  # noqa: F811
    run_dir = tmp_path / "run"
    records = train_resume_refuse(
        gpt.TASK,
        ["--batch-size", "4", "--max-seq-len", "32", "--eval-every", "0", "--samples", "1", "--sample-tokens", "8"],
        run_dir,
        capsys,
    )
    assert [r["split"] for r in final_evals(records)] == ["valid"]
    assert (run_dir / "samples.txt").read_text().startswith("# 1 samples")
    assert json.loads((run_dir / "config.json").read_text())["implementation"] == "flax"
