"""Parallel text in, token batches out: reading, encoding, length filtering and token-based batching.

Sources (``--data``):
  ``synthetic[:PAIRS]``    the toy task of `train.wmt.synthetic`, generated in memory (20,000 training pairs or PAIRS);
  ``text:DIR``             ``DIR/{train,valid,test}.{src,tgt}``, one sentence per line, test optional;
  ``tfds:NAME``            a TensorFlow Datasets translation set such as ``wmt14_translate/de-en``
                           (needs the optional ``tensorflow-datasets`` package; imported only here).

Examples. A pair (s, t) of token lists becomes
  src    = s + [EOS]          (the encoder input)
  tgt_in = [BOS] + t          (the decoder input, teacher forcing)
  labels = t + [EOS]
so its length is n = max(len(s), len(t)) + 1. Pairs with n above the model's positions are dropped, and so are
pairs with an empty side; both are counted.

Batches. Every example is padded to a bucket length L: the smallest of `bucket_lengths` (multiples of 8 that
grow by about 10%) that holds it, so the compiled step sees few distinct shapes. A micro-batch holds examples of
one bucket only, ``rows = num_shards * (max_tokens // L)`` of them, so each device gets at most ``max_tokens``
padded tokens (``--max-tokens`` is per device, as in fairseq); in FP8 runs one row fewer where that makes a device's
tokens a multiple of 16 (`token_multiple`). An optimizer step takes ``grad_accum``
micro-batches of the same bucket, stacked: arrays have shape (grad_accum, rows, L). Each epoch shuffles the
examples within each bucket and the order of the steps, from ``(seed, epoch)`` alone; the last step of a bucket
is filled up with empty (all-PAD) rows. Every example appears exactly once per epoch.

Several hosts. The plan of an epoch is a pure function of the example lengths and ``(seed, epoch)``, so every
host computes the same plan and builds only its own slice of the rows of each step (process ``p`` of ``P``
takes rows ``[p*rows/P, (p+1)*rows/P)``); the slices form one global batch sharded over all devices.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from train.data import files as files_lib
from train.data import tokenizer as tokenizer_lib
from train.data.stream import EpochStream, host_rows, import_tfds
from train.errors import DataError, UsageError
from train.wmt import synthetic as wmt_synthetic

PAD_ID, BOS_ID, EOS_ID = (tokenizer_lib.SPECIAL_IDS[name] for name in ("pad", "bos", "eos"))
SPLITS = ("train", "valid", "test")
LENGTH_MULTIPLE = 8
# In FP8 runs a device's padded tokens per micro-batch are a multiple of this where a row fewer makes them one: the
# step's matrix products then have every dimension a multiple of 16, which cuBLASLt's FP8 GEMMs need (XLA pads their
# operands otherwise: transformer-big's fp8 step at 341 x 24 tokens launched 1,231 kernels against 947 at 1024 x 8).
FP8_TOKEN_MULTIPLE = 16
BUCKET_GROWTH = 1.1
SYNTHETIC_TRAIN_PAIRS = 20_000
SYNTHETIC_MAX_PAIRS = 2_000_000  # generated in memory: about a minute on one CPU core

# split -> (source sentences, target sentences)
Corpus = dict[str, tuple[list[str], list[str]]]


# ----------------------------------------------------------------------------------------------- reading


def synthetic_corpus(seed: int = 0, *, train: int = SYNTHETIC_TRAIN_PAIRS, valid: int = 500, test: int = 500) -> Corpus:
    splits = wmt_synthetic.synthetic_corpus(train, valid, test, seed=seed)
    return {name: ([s for s, _ in pairs], [t for _, t in pairs]) for name, pairs in splits.items()}


def _read_lines(path: Path) -> list[str]:
    if path.is_dir():
        raise DataError(f"{path} is a directory, not a data file")
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    lines = [line.rstrip("\n") for line in files_lib.utf8_lines(path)]
    if not lines:
        raise DataError(f"data file is empty: {path}")
    return lines


def read_text_corpus(directory: str | Path, src_lang: str, tgt_lang: str) -> Corpus:
    """Reads ``{split}.{src_lang}`` / ``{split}.{tgt_lang}`` for train and valid (required) and test (optional).

    Raises:
      DataError: the directory or a required file is missing, a file is empty, or the two sides of a split have
        different numbers of lines.
    """
    directory = Path(directory)
    if directory.is_file():
        raise DataError(
            f"{directory} is a file: --data text: takes a directory of {{train,valid,test}}.{{{src_lang},{tgt_lang}}}"
        )
    if not directory.is_dir():
        raise DataError(f"data directory not found: {directory}")
    corpus: Corpus = {}
    for split in SPLITS:
        src_path, tgt_path = directory / f"{split}.{src_lang}", directory / f"{split}.{tgt_lang}"
        if split == "test" and not src_path.exists() and not tgt_path.exists():
            continue
        src, tgt = _read_lines(src_path), _read_lines(tgt_path)
        if len(src) != len(tgt):
            raise DataError(f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}; they must be parallel")
        corpus[split] = (src, tgt)
    return corpus


TFDS_SPLITS = {"train": "train", "valid": "validation", "test": "test"}


def read_tfds_corpus(name: str, src_lang: str, tgt_lang: str, data_dir: str | None = None) -> Corpus:
    """Reads a TensorFlow Datasets translation set whose examples have one text feature per language.

    Raises:
      UsageError: tensorflow-datasets is not installed (the message says how to install it).
      DataError: the dataset cannot be prepared, or it lacks the languages.
    """
    tfds = import_tfds()
    corpus: Corpus = {}
    for split, tfds_split in TFDS_SPLITS.items():
        try:
            dataset = tfds.load(name, split=tfds_split, data_dir=data_dir, shuffle_files=False)
        except Exception as err:  # noqa: BLE001 - tfds raises many kinds; the user needs the message
            raise DataError(f"cannot load tfds:{name} split {tfds_split}: {type(err).__name__}: {err}") from err
        src, tgt = [], []
        for example in tfds.as_numpy(dataset):
            if src_lang not in example or tgt_lang not in example:
                raise DataError(f"tfds:{name} examples have features {sorted(example)}; no {src_lang!r}/{tgt_lang!r}")
            src.append(example[src_lang].decode("utf-8"))
            tgt.append(example[tgt_lang].decode("utf-8"))
        if not src:
            raise DataError(f"tfds:{name} split {tfds_split} is empty")
        corpus[split] = (src, tgt)
    return corpus


def read_corpus(spec: str, *, src_lang: str, tgt_lang: str, seed: int = 0, tfds_data_dir: str | None = None) -> Corpus:
    """The corpus named by a ``--data`` value: ``synthetic``, ``text:DIR`` or ``tfds:NAME``."""
    kind, _, location = spec.partition(":")
    if kind == "synthetic":
        return synthetic_corpus(seed, train=synthetic_size(location))
    if kind == "text" and location:
        return read_text_corpus(location, src_lang, tgt_lang)
    if kind == "tfds" and location:
        return read_tfds_corpus(location, src_lang, tgt_lang, tfds_data_dir)
    raise UsageError(f"--data {spec!r} is not one of: synthetic, synthetic:PAIRS, text:DIR, tfds:NAME")


def synthetic_size(location: str) -> int:
    """The training pairs of ``--data synthetic[:PAIRS]``: PAIRS, or 20,000 without it.

    A larger corpus keeps a large global batch (many devices x ``--max-tokens``) from spending a noticeable part
    of each epoch on the partly empty last step of every length bucket.
    """
    if not location:
        return SYNTHETIC_TRAIN_PAIRS
    if not location.isdigit() or not 1 <= int(location) <= SYNTHETIC_MAX_PAIRS:
        raise UsageError(f"--data synthetic:{location}: PAIRS must be a whole number from 1 to {SYNTHETIC_MAX_PAIRS:,}")
    return int(location)


# ---------------------------------------------------------------------------------------------- encoding


@dataclasses.dataclass(frozen=True)
class Ragged:
    """Variable-length rows stored flat: row i is ``values[offsets[i]:offsets[i+1]]``."""

    values: np.ndarray  # (total,) int32
    offsets: np.ndarray  # (rows + 1,) int64

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[int]]) -> Ragged:
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        values = np.fromiter((t for r in rows for t in r), dtype=np.int32, count=int(offsets[-1]))
        return cls(values, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def lengths_of(self, indices: np.ndarray) -> np.ndarray:
        """The lengths of the rows at ``indices`` (without differencing every row of a corpus of millions)."""
        return self.offsets[indices + 1] - self.offsets[indices]

    def row(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    def take(self, indices: np.ndarray) -> Ragged:
        """The rows at ``indices``, in that order (vectorized: corpora have millions of rows)."""
        lengths = self.lengths_of(indices)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        # Position j of new row r reads old position offsets_old[indices[r]] + j.
        shift = np.repeat(self.offsets[indices] - offsets[:-1], lengths)
        return Ragged(self.values[np.arange(offsets[-1]) + shift], offsets)

    def padded(self, indices: np.ndarray, length: int, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, lengths): the rows at ``indices`` (-1: an empty row) as an int32 (len(indices), ``length``)
        array of PAD_ID holding row r's tokens at columns ``start .. start + lengths[r] - 1``; and those lengths."""
        real = indices >= 0
        rows = np.where(real, indices, 0)
        lengths = np.where(real, self.lengths_of(rows), 0)
        column = np.arange(length) - start
        inside = (column >= 0) & (column < lengths[:, None])
        tokens = np.full((len(indices), length), PAD_ID, np.int32)
        tokens[inside] = self.values[(self.offsets[rows][:, None] + column)[inside]]
        return tokens, lengths


