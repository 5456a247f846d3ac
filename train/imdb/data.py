"""Sentiment classification data for ``python -m train.imdb``: sources, vocabularies, fixed-shape batches.

Sources (``--data``, and ``--test-data`` for a separate test set):
  ``synthetic``       movie reviews generated from code (`train.imdb.synthetic`), with a test set of their own;
  ``csv:PATH``        a CSV file with a header row;
  ``jsonl:PATH``      one JSON object per line;
  ``tfds:NAME``       a TensorFlow Datasets set such as ``imdb_reviews`` (its ``train`` and ``test`` splits;
                      needs the optional ``tensorflow-datasets`` package, imported only here).
Files and tfds examples give a text and an integer label (``--text-field``, ``--label-field``). The validation
split is a fraction of the training examples held out by seed (`hold_out`).

Examples. A text becomes ``[CLS] tokens [SEP]`` cut to ``max_len`` ids (the end of a long text is dropped,
``[SEP]`` kept) and padded with the vocabulary's pad id to exactly ``max_len``, so every batch has the same
shape and the training step compiles once.

Batches. An epoch is a permutation of the training examples drawn from ``(seed, epoch)``, cut into steps of
``grad_accum`` micro-batches of ``batch_size`` rows (over all devices); the last step is filled up with empty
rows (all pad ids, label -1), which carry no weight. Every host computes the same plan and builds only its own
rows of each step (`train.data.stream.host_rows`).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

import numpy as np

from train.data import files as files_lib
from train.data import stream as data_lib
from train.data import tokenizer as tokenizer_lib
from train.data.stream import EpochStream, host_rows, import_tfds
from train.errors import DataError, UsageError
from train.imdb import synthetic as imdb_synthetic

SPLITS = ("train", "valid", "test")
FILL_LABEL = -1  # the label of an empty row that fills up the last step of an epoch
SYNTHETIC_TRAIN_EXAMPLES = 12000
SYNTHETIC_TEST_EXAMPLES = 1000


@dataclasses.dataclass(frozen=True)
class Split:
    """Texts and their integer labels; ``source`` names where they came from, for messages."""

    texts: list[str]
    labels: np.ndarray  # (n,) int64
    source: str

    def __len__(self) -> int:
        return len(self.texts)

    def take(self, indices: np.ndarray) -> Split:
        return Split([self.texts[i] for i in indices], self.labels[indices], self.source)


# ------------------------------------------------------------------------------------- the synthetic task


def synthetic_splits(
    seed: int, *, train: int = SYNTHETIC_TRAIN_EXAMPLES, test: int = SYNTHETIC_TEST_EXAMPLES
) -> dict[str, Split]:
    """``train`` and ``test`` reviews of `train.imdb.synthetic` seeded with ``seed``; no text is in both."""
    texts, labels = imdb_synthetic.distinct_reviews(train + test, seed)
    return {
        "train": Split(texts[:train], labels[:train], "synthetic train"),
        "test": Split(texts[train:], labels[train:], "synthetic test"),
    }


# ------------------------------------------------------------------------------------------------ reading


def parse_label(value: Any, where: str) -> int:
    """An integer label >= 0 from a number or a string of digits (CSV); DataError naming ``where`` otherwise."""
    if isinstance(value, str) and re.fullmatch(r"\s*\d+\s*", value):
        return int(value)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0:
        return int(value)
    raise DataError(f"{where}: label {value!r} is not a class index (an integer >= 0)")


def _split_from_rows(
    rows: Iterator[tuple[str, dict[str, Any]]], source: str, text_field: str, label_field: str
) -> Split:
    """A Split from (where, record) pairs; DataError naming the first record without a field or a bad label."""
    texts, labels = [], []
    for where, record in rows:
        missing = [field for field in (text_field, label_field) if field not in record]
        if missing:
            raise DataError(
                f"{where}: no field {missing[0]!r} (fields: {', '.join(map(str, record))}); "
                f"choose them with --text-field / --label-field"
            )
        empty = [field for field in (text_field, label_field) if record[field] is None]
        if empty:  # a CSV row shorter than its header, or a JSON null
            raise DataError(f"{where}: no value for {empty[0]!r} (a row with fewer columns than the header, or null)")
        if not isinstance(record[text_field], str):
            raise DataError(f"{where}: {text_field!r} is {type(record[text_field]).__name__}, not text")
        texts.append(record[text_field])
        labels.append(parse_label(record[label_field], where))
    if not texts:
        raise DataError(f"{source} holds no examples")
    return Split(texts, np.asarray(labels, np.int64), source)


def _existing_file(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path} is a directory, not a data file")
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    return path


def read_csv(path: str | Path, text_field: str, label_field: str) -> Split:
    """A CSV file with a header row naming its columns (any others are ignored)."""
    path = _existing_file(path)
    reader = csv.DictReader(files_lib.utf8_lines(path, newline=""))
    if reader.fieldnames is None:
        raise DataError(f"{path} is empty: a CSV file needs a header row naming its columns")
    rows = ((f"{path} line {reader.line_num}", row) for row in reader)
    return _split_from_rows(rows, str(path), text_field, label_field)


def _jsonl_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    for number, line in enumerate(files_lib.utf8_lines(path), start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{where} is not JSON: {err.msg}") from err
        if not isinstance(record, dict):
            raise DataError(f"{where} is a JSON {type(record).__name__}, not an object")
        yield where, record


def read_jsonl(path: str | Path, text_field: str, label_field: str) -> Split:
    """A JSON Lines file: one object per line with (at least) the text and label fields."""
    path = _existing_file(path)
    return _split_from_rows(_jsonl_records(path), str(path), text_field, label_field)


def read_tfds(name: str, split: str, text_field: str, label_field: str, data_dir: str | None = None) -> Split:
    """One split of a TensorFlow Datasets text classification set, e.g. ``imdb_reviews`` ``train``.

    Raises:
      UsageError: tensorflow-datasets is missing (the message says how to install it).
      DataError: the set cannot be loaded, or its examples lack the fields.
    """
    tfds = import_tfds()
    try:
        dataset = tfds.load(name, split=split, data_dir=data_dir, shuffle_files=False)
    except Exception as err:  # noqa: BLE001 - tfds raises many kinds; the user needs the message
        raise DataError(f"cannot load tfds:{name} split {split}: {type(err).__name__}: {err}") from err
    where = f"tfds:{name} {split}"
    records = (
        (
            f"{where} example {number}",
            {key: value.decode("utf-8") if isinstance(value, bytes) else value for key, value in example.items()},
        )
        for number, example in enumerate(tfds.as_numpy(dataset))
    )
    return _split_from_rows(records, where, text_field, label_field)


def read_source(spec: str, *, split: str, text_field: str, label_field: str, tfds_data_dir: str | None) -> Split:
    """The examples a ``csv:PATH``, ``jsonl:PATH`` or ``tfds:NAME`` value names (``split`` picks the tfds split)."""
    kind, _, location = spec.partition(":")
    if kind == "csv" and location:
        return read_csv(location, text_field, label_field)
    if kind == "jsonl" and location:
        return read_jsonl(location, text_field, label_field)
    if kind == "tfds" and location:
        return read_tfds(location, split, text_field, label_field, tfds_data_dir)
    raise UsageError(
        f"{spec!r} is not a data source: expected csv:PATH, jsonl:PATH or tfds:NAME (or synthetic for --data)"
    )


def hold_out(split: Split, fraction: float, seed: int) -> tuple[Split, Split]:
    """(rest, held out): ``round(fraction * n)`` examples drawn by ``seed``; both keep their original order."""
    count = round(fraction * len(split))
    if fraction > 0 and not 0 < count < len(split):
        raise DataError(
            f"--valid-fraction {fraction} of {len(split)} training examples leaves "
            f"{count} for validation and {len(split) - count} for training; both need at least one"
        )
    chosen = np.zeros(len(split), bool)
    chosen[np.random.default_rng(seed).permutation(len(split))[:count]] = True
    held_out = split.take(np.flatnonzero(chosen))
    return split.take(np.flatnonzero(~chosen)), dataclasses.replace(held_out, source=f"{split.source} (held out)")


def read_dataset(
    data: str,
    *,
    test_data: str | None,
    valid_fraction: float,
    seed: int,
    text_field: str,
    label_field: str,
    tfds_data_dir: str | None,
) -> dict[str, Split]:
    """The train, valid and (when there is one) test splits of ``--data`` / ``--test-data``.

    The test split is ``--test-data`` when given, else the source's own (synthetic, tfds ``test``); the
    validation split is ``valid_fraction`` of the training examples (none for 0).
    """
    read = dict(text_field=text_field, label_field=label_field, tfds_data_dir=tfds_data_dir)
    if data == "synthetic":
        splits = synthetic_splits(seed)
    else:
        splits = {"train": read_source(data, split="train", **read)}
        if data.startswith("tfds:") and test_data is None:
            splits["test"] = read_source(data, split="test", **read)
    if test_data is not None:
        splits["test"] = read_source(test_data, split="test", **read)
    train, valid = hold_out(splits["train"], valid_fraction, seed)
    splits["train"] = train
    if len(valid):
        splits["valid"] = valid
    if set(splits) == {"train"}:
        raise UsageError("no evaluation data: give --test-data or a --valid-fraction above 0")
    return {name: splits[name] for name in SPLITS if name in splits}


# ------------------------------------------------------------------------------------------- vocabularies


class Vocabulary(Protocol):
    """Texts to ``[CLS] ... [SEP]`` token ids."""

    pad_id: int
    size: int

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text with [CLS] first and [SEP] last, untruncated."""


