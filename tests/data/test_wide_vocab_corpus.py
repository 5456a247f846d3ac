"""scripts/wide_vocab_corpus.py: the benchmark-shaped corpus that `train.wmt --data text:DIR` reads."""

import numpy as np
import pytest

from scripts.wide_vocab_corpus import main, random_words, sentence_pairs
from train.wmt import data


def test_pairs_have_the_asked_words_and_the_target_is_the_source_reversed():
    rng = np.random.default_rng(0)
    vocab = random_words(50, rng)
    assert len(set(vocab)) == 50 and all(3 <= len(word) <= 9 and word.isalpha() for word in vocab)
    pairs = sentence_pairs(20, 7, vocab, rng)
    for source, target in pairs:
        assert len(source.split()) == 7
        assert target.split() == source.split()[::-1]


def test_frequent_words_come_first_in_the_vocabulary():
    rng = np.random.default_rng(1)
    vocab = random_words(1000, rng)
    words = " ".join(source for source, _ in sentence_pairs(2000, 10, vocab, rng)).split()
    counts = {word: words.count(word) for word in vocab[:2] + vocab[-2:]}
    assert min(counts[vocab[0]], counts[vocab[1]]) > 10 * max(counts[vocab[-1]], counts[vocab[-2]], 1)


def test_the_written_corpus_loads_as_text_data(tmp_path):
    assert main([str(tmp_path), "--pairs", "200", "--words", "5", "--vocab", "300", "--seed", "3"]) == 0
    lines = {path.name: path.read_text().splitlines() for path in tmp_path.iterdir()}
    assert sorted(lines) == ["test.de", "test.en", "train.de", "train.en", "valid.de", "valid.en"]
    assert len(lines["train.de"]) == len(lines["train.en"]) == 200
    assert len(lines["valid.de"]) == len(lines["test.en"]) == 5
    corpus = data.read_text_corpus(tmp_path, "de", "en")
    sources, targets = corpus["train"]
    assert len(sources) == len(targets) == 200 and targets[0].split() == sources[0].split()[::-1]


def test_a_zero_size_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--words", "0"])
    assert "--words" in capsys.readouterr().err
