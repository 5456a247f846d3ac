"""Language-modelling data for ``python -m train.gpt``: documents in, packed token rows out.

Sources (``--data``):
  ``synthetic``       the grammar of `train.gpt.synthetic`, one word per token (`WordVocabulary`);
  ``text:PATH``       a text file with one document per line, or a directory whose ``*.txt`` files are one
                      document each;
  ``tfds:NAME``       a TensorFlow Datasets text set such as ``lm1b`` (its ``train`` split and, when it has
                      one, a validation split; needs the optional ``tensorflow-datasets`` package).
Text is tokenized by a sentencepiece model trained on the training documents or given (``--spm-model``), or by
the tokenizer of a Hugging Face GPT-2 directory (``--init-from``). Without a validation split the last
``valid_fraction`` of the training stream is held out (cut at a document boundary where there is one).

Packing. The documents d_1..d_n of a split become one stream with an end-of-document id (EOD) around each,

    stream = EOD d_1 EOD d_2 EOD ... EOD d_n EOD          (T tokens)

and row r of length L reads L+1 tokens from position rL: inputs ``stream[rL : rL+L]``, labels
``stream[rL+1 : rL+L+1]``. Rows overlap by one token, so every token after the first is a label exactly once;
the last row is cut short by the stream's end, and its missing positions hold the EOD id as input and
`IGNORE_LABEL` as label (no loss, no weight). A document may span two rows; causal attention lets a position
see the earlier documents of its row.

Batches. An epoch is a permutation of the rows drawn from ``(seed, epoch)``, cut into steps of ``grad_accum``
micro-batches of ``rows`` rows over all devices; the last step is filled up with empty rows (all labels
IGNORE_LABEL). Arrays are ``input_ids`` and ``labels``, int32 of shape (grad_accum, rows / hosts, L); counts are
``{"tokens": labels that count}`` over all hosts; ``position`` resumes the stream (`EpochStream`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence

import numpy as np

from train.data import files as files_lib
from train.data import tokenizer as tokenizer_lib
from train.data.stream import EpochStream, fixed_eval_plan, host_rows, import_tfds, plan_fixed_epoch
from train.errors import DataError, UsageError
from train.gpt import synthetic as gpt_synthetic

IGNORE_LABEL = -1
SPLITS = ("train", "valid")

Corpus = dict[str, list[str]]  # split -> documents


class Tokenizer(Protocol):
    """Texts to ids and back; ``eos_id`` separates documents."""

    @property
    def size(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


# ------------------------------------------------------------------------------------------------ reading


def read_text(path: str | Path) -> list[str]:
    """The documents of a UTF-8 text file (one per non-blank line) or of a directory (one per ``*.txt`` file)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise DataError(f"--data text:{path}: the directory holds no .txt files")
        documents = [text for text in (files_lib.utf8_text(file).strip() for file in files) if text]
    elif path.is_file():
        documents = [line.strip() for line in files_lib.utf8_lines(path) if line.strip()]
    else:
        raise DataError(f"--data text:{path}: no such file or directory")
    if not documents:
        raise DataError(f"--data text:{path} is empty: it holds no text to train on")
    return documents


def read_tfds_split(name: str, split: str, *, text_field: str, data_dir: str | None = None) -> list[str]:
    """The ``text_field`` of every example of one split of a TensorFlow Datasets set.

    Raises:
      UsageError: tensorflow-datasets is missing (the message says how to install it).
      DataError: NAME is not a tfds dataset, the split cannot be loaded, or its examples have no ``text_field``.
    """
    tfds = import_tfds()
    try:
        tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError as err:
        raise DataError(
            f"--data tfds:{name}: tensorflow-datasets has no dataset {name!r} (tfds.list_builders() lists them)"
        ) from err
    try:
        dataset = tfds.load(name, split=split, data_dir=data_dir, shuffle_files=False)
    except Exception as err:  # noqa: BLE001 - tfds raises many kinds; the user needs the message
        raise DataError(f"cannot load tfds:{name} split {split}: {type(err).__name__}: {err}") from err
    documents = []
    for example in tfds.as_numpy(dataset):
        if text_field not in example:
            raise DataError(
                f"tfds:{name} examples have features {sorted(example)}; no {text_field!r} (choose it with --text-field)"
            )
        text = example[text_field]
        documents.append(text.decode("utf-8") if isinstance(text, bytes) else str(text))
    return documents