@dataclasses.dataclass(frozen=True)
class ParallelData:
    """Token ids of aligned source and target sentences, without BOS/EOS."""

    src: Ragged
    tgt: Ragged

    def __len__(self) -> int:
        return len(self.src)

    @property
    def example_lengths(self) -> np.ndarray:
        """n = max(len(src), len(tgt)) + 1: the padded length an example needs (EOS or BOS added)."""
        return np.maximum(self.src.lengths, self.tgt.lengths) + 1

    def take(self, indices: np.ndarray) -> ParallelData:
        return ParallelData(self.src.take(indices), self.tgt.take(indices))


def encode(processor, src: Sequence[str], tgt: Sequence[str]) -> ParallelData:
    return ParallelData(
        Ragged.from_lists(tokenizer_lib.encode(processor, src)),
        Ragged.from_lists(tokenizer_lib.encode(processor, tgt)),
    )


@dataclasses.dataclass(frozen=True)
class FilterStats:
    kept: int
    too_long: int
    empty: int


def length_filter(data: ParallelData, max_len: int) -> tuple[np.ndarray, FilterStats]:
    """Indices of the pairs to keep: no empty side and an example length (see `ParallelData`) <= ``max_len``."""
    empty = (data.src.lengths == 0) | (data.tgt.lengths == 0)
    too_long = ~empty & (data.example_lengths > max_len)
    keep = np.flatnonzero(~empty & ~too_long)
    return keep, FilterStats(kept=len(keep), too_long=int(too_long.sum()), empty=int(empty.sum()))


