"""The synthetic review task of ``python -m train.imdb --data synthetic``: movie reviews generated from code,
labelled by a rule that counting sentiment words cannot learn (see the comment above `SUBJECTS`)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

# The score of a review is the sum of its clauses' scores; its label is 1 when the score is positive.
#   opinion clause   polarity (+1 / -1), doubled by an intensifier ("very", "extremely", ...; a downtoner
#                    such as "somewhat" leaves it as it is), with the opposite sign when negated ("not",
#                    "never", "did not");
#   "but"            the clause after it counts twice (the contrast is the reviewer's conclusion);
#   neutral clause   (a neutral adjective, or a remark about the viewing) counts 0.
# A review has one or two opinion clauses and up to two neutral ones; one whose score is 0 is drawn again.
# Counting sentiment words cannot solve it: negation flips them, intensifiers and contrast change their weight.
# One opinion clause in ten is negated (NEGATION_ODDS): counting sentiment words then scores about 0.84 (0.75 with
# one in five negated, 0.63 with one in three), and that share of the signal is what a 12-layer BERT trained from
# random initialization needs to leave its starting plateau early enough for one-epoch runs to learn the task
# (BERT-base at batch 32: docs/results/README.md, "The study's grid on one H200").
SUBJECTS = (
    "the movie",
    "the film",
    "the plot",
    "the acting",
    "the script",
    "the ending",
    "the soundtrack",
    "the cast",
    "the dialogue",
    "the story",
    "the camera work",
    "the villain",
    "the pacing",
    "the lead actress",
    "the sequel",
)
LINKING_VERBS = ("was", "is", "felt", "seemed")
POSITIVE_ADJECTIVES = (
    "good",
    "great",
    "wonderful",
    "brilliant",
    "moving",
    "funny",
    "clever",
    "beautiful",
    "charming",
    "gripping",
    "superb",
    "delightful",
    "fresh",
    "smart",
    "entertaining",
)
NEGATIVE_ADJECTIVES = (
    "bad",
    "awful",
    "boring",
    "dull",
    "terrible",
    "weak",
    "silly",
    "clumsy",
    "tedious",
    "lame",
    "messy",
    "bland",
    "painful",
    "stupid",
    "forgettable",
)
NEUTRAL_ADJECTIVES = ("long", "short", "loud", "old", "new", "dark", "colorful", "foreign", "familiar", "unusual")
# (base form, past tense): "i loved the plot", "i did not love the plot".
POSITIVE_VERBS = (("like", "liked"), ("love", "loved"), ("enjoy", "enjoyed"), ("admire", "admired"))
NEGATIVE_VERBS = (("hate", "hated"), ("dislike", "disliked"), ("regret", "regretted"), ("resent", "resented"))
INTENSIFIERS = ("very", "really", "extremely", "truly", "incredibly")
DOWNTONERS = ("somewhat", "slightly", "a bit", "fairly", "mildly")
REMARKS = (
    "i saw it last week",
    "my friend recommended it",
    "it is about two brothers",
    "it runs about two hours",
    "i watched it on a sunday",
    "it was shot in canada",
    "the theater was half empty",
    "i went with my sister",
    "it came out in the nineties",
    "it is based on a novel",
)
CONNECTIVES = ("and", ".", ";", ", and")
MODIFIERS = ("", *INTENSIFIERS, *DOWNTONERS)
STRENGTH = {"": 1, **{word: 2 for word in INTENSIFIERS}, **{word: 1 for word in DOWNTONERS}}
NEGATION_ODDS = 0.1
# No modifier half of the time, else any intensifier or downtoner with equal odds.
MODIFIER_ODDS = (0.5, *[0.5 / (len(MODIFIERS) - 1)] * (len(MODIFIERS) - 1))


def _choice(rng: np.random.Generator, options: Sequence[Any]) -> Any:
    return options[rng.integers(len(options))]


def _opinion_clause(rng: np.random.Generator) -> tuple[list[str], int]:
    """The words of a clause expressing an opinion, and its score."""
    polarity = 1 if rng.random() < 0.5 else -1
    negated = rng.random() < NEGATION_ODDS
    modifier = MODIFIERS[rng.choice(len(MODIFIERS), p=MODIFIER_ODDS)]
    score = polarity * STRENGTH[modifier] * (-1 if negated else 1)
    modifiers = modifier.split()
    if rng.random() < 0.25:
        base, past = _choice(rng, POSITIVE_VERBS if polarity > 0 else NEGATIVE_VERBS)
        verb = ["did", "not", *modifiers, base] if negated else [*modifiers, past]
        return ["i", *verb, *_choice(rng, SUBJECTS).split()], score
    adjective = _choice(rng, POSITIVE_ADJECTIVES if polarity > 0 else NEGATIVE_ADJECTIVES)
    negation = [_choice(rng, ("not", "never"))] if negated else []
    return [*_choice(rng, SUBJECTS).split(), _choice(rng, LINKING_VERBS), *negation, *modifiers, adjective], score


def _neutral_clause(rng: np.random.Generator) -> list[str]:
    if rng.random() < 0.5:
        return _choice(rng, REMARKS).split()
    return [*_choice(rng, SUBJECTS).split(), _choice(rng, LINKING_VERBS), _choice(rng, NEUTRAL_ADJECTIVES)]


def synthetic_review(rng: np.random.Generator) -> tuple[str, int]:
    """One review of one or two opinion clauses and up to two neutral ones, and its label (see above)."""
    while True:
        clauses: list[tuple[list[str], int]] = [_opinion_clause(rng) for _ in range(rng.integers(1, 3))]
        clauses += [(_neutral_clause(rng), 0) for _ in range(rng.integers(0, 3))]
        order = rng.permutation(len(clauses))
        words, score = list(clauses[order[0]][0]), clauses[order[0]][1]
        for index in order[1:]:
            clause, clause_score = clauses[index]
            contrast = clause_score != 0 and rng.random() < 0.3
            words += (["but"] if contrast else _choice(rng, CONNECTIVES).split()) + clause
            score += 2 * clause_score if contrast else clause_score
        if score != 0:
            return " ".join(words), int(score > 0)


def distinct_reviews(count: int, seed: int) -> tuple[list[str], np.ndarray]:
    """``count`` different reviews drawn by the generator seeded with ``seed``, and their labels (n,) int64."""
    rng = np.random.default_rng(seed)
    reviews: dict[str, int] = {}
    while len(reviews) < count:
        text, label = synthetic_review(rng)
        reviews.setdefault(text, label)
    return list(reviews), np.asarray(list(reviews.values()), np.int64)
