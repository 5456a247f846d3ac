"""Token-based batching: budgets, padding, coverage, determinism and the split of rows over hosts."""

import numpy as np
import pytest

from train.data.stream import host_rows
from train.errors import UsageError
from train.wmt import data as ip

PAD, BOS, EOS = 0, 1, 2


def random_data(count=700, max_len=60, seed=0) -> ip.ParallelData:
    rng = np.random.default_rng(seed)
    src = [rng.integers(4, 100, size=rng.integers(1, max_len)).tolist() for _ in range(count)]
    tgt = [rng.integers(4, 100, size=rng.integers(1, max_len)).tolist() for _ in range(count)]
    return ip.ParallelData(ip.Ragged.from_lists(src), ip.Ragged.from_lists(tgt))


def plan(data, **overrides):
    options = dict(max_tokens=512, num_shards=2, grad_accum=2, seed=7, epoch=0)
    options.update(overrides)
    return ip.plan_epoch(data.example_lengths, **options)


def test_bucket_lengths_are_multiples_of_8_growing_about_ten_percent():
    buckets = ip.bucket_lengths(256)
    assert buckets[0] == 8 and buckets[-1] >= 256 and np.all(buckets % 8 == 0)
    assert np.all(np.diff(buckets) > 0)
    assert np.all(buckets[1:] <= np.maximum(buckets[:-1] * 1.1 + 8, buckets[:-1] + 8))


def test_every_example_appears_once_per_epoch():
    data = random_data()
    for epoch in (0, 1):
        indices = np.concatenate([s.indices.ravel() for s in plan(data, epoch=epoch)])
        real = indices[indices >= 0]
        assert sorted(real.tolist()) == list(range(len(data)))