def read_corpus(
    spec: str,
    *,
    seed: int = 0,
    text_field: str = "text",
    tfds_valid_split: str | None = "validation",
    tfds_data_dir: str | None = None,
) -> Corpus:
    """The documents a ``--data`` value names: ``synthetic``, ``text:PATH`` or ``tfds:NAME``; "valid" only
    where the source has its own validation documents."""
    kind, _, location = spec.partition(":")
    if kind == "synthetic" and not location:
        return gpt_synthetic.synthetic_corpus(seed)
    if kind == "text" and location:
        return {"train": read_text(location)}
    if kind == "tfds" and location:
        read = dict(text_field=text_field, data_dir=tfds_data_dir)
        corpus = {"train": read_tfds_split(location, "train", **read)}
        if tfds_valid_split:
            corpus["valid"] = read_tfds_split(location, tfds_valid_split, **read)
        return corpus
    raise UsageError(f"--data {spec!r} is not one of: synthetic, text:PATH, tfds:NAME")


# ------------------------------------------------------------------------------------------------ tokenizers


@dataclasses.dataclass(frozen=True)
class SentencePieceTokenizer:
    """A `train.data.tokenizer` model (pad=0, bos=1, eos=2, unk=3); eos ends a document."""

    processor: Any  # sentencepiece.SentencePieceProcessor

    @property
    def size(self) -> int:
        return self.processor.GetPieceSize()

    @property
    def eos_id(self) -> int:
        return tokenizer_lib.SPECIAL_IDS["eos"]

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return tokenizer_lib.encode(self.processor, texts)

    def decode(self, ids: Sequence[int]) -> str:
        return self.processor.Decode([int(i) for i in ids if i >= len(tokenizer_lib.SPECIAL_IDS)])


@dataclasses.dataclass(frozen=True)
class HuggingFaceTokenizer:
    """The tokenizer of a local Hugging Face GPT-2 directory; its ``<|endoftext|>`` ends a document."""

    tokenizer: Any  # transformers.PreTrainedTokenizerFast

    @classmethod
    def load(cls, directory: str | Path) -> HuggingFaceTokenizer:
        directory = Path(directory)
        if not any((directory / name).is_file() for name in ("tokenizer.json", "vocab.json")):
            raise UsageError(
                f"--init-from {directory}: no tokenizer there (expected tokenizer.json or vocab.json + merges.txt)"
            )
        try:
            from transformers import AutoTokenizer
        except ImportError as err:
            raise UsageError(
                "--init-from needs transformers for the checkpoint's tokenizer: pip install "
                "'ls-jax[hf]' (or pip install transformers)"
            ) from err
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        if tokenizer.eos_token_id is None:
            raise UsageError(f"--init-from {directory}: the tokenizer has no end-of-text token to separate documents")
        return cls(tokenizer)

    @property
    def size(self) -> int:
        return len(self.tokenizer)

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return self.tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def _lines(documents: Iterable[str]) -> Iterable[str]:
    """The non-blank lines of the documents: sentencepiece skips training sentences of over 4192 bytes."""
    return (line for document in documents for line in document.splitlines() if line.strip())


def sentencepiece_tokenizer(
    documents: Sequence[str], run_dir: Path, *, spm_model: str | None, vocab_size: int, seed: int
) -> SentencePieceTokenizer:
    """The model at ``spm_model``, copied into ``run_dir``, or one trained on ``documents`` and saved there.

    Raises:
      UsageError: ``spm_model`` does not exist or is not a sentencepiece model with ids pad=0 bos=1 eos=2 unk=3.
    """
    if spm_model is None:
        path = run_dir / tokenizer_lib.MODEL_FILENAME
        return SentencePieceTokenizer(
            tokenizer_lib.train(_lines(documents), path, vocab_size=vocab_size, model_type="bpe", seed=seed)
        )
    if not Path(spm_model).is_file():
        raise UsageError(
            f"--spm-model {spm_model}: no such file; give a sentencepiece .model file or leave the flag "
            "out to train one on the corpus"
        )
    try:
        processor = tokenizer_lib.load(spm_model)
    except ValueError as err:
        raise UsageError(f"--spm-model {spm_model}: {err}") from err
    tokenizer_lib.copy_into(spm_model, run_dir)
    return SentencePieceTokenizer(processor)


