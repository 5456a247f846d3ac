"""train.gpt.data and train.gpt.synthetic: the synthetic corpus and its entropy floor, reading, tokenizers,
packing, batches and their resume position, and each bad input's error."""

import importlib.util
import math
import sys

import numpy as np
import pytest

from train.errors import UsageError
from train.gpt import data as gpt_data
from train.gpt import synthetic as gpt_synthetic
from train.gpt.data import IGNORE_LABEL, DataError, PackedRows

HAS_TFDS = importlib.util.find_spec("tensorflow_datasets") is not None
EOD = 2


def random_documents(count, seed=0, vocab=50):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(4, vocab, size=rng.integers(1, 12))) for _ in range(count)]


# ---------------------------------------------------------------------------------------------- synthetic


def test_entropy_floor_matches_the_generators_own_log_probabilities():
    documents = gpt_synthetic.generate_documents(20000, seed=3)
    nats = np.array([-doc.log_prob for doc in documents])
    tokens = np.array([len(doc.words) + 1 for doc in documents])  # + the end-of-document token
    floor = gpt_synthetic.entropy_floor()
    # Ratio estimator of E[nats] / E[tokens]; 5 standard errors of the document entropy bound its error.
    tolerance = 5 * nats.std() / math.sqrt(len(nats)) / tokens.mean()
    assert abs(nats.sum() / tokens.sum() - floor.nats_per_token) < tolerance
    assert abs(tokens.mean() - floor.tokens_per_document) < 5 * tokens.std() / math.sqrt(len(tokens))
    assert floor.perplexity == pytest.approx(6.41, abs=0.01)  # the number the module docstring states


def test_synthetic_documents_follow_the_grammar_and_the_seed():
    documents = gpt_synthetic.generate_documents(300, seed=7)
    assert [d.text for d in documents] == [d.text for d in gpt_synthetic.generate_documents(300, seed=7)]
    assert [d.text for d in documents] != [d.text for d in gpt_synthetic.generate_documents(300, seed=8)]
    singular_verbs = {singular for _, singular in gpt_synthetic.VERBS}
    all_verbs = singular_verbs | {plural for plural, _ in gpt_synthetic.VERBS}
    plural_nouns = {plural for _, plural in gpt_synthetic.NOUNS}
    all_nouns = plural_nouns | {singular for singular, _ in gpt_synthetic.NOUNS}
    for doc in documents:
        sentences = " ".join(doc.words).split(" . ")
        assert 1 <= len(sentences) <= 3 and doc.words[-1] == "."
        subject_plural = next(w for w in doc.words if w in all_nouns) in plural_nouns
        verbs = [w for w in doc.words if w in all_verbs]
        assert all((v in singular_verbs) != subject_plural for v in verbs)  # agreement with the first subject
        pronouns = [w for w in doc.words if w in ("it", "they")]
        assert pronouns == ["they" if subject_plural else "it"] * (len(sentences) - 1)


def test_word_vocabulary_round_trip_and_no_unknown_words():
    vocabulary = gpt_synthetic.WordVocabulary()
    texts = gpt_synthetic.synthetic_corpus(0, train=200, valid=10)["train"]
    ids = vocabulary.encode(texts)
    assert all(4 <= i < vocabulary.size for row in ids for i in row)
    assert [vocabulary.decode(row) for row in ids] == texts
    assert vocabulary.encode(["the zebra"]) == [[vocabulary.encode(["the"])[0][0], 3]]


# ---------------------------------------------------------------------------------------------- packing


def test_pack_puts_every_document_once_in_order_between_eod_ids():
    documents = random_documents(20)
    stream = gpt_data.pack(documents + [[]], EOD)
    expected = [EOD] + [token for doc in documents for token in (*doc, EOD)]
    assert stream.tolist() == expected and stream.dtype == np.int32


@pytest.mark.parametrize("seq_len", [1, 5, 16])
def test_rows_cover_the_stream_once_with_the_final_row_masked(seq_len):
    stream = gpt_data.pack(random_documents(15, seed=seq_len), EOD)
    rows = PackedRows(stream, seq_len, EOD)
    batch = rows.batch(np.arange(rows.num_rows))
    mask = batch["labels"] != IGNORE_LABEL
    assert batch["input_ids"].shape == (rows.num_rows, seq_len)
    assert batch["input_ids"][mask].tolist() == stream[:-1].tolist()  # row-major order is stream order
    assert batch["labels"][mask].tolist() == stream[1:].tolist()
    assert mask[:-1].all()  # only the last row can be short
    short = mask[-1].sum()
    assert short == len(stream) - 1 - (rows.num_rows - 1) * seq_len > 0
    assert (batch["input_ids"][-1, short:] == EOD).all() and (batch["labels"][-1, short:] == IGNORE_LABEL).all()
    empty = rows.batch(np.array([-1]))
    assert (empty["labels"] == IGNORE_LABEL).all() and rows.count_targets(np.array([-1, 0])) == seq_len


