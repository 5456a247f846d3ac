"""A parallel text corpus shaped like the e2e benchmark's WMT batches, for timing the training CLI on them.

``train.bench e2e`` times the WMT models on sentences of 64 tokens over a 32,768-piece vocabulary; the embedded
synthetic task has about 20 tokens a sentence over 512 pieces, so its step spends far less on the output
projection, the loss and attention. This writes ``DIR/{train,valid,test}.{de,en}`` for ``--data text:DIR``: each
sentence ``--words`` words drawn from ``--vocab`` random lowercase words (Zipf-distributed, as natural text is), the
target the source's words in reverse order. With ``--spm-vocab-size 32768`` sentencepiece gives most words a piece
of their own and splits the rarest: the default 52 words make sentences of 53-78 tokens, 55 on average.

  python scripts/wide_vocab_corpus.py DIR [--pairs 20000] [--words 52] [--vocab 40000] [--seed 0]
"""

from __future__ import annotations

import argparse
import string
from pathlib import Path

import numpy as np

SPLITS = {"train": 1.0, "valid": 0.025, "test": 0.025}  # pairs per split, as a share of --pairs


def random_words(count: int, rng: np.random.Generator) -> list[str]:
    """``count`` distinct lowercase words of 3-9 letters."""
    letters = np.array(list(string.ascii_lowercase))
    words: dict[str, None] = {}
    while len(words) < count:
        length = int(rng.integers(3, 10))
        words["".join(rng.choice(letters, length))] = None
    return list(words)


def sentence_pairs(pairs: int, words: int, vocab: list[str], rng: np.random.Generator) -> list[tuple[str, str]]:
    """``pairs`` (source, target) sentences of ``words`` words; word ``k`` of the vocabulary drawn with weight
    ``1 / (k + 1)``; the target is the source reversed."""
    weights = 1.0 / np.arange(1, len(vocab) + 1)
    ids = rng.choice(len(vocab), size=(pairs, words), p=weights / weights.sum())
    return [(" ".join(vocab[i] for i in row), " ".join(vocab[i] for i in row[::-1])) for row in ids]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--pairs", type=int, default=20_000, help="training pairs")
    parser.add_argument("--words", type=int, default=52, help="words a sentence")
    parser.add_argument("--vocab", type=int, default=40_000, help="distinct words")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.pairs, args.words, args.vocab) < 1:
        parser.error("--pairs, --words and --vocab must be at least 1")
    rng = np.random.default_rng(args.seed)
    vocab = random_words(args.vocab, rng)
    args.directory.mkdir(parents=True, exist_ok=True)
    for split, share in SPLITS.items():
        pairs = sentence_pairs(max(1, int(args.pairs * share)), args.words, vocab, rng)
        for side, lang in enumerate(("de", "en")):
            (args.directory / f"{split}.{lang}").write_text("".join(pair[side] + "\n" for pair in pairs))
    print(f"wrote {args.directory}/{{{','.join(SPLITS)}}}.{{de,en}}: {args.pairs} training pairs of {args.words} words")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