# ------------------------------------------------------------------------------------------------ packing


def pack(documents: Sequence[Sequence[int]], eod_id: int) -> np.ndarray:
    """``EOD d_1 EOD d_2 ... d_n EOD`` as one int32 stream (empty documents are left out)."""
    tokens = itertools.chain.from_iterable((*document, eod_id) for document in documents if len(document))
    return np.fromiter(itertools.chain([eod_id], tokens), np.int32)


def split_tail(stream: np.ndarray, fraction: float, eod_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(head, tail) of a stream, about ``fraction`` of its tokens in the tail. Both hold the token at the cut (the
    head's last label, the tail's first input), so no label is in both; the cut moves back to the last EOD in the
    second half of the head, so the tail starts a document, unless there is none (a single long document)."""
    cut = len(stream) - max(2, round(fraction * len(stream)))
    if cut < 2:
        raise DataError(f"{len(stream)} tokens are too few to hold out a validation part")
    half = cut // 2
    boundaries = np.flatnonzero(stream[half : cut + 1] == eod_id)
    if len(boundaries) and half + boundaries[-1] > 0:
        cut = half + int(boundaries[-1])
    return stream[: cut + 1], stream[cut:]


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """A token stream read as rows of ``seq_len`` inputs and labels (module docstring)."""

    stream: np.ndarray  # (T,) int32
    seq_len: int
    eod_id: int

    @property
    def num_targets(self) -> int:
        return len(self.stream) - 1

    @property
    def num_rows(self) -> int:
        return math.ceil(self.num_targets / self.seq_len)

    def label_mask(self, indices: np.ndarray) -> np.ndarray:
        """indices.shape + (L,) booleans: True where a row's label exists; index -1 is an empty row."""
        positions = np.asarray(indices)[..., None] * self.seq_len + np.arange(1, self.seq_len + 1)
        return (np.asarray(indices)[..., None] >= 0) & (positions <= self.num_targets)

    def batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """``input_ids`` and ``labels``, int32 of shape ``indices.shape + (L,)``."""
        mask = self.label_mask(indices)
        starts = np.maximum(np.asarray(indices), 0)[..., None] * self.seq_len + np.arange(self.seq_len)
        inputs = self.stream[np.where(mask, starts, 0)]
        labels = self.stream[np.where(mask, starts + 1, 0)]
        return {
            "input_ids": np.where(mask, inputs, self.eod_id).astype(np.int32),
            "labels": np.where(mask, labels, IGNORE_LABEL).astype(np.int32),
        }

    def count_targets(self, indices: np.ndarray) -> int:
        return int(self.label_mask(indices).sum())


def unigram_perplexity(stream: np.ndarray) -> float:
    """exp(-sum_v p_v ln p_v) over the label frequencies p of a stream: the perplexity, on that stream, of the best
    model that ignores context."""
    counts = np.bincount(stream[1:])
    freqs = counts[counts > 0] / (len(stream) - 1)
    return float(np.exp(-(freqs * np.log(freqs)).sum()))


def check_sequence_length(seq_len: int, max_positions: int) -> None:
    """UsageError unless 1 <= seq_len <= the model's positions."""
    if seq_len < 1:
        raise UsageError(f"--max-seq-len must be >= 1, got {seq_len}")
    if seq_len > max_positions:
        raise UsageError(
            f"--max-seq-len {seq_len} is longer than the model's {max_positions} positions; lower "
            "--max-seq-len or choose a model with more positions"
        )


def packed_rows(stream: np.ndarray, seq_len: int, eod_id: int, split: str) -> PackedRows:
    """`PackedRows` of a split's stream; DataError when the training split has fewer tokens than one row."""
    rows = PackedRows(stream, seq_len, eod_id)
    if split == "train" and rows.num_targets < seq_len:
        raise DataError(
            f"the training split has {rows.num_targets + 1} tokens (with end-of-document ids), fewer "
            f"than one sequence of {seq_len + 1}; lower --max-seq-len or give more text"
        )
    return rows


# ------------------------------------------------------------------------------------------------ loading


@dataclasses.dataclass(frozen=True)
class LMData:
    tokenizer: Tokenizer
    splits: dict[str, PackedRows]  # "train", "valid"
    stats: dict[str, Any]  # documents and tokens per split, vocab_size: for the run log


def encode_corpus(corpus: Corpus, tokenizer: Tokenizer, *, seq_len: int, valid_fraction: float) -> LMData:
    """Tokenizes and packs every split; holds out the tail of the training stream when there is no "valid"."""
    if not any(corpus["train"]):
        raise DataError("the training corpus is empty: it holds no text to train on")
    streams = {name: pack(tokenizer.encode(documents), tokenizer.eos_id) for name, documents in corpus.items()}
    if len(streams["train"]) == 1:
        raise DataError("the training corpus is empty: its documents encode to no tokens")
    if "valid" not in streams:
        streams["train"], streams["valid"] = split_tail(streams["train"], valid_fraction, tokenizer.eos_id)
    splits = {name: packed_rows(streams[name], seq_len, tokenizer.eos_id, name) for name in SPLITS}
    stats = {
        "vocab_size": tokenizer.size,
        **{f"{name}_documents": len(docs) for name, docs in corpus.items()},
        **{f"{name}_tokens": rows.num_targets for name, rows in splits.items()},
    }
    return LMData(tokenizer, splits, stats)


def load_data(
    spec: str,
    *,
    seq_len: int,
    max_positions: int,
    run_dir: Path,
    tokenizer: Tokenizer | None = None,
    spm_model: str | None = None,
    vocab_size: int = 8000,
    valid_fraction: float = 0.05,
    seed: int = 0,
    text_field: str = "text",
    tfds_valid_split: str | None = "validation",
    tfds_data_dir: str | None = None,
) -> LMData:
    """Reads, tokenizes and packs ``--data`` for a model of ``max_positions`` positions.

    The tokenizer: ``tokenizer`` when given (a Hugging Face checkpoint's), else the synthetic corpus' own
    `WordVocabulary`, else sentencepiece (`sentencepiece_tokenizer`, written into ``run_dir``).

    Raises:
      UsageError: the sequence is longer than the positions, or the tokenizer file is missing.
      DataError: the corpus is missing or empty or shorter than one sequence, or the tfds name is unknown (each
        names the problem and the fix).
    """
    check_sequence_length(seq_len, max_positions)
    corpus = read_corpus(
        spec, seed=seed, text_field=text_field, tfds_valid_split=tfds_valid_split, tfds_data_dir=tfds_data_dir
    )
    if tokenizer is None:
        if spec == "synthetic" and spm_model is None:
            tokenizer = gpt_synthetic.WordVocabulary()
        else:
            tokenizer = sentencepiece_tokenizer(
                corpus["train"], run_dir, spm_model=spm_model, vocab_size=vocab_size, seed=seed
            )
    return encode_corpus(corpus, tokenizer, seq_len=seq_len, valid_fraction=valid_fraction)


# ------------------------------------------------------------------------------------------------ batches


@dataclasses.dataclass
class LMBatchStream(EpochStream):
    """Training batches of packed rows: a fresh permutation of the rows each epoch (see the module docstring)."""

    data: PackedRows
    rows: int  # per micro-batch, over all hosts
    grad_accum: int

    def _plan_for(self, epoch: int) -> np.ndarray:
        return plan_fixed_epoch(
            self.data.num_rows, batch_size=self.rows, grad_accum=self.grad_accum, seed=self.seed, epoch=epoch
        )

    def _batch(self, step: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        local = host_rows(step, self.process_index, self.process_count)
        return self.data.batch(local), {"tokens": self.data.count_targets(step)}

    def shapes(self) -> list[tuple[int, int, int]]:
        """The one (grad_accum, rows, L) shape every step has (global rows)."""
        return [(self.grad_accum, self.rows, self.data.seq_len)]


def eval_batches(
    data: PackedRows, rows: int, process_index: int = 0, process_count: int = 1
) -> Iterable[dict[str, np.ndarray]]:
    """Every row once, in order, ``rows`` (global) at a time: this host's part of each batch, (rows / hosts, L)."""
    for indices in fixed_eval_plan(data.num_rows, rows):
        yield data.batch(host_rows(indices, process_index, process_count))
