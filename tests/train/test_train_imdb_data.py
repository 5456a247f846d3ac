"""`train.imdb.data` and `train.imdb.synthetic`: the synthetic review task, the CSV / JSONL / tfds readers, splits,
encoding and batches."""

import csv
import importlib.util
import json
import sys

import numpy as np
import pytest

from train.data import stream as data_lib
from train.errors import DataError, UsageError
from train.imdb import data as imdb_data
from train.imdb import synthetic as imdb_synthetic

HAS_TFDS = importlib.util.find_spec("tensorflow_datasets") is not None
POSITIVE = set(imdb_synthetic.POSITIVE_ADJECTIVES) | {word for pair in imdb_synthetic.POSITIVE_VERBS for word in pair}
NEGATIVE = set(imdb_synthetic.NEGATIVE_ADJECTIVES) | {word for pair in imdb_synthetic.NEGATIVE_VERBS for word in pair}


# ---------------------------------------------------------------------------------------- synthetic task


def test_synthetic_splits_are_deterministic_balanced_and_disjoint():
    splits = imdb_data.synthetic_splits(3, train=2000, test=300)
    again = imdb_data.synthetic_splits(3, train=2000, test=300)
    other = imdb_data.synthetic_splits(4, train=2000, test=300)
    assert splits["train"].texts == again["train"].texts and splits["test"].texts == again["test"].texts
    assert splits["train"].texts != other["train"].texts
    assert len(splits["train"]) == 2000 and len(splits["test"]) == 300
    assert not set(splits["train"].texts) & set(splits["test"].texts)
    assert len(set(splits["train"].texts)) == 2000
    assert set(splits["train"].labels.tolist()) == {0, 1}
    assert 0.45 < splits["train"].labels.mean() < 0.55


def opinion_score(words):
    """The documented score of one opinion clause, computed from its words."""
    polarity = sum((word in POSITIVE) - (word in NEGATIVE) for word in words)
    strength = 2 if set(words) & set(imdb_synthetic.INTENSIFIERS) else 1
    negated = bool({"not", "never"} & set(words))
    return polarity * strength * (-1 if negated else 1)


def test_opinion_clauses_score_as_documented():
    rng = np.random.default_rng(0)
    clauses = [imdb_synthetic._opinion_clause(rng) for _ in range(3000)]
    assert all(score == opinion_score(words) for words, score in clauses)
    scores = {score for _, score in clauses}
    assert scores == {-2, -1, 1, 2}
    # Negation occurs with both polarities, so a sentiment word alone does not give the sign.
    negated_positive = [s for w, s in clauses if {"not", "never"} & set(w) and set(w) & POSITIVE]
    assert negated_positive and all(score < 0 for score in negated_positive)


def keyword_vote(text):
    votes = sum((word in POSITIVE) - (word in NEGATIVE) for word in text.split())
    return int(votes >= 0)


def test_counting_sentiment_words_does_not_solve_the_task():
    split = imdb_data.synthetic_splits(0, train=3000, test=1)["train"]
    accuracy = np.mean([keyword_vote(text) == label for text, label in zip(split.texts, split.labels)])
    assert 0.5 < accuracy < 0.87  # about 0.84; BERT-base ends an epoch at 0.87-0.91


# ------------------------------------------------------------------------------------------------ readers


def write_csv(path, rows, fields=("text", "label")):
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(fields)
        writer.writerows(rows)
    return path


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def test_read_csv_with_quotes_newlines_and_extra_columns(tmp_path):
    rows = [('great, truly "great"', 1, "x"), ("line one\nline two", 0, "y"), ("plain", "1", "z")]
    path = write_csv(tmp_path / "data.csv", rows, fields=("review", "sentiment", "id"))
    split = imdb_data.read_csv(path, "review", "sentiment")
    assert split.texts == ['great, truly "great"', "line one\nline two", "plain"]
    assert split.labels.tolist() == [1, 0, 1] and split.source == str(path)