def test_split_tail_holds_out_whole_documents_without_sharing_a_label():
    stream = gpt_data.pack(random_documents(40), EOD)
    head, tail = gpt_data.split_tail(stream, 0.2, EOD)
    assert head[-1] == tail[0] == EOD  # the cut is at a document boundary
    assert np.concatenate([head, tail[1:]]).tolist() == stream.tolist()
    assert 0.1 < (len(tail) - 1) / (len(stream) - 1) < 0.3
    one_document = gpt_data.pack([list(range(4, 104))], EOD)
    head, tail = gpt_data.split_tail(one_document, 0.1, EOD)
    assert len(tail) == round(0.1 * 102) and head[-1] == tail[0] != EOD  # no boundary: cut inside the document


# ---------------------------------------------------------------------------------------------- batches


def make_stream(rows, **kwargs):
    data = PackedRows(gpt_data.pack(random_documents(30), EOD), 4, EOD)
    return data, gpt_data.LMBatchStream(data=data, rows=rows, grad_accum=2, seed=5, **kwargs)


def test_an_epoch_takes_every_row_once_and_counts_its_tokens():
    data, stream = make_stream(rows=3)
    seen, tokens = [], 0
    for _ in range(stream.steps_per_epoch):
        batch, counts = next(stream)
        assert batch["input_ids"].shape == batch["labels"].shape == (2, 3, 4)
        assert batch["input_ids"].dtype == np.int32
        tokens += counts["tokens"]
        assert counts["tokens"] == int((batch["labels"] != IGNORE_LABEL).sum())
        seen += [tuple(row) for row in batch["labels"].reshape(-1, 4) if (row != IGNORE_LABEL).any()]
    assert tokens == data.num_targets
    assert sorted(seen) == sorted(tuple(row) for row in data.batch(np.arange(data.num_rows))["labels"])
    assert stream.position == {"epoch": 0, "index": stream.steps_per_epoch}
    next(stream)
    assert stream.position == {"epoch": 1, "index": 1}
    assert stream.shapes() == [(2, 3, 4)]


def test_a_stream_resumed_from_its_position_continues_with_the_same_batches():
    _, stream = make_stream(rows=3)
    for _ in range(stream.steps_per_epoch + 2):  # into the second epoch
        next(stream)
    _, resumed = make_stream(rows=3, **stream.position)
    for _ in range(stream.steps_per_epoch):
        (expected, expected_counts), (got, got_counts) = next(stream), next(resumed)
        assert all(np.array_equal(expected[k], got[k]) for k in expected) and expected_counts == got_counts


def test_hosts_build_disjoint_slices_of_the_same_global_batch():
    _, whole = make_stream(rows=4)
    _, first = make_stream(rows=4, process_index=0, process_count=2)
    _, second = make_stream(rows=4, process_index=1, process_count=2)
    for _ in range(3):
        (batch, counts), (a, counts_a), (b, counts_b) = next(whole), next(first), next(second)
        assert np.array_equal(np.concatenate([a["labels"], b["labels"]], axis=1), batch["labels"])
        assert counts == counts_a == counts_b  # counts are global


def test_eval_batches_hold_every_row_once_in_order():
    data = PackedRows(gpt_data.pack(random_documents(30), EOD), 4, EOD)
    labels = np.concatenate([batch["labels"] for batch in gpt_data.eval_batches(data, rows=8)])
    assert labels[labels != IGNORE_LABEL].tolist() == data.stream[1:].tolist()


# ---------------------------------------------------------------------------------------------- loading


def write_lines(path, lines):
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


def test_text_file_trains_a_sentencepiece_model_and_holds_out_the_tail(tmp_path):
    texts = gpt_synthetic.synthetic_corpus(0, train=400, valid=1)["train"]
    source = write_lines(tmp_path / "docs.txt", ["", *texts, "   "])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    data = gpt_data.load_data(
        f"text:{source}", seq_len=16, max_positions=64, run_dir=run_dir, vocab_size=120, valid_fraction=0.1
    )
    assert (run_dir / "spm.model").is_file() and data.tokenizer.size <= 120
    assert data.stats["train_documents"] == 400
    total = data.splits["train"].num_targets + data.splits["valid"].num_targets
    assert total == sum(len(ids) + 1 for ids in data.tokenizer.encode(texts))
    assert data.tokenizer.decode(data.tokenizer.encode([texts[0]])[0]) == texts[0]

    given_dir = tmp_path / "given"
    given_dir.mkdir()
    again = gpt_data.load_data(
        f"text:{source}",
        seq_len=16,
        max_positions=64,
        run_dir=given_dir,
        spm_model=str(run_dir / "spm.model"),
        valid_fraction=0.1,
    )
    assert (given_dir / "spm.model").read_bytes() == (run_dir / "spm.model").read_bytes()
    assert np.array_equal(again.splits["train"].stream, data.splits["train"].stream)