@dataclasses.dataclass(frozen=True)
class SentencePieceVocabulary:
    """A vocabulary trained on the data (`train.data.tokenizer`): BOS serves as [CLS] and EOS as [SEP]."""

    processor: Any  # sentencepiece.SentencePieceProcessor

    @property
    def pad_id(self) -> int:
        return tokenizer_lib.SPECIAL_IDS["pad"]

    @property
    def size(self) -> int:
        return self.processor.GetPieceSize()

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        cls, sep = tokenizer_lib.SPECIAL_IDS["bos"], tokenizer_lib.SPECIAL_IDS["eos"]
        return [[cls, *ids, sep] for ids in tokenizer_lib.encode(self.processor, texts)]


@dataclasses.dataclass(frozen=True)
class HuggingFaceVocabulary:
    """A pretrained checkpoint's own tokenizer (``transformers.BertTokenizerFast``: vocab.txt or tokenizer.json)."""

    tokenizer: Any

    @classmethod
    def load(cls, directory: str | Path) -> HuggingFaceVocabulary:
        """The tokenizer files of a local Hugging Face model directory.

        Raises:
          FileNotFoundError: the directory has neither vocab.txt nor tokenizer.json.
          ImportError: transformers is not installed (the message says how to install it).
        """
        directory = Path(directory)
        if not any((directory / name).is_file() for name in ("vocab.txt", "tokenizer.json")):
            raise FileNotFoundError(f"no tokenizer in {directory}: expected vocab.txt or tokenizer.json")
        try:
            from transformers import BertTokenizerFast
        except ImportError as err:
            raise ImportError(
                "--init-from needs transformers for the checkpoint's tokenizer: "
                "pip install 'ls-jax[hf]' (or pip install transformers)"
            ) from err
        return cls(BertTokenizerFast.from_pretrained(str(directory), local_files_only=True))

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def size(self) -> int:
        return len(self.tokenizer)

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        # Truncation is left to `encode_split`, which cuts every vocabulary's output the same way (as
        # transformers' own truncation of a single text does); verbose=False silences its length warning.
        return self.tokenizer(list(texts), add_special_tokens=True, verbose=False)["input_ids"]