def test_token_budget_per_device_padding_and_bucket_fit():
    data = random_data()
    lengths = data.example_lengths
    for step in plan(data):
        grad_accum, rows = step.indices.shape
        assert grad_accum == 2 and rows % 2 == 0
        assert (rows // 2) * step.length <= 512  # --max-tokens is per device
        assert step.length % 8 == 0
        real = step.indices[step.indices >= 0]
        assert lengths[real].max() <= step.length
        assert (ip.padded_lengths(lengths)[real] == step.length).all()  # one bucket per step


def test_fp8_batches_hold_a_multiple_of_16_tokens_per_device_where_a_row_fewer_does_it():
    """8192 tokens at length 24 fit 341 rows, 8,184 tokens; an FP8 run's batch takes 340 (8,160) so that every
    dimension of the step's matrix products is a multiple of 16, as cuBLASLt's FP8 GEMMs need. A row is dropped
    only when at least two fit; other precisions keep every row that fits."""
    fp8 = ip.token_multiple("fp8")
    assert fp8 == 16 and ip.token_multiple("bf16") == 8
    assert ip.rows_per_micro_batch(24, 8192, 1, fp8) == 340
    assert ip.rows_per_micro_batch(24, 8192, 1, ip.token_multiple("bf16")) == 341
    assert ip.rows_per_micro_batch(24, 8192, 4, fp8) == 4 * 340
    assert ip.rows_per_micro_batch(16, 8192, 1, fp8) == 512  # a multiple already: nothing dropped
    assert ip.rows_per_micro_batch(40, 40, 1, fp8) == 1  # one row fits: kept, though 40 is not a multiple of 16
    for length in ip.bucket_lengths(1024):
        rows = ip.rows_per_micro_batch(int(length), 8192, 1, fp8)
        assert rows * length <= 8192 and (rows * length) % 16 == 0
        assert rows >= 8192 // length - 1
    data = random_data()
    steps = plan(data, max_tokens=8192, num_shards=1, grad_accum=1, multiple=fp8)
    assert all(step.indices.size * step.length % 16 == 0 for step in steps)
    real = np.concatenate([step.indices.ravel() for step in steps])
    assert sorted(real[real >= 0].tolist()) == list(range(len(data)))  # every example still once


def test_plan_is_deterministic_in_seed_and_epoch():
    data = random_data()
    same = [s.indices.tolist() for s in plan(data)]
    assert same == [s.indices.tolist() for s in plan(data)]
    assert same != [s.indices.tolist() for s in plan(data, seed=8)]
    assert same != [s.indices.tolist() for s in plan(data, epoch=1)]


def test_make_batch_layout():
    data = ip.ParallelData(ip.Ragged.from_lists([[10, 11, 12], [20]]), ip.Ragged.from_lists([[30, 31], [40, 41, 42]]))
    batch = ip.make_batch(data, np.array([[1, 0, -1]]), 8)
    assert {k: v.shape for k, v in batch.items()} == {"src": (1, 3, 8), "tgt_in": (1, 3, 8), "labels": (1, 3, 8)}
    assert batch["src"][0, 0].tolist() == [20, EOS, PAD, PAD, PAD, PAD, PAD, PAD]
    assert batch["tgt_in"][0, 0].tolist() == [BOS, 40, 41, 42, PAD, PAD, PAD, PAD]
    assert batch["labels"][0, 0].tolist() == [40, 41, 42, EOS, PAD, PAD, PAD, PAD]
    assert batch["src"][0, 1].tolist()[:4] == [10, 11, 12, EOS]
    assert not batch["src"][0, 2].any() and not batch["labels"][0, 2].any()  # the empty row


def test_token_counts_are_non_pad_tokens():
    data = random_data(50)
    indices = np.array([[3, 9, -1], [0, 4, 5]])
    batch = ip.make_batch(data, indices, int(ip.padded_lengths(data.example_lengths).max()))
    counts = ip.token_counts(data, indices)
    assert counts["target_tokens"] == int((batch["labels"] != PAD).sum())
    assert counts["tokens"] == counts["target_tokens"] + int((batch["src"] != PAD).sum())


def test_hosts_get_disjoint_slices_that_make_the_global_batch():
    indices = np.arange(24).reshape(2, 12)
    slices = [host_rows(indices, p, 3) for p in range(3)]
    assert np.array_equal(np.concatenate(slices, axis=-1), indices)
    with pytest.raises(UsageError, match="12 rows .* 5 hosts"):
        host_rows(indices, 0, 5)


def test_max_tokens_below_the_longest_sentence_is_an_error():
    data = random_data(max_len=60)  # longest examples pad to 64
    with pytest.raises(UsageError, match="--max-tokens 40 is smaller than the longest padded sentence length 64"):
        plan(data, max_tokens=40)


def test_stream_resumes_at_its_position_across_epochs():
    data = random_data(300)
    options = dict(max_tokens=512, num_shards=1, grad_accum=1, seed=3)
    stream = ip.BatchStream(data, **options)
    batches = [next(stream) for _ in range(stream.steps_per_epoch + 5)]
    assert stream.position["epoch"] == 1
    resumed = ip.BatchStream(data, **options, epoch=0, index=7)
    for expected_batch, expected_counts in batches[7:]:
        batch, counts = next(resumed)
        assert counts == expected_counts
        assert all(np.array_equal(batch[k], expected_batch[k]) for k in batch)


def test_stream_shapes_cover_every_step_shape():
    data = random_data(400)
    stream = ip.BatchStream(data, max_tokens=512, num_shards=2, grad_accum=2, seed=0)
    shapes = set(stream.shapes())
    for _ in range(stream.steps_per_epoch):
        batch, _ = next(stream)
        assert batch["src"].shape in shapes


def test_eval_plan_covers_everything_in_one_shape_sorted_by_length():
    data = random_data(300)
    length, indices = ip.eval_plan(data.example_lengths, max_tokens=512, num_shards=2)
    assert length == ip.padded_lengths(data.example_lengths).max()
    assert indices.shape[1] == 2 * (512 // length)
    real = indices[indices >= 0]
    assert sorted(real.tolist()) == list(range(300))
    assert np.all(np.diff(data.example_lengths[real]) >= 0)


def test_ragged_take_keeps_rows_in_the_given_order():
    rows = [[5, 6], [], [7], [8, 9, 10]]
    taken = ip.Ragged.from_lists(rows).take(np.array([3, 1, 0, 3]))
    assert [taken.row(i).tolist() for i in range(len(taken))] == [[8, 9, 10], [], [5, 6], [8, 9, 10]]