def test_a_directory_of_text_files_is_one_document_per_file(tmp_path):
    (tmp_path / "b.txt").write_text("second document\nover two lines\n")
    (tmp_path / "a.txt").write_text("first document\n")
    (tmp_path / "empty.txt").write_text("\n")
    (tmp_path / "notes.md").write_text("not read")
    assert gpt_data.read_text(tmp_path) == ["first document", "second document\nover two lines"]


def test_synthetic_source_uses_the_word_vocabulary(tmp_path):
    data = gpt_data.load_data("synthetic", seq_len=32, max_positions=64, run_dir=tmp_path)
    assert isinstance(data.tokenizer, gpt_synthetic.WordVocabulary) and not list(tmp_path.iterdir())
    assert data.stats["train_documents"] == gpt_synthetic.SYNTHETIC_TRAIN_DOCUMENTS
    assert data.splits["valid"].stream[0] == EOD and data.splits["train"].seq_len == 32


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("content", ["", "\n \n\t\n"])
def test_empty_text_file_is_named(tmp_path, content):
    source = tmp_path / "empty.txt"
    source.write_text(content)
    with pytest.raises(DataError, match=r"empty\.txt is empty: it holds no text"):
        gpt_data.load_data(f"text:{source}", seq_len=8, max_positions=64, run_dir=tmp_path)


def test_empty_corpus_after_tokenizing_and_empty_directory(tmp_path):
    with pytest.raises(DataError, match="holds no .txt files"):
        gpt_data.read_text(tmp_path)
    with pytest.raises(DataError, match="the training corpus is empty"):
        gpt_data.encode_corpus({"train": ["zebra"]}, _NoTokens(), seq_len=4, valid_fraction=0.1)
    with pytest.raises(DataError, match="no such file or directory"):
        gpt_data.load_data(f"text:{tmp_path / 'absent.txt'}", seq_len=8, max_positions=64, run_dir=tmp_path)
    with pytest.raises(UsageError, match="not one of: synthetic, text:PATH, tfds:NAME"):
        gpt_data.load_data("csv:x", seq_len=8, max_positions=64, run_dir=tmp_path)


class _NoTokens(gpt_synthetic.WordVocabulary):
    def encode(self, texts):
        return [[] for _ in texts]


def test_corpus_shorter_than_one_sequence(tmp_path):
    corpus = {"train": ["the cat sees a dog ."], "valid": ["the dog sees a cat ."]}
    with pytest.raises(DataError, match=r"has 8 tokens .* fewer than one sequence of 9; lower --max-seq-len"):
        gpt_data.encode_corpus(corpus, gpt_synthetic.WordVocabulary(), seq_len=8, valid_fraction=0.1)
    assert gpt_data.encode_corpus(corpus, gpt_synthetic.WordVocabulary(), seq_len=7, valid_fraction=0.1)


def test_sequence_longer_than_the_positions(tmp_path):
    with pytest.raises(UsageError, match="--max-seq-len 2048 is longer than the model's 1024 positions"):
        gpt_data.load_data("synthetic", seq_len=2048, max_positions=1024, run_dir=tmp_path)


def test_missing_or_invalid_tokenizer_file(tmp_path):
    source = write_lines(tmp_path / "docs.txt", ["some text"] * 20)
    with pytest.raises(UsageError, match=r"--spm-model .*absent\.model: no such file"):
        gpt_data.load_data(
            f"text:{source}", seq_len=4, max_positions=64, run_dir=tmp_path, spm_model=str(tmp_path / "absent.model")
        )
    with pytest.raises(UsageError, match=r"--spm-model (.*docs\.txt): \1 is not a sentencepiece model"):
        gpt_data.load_data(
            f"text:{source}", seq_len=4, max_positions=64, run_dir=tmp_path / "run", spm_model=str(source)
        )
    with pytest.raises(UsageError, match="no tokenizer there"):
        gpt_data.HuggingFaceTokenizer.load(tmp_path)


def test_missing_tfds_package_gives_install_instructions(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # makes the import fail
    with pytest.raises(UsageError, match="pip install"):
        gpt_data.load_data("tfds:lm1b", seq_len=8, max_positions=64, run_dir=tmp_path)


@pytest.mark.skipif(not HAS_TFDS, reason="tensorflow-datasets is not installed (optional extra 'data')")
def test_tfds_unknown_name_and_mock_data(tmp_path):
    import tensorflow_datasets as tfds

    with pytest.raises(DataError, match="tensorflow-datasets has no dataset 'no_such_corpus'"):
        gpt_data.read_corpus("tfds:no_such_corpus")
    with tfds.testing.mock_data(num_examples=40):
        corpus = gpt_data.read_corpus("tfds:lm1b", tfds_valid_split="test")
        with pytest.raises(DataError, match="no 'body'"):
            gpt_data.read_corpus("tfds:lm1b", text_field="body")
    assert set(corpus) == {"train", "valid"} and len(corpus["train"]) == len(corpus["valid"]) == 40
    assert all(isinstance(text, str) for text in corpus["train"])
