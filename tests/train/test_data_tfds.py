"""The ``--data tfds:NAME`` reader, against TensorFlow Datasets' mock data (no download)."""

import importlib.util
import sys

import pytest

from train.errors import DataError, UsageError
from train.wmt import data as wmt_data

HAS_TFDS = importlib.util.find_spec("tensorflow_datasets") is not None


@pytest.mark.skipif(not HAS_TFDS, reason="tensorflow-datasets is not installed (optional extra 'data')")
def test_reads_wmt14_splits_from_mock_data():
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=12):
        corpus = wmt_data.read_tfds_corpus("wmt14_translate/de-en", "de", "en")
    assert set(corpus) == {"train", "valid", "test"}
    for src, tgt in corpus.values():
        assert len(src) == len(tgt) == 12
        assert all(isinstance(s, str) for s in src + tgt)


@pytest.mark.skipif(not HAS_TFDS, reason="tensorflow-datasets is not installed (optional extra 'data')")
def test_unknown_language_is_named():
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=3):
        with pytest.raises(DataError, match="no 'fr'"):
            wmt_data.read_tfds_corpus("wmt14_translate/de-en", "fr", "en")


def test_missing_package_gives_install_instructions(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # makes the import fail
    with pytest.raises(UsageError, match="pip install"):
        wmt_data.read_tfds_corpus("wmt14_translate/de-en", "de", "en")