def train_vocabulary(texts: Sequence[str], path: Path, *, vocab_size: int, seed: int) -> SentencePieceVocabulary:
    """A sentencepiece BPE vocabulary of at most ``vocab_size`` pieces trained on ``texts``, saved at ``path``.

    BPE, like BERT's WordPiece, keeps frequent words whole; a unigram model trained on a small corpus splits even
    words such as "not" into pieces.
    """
    return SentencePieceVocabulary(tokenizer_lib.train(texts, path, vocab_size=vocab_size, model_type="bpe", seed=seed))


# ------------------------------------------------------------------------------------------------ encoding


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A split as model inputs: ``input_ids`` (n, max_len) padded with ``pad_id``, ``labels`` (n,)."""

    input_ids: np.ndarray  # int32
    labels: np.ndarray  # int32
    pad_id: int
    truncated: int  # examples whose end was cut off

    def __len__(self) -> int:
        return len(self.labels)


def encode_split(vocabulary: Vocabulary, split: Split, max_len: int) -> Encoded:
    """Token ids of every text, cut to ``max_len`` (keeping the final [SEP]) and padded to it."""
    if max_len < 2:
        raise ValueError(f"max_len must hold [CLS] and [SEP], got {max_len}")
    input_ids = np.full((len(split), max_len), vocabulary.pad_id, np.int32)
    truncated = 0
    for row, ids in enumerate(vocabulary.encode(split.texts)):
        if len(ids) > max_len:
            ids, truncated = [*ids[: max_len - 1], ids[-1]], truncated + 1
        input_ids[row, : len(ids)] = ids
    return Encoded(input_ids, split.labels.astype(np.int32), vocabulary.pad_id, truncated)


# ------------------------------------------------------------------------------------------------ batching


def make_batch(data: Encoded, indices: np.ndarray) -> dict[str, np.ndarray]:
    """``input_ids`` of shape ``indices.shape + (max_len,)`` and ``labels`` of ``indices.shape``; index -1 is an
    empty row (pad ids, label -1)."""
    real = indices >= 0
    safe = np.where(real, indices, 0)
    return {
        "input_ids": np.where(real[..., None], data.input_ids[safe], data.pad_id).astype(np.int32),
        "labels": np.where(real, data.labels[safe], FILL_LABEL).astype(np.int32),
    }


@dataclasses.dataclass
class PreparedData:
    """The encoded splits, the vocabulary that encoded them and the facts logged in the run record."""

    vocabulary: Vocabulary
    splits: dict[str, Encoded]  # train, valid and/or test
    stats: dict[str, Any]


@dataclasses.dataclass
class BatchStream(EpochStream):
    """Fixed-size batches of examples in a fresh order each epoch (`plan_epoch`): ``batch`` holds this host's rows
    of the step (`make_batch`, arrays with a leading grad_accum axis) and ``counts`` is ``{"examples": n}``, the
    step's real examples over all hosts.
    """

    data: Encoded
    batch_size: int
    grad_accum: int

    def _plan_for(self, epoch: int) -> np.ndarray:
        return data_lib.plan_fixed_epoch(
            len(self.data), batch_size=self.batch_size, grad_accum=self.grad_accum, seed=self.seed, epoch=epoch
        )

    def _batch(self, step: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        local = host_rows(step, self.process_index, self.process_count)
        return make_batch(self.data, local), {"examples": int((step >= 0).sum())}
