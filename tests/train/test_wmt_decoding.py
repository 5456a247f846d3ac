"""Decoding for BLEU in batches sized to a device-memory budget: the same translations as one batch, and a large
eval set never put into one batch the decoder cannot hold."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_data_text import write_corpus

from ls_jax.models import Transformer, TransformerConfig
from train.costs import metrics
from train.harness.parallel import DataParallel
from train.harness.training import run_training
from train.wmt import config as wmt_config
from train.wmt import data as wmt_data
from train.wmt import model as wmt_model
from train.wmt import task as wmt
from train.wmt.evaluate import Evaluator

MIB = 2**20


@pytest.fixture(scope="module")
def evaluator_parts(tmp_path_factory):
    """(data, model, params, corpus directory) of a randomly initialized transformer-tiny over a validation set of
    up to 16 sentences."""
    directory = tmp_path_factory.mktemp("corpus")
    write_corpus(directory, {"train": 200, "valid": 16})
    config = wmt_config.resolve_config({"data": f"text:{directory}", "spm_vocab_size": 200, "spm_model_type": "bpe"})
    data = wmt.load_data(config, None, tmp_path_factory.mktemp("run"), max_len=24)
    model_cfg = TransformerConfig.preset(
        "transformer-tiny",
        data.stats["vocab_size"],
        dtype=jnp.float32,
        hidden_dropout_ratio=0.0,
        attn_prob_dropout_ratio=0.0,
        activation_dropout_ratio=0.0,
    )
    model = Transformer(model_cfg)
    tokens = jnp.ones((1, 8), jnp.int32)
    params = model.init(jax.random.PRNGKey(3), tokens, tokens)["params"]
    return data, model, params, directory


def evaluator(parts, decode_memory_mib):
    data, model, _, directory = parts
    config = wmt_config.resolve_config(
        {
            "data": f"text:{directory}",
            "decode": "beam",
            "beam_size": 2,
            "max_tokens": 4096,
            "decode_memory": decode_memory_mib,
        }
    )
    return Evaluator(
        model,
        model.config,
        wmt_model.make_criterion("ls_jax", config.label_smoothing),
        data,
        config,
        DataParallel.over_all_devices(),
    )


def decode_batches(evaluator):
    return sum(1 for _ in evaluator._batches(evaluator.data.eval_sets["valid"], None, decoding=True))


def test_chunked_decoding_gives_the_translations_of_one_batch(evaluator_parts):
    data, _, params, _ = evaluator_parts
    sentences = len(data.eval_sets["valid"])
    whole, chunked = evaluator(evaluator_parts, 10**6), evaluator(evaluator_parts, 1)
    assert decode_batches(whole) == 1
    assert decode_batches(chunked) == sentences  # 1 MiB holds one sentence's beams: one sentence per batch
    one_batch = whole.translate({"params": params}, "valid", None)
    assert len(one_batch) == sentences > 10 and any(one_batch)
    assert chunked.translate({"params": params}, "valid", None) == one_batch


def test_a_large_eval_set_is_decoded_in_batches_within_the_budget():
    # transformer-base in bf16 at beam 4: 100k sentences of 10 to 16 tokens, --max-tokens 8192, a 2 GiB budget.
    model_cfg = TransformerConfig.preset("transformer-base", 32000, dtype=jnp.bfloat16)
    lengths = np.random.default_rng(0).integers(10, 17, size=100_000)
    budget = 2048 * MIB

    def max_rows(length):
        row_bytes = wmt_model.decode_row_bytes(
            model_cfg, src_len=length, decode_len=model_cfg.layer.max_seq_len, beams=4
        )
        return wmt_model.decode_rows(budget, row_bytes, num_shards=1)

    length, plan = wmt_data.eval_plan(lengths, max_tokens=8192, num_shards=1, max_rows=max_rows)
    rows = plan.shape[1]
    row_bytes = wmt_model.decode_row_bytes(model_cfg, src_len=length, decode_len=256, beams=4)
    assert rows * row_bytes <= budget
    by_tokens = wmt_data.rows_per_micro_batch(length, 8192, 1)
    assert by_tokens * row_bytes > 10 * 2**30  # what a batch of --max-tokens rows would have asked for
    assert rows < by_tokens
    assert sorted(plan[plan >= 0].tolist()) == list(range(len(lengths)))  # every sentence once


def test_decode_rows_are_a_multiple_of_the_devices_and_at_least_one_each():
    assert wmt_model.decode_rows(10 * MIB, 3 * MIB, num_shards=4) == 12
    assert wmt_model.decode_rows(1 * MIB, 3 * MIB, num_shards=4) == 4


def test_the_budget_is_the_flag_else_half_the_free_memory(evaluator_parts):
    assert evaluator(evaluator_parts, 300).decode_budget_bytes == 300 * MIB
    if metrics.free_memory_bytes(jax.local_devices()) is None:  # CPU: no memory report
        assert evaluator(evaluator_parts, None).decode_budget_bytes == wmt_config.HOST_DECODE_MEMORY_MIB * MIB

    class Device:
        def __init__(self, limit, used):
            self.stats = {"bytes_limit": limit, "bytes_in_use": used}

        def memory_stats(self):
            return self.stats

    assert metrics.free_memory_bytes([Device(80, 30), Device(80, 50)]) == 30


def test_decode_memory_must_be_positive(capsys):
    assert run_training(wmt.TASK, ["--decode-memory", "0"]) == 2
    assert "--decode-memory must be >= 1" in capsys.readouterr().err
