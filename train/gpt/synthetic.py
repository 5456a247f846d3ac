"""A synthetic corpus for ``python -m train.gpt``, generated from code, with a known entropy floor.

A document is one to three sentences of a small English-like grammar, one word per token::

    first sentence   SUBJECT VERB OBJECT [ADVERB] .
    later sentences  then PRONOUN VERB OBJECT [ADVERB] .
    SUBJECT, OBJECT  DETERMINER [ADJECTIVE] NOUN

Each choice is drawn from a table below: the number of sentences (uniform over 1-3), a noun phrase's number
(singular or plural, even odds), its determiner (singular: "the" or "a"; plural: "the" half of the time, else one
of eight numerals), an optional adjective (half of the time, uniform over ten), the noun (uniform over sixteen),
the verb (uniform over twelve) and an optional adverb (40%, uniform over six). Three kinds of token carry no
choice at all, and a model has to learn them from context:

- the noun's form (singular or plural) follows its determiner when that is "a" or a numeral;
- the verb's form agrees with its subject ("sees" / "see"), a determiner and an adjective earlier;
- the pronoun of a later sentence is "it" or "they" after the *first* sentence's subject, up to ~20 tokens back.

Every choice shows in the words (the determiner or noun form gives the number, an absent adjective or adverb
leaves a different next word), so a document's words determine its choices and the entropy of a document is the
sum of the entropies of its choices. Documents are independent, and packed into one stream with an end-of-document
token after each, so the best possible model's cross entropy per token is

    H = E[entropy of a document] / E[tokens of a document + 1]
      = 28.42 nats / 15.30 tokens = 1.857 nats per token:  a perplexity floor of exp(H) = 6.41

(`entropy_floor` computes it from the tables; a unigram model of the same text has a perplexity of about 47).
A model whose context starts mid-document (a packed row's first tokens) cannot know the pronoun or a pending
agreement, so a trained model lands a little above the floor.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from typing import Mapping, Sequence

import numpy as np

from ls_jax.models.tokens import EOS_ID, NUM_SPECIAL_TOKENS, UNK_ID

# (singular, plural); every plural differs from its singular, so the noun shows its number.
NOUNS: tuple[tuple[str, str], ...] = (
    ("cat", "cats"),
    ("dog", "dogs"),
    ("bird", "birds"),
    ("horse", "horses"),
    ("farmer", "farmers"),
    ("teacher", "teachers"),
    ("child", "children"),
    ("king", "kings"),
    ("queen", "queens"),
    ("doctor", "doctors"),
    ("student", "students"),
    ("fox", "foxes"),
    ("mouse", "mice"),
    ("wolf", "wolves"),
    ("baker", "bakers"),
    ("sailor", "sailors"),
)
# (plural subject, singular subject)
VERBS: tuple[tuple[str, str], ...] = (
    ("see", "sees"),
    ("like", "likes"),
    ("find", "finds"),
    ("carry", "carries"),
    ("watch", "watches"),
    ("follow", "follows"),
    ("help", "helps"),
    ("draw", "draws"),
    ("want", "wants"),
    ("hold", "holds"),
    ("visit", "visits"),
    ("chase", "chases"),
)
ADJECTIVES: tuple[str, ...] = ("big", "small", "red", "green", "old", "young", "happy", "quiet", "brave", "clever")
ADVERBS: tuple[str, ...] = ("quickly", "slowly", "often", "today", "again", "carefully")
NUMERALS: tuple[str, ...] = ("two", "three", "four", "five", "six", "seven", "eight", "nine")
FUNCTION_WORDS: tuple[str, ...] = ("the", "a", "then", "it", "they", ".")

# The choice tables: option -> probability. None is "no word here".
SENTENCES: dict[int, float] = {1: 1 / 3, 2: 1 / 3, 3: 1 / 3}
PLURAL: dict[bool, float] = {False: 0.5, True: 0.5}
SINGULAR_DETERMINER: dict[str, float] = {"the": 0.5, "a": 0.5}
PLURAL_DETERMINER: dict[str, float] = {"the": 0.5, **{n: 0.5 / len(NUMERALS) for n in NUMERALS}}
ADJECTIVE: dict[str | None, float] = {None: 0.5, **{a: 0.5 / len(ADJECTIVES) for a in ADJECTIVES}}
NOUN: dict[int, float] = {i: 1 / len(NOUNS) for i in range(len(NOUNS))}
VERB: dict[int, float] = {i: 1 / len(VERBS) for i in range(len(VERBS))}
ADVERB: dict[str | None, float] = {None: 0.6, **{a: 0.4 / len(ADVERBS) for a in ADVERBS}}

SYNTHETIC_TRAIN_DOCUMENTS = 50_000
SYNTHETIC_VALID_DOCUMENTS = 2_000


@dataclasses.dataclass(frozen=True)
class Document:
    """A generated document and the natural log of the probability of the choices that made it."""

    words: list[str]
    log_prob: float

    @property
    def text(self) -> str:
        return " ".join(self.words)


class _Sampler:
    """Draws from the choice tables and sums the log-probability of what it drew."""

    def __init__(self, rng: np.random.Generator):
        self.rng, self.log_prob = rng, 0.0

    def choose(self, table: Mapping) -> object:
        options, cumulative, log_probs = _inverse_cdf(id(table), table)
        index = min(bisect.bisect_right(cumulative, self.rng.random()), len(options) - 1)
        self.log_prob += log_probs[index]
        return options[index]


_TABLES: dict[int, tuple[list, list[float], list[float]]] = {}


def _inverse_cdf(key: int, table: Mapping) -> tuple[list, list[float], list[float]]:
    """(options, cumulative probabilities, log-probabilities) of a table, computed once per table."""
    if key not in _TABLES:
        _TABLES[key] = (list(table), list(itertools.accumulate(table.values())), [math.log(p) for p in table.values()])
    return _TABLES[key]


def _noun_phrase(sampler: _Sampler) -> tuple[list[str], bool]:
    plural = sampler.choose(PLURAL)
    determiner = sampler.choose(PLURAL_DETERMINER if plural else SINGULAR_DETERMINER)
    adjective = sampler.choose(ADJECTIVE)
    noun = NOUNS[sampler.choose(NOUN)][int(plural)]
    return [determiner, *([adjective] if adjective else []), noun], plural


def _predicate(sampler: _Sampler, plural_subject: bool) -> list[str]:
    verb = VERBS[sampler.choose(VERB)][0 if plural_subject else 1]
    obj, _ = _noun_phrase(sampler)
    adverb = sampler.choose(ADVERB)
    return [verb, *obj, *([adverb] if adverb else []), "."]


def generate_document(rng: np.random.Generator) -> Document:
    """One document of the grammar above."""
    sampler = _Sampler(rng)
    sentences = sampler.choose(SENTENCES)
    subject, plural = _noun_phrase(sampler)
    words = subject + _predicate(sampler, plural)
    for _ in range(sentences - 1):
        words += ["then", "they" if plural else "it"] + _predicate(sampler, plural)
    return Document(words, sampler.log_prob)


def generate_documents(count: int, seed: int) -> list[Document]:
    """``count`` documents; the same seed gives the same documents."""
    rng = np.random.default_rng(seed)
    return [generate_document(rng) for _ in range(count)]


def synthetic_corpus(
    seed: int = 0, *, train: int = SYNTHETIC_TRAIN_DOCUMENTS, valid: int = SYNTHETIC_VALID_DOCUMENTS
) -> dict[str, list[str]]:
    """Train and valid documents from independent streams of ``seed`` (short ones may occur in both, as they would
    in any sample of the language; that does not lower the floor a model can reach)."""
    return {
        "train": [doc.text for doc in generate_documents(train, seed)],
        "valid": [doc.text for doc in generate_documents(valid, seed + 1_000_003)],
    }


# ------------------------------------------------------------------------------------------- entropy floor


def _entropy(table: Mapping) -> float:
    """-sum p ln p over a choice table, in nats."""
    return -sum(p * math.log(p) for p in table.values() if p > 0)


def _present(table: Mapping) -> float:
    """The expected number of words an optional choice emits."""
    return sum(p for option, p in table.items() if option is not None)


@dataclasses.dataclass(frozen=True)
class EntropyFloor:
    """Expected entropy and tokens of a document (end-of-document token included) and their ratio."""

    nats_per_document: float
    tokens_per_document: float

    @property
    def nats_per_token(self) -> float:
        return self.nats_per_document / self.tokens_per_document

    @property
    def perplexity(self) -> float:
        return math.exp(self.nats_per_token)


def entropy_floor() -> EntropyFloor:
    """The lowest cross entropy a model can reach on the packed stream (module docstring), from the tables."""
    determiner = PLURAL[False] * _entropy(SINGULAR_DETERMINER) + PLURAL[True] * _entropy(PLURAL_DETERMINER)
    noun_phrase = _entropy(PLURAL) + determiner + _entropy(ADJECTIVE) + _entropy(NOUN)
    noun_phrase_words = 1 + _present(ADJECTIVE) + 1
    predicate = _entropy(VERB) + noun_phrase + _entropy(ADVERB)
    predicate_words = 1 + noun_phrase_words + _present(ADVERB) + 1  # verb, object, adverb, "."
    later = sum(p * (n - 1) for n, p in SENTENCES.items())  # expected later sentences
    nats = _entropy(SENTENCES) + noun_phrase + predicate + later * predicate
    tokens = noun_phrase_words + predicate_words + later * (2 + predicate_words) + 1  # "then", pronoun; EOD
    return EntropyFloor(nats, tokens)


# ------------------------------------------------------------------------------------------- vocabulary


def _lexicon() -> list[str]:
    words = [*FUNCTION_WORDS, *ADJECTIVES, *ADVERBS, *NUMERALS]
    words += [form for pair in NOUNS for form in pair] + [form for pair in VERBS for form in pair]
    return words


@dataclasses.dataclass(frozen=True)
class WordVocabulary:
    """One id per word of the grammar, after the special ids (pad=0, bos=1, eos=2, unk=3); eos ends a document.

    A word-level vocabulary keeps a token equal to a choice of the grammar, so `entropy_floor` is per token.
    """

    words: tuple[str, ...] = tuple(_lexicon())

    @property
    def size(self) -> int:
        return NUM_SPECIAL_TOKENS + len(self.words)

    @property
    def eos_id(self) -> int:
        return EOS_ID

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Whitespace-separated words -> ids (a word outside the grammar is unk)."""
        ids = {word: NUM_SPECIAL_TOKENS + i for i, word in enumerate(self.words)}
        return [[ids.get(word, UNK_ID) for word in text.split()] for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> words joined by spaces; special ids are left out."""
        return " ".join(self.words[i - NUM_SPECIAL_TOKENS] for i in map(int, ids) if i >= NUM_SPECIAL_TOKENS)
