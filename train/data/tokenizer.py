"""SentencePiece vocabularies with the ids ls_jax.models expects: pad=0, bos=1, eos=2, unk=3.

One vocabulary is shared by source and target (the Transformer shares its embedding table). It is trained on
the training text, or loaded from a ``.model`` file, and always copied into the run directory so a resumed or
evaluated run decodes with exactly the vocabulary it was trained with.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterable, Sequence

import sentencepiece as spm

from train.errors import DataError, UsageError

SPECIAL_IDS = {"pad": 0, "bos": 1, "eos": 2, "unk": 3}
MODEL_FILENAME = "spm.model"
# sentencepiece's check that the vocabulary holds every character of the text plus the special pieces
_TOO_SMALL = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")
_NO_TEXT = "!sentences_.empty()"  # sentencepiece's failed check when every training sentence is empty


class VocabularyTooSmall(ValueError):
    """The requested vocabulary size is below ``minimum``: the corpus's characters plus the special pieces."""

    def __init__(self, vocab_size: int, minimum: int):
        super().__init__(
            f"a vocabulary of {vocab_size} pieces cannot hold this corpus: sentencepiece needs at "
            f"least {minimum} (every character of the text plus the {len(SPECIAL_IDS)} special pieces)"
        )
        self.vocab_size = vocab_size
        self.minimum = minimum

    def for_flag(self, flag: str) -> UsageError:
        """This error as the one line of the flag that asked for the vocabulary size."""
        return UsageError(f"{flag} {self.vocab_size}: {self}; pass {flag} {self.minimum} or more")


def _check_special_ids(processor: spm.SentencePieceProcessor, path: Path) -> None:
    actual = {
        "pad": processor.pad_id(),
        "bos": processor.bos_id(),
        "eos": processor.eos_id(),
        "unk": processor.unk_id(),
    }
    wrong = {name: got for name, got in actual.items() if got != SPECIAL_IDS[name]}
    if wrong:
        found = ", ".join(f"{name}={got}" for name, got in wrong.items())
        raise ValueError(
            f"{path}: sentencepiece model has {found}; ls-jax needs pad=0 bos=1 eos=2 unk=3 "
            "(train it with --pad_id=0 --bos_id=1 --eos_id=2 --unk_id=3)"
        )


def load(path: str | os.PathLike) -> spm.SentencePieceProcessor:
    """Loads a sentencepiece model and checks its special ids.

    Raises:
      FileNotFoundError: no file at ``path``.
      ValueError: the file is not a sentencepiece model, or its special ids differ from `SPECIAL_IDS`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"sentencepiece model not found: {path}")
    processor = spm.SentencePieceProcessor()
    try:
        processor.Load(str(path))
    except (OSError, RuntimeError) as err:
        raise ValueError(f"{path} is not a sentencepiece model: {err}") from err
    _check_special_ids(processor, path)
    return processor


def train(
    sentences: Iterable[str],
    path: str | os.PathLike,
    *,
    vocab_size: int,
    model_type: str = "unigram",
    character_coverage: float = 1.0,
    max_sentences: int = 2_000_000,
    seed: int = 0,
) -> spm.SentencePieceProcessor:
    """Trains a shared vocabulary on ``sentences`` and writes it to ``path``.

    ``vocab_size`` is an upper bound: a small corpus (such as the synthetic task) gets fewer pieces instead of
    an error. At most ``max_sentences`` sentences, sampled by sentencepiece, are used for training.

    Raises:
      VocabularyTooSmall: ``vocab_size`` is below the corpus's characters plus the special pieces.
      DataError: every sentence is empty.
    """
    path = Path(path)
    spm.set_random_generator_seed(seed)
    # Below one piece beyond the special ones sentencepiece fails without naming the size it needs; trained at
    # that size, it names it (or the corpus fits, and that size is the minimum).
    smallest = len(SPECIAL_IDS) + 1
    with open(path, "wb") as model_file:
        _train_into(
            model_file,
            vocab_size,
            sentence_iterator=iter(sentences),
            vocab_size=max(vocab_size, smallest),
            model_type=model_type,
            character_coverage=character_coverage,
            input_sentence_size=max_sentences,
            shuffle_input_sentence=True,
            hard_vocab_limit=False,
            pad_id=SPECIAL_IDS["pad"],
            bos_id=SPECIAL_IDS["bos"],
            eos_id=SPECIAL_IDS["eos"],
            unk_id=SPECIAL_IDS["unk"],
            minloglevel=2,
        )
    if vocab_size < smallest:
        raise VocabularyTooSmall(vocab_size, smallest)
    return load(path)


def _train_into(model_file: Any, asked: int, **options: Any) -> None:
    """``SentencePieceTrainer.Train`` writing to ``model_file``; its too-small-vocabulary check as an exception
    about the ``asked`` size, its check for a corpus of empty sentences as a DataError."""
    try:
        spm.SentencePieceTrainer.Train(model_writer=model_file, **options)
    except RuntimeError as err:
        if _NO_TEXT in str(err):
            raise DataError("the training data holds no text to learn a vocabulary from: every text is empty") from None
        match = _TOO_SMALL.search(str(err))
        if match is None:
            raise
        raise VocabularyTooSmall(asked, int(match.group(2))) from None


def copy_into(source: str | os.PathLike, run_dir: Path) -> Path:
    """Copies a sentencepiece model into ``run_dir`` (unless it is already there) and returns the copy's path."""
    target = run_dir / MODEL_FILENAME
    if Path(source).resolve() != target.resolve():
        shutil.copyfile(source, target)
    return target


def encode(processor: spm.SentencePieceProcessor, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, without BOS/EOS (the batcher adds them)."""
    return processor.Encode(list(texts), out_type=int, num_threads=os.cpu_count() or 1)


def decode(processor: spm.SentencePieceProcessor, ids: Sequence[Sequence[int]]) -> list[str]:
    """Detokenized texts; ids after the first EOS and special ids are dropped."""
    eos = SPECIAL_IDS["eos"]
    first_special_free = len(SPECIAL_IDS)
    texts = []
    for row in ids:
        row = list(row)
        if eos in row:
            row = row[: row.index(eos)]
        texts.append(processor.Decode([int(t) for t in row if t >= first_special_free]))
    return texts