def test_read_jsonl_skips_blank_lines_and_accepts_digit_strings(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "good", "label": 1}\n\n{"text": "bad", "label": "0", "extra": [1]}\n')
    split = imdb_data.read_jsonl(path, "text", "label")
    assert split.texts == ["good", "bad"] and split.labels.tolist() == [1, 0]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "a", "label": 1}\n{"txt": "b", "label": 0}\n', "line 2: no field 'text' (fields: txt, label)"),
        ('{"text": "a", "label": 1.5}\n', "label 1.5 is not a class index"),
        ('{"text": "a", "label": -1}\n', "label -1 is not a class index"),
        ('{"text": "a", "label": true}\n', "label True is not a class index"),
        ('{"text": "a", "label": "pos"}\n', "label 'pos' is not a class index"),
        ('{"text": 3, "label": 1}\n', "'text' is int, not text"),
        ('{"text": "a", "label": 1}\n{"text": \n', "line 2 is not JSON"),
        ('["a", 1]\n', "line 1 is a JSON list, not an object"),
        ("\n\n", "holds no examples"),
    ],
    ids=[
        "missing-field",
        "float-label",
        "negative-label",
        "bool-label",
        "word-label",
        "text-not-string",
        "bad-json",
        "not-object",
        "empty",
    ],
)
def test_bad_jsonl_names_the_problem(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        imdb_data.read_jsonl(path, "text", "label")


def test_bad_csv_names_the_problem(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(DataError, match="needs a header row"):
        imdb_data.read_csv(empty, "text", "label")
    header_only = write_csv(tmp_path / "header.csv", [])
    with pytest.raises(DataError, match="holds no examples"):
        imdb_data.read_csv(header_only, "text", "label")
    other_columns = write_csv(tmp_path / "other.csv", [("a", 1)], fields=("review", "label"))
    with pytest.raises(DataError, match=r"line 2: no field 'text' \(fields: review, label\)"):
        imdb_data.read_csv(other_columns, "text", "label")
    with pytest.raises(DataError, match="data file not found"):
        imdb_data.read_csv(tmp_path / "absent.csv", "text", "label")
    short_row = tmp_path / "short.csv"
    short_row.write_text('text,label\n"a good film",1\n"no label here"\n')
    with pytest.raises(DataError, match=r"line 3: no value for 'label' \(a row with fewer columns than the header"):
        imdb_data.read_csv(short_row, "text", "label")


def test_unknown_source_is_named():
    with pytest.raises(UsageError, match="'parquet:x' is not a data source: expected csv:PATH"):
        imdb_data.read_source("parquet:x", split="train", text_field="t", label_field="l", tfds_data_dir=None)


def test_tfds_without_the_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # makes the import fail
    with pytest.raises(UsageError, match="pip install"):
        imdb_data.read_tfds("imdb_reviews", "train", "text", "label")


def test_init_from_without_transformers_says_how_to_install(tmp_path, monkeypatch):
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n")
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes the import fail
    with pytest.raises(ImportError, match="pip install"):
        imdb_data.HuggingFaceVocabulary.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="expected vocab.txt or tokenizer.json"):
        imdb_data.HuggingFaceVocabulary.load(tmp_path / "absent")


@pytest.mark.skipif(not HAS_TFDS, reason="tensorflow-datasets is not installed (optional extra 'data')")
def test_reads_imdb_reviews_from_tfds_mock_data():
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=10):
        split = imdb_data.read_tfds("imdb_reviews", "train", "text", "label")
    assert len(split) == 10 and all(isinstance(text, str) for text in split.texts)
    assert set(split.labels.tolist()) <= {0, 1}


# ------------------------------------------------------------------------------------------------- splits


def numbered_split(count):
    return imdb_data.Split([f"text {i}" for i in range(count)], np.arange(count) % 2, "numbers")


def test_hold_out_is_a_seeded_disjoint_partition():
    rest, held = imdb_data.hold_out(numbered_split(100), 0.2, seed=1)
    again, _ = imdb_data.hold_out(numbered_split(100), 0.2, seed=1)
    other, _ = imdb_data.hold_out(numbered_split(100), 0.2, seed=2)
    assert len(held) == 20 and len(rest) == 80
    assert sorted(rest.texts + held.texts, key=lambda t: int(t.split()[1])) == numbered_split(100).texts
    assert rest.texts == again.texts and rest.texts != other.texts
    assert held.source == "numbers (held out)"
    assert len(imdb_data.hold_out(numbered_split(5), 0.0, seed=0)[1]) == 0
    with pytest.raises(DataError, match="leaves 0 for validation"):
        imdb_data.hold_out(numbered_split(3), 0.1, seed=0)