# --------------------------------------------------------------------------------------------- batching


def bucket_lengths(max_len: int) -> np.ndarray:
    """Multiples of 8 from 8 up to (and covering) ``max_len``, each about 10% above the previous."""
    buckets = [LENGTH_MULTIPLE]
    while buckets[-1] < max_len:
        grown = math.ceil(buckets[-1] * BUCKET_GROWTH / LENGTH_MULTIPLE) * LENGTH_MULTIPLE
        buckets.append(max(grown, buckets[-1] + LENGTH_MULTIPLE))
    return np.asarray(buckets, dtype=np.int64)


def padded_lengths(example_lengths: np.ndarray) -> np.ndarray:
    """The smallest of `bucket_lengths` that holds each example."""
    buckets = bucket_lengths(int(example_lengths.max()))
    return buckets[np.searchsorted(buckets, example_lengths)]


def token_multiple(precision: str) -> int:
    """What a device's padded tokens per micro-batch are a multiple of where a row fewer does it: `FP8_TOKEN_MULTIPLE`
    in FP8, else `LENGTH_MULTIPLE` (which every bucket length is: every row fits)."""
    return FP8_TOKEN_MULTIPLE if precision == "fp8" else LENGTH_MULTIPLE


def rows_per_micro_batch(length: int, max_tokens: int, num_shards: int, multiple: int = LENGTH_MULTIPLE) -> int:
    """``num_shards * rows``, ``rows`` as many as fit ``max_tokens`` padded tokens per device, rounded down to a
    multiple of ``multiple / gcd(multiple, length)`` when at least that many fit, so that ``rows * length`` is a
    multiple of ``multiple`` (`token_multiple`; in FP8, 8192 tokens at length 24: 340 rows, not 341)."""
    per_shard = max_tokens // length
    if per_shard == 0:
        raise UsageError(
            f"--max-tokens {max_tokens} is smaller than the longest padded sentence length {length} "
            f"(lengths are padded to a multiple of {LENGTH_MULTIPLE}); raise --max-tokens or lower --max-len"
        )
    aligned = multiple // math.gcd(multiple, length)
    if per_shard >= aligned:
        per_shard -= per_shard % aligned
    return num_shards * per_shard


@dataclasses.dataclass(frozen=True)
class PlannedStep:
    """One optimizer step: ``indices`` (grad_accum, rows) into the examples, -1 for empty rows."""

    length: int
    indices: np.ndarray


def plan_epoch(
    example_lengths: np.ndarray,
    *,
    max_tokens: int,
    num_shards: int,
    grad_accum: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    multiple: int = LENGTH_MULTIPLE,
) -> list[PlannedStep]:
    """The steps of one epoch (see the module docstring); deterministic in ``(seed, epoch)``. A device's tokens per
    micro-batch are a multiple of ``multiple`` where a row fewer does it (`rows_per_micro_batch`)."""
    padded = padded_lengths(example_lengths)
    rng = np.random.default_rng([seed, epoch])
    steps = []
    for length in np.unique(padded)[::-1]:  # longest first, so a too-small budget names the longest length
        members = np.flatnonzero(padded == length)
        if shuffle:
            members = rng.permutation(members)
        rows = rows_per_micro_batch(int(length), max_tokens, num_shards, multiple)
        per_step = rows * grad_accum
        filled = np.full(math.ceil(len(members) / per_step) * per_step, -1, dtype=np.int64)
        filled[: len(members)] = members
        steps.extend(
            PlannedStep(int(length), chunk.reshape(grad_accum, rows)) for chunk in filled.reshape(-1, per_step)
        )
    if shuffle:
        steps = [steps[i] for i in rng.permutation(len(steps))]
    return steps


