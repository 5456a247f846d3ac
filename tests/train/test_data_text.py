"""Reading parallel text files and the sentencepiece vocabulary."""

import dataclasses

import numpy as np
import pytest
import sentencepiece as spm

from train.data import tokenizer as tokenizer_lib
from train.errors import DataError, UsageError
from train.wmt import config as wmt_config
from train.wmt import data as wmt_data
from train.wmt import synthetic as wmt_synthetic


def write_corpus(directory, sizes=None, src="de", tgt="en"):
    """Writes {split}.{src}/{tgt} from the synthetic task; returns the pairs written per split."""
    sizes = sizes or {"train": 300, "valid": 20, "test": 20}
    corpus = wmt_synthetic.synthetic_corpus(*(sizes.get(s, 1) for s in ("train", "valid", "test")), seed=1)
    directory.mkdir(parents=True, exist_ok=True)
    for split in sizes:
        (directory / f"{split}.{src}").write_text("".join(s + "\n" for s, _ in corpus[split]))
        (directory / f"{split}.{tgt}").write_text("".join(t + "\n" for _, t in corpus[split]))
    return {split: corpus[split] for split in sizes}


def test_reads_every_split_line_aligned(tmp_path):
    written = write_corpus(tmp_path)
    corpus = wmt_data.read_text_corpus(tmp_path, "de", "en")
    assert set(corpus) == {"train", "valid", "test"}
    for split, pairs in written.items():
        assert list(zip(*corpus[split])) == pairs


def test_test_split_is_optional(tmp_path):
    write_corpus(tmp_path, {"train": 50, "valid": 5})
    assert set(wmt_data.read_text_corpus(tmp_path, "de", "en")) == {"train", "valid"}


def test_read_corpus_dispatches_on_the_data_spec(tmp_path):
    write_corpus(tmp_path, {"train": 30, "valid": 5})
    assert len(wmt_data.read_corpus(f"text:{tmp_path}", src_lang="de", tgt_lang="en")["train"][0]) == 30
    assert len(wmt_data.read_corpus("synthetic", src_lang="de", tgt_lang="en")["valid"][0]) == 500
    with pytest.raises(UsageError, match="not one of"):
        wmt_data.read_corpus("csv:x", src_lang="de", tgt_lang="en")


def test_a_synthetic_corpus_of_a_given_size():
    corpus = wmt_data.read_corpus("synthetic:1234", src_lang="de", tgt_lang="en")
    assert [len(corpus[split][0]) for split in ("train", "valid", "test")] == [1234, 500, 500]
    for bad in ("0", "1e5", "-3", "many", "2000001"):
        with pytest.raises(UsageError, match=f"synthetic:{bad}: PAIRS must be a whole number"):
            wmt_data.read_corpus(f"synthetic:{bad}", src_lang="de", tgt_lang="en")


@pytest.mark.parametrize(
    "breakage, error, message",
    [
        (lambda d: (d / "valid.en").unlink(), DataError, "valid.en"),
        (lambda d: (d / "train.de").write_text(""), DataError, "empty: .*train.de"),
        (lambda d: (d / "train.en").write_text("one line\n"), DataError, "300 lines but .*1"),
    ],
    ids=["missing-file", "empty-file", "unaligned"],
)
def test_bad_files_are_named(tmp_path, breakage, error, message):
    write_corpus(tmp_path, {"train": 300, "valid": 5})
    breakage(tmp_path)
    with pytest.raises(error, match=message):
        wmt_data.read_text_corpus(tmp_path, "de", "en")


def test_missing_directory(tmp_path):
    with pytest.raises(DataError, match="nowhere"):
        wmt_data.read_text_corpus(tmp_path / "nowhere", "de", "en")


@pytest.fixture(scope="module")
def trained_vocab(tmp_path_factory):
    pairs = wmt_synthetic.synthetic_corpus(2000, 1, 1, seed=0)["train"]
    path = tmp_path_factory.mktemp("spm") / "spm.model"
    processor = tokenizer_lib.train(
        [s for s, _ in pairs] + [t for _, t in pairs], path, vocab_size=300, model_type="bpe"
    )
    return path, processor, pairs


def test_trained_vocabulary_has_the_model_special_ids_and_round_trips(trained_vocab):
    path, processor, pairs = trained_vocab
    assert (processor.pad_id(), processor.bos_id(), processor.eos_id(), processor.unk_id()) == (0, 1, 2, 3)
    assert processor.GetPieceSize() <= 300
    texts = [s for s, _ in pairs[:20]] + [t for _, t in pairs[:20]]
    ids = tokenizer_lib.encode(processor, texts)
    assert all(min(row) >= 4 for row in ids)  # no special id inside a sentence
    assert tokenizer_lib.decode(processor, ids) == texts
    reloaded = tokenizer_lib.load(path)
    assert tokenizer_lib.encode(reloaded, texts) == ids


def test_decode_stops_at_eos_and_drops_padding(trained_vocab):
    _, processor, pairs = trained_vocab
    ids = tokenizer_lib.encode(processor, [pairs[0][0]])[0]
    row = [*ids, 2, 0, 0, ids[0]]
    assert tokenizer_lib.decode(processor, [row]) == [pairs[0][0]]


def test_load_rejects_a_vocabulary_with_other_special_ids(tmp_path, trained_vocab):
    _, _, pairs = trained_vocab
    with open(tmp_path / "default_ids.model", "wb") as model_file:
        spm.SentencePieceTrainer.Train(
            sentence_iterator=iter(s for s, _ in pairs),
            model_writer=model_file,
            vocab_size=100,
            model_type="bpe",
            minloglevel=2,
        )  # sentencepiece's own defaults: unk=0 bos=1 eos=2 pad=-1
    with pytest.raises(ValueError, match="pad=-1.*unk=0"):
        tokenizer_lib.load(tmp_path / "default_ids.model")


def test_load_names_missing_and_broken_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="absent.model"):
        tokenizer_lib.load(tmp_path / "absent.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="junk.model is not a sentencepiece model"):
        tokenizer_lib.load(tmp_path / "junk.model")


def test_encode_and_length_filter_count_what_they_drop(trained_vocab):
    _, processor, pairs = trained_vocab
    src = [s for s, _ in pairs[:50]] + ["", "the cat sees a dog"]
    tgt = [t for _, t in pairs[:50]] + ["keva", ""]
    data = wmt_data.encode(processor, src, tgt)
    lengths = data.example_lengths
    limit = int(np.median(lengths[:50]))
    keep, stats = wmt_data.length_filter(data, limit)
    assert stats.empty == 2
    assert stats.too_long == int((lengths[:50] > limit).sum()) > 0
    assert stats.kept == len(keep) == 50 - stats.too_long
    assert keep.tolist() == [i for i in range(50) if lengths[i] <= limit]


def test_a_sized_synthetic_corpus_keeps_the_synthetic_defaults():
    sized = wmt_config.resolve_config({"data": "synthetic:50000"})
    assert dataclasses.replace(sized, data="synthetic") == wmt_config.resolve_config({})
    assert wmt_config.resolve_config({"data": "text:x"}).steps == 100_000