def test_read_dataset_splits(tmp_path):
    train = write_csv(tmp_path / "train.csv", [(f"review {i}", i % 2) for i in range(50)])
    test = write_jsonl(tmp_path / "test.jsonl", [{"text": "t", "label": 1}] * 7)
    common = dict(seed=0, text_field="text", label_field="label", tfds_data_dir=None)
    splits = imdb_data.read_dataset(f"csv:{train}", test_data=f"jsonl:{test}", valid_fraction=0.2, **common)
    assert {name: len(split) for name, split in splits.items()} == {"train": 40, "valid": 10, "test": 7}
    splits = imdb_data.read_dataset(f"csv:{train}", test_data=f"jsonl:{test}", valid_fraction=0.0, **common)
    assert list(splits) == ["train", "test"] and len(splits["train"]) == 50
    with pytest.raises(UsageError, match="no evaluation data"):
        imdb_data.read_dataset(f"csv:{train}", test_data=None, valid_fraction=0.0, **common)


# ------------------------------------------------------------------------------------ encoding and batches


class WordVocabulary:
    """Whitespace words -> ids from 4 on; [CLS]=2, [SEP]=3, pad 0."""

    pad_id = 0
    size = 100

    def encode(self, texts):
        return [[2, *(4 + int(word) for word in text.split()), 3] for text in texts]


def test_encode_split_cuts_long_texts_keeping_sep_and_pads():
    split = imdb_data.Split(["1 2 3 4 5 6", "7", ""], np.array([1, 0, 1]), "x")
    encoded = imdb_data.encode_split(WordVocabulary(), split, max_len=5)
    assert encoded.input_ids.tolist() == [[2, 5, 6, 7, 3], [2, 11, 3, 0, 0], [2, 3, 0, 0, 0]]
    assert encoded.truncated == 1 and encoded.labels.tolist() == [1, 0, 1]
    assert encoded.input_ids.dtype == np.int32


def encoded_numbers(count, max_len=4):
    split = imdb_data.Split([str(i) for i in range(count)], np.arange(count) % 2, "numbers")
    return imdb_data.encode_split(WordVocabulary(), split, max_len)


def test_an_epoch_holds_every_example_once_and_fills_the_last_step():
    data = encoded_numbers(23)
    stream = imdb_data.BatchStream(data, batch_size=4, grad_accum=2, seed=0)
    assert stream.steps_per_epoch == 3
    batches = [next(stream) for _ in range(3)]
    ids = np.concatenate([batch["input_ids"][..., 1].reshape(-1) for batch, _ in batches]) - 4
    labels = np.concatenate([batch["labels"].reshape(-1) for batch, _ in batches])
    real = labels >= 0
    assert sorted(ids[real].tolist()) == list(range(23))
    assert (labels[real] == ids[real] % 2).all()
    assert (labels[~real] == imdb_data.FILL_LABEL).all() and real.sum() == 23
    assert all(batch["input_ids"].shape == (2, 4, 4) and batch["labels"].shape == (2, 4) for batch, _ in batches)
    assert [counts["examples"] for _, counts in batches] == [8, 8, 7]
    assert stream.position == {"epoch": 0, "index": 3}
    next(stream)
    assert stream.position == {"epoch": 1, "index": 1}


def test_batches_are_deterministic_by_seed_and_resume_from_a_position():
    data = encoded_numbers(40)
    straight = imdb_data.BatchStream(data, batch_size=4, grad_accum=1, seed=5)
    expected = [next(straight)[0]["input_ids"] for _ in range(14)]
    resumed = imdb_data.BatchStream(data, batch_size=4, grad_accum=1, seed=5, epoch=1, index=2)
    np.testing.assert_array_equal(next(resumed)[0]["input_ids"], expected[12])
    other = imdb_data.BatchStream(data, batch_size=4, grad_accum=1, seed=6)
    assert not np.array_equal(next(other)[0]["input_ids"], expected[0])


def test_each_host_builds_its_own_rows():
    data = encoded_numbers(16)
    whole = next(imdb_data.BatchStream(data, batch_size=8, grad_accum=1, seed=0))[0]
    parts = [
        next(imdb_data.BatchStream(data, batch_size=8, grad_accum=1, seed=0, process_index=p, process_count=2))
        for p in range(2)
    ]
    np.testing.assert_array_equal(np.concatenate([p[0]["labels"] for p in parts], axis=1), whole["labels"])
    assert all(p[1] == {"examples": 8} for p in parts)


def test_eval_plan_covers_every_example_in_order():
    plan = data_lib.fixed_eval_plan(10, 4)
    assert plan.shape == (3, 4)
    assert plan.reshape(-1).tolist() == [*range(10), -1, -1]
