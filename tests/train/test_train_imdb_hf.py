"""``python -m train.imdb --init-from DIR`` against Hugging Face transformers: a tiny random BERT and its
vocab.txt saved to disk give the same token ids, logits and evaluation as transformers (CPU, float32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_train_imdb import QUIET, WORDS, check_log_schema, csv_data  # noqa: F401 - csv_data is a fixture

from ls_jax.models import BertForSequenceClassification
from train.harness.training import run_training
from train.imdb import config as imdb_config
from train.imdb import data as imdb_data
from train.imdb import model as imdb_model
from train.imdb import task as imdb
from train.records import runlog

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(set(WORDS)), "##s", "##ly"]


def save_tiny_bert(directory, *, with_classifier=True):
    """A random transformers BERT with the vocabulary VOCAB (vocab.txt, as BERT checkpoints ship it)."""
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=24,
        num_labels=2,
    )
    model = transformers.BertForSequenceClassification(config).eval()
    (model if with_classifier else model.bert).save_pretrained(directory)
    (directory / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return model


def transformers_logits(model, directory, texts, max_len):
    tokenizer = transformers.BertTokenizerFast.from_pretrained(str(directory))
    inputs = tokenizer(texts, truncation=True, max_length=max_len, padding="max_length", return_tensors="pt")
    with torch.no_grad():
        return inputs["input_ids"].numpy(), model(**inputs).logits.numpy()


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bert")
    return directory, save_tiny_bert(directory)


def test_init_from_gives_transformers_logits_on_the_same_text(bert_dir):
    directory, reference = bert_dir
    texts = ["The movie was NOT very good", "a truly awful films", "fun", " ".join(WORDS)]  # the last one is cut
    config = imdb_config.resolve_config({"init_from": str(directory)})
    vocabulary = imdb_data.HuggingFaceVocabulary.load(directory)
    model_cfg, params = imdb_model.build_model(config, vocabulary.size, "fp32", jax.random.PRNGKey(0))
    encoded = imdb_data.encode_split(vocabulary, imdb_data.Split(texts, np.zeros(4, np.int64), "t"), max_len=16)
    expected_ids, expected = transformers_logits(reference, directory, texts, 16)
    np.testing.assert_array_equal(encoded.input_ids, expected_ids)
    assert encoded.truncated == 1
    input_ids = jnp.asarray(encoded.input_ids)
    logits = BertForSequenceClassification(model_cfg).apply({"params": params}, input_ids, input_ids != 0)
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-5)


def test_the_flax_implementation_takes_the_checkpoint_and_gives_transformers_logits(bert_dir):
    """--implementation flax --init-from: the checkpoint's weights mapped onto the plain Flax BERT."""
    directory, reference = bert_dir
    texts = ["The movie was NOT very good", "a truly awful films", "fun"]
    config = imdb_config.resolve_config({"init_from": str(directory), "implementation": "flax"})
    vocabulary = imdb_data.HuggingFaceVocabulary.load(directory)
    model_cfg, params = imdb_model.build_model(config, vocabulary.size, "fp32", jax.random.PRNGKey(0))
    classifier, reference_params = imdb_model.build_classifier(config, model_cfg, params, vocabulary.pad_id)
    assert classifier.implementation == "flax" and "word_embedding" in reference_params
    encoded = imdb_data.encode_split(vocabulary, imdb_data.Split(texts, np.zeros(3, np.int64), "t"), max_len=16)
    _, expected = transformers_logits(reference, directory, texts, 16)
    logits = classifier.logits({"params": reference_params}, jnp.asarray(encoded.input_ids), deterministic=True)
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-5)


