"""The embedded synthetic translation task: deterministic, disjoint splits, and a grammar that is not a copy."""

from train.wmt import synthetic as wmt_synthetic


def test_same_seed_same_corpus_and_other_seed_differs():
    first = wmt_synthetic.synthetic_corpus(200, 20, 20, seed=3)
    assert first == wmt_synthetic.synthetic_corpus(200, 20, 20, seed=3)
    assert first["train"] != wmt_synthetic.synthetic_corpus(200, 20, 20, seed=4)["train"]


def test_splits_have_requested_sizes_and_never_overlap():
    corpus = wmt_synthetic.synthetic_corpus(3000, 300, 300, seed=0)
    assert [len(corpus[s]) for s in ("train", "valid", "test")] == [3000, 300, 300]
    train, valid, test = (set(corpus[s]) for s in ("train", "valid", "test"))
    assert len(train) == 3000 and not train & valid and not train & test and not valid & test


def test_lexicon_is_fixed_and_one_to_one():
    lexicon = wmt_synthetic.Lexicon.build()
    assert lexicon == wmt_synthetic.Lexicon.build()
    stems = [
        *lexicon.noun.values(),
        *lexicon.verb.values(),
        *lexicon.adjective.values(),
        *lexicon.adverb.values(),
        *lexicon.numeral.values(),
    ]
    assert len(stems) == len(set(stems))


def test_translation_reorders_and_inflects():
    lexicon = wmt_synthetic.Lexicon.build()
    subject = wmt_synthetic.NounPhrase(noun=1, adjective=0, determiner="the", plural=False)  # "the big dog"
    obj = wmt_synthetic.NounPhrase(noun=0, adjective=1, determiner="two", plural=True)  # "two small cats"
    clause = wmt_synthetic.Clause(subject, verb=0, obj=obj, adverb=0)  # "sees", "quickly"
    source, target = wmt_synthetic.translate([clause], lexicon)
    assert source == "the big dog sees two small cats quickly"
    ri = wmt_synthetic.PLURAL_SUFFIX
    expected = [
        lexicon.noun["dog"],
        lexicon.adjective["big"],
        wmt_synthetic.DEFINITE_PARTICLE,  # adjective after noun
        lexicon.noun["cat"] + ri,
        lexicon.adjective["small"] + ri,
        lexicon.numeral["two"],  # agreement
        wmt_synthetic.OBJECT_PARTICLE,
        lexicon.adverb["quickly"],
        lexicon.verb["see"] + wmt_synthetic.VERB_SINGULAR_SUFFIX,  # verb last, agreeing with the subject
    ]
    assert target.split() == expected


def test_verb_agrees_with_plural_subject_and_clauses_join():
    lexicon = wmt_synthetic.Lexicon.build()
    plural = wmt_synthetic.NounPhrase(noun=7, adjective=None, determiner="three", plural=True)  # "three children"
    singular = wmt_synthetic.NounPhrase(noun=16, adjective=None, determiner="a", plural=False)  # "an apple"
    clause = wmt_synthetic.Clause(plural, verb=3, obj=singular, adverb=None)
    source, target = wmt_synthetic.translate([clause, clause], lexicon)
    assert source == "three children carry a apple and three children carry a apple"
    words = target.split()
    assert words.count(wmt_synthetic.CONJUNCTION) == 1
    assert words[-1] == lexicon.verb["carry"] + wmt_synthetic.VERB_PLURAL_SUFFIX
    assert "a" not in words  # the indefinite article has no translation