def make_batch(data: ParallelData, indices: np.ndarray, length: int) -> dict[str, np.ndarray]:
    """``src``, ``tgt_in`` and ``labels``, int32 of shape ``indices.shape + (length,)``; index -1 is an empty row.

    Vectorized over the rows: it runs on the host once per step, ahead of the devices.
    """
    flat = indices.reshape(-1)
    real = np.flatnonzero(flat >= 0)
    src, src_lengths = data.src.padded(flat, length)
    labels, tgt_lengths = data.tgt.padded(flat, length)
    tgt_in, _ = data.tgt.padded(flat, length, start=1)
    src[real, src_lengths[real]] = EOS_ID
    labels[real, tgt_lengths[real]] = EOS_ID
    tgt_in[real, 0] = BOS_ID
    shape = indices.shape + (length,)
    return {"src": src.reshape(shape), "tgt_in": tgt_in.reshape(shape), "labels": labels.reshape(shape)}


def token_counts(data: ParallelData, indices: np.ndarray) -> dict[str, int]:
    """Non-pad tokens of a planned step: ``tokens`` (source + target) and ``target_tokens`` (labels)."""
    real = indices[indices >= 0]
    source = int(data.src.lengths_of(real).sum()) + len(real)
    target = int(data.tgt.lengths_of(real).sum()) + len(real)
    return {"tokens": source + target, "target_tokens": target}


@dataclasses.dataclass
class PreparedData:
    """One run's data, encoded and length-filtered."""

    processor: Any  # sentencepiece
    train: ParallelData
    eval_sets: dict[str, ParallelData]  # valid, test
    references: dict[str, list[str]]  # the raw target sentences kept, per split (BLEU references)
    stats: dict[str, Any]


@dataclasses.dataclass
class BatchStream(EpochStream):
    """Token-budget batches of a parallel corpus (`plan_epoch`): ``batch`` holds this host's rows (`make_batch`,
    with the leading grad_accum axis) and ``counts`` the global token counts of the step (`token_counts`).
    """

    data: ParallelData
    max_tokens: int
    num_shards: int
    grad_accum: int
    multiple: int = LENGTH_MULTIPLE  # a device's tokens per micro-batch, where a row fewer does it (`token_multiple`)

    def _plan_for(self, epoch: int) -> list[PlannedStep]:
        return plan_epoch(
            self.data.example_lengths,
            max_tokens=self.max_tokens,
            num_shards=self.num_shards,
            grad_accum=self.grad_accum,
            seed=self.seed,
            epoch=epoch,
            multiple=self.multiple,
        )

    def _batch(self, step: PlannedStep) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        local = host_rows(step.indices, self.process_index, self.process_count)
        return make_batch(self.data, local, step.length), token_counts(self.data, step.indices)

    def shapes(self) -> list[tuple[int, ...]]:
        """The distinct (grad_accum, rows, length) batch shapes any epoch produces, longest first."""
        lengths = np.unique(padded_lengths(self.data.example_lengths))
        return [
            (
                self.grad_accum,
                rows_per_micro_batch(int(length), self.max_tokens, self.num_shards, self.multiple),
                int(length),
            )
            for length in lengths[::-1]
        ]


def eval_plan(
    example_lengths: np.ndarray, *, max_tokens: int, num_shards: int, max_rows: Callable[[int], int] | None = None
) -> tuple[int, np.ndarray]:
    """All examples in batches of one shape, for evaluation: ``(length, indices (batches, rows))``.

    ``length`` is the longest example's bucket, so the evaluation computations compile once; examples are
    sorted by length so a batch of short sentences finishes decoding early. Index -1 marks empty rows. A batch
    holds the rows that fit ``max_tokens`` per device, or fewer, ``max_rows(length)``, when that is given.
    """
    length = int(padded_lengths(example_lengths).max())
    rows = rows_per_micro_batch(length, max_tokens, num_shards)
    if max_rows is not None:
        rows = min(rows, max_rows(length))
    order = np.argsort(example_lengths, kind="stable")
    indices = np.full(math.ceil(len(order) / rows) * rows, -1, dtype=np.int64)
    indices[: len(order)] = order
    return length, indices.reshape(-1, rows)
