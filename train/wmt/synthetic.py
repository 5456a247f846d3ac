"""A toy translation task generated from code, so ``python -m train.wmt`` runs with no download.

The source is a small English-like language; the target is a made-up language whose grammar differs in ways a
translation model has to learn rather than copy:

- word mapping: every source lemma has its own target stem (generated once from a fixed seed);
- word order: subject-object-verb (source: subject-verb-object), the adverb before the verb, adjectives and
  numerals after the noun;
- morphology: plural nouns take the suffix ``-ri`` and so do adjectives agreeing with them; the verb agrees
  with its subject (``-su`` singular, ``-ran`` plural), where English marks only the third person singular;
- function words: ``the`` becomes a particle ``ta`` after the noun phrase, ``a`` disappears, the object takes
  a postposition ``wo``, and ``and`` joining two clauses becomes ``ke``.

Example: ``the big dog sees two small cats quickly`` -> ``<dog> <big> ta <cat>ri <small>ri <two> wo <quickly>
<see>su`` with the bracketed words replaced by their target stems.

Sentences come from a seeded generator; `synthetic_corpus` deduplicates them so the splits never overlap.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

Pair = tuple[str, str]

# (singular, plural) source nouns; a few irregular plurals so number is not always a visible "-s".
NOUNS: tuple[tuple[str, str], ...] = (
    ("cat", "cats"),
    ("dog", "dogs"),
    ("bird", "birds"),
    ("fish", "fish"),
    ("horse", "horses"),
    ("farmer", "farmers"),
    ("teacher", "teachers"),
    ("child", "children"),
    ("king", "kings"),
    ("queen", "queens"),
    ("doctor", "doctors"),
    ("student", "students"),
    ("baker", "bakers"),
    ("fox", "foxes"),
    ("mouse", "mice"),
    ("wolf", "wolves"),
    ("apple", "apples"),
    ("book", "books"),
    ("letter", "letters"),
    ("song", "songs"),
    ("house", "houses"),
    ("boat", "boats"),
    ("tree", "trees"),
    ("stone", "stones"),
)
# (plural/base, third person singular) source verbs.
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
    ("paint", "paints"),
    ("build", "builds"),
    ("visit", "visits"),
    ("call", "calls"),
    ("chase", "chases"),
    ("teach", "teaches"),
)
ADJECTIVES: tuple[str, ...] = (
    "big",
    "small",
    "red",
    "green",
    "old",
    "young",
    "happy",
    "quiet",
    "brave",
    "clever",
    "tired",
    "strange",
)
ADVERBS: tuple[str, ...] = ("quickly", "slowly", "often", "today", "again", "carefully")
NUMERALS: tuple[str, ...] = ("two", "three", "four", "five", "six", "seven", "eight", "nine", "many")

PLURAL_SUFFIX = "ri"
VERB_SINGULAR_SUFFIX = "su"
VERB_PLURAL_SUFFIX = "ran"
DEFINITE_PARTICLE = "ta"
OBJECT_PARTICLE = "wo"
CONJUNCTION = "ke"

_LEXICON_SEED = 20240521  # fixed: the target language must not change with the data seed
_ONSETS = ("b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "sh", "ch")
_VOWELS = ("a", "e", "i", "o", "u")


def _target_stems(count: int) -> list[str]:
    """``count`` distinct two-syllable words; function words have one syllable, so none collides with them."""
    rng = np.random.default_rng(_LEXICON_SEED)
    syllables = [onset + vowel for onset, vowel in itertools.product(_ONSETS, _VOWELS)]
    stems: list[str] = []
    while len(stems) < count:
        first, second = rng.choice(len(syllables), size=2)
        word = syllables[first] + syllables[second]
        if word not in stems:
            stems.append(word)
    return stems


@dataclasses.dataclass(frozen=True)
class Lexicon:
    """Source lemma -> target stem for every open-class word."""

    noun: dict[str, str]
    verb: dict[str, str]
    adjective: dict[str, str]
    adverb: dict[str, str]
    numeral: dict[str, str]

    @classmethod
    def build(cls) -> Lexicon:
        lemmas = [
            [singular for singular, _ in NOUNS],
            [base for base, _ in VERBS],
            list(ADJECTIVES),
            list(ADVERBS),
            list(NUMERALS),
        ]
        stems = iter(_target_stems(sum(len(group) for group in lemmas)))
        noun, verb, adjective, adverb, numeral = ({lemma: next(stems) for lemma in group} for group in lemmas)
        return cls(noun, verb, adjective, adverb, numeral)


@dataclasses.dataclass(frozen=True)
class NounPhrase:
    noun: int  # index into NOUNS
    adjective: int | None  # index into ADJECTIVES
    determiner: str  # "the", "a" (singular only) or a numeral (plural only)
    plural: bool


@dataclasses.dataclass(frozen=True)
class Clause:
    subject: NounPhrase
    verb: int  # index into VERBS
    obj: NounPhrase
    adverb: int | None  # index into ADVERBS


def _noun_phrase(rng: np.random.Generator) -> NounPhrase:
    plural = bool(rng.random() < 0.5)
    determiners = ("the", *NUMERALS) if plural else ("the", "a")
    determiner = determiners[rng.integers(len(determiners))]
    adjective = int(rng.integers(len(ADJECTIVES))) if rng.random() < 0.5 else None
    return NounPhrase(int(rng.integers(len(NOUNS))), adjective, determiner, plural)


def _clause(rng: np.random.Generator) -> Clause:
    adverb = int(rng.integers(len(ADVERBS))) if rng.random() < 0.4 else None
    return Clause(_noun_phrase(rng), int(rng.integers(len(VERBS))), _noun_phrase(rng), adverb)


def _source_noun_phrase(np_: NounPhrase) -> list[str]:
    adjective = [] if np_.adjective is None else [ADJECTIVES[np_.adjective]]
    singular, plural = NOUNS[np_.noun]
    return [np_.determiner] + adjective + [plural if np_.plural else singular]


def _target_noun_phrase(np_: NounPhrase, lexicon: Lexicon) -> list[str]:
    suffix = PLURAL_SUFFIX if np_.plural else ""
    words = [lexicon.noun[NOUNS[np_.noun][0]] + suffix]
    if np_.adjective is not None:
        words.append(lexicon.adjective[ADJECTIVES[np_.adjective]] + suffix)
    if np_.determiner == "the":
        words.append(DEFINITE_PARTICLE)
    elif np_.determiner in NUMERALS:
        words.append(lexicon.numeral[np_.determiner])
    return words


def _source_clause(clause: Clause) -> list[str]:
    base, third_singular = VERBS[clause.verb]
    verb = base if clause.subject.plural else third_singular
    adverb = [] if clause.adverb is None else [ADVERBS[clause.adverb]]
    return _source_noun_phrase(clause.subject) + [verb] + _source_noun_phrase(clause.obj) + adverb


def _target_clause(clause: Clause, lexicon: Lexicon) -> list[str]:
    agreement = VERB_PLURAL_SUFFIX if clause.subject.plural else VERB_SINGULAR_SUFFIX
    adverb = [] if clause.adverb is None else [lexicon.adverb[ADVERBS[clause.adverb]]]
    return (
        _target_noun_phrase(clause.subject, lexicon)
        + _target_noun_phrase(clause.obj, lexicon)
        + [OBJECT_PARTICLE]
        + adverb
        + [lexicon.verb[VERBS[clause.verb][0]] + agreement]
    )


def translate(clauses: list[Clause], lexicon: Lexicon) -> Pair:
    """The (source, target) sentences of one or more clauses joined by "and"."""
    source = " and ".join(" ".join(_source_clause(c)) for c in clauses)
    target = f" {CONJUNCTION} ".join(" ".join(_target_clause(c, lexicon)) for c in clauses)
    return source, target


def generate_pairs(count: int, seed: int, *, two_clause_rate: float = 0.3) -> list[Pair]:
    """``count`` sentence pairs (not deduplicated); the same seed gives the same pairs."""
    rng = np.random.default_rng(seed)
    lexicon = Lexicon.build()
    pairs = []
    for _ in range(count):
        num_clauses = 2 if rng.random() < two_clause_rate else 1
        pairs.append(translate([_clause(rng) for _ in range(num_clauses)], lexicon))
    return pairs


def synthetic_corpus(train: int = 20000, valid: int = 500, test: int = 500, *, seed: int = 0) -> dict[str, list[Pair]]:
    """Disjoint train/valid/test splits of distinct pairs, deterministic in ``seed``."""
    total = train + valid + test
    distinct: dict[Pair, None] = {}
    batch_seed = seed
    while len(distinct) < total:
        for pair in generate_pairs(total, batch_seed):
            distinct.setdefault(pair)
        batch_seed += 1_000_003  # a fresh stream if the first one held duplicates
    pairs = list(distinct)[:total]
    return {"train": pairs[:train], "valid": pairs[train : train + valid], "test": pairs[train + valid :]}