@pytest.mark.slow
def test_init_from_run_evaluates_the_checkpoint_as_transformers_does(bert_dir, csv_data, tmp_path):  # noqa: F811
    directory, reference = bert_dir
    train, test = csv_data
    run_dir = tmp_path / "run"
    # A vanishing learning rate leaves the weights as loaded, so the evaluation scores the checkpoint itself.
    code = run_training(
        imdb.TASK,
        [
            "--init-from",
            str(directory),
            "--data",
            f"csv:{train}",
            "--test-data",
            f"csv:{test}",
            "--max-seq-len",
            "16",
            "--batch-size",
            "8",
            "--steps",
            "1",
            "--lr",
            "1e-20",
            "--run-dir",
            str(run_dir),
            *QUIET,
        ],
    )
    assert code == 0
    records = runlog.read(run_dir / "run.jsonl")
    check_log_schema(records)
    assert records[0]["model"] == directory.name and not (run_dir / "spm.model").exists()
    test_eval = next(r for r in records if r["type"] == "eval" and r["split"] == "test")
    split = imdb_data.read_csv(test, "text", "label")
    _, logits = transformers_logits(reference, directory, split.texts, 16)
    losses = torch.nn.functional.cross_entropy(torch.tensor(logits), torch.tensor(split.labels), reduction="none")
    assert test_eval["loss"] == pytest.approx(float(losses.mean()), abs=1e-5)
    assert test_eval["metrics"]["accuracy"] == pytest.approx(
        float(np.mean(logits.argmax(-1) == split.labels)), abs=1e-12
    )


@pytest.mark.slow
def test_init_from_an_encoder_without_classifier_trains(tmp_path, csv_data):  # noqa: F811
    directory = tmp_path / "encoder"
    save_tiny_bert(directory, with_classifier=False)
    train, test = csv_data
    code = run_training(
        imdb.TASK,
        [
            "--init-from",
            str(directory),
            "--data",
            f"csv:{train}",
            "--test-data",
            f"csv:{test}",
            "--max-seq-len",
            "16",
            "--batch-size",
            "8",
            "--steps",
            "2",
            "--run-dir",
            str(tmp_path / "r"),
            *QUIET,
        ],
    )
    assert code == 0
    assert runlog.read(tmp_path / "r" / "run.jsonl")[-1]["completed"]


def test_an_encoder_without_classifier_takes_any_number_of_labels(tmp_path):
    from ls_jax.models import hf

    directory = tmp_path / "encoder"
    save_tiny_bert(directory, with_classifier=False)
    config, params = hf.load_pretrained(directory, rng=jax.random.key(0), num_labels=5)
    assert config.num_labels == 5 and params["classifier"]["kernel"].shape == (32, 5)
    config, _ = hf.load_pretrained(directory, rng=jax.random.key(0))
    assert config.num_labels == 2  # config.json's, without num_labels


def test_init_from_a_directory_that_does_not_exist_says_so(tmp_path, capsys):
    assert run_training(imdb.TASK, ["--init-from", str(tmp_path / "nope"), "--run-dir", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err == (
        f"error: --init-from {tmp_path / 'nope'}: no such directory; give a local Hugging Face BERT directory "
        "(config.json, the weights, the tokenizer)\n"
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--max-seq-len", "25"], "--max-seq-len 25 exceeds the model's 24 positions"),
        (["--preset", "bert-base"], "--preset and --init-from exclude each other"),
        (["--num-labels", "3"], "its classifier has 2 labels, not 3: fine-tune it with as many, or start from"),
    ],
    ids=["max-seq-len", "preset", "num-labels"],
)
def test_bad_input_with_init_from(bert_dir, csv_data, tmp_path, capsys, extra, message):  # noqa: F811
    train, test = csv_data
    args = ["--init-from", str(bert_dir[0]), "--data", f"csv:{train}", "--run-dir", str(tmp_path / "r"), *extra]
    assert run_training(imdb.TASK, args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_labels_beyond_the_checkpoint_classifier_are_refused(bert_dir, tmp_path, capsys):
    from test_train_imdb_data import write_csv

    data = write_csv(tmp_path / "three.csv", [("good", 2), ("bad", 0)] * 10)
    assert (
        run_training(
            imdb.TASK,
            [
                "--init-from",
                str(bert_dir[0]),
                "--data",
                f"csv:{data}",
                "--max-seq-len",
                "16",
                "--run-dir",
                str(tmp_path / "r"),
            ],
        )
        == 3
    )  # a data fault
    assert "has label 2, but the model has 2 labels (0 .. 1); the checkpoint's config.json sets them" in (
        capsys.readouterr().err
    )
