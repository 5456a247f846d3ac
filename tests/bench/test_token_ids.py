"""train.bench.steps.token_ids and the e2e batches drawn with it: uniform ids, or Zipf-distributed as in text."""

import numpy as np
import pytest

from train.bench import e2e
from train.bench.steps import token_ids, transformer_steps, workloads, zoo_steps


def test_zipf_probabilities_fall_as_one_over_the_rank():
    p = token_ids.zipf_probabilities(1000)
    assert p.sum() == pytest.approx(1.0)
    assert p[0] / p[1] == pytest.approx(2.0) and p[0] / p[9] == pytest.approx(10.0)


@pytest.mark.parametrize("distribution", token_ids.DISTRIBUTIONS)
def test_draws_stay_in_range_and_repeat_with_the_seed(distribution):
    draw = lambda: token_ids.draw(np.random.default_rng(7), (64, 32), 4, 500, distribution)  # noqa: E731
    ids = draw()
    assert ids.dtype == np.int32 and ids.shape == (64, 32)
    assert ids.min() >= 4 and ids.max() < 500
    np.testing.assert_array_equal(ids, draw())


def test_zipf_ids_repeat_the_frequent_ones_where_uniform_ids_spread():
    rng = np.random.default_rng(0)
    zipf = np.bincount(token_ids.draw(rng, (20_000,), 0, 10_000, "zipf"), minlength=10_000)
    uniform = np.bincount(token_ids.draw(rng, (20_000,), 0, 10_000, "uniform"), minlength=10_000)
    # H(10,000) is about 9.79: the first id takes about 10% of the positions, the tenth about 1%.
    assert 1700 < zipf[0] < 2400 and 150 < zipf[9] < 260
    assert uniform.max() < 20
    assert np.count_nonzero(zipf) < np.count_nonzero(uniform)


def test_an_unknown_distribution_is_named():
    with pytest.raises(ValueError, match="uniform, zipf.*'text'"):
        token_ids.draw(np.random.default_rng(0), (2,), 0, 10, "text")


def test_the_batches_draw_their_ids_from_the_workload():
    wmt = workloads.wmt_workload("tiny-2e2d", 256, token_ids="zipf")
    batch = wmt.batch()
    assert wmt.describe()["token_ids"] == "zipf"
    labels = np.asarray(batch["labels"])
    assert labels.min() >= 4 and labels.max() < transformer_steps.VOCAB
    np.testing.assert_array_equal(np.asarray(batch["tgt_in"])[:, 1:], labels[:, :-1])
    # About 9% of Zipf ids over the 32,764 ids above the special ones are the most frequent one; uniform ids
    # almost never repeat one that often.
    assert np.mean(labels == 4) > 0.05
    assert np.mean(np.asarray(workloads.wmt_workload("tiny-2e2d", 256).batch()["labels"]) == 4) < 0.01
    gpt = zoo_steps.make_batch("gpt2-tiny", 4, 16, seed=0, token_ids="zipf")
    np.testing.assert_array_equal(np.asarray(gpt["input_ids"])[:, 1:], np.asarray(gpt["labels"])[:, :-1])


def test_zipf_rows_go_to_a_results_file_of_their_own(tmp_path):
    header = {"memory_capacity_bytes": None}
    assert e2e.ResultFile.open(tmp_path, header, fresh=True).path.name.startswith("e2e-")
    zipf = e2e.ResultFile.open(tmp_path, header, fresh=True, token_ids="zipf")
    assert zipf.path.name.startswith("e2e-zipf-") and zipf.path.parent == tmp_path


def test_e2e_refuses_an_unknown_distribution(capsys):
    with pytest.raises(SystemExit) as exit_info:
        e2e.main(["--token-ids", "text", "--quick"])
    assert exit_info.value.code == 2
    assert "--token-ids" in capsys.readouterr().err
