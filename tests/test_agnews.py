"""AG News: the CSV reader, the text pipeline, the text models, and methods on token-id batches."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from plfl.config import load_config, validate
from plfl.data import load_federated_data
from plfl.data.sources import AGNews, DataConfig
from plfl.data.text import PAD_ID, UNK_ID, encode, train_tokenizer
from plfl.errors import ConfigError, DataError
from plfl.experiment import run_experiment
from plfl.models import build_model

from conftest import SHARED_DATA, reads_shared_data

ROOT = Path(__file__).resolve().parents[1]
AG_NEWS = SHARED_DATA / "ag_news"
# Words that mark each class, so that a model can learn the tiny set.
TOPICS = [
    ["war", "minister", "election"],
    ["match", "goal", "coach"],
    ["stocks", "profit", "bank"],
    ["software", "space", "chip"],
]


def write_agnews(root: Path, train_rows: int = 48, test_rows: int = 16) -> Path:
    """train.csv and test.csv in AG News's layout, classes 1-4 in turn; test texts also hold 'testonly'."""
    root.mkdir(parents=True, exist_ok=True)
    for name, n, extra in (("train.csv", train_rows, ""), ("test.csv", test_rows, " testonly")):
        with open(root / name, "w", newline="") as f:
            writer = csv.writer(f, quoting=csv.QUOTE_ALL)
            for i in range(n):
                words = TOPICS[i % 4]
                writer.writerow([i % 4 + 1, f"{words[i % 3]} news {i}", f"{words[(i + 1) % 3]} today{extra}"])
    return root


def agnews_config(root: Path, **overrides) -> AGNews:
    """The agnews source's keys over ``root``."""
    return AGNews(source="agnews", root=str(root), **overrides)


def error_of(root: Path, **overrides) -> str:
    with pytest.raises(DataError) as info:
        agnews_config(root, **overrides).read()
    return str(info.value)


# ---------------------------------------------------------------- reader


def test_reader_pools_train_then_test_rows_with_rfc4180_quoting(tmp_path):
    (tmp_path / "train.csv").write_text('"3","Fed, banks","Rates ""rise""\non Monday"\n"1","A","b"\n')
    (tmp_path / "test.csv").write_text('"4","Chips","Faster"\n')
    texts, labels, num_classes = agnews_config(tmp_path).read()
    assert list(texts) == ['Fed, banks Rates "rise"\non Monday', "A b", "Chips Faster"]
    assert labels.tolist() == [2, 0, 3] and labels.dtype == torch.int64
    assert num_classes == 4


def test_reader_takes_the_configured_file_names(tmp_path):
    write_agnews(tmp_path)
    (tmp_path / "train.csv").rename(tmp_path / "train_first48.csv")
    texts, labels, _ = agnews_config(tmp_path, train_file="train_first48.csv").read()
    assert len(texts) == len(labels) == 64


def test_missing_file_names_the_path_and_the_key(tmp_path):
    write_agnews(tmp_path)
    message = error_of(tmp_path, test_file="test_full.csv")
    assert f"AG News file {tmp_path / 'test_full.csv'} does not exist" in message
    assert "data.test_file" in message


def test_unset_root_says_to_set_it():
    with pytest.raises(DataError, match="data.source=agnews needs data.root"):
        AGNews(source="agnews").read()


@pytest.mark.parametrize(
    "content, message",
    [
        ('"1","a","b"\n"2","a"b","c"\n', "line 2: malformed CSV"),
        ('"1","a","b"\n"2","a","b"\n"3","only two"\n', "line 3: 2 fields, expected 3 (class, title, description)"),
        ('"1","a","b"\n"5","a","b"\n', "line 2: class '5' is not one of 1, 2, 3, 4"),
        ('"World","a","b"\n', "line 1: class 'World' is not one of 1, 2, 3, 4"),
        ("", "holds no records"),
    ],
)
def test_malformed_train_file_is_refused_with_its_line(tmp_path, content, message):
    write_agnews(tmp_path)
    (tmp_path / "train.csv").write_text(content)
    assert f"{tmp_path / 'train.csv'}" in (error := error_of(tmp_path))
    assert message in error and "Restore the official AG News CSV" in error


def test_a_non_utf8_file_is_refused(tmp_path):
    write_agnews(tmp_path)
    (tmp_path / "test.csv").write_bytes(b'"1","caf\xe9","b"\n')
    assert f"{tmp_path / 'test.csv'} is not UTF-8 text" in error_of(tmp_path)


# ---------------------------------------------------------------- text pipeline


def test_vocabulary_is_ordered_by_count_then_string_and_capped():
    tokenizer = train_tokenizer(["b a c a", "A, b zz"], vocab_size=5)
    assert tokenizer.get_vocab() == {"[PAD]": 0, "[UNK]": 1, "a": 2, "b": 3, ",": 4}
    assert train_tokenizer(["A, b zz", "b a c a"], vocab_size=5).get_vocab() == tokenizer.get_vocab()


def test_encode_pads_with_zero_truncates_and_maps_unknown_words():
    tokenizer = train_tokenizer(["a b c"], vocab_size=10)
    ids = encode(tokenizer, ["c a unseen", "a b c a b c", ""], max_length=4)
    a, b, c = (tokenizer.token_to_id(w) for w in "abc")
    assert ids.tolist() == [[c, a, UNK_ID, PAD_ID], [a, b, c, a], [PAD_ID] * 4]
    assert ids.dtype == torch.int64


def test_vocab_size_below_three_is_refused():
    with pytest.raises(ValueError, match="vocab_size=2 leaves no id for a word"):
        train_tokenizer(["a"], vocab_size=2)


def test_federation_vocabulary_is_trained_on_exactly_the_clients_training_texts(tmp_path, monkeypatch):
    seen = []

    def recording(texts, vocab_size):
        seen.extend(texts)
        return train_tokenizer(texts, vocab_size)

    monkeypatch.setattr("plfl.data.text.train_tokenizer", recording)
    cfg = DataConfig(source="agnews", root=str(write_agnews(tmp_path)), num_clients=3, partition="iid", max_length=8)
    data = load_federated_data(cfg, seed=0)
    x_train = torch.cat([c.x_train for c in data.clients])
    x_test = torch.cat([c.x_test for c in data.clients])
    assert data.input_shape == (8,) and x_train.dtype == torch.int64
    assert int(torch.cat([x_train, x_test]).max()) < data.vocab_size <= cfg.vocab_size
    # Every text is unique (its row number is a word), so the rows identify the texts the vocabulary saw.
    seen_rows = encode(train_tokenizer(seen, cfg.vocab_size), seen, 8)
    assert sorted(map(tuple, seen_rows.tolist())) == sorted(map(tuple, x_train.tolist()))
    assert not set(map(tuple, seen_rows.tolist())) & set(map(tuple, x_test.tolist()))


def test_the_same_seed_gives_the_same_token_ids(tmp_path):
    cfg = DataConfig(source="agnews", root=str(write_agnews(tmp_path)), num_clients=3, partition="iid", max_length=8)
    first, second = load_federated_data(cfg, seed=1), load_federated_data(cfg, seed=1)
    assert first.vocab_size == second.vocab_size
    assert all(torch.equal(a.x_train, b.x_train) for a, b in zip(first.clients, second.clients))


def test_text_keys_with_another_source_are_refused():
    with pytest.raises(ConfigError, match="data.vocab_size=100 is read only by data.source=agnews"):
        validate(OmegaConf.create({"data": {"source": "digits", "vocab_size": 100}}))


# ---------------------------------------------------------------- models


def test_fasttext_is_embedding_mean_without_padding_then_two_linears():
    model = build_model("fasttext", (5,), 4, vocab_size=20, embedding_dim=6)
    table = model.body[0].embedding.weight
    features = model.body[0](torch.tensor([[3, 7, 0, 0, 0], [0, 0, 0, 0, 0]]))
    assert torch.allclose(features[0], (table[3] + table[7]) / 2)
    assert torch.equal(features[1], torch.zeros(6))
    assert [n for n, _ in model.named_parameters()][-2:] == ["head.weight", "head.bias"]
    assert model.head.in_features == model.body[1].out_features == 6


def test_transformer_output_does_not_depend_on_trailing_padding():
    torch.manual_seed(0)
    model = build_model("transformer", (10,), 4, vocab_size=20, embedding_dim=8, num_layers=2, num_heads=2).eval()
    short = torch.tensor([[4, 9, 2, 0, 0, 0]])
    long = torch.cat([short, torch.zeros(1, 4, dtype=torch.int64)], dim=1)
    with torch.no_grad():
        assert torch.allclose(model(short), model(long), atol=1e-6)
        assert torch.isfinite(model(torch.zeros(2, 10, dtype=torch.int64))).all()  # texts without tokens
    assert model(short).shape == (1, 4)


@pytest.mark.parametrize(
    "name, shape, vocab, message",
    [
        ("fasttext", (1, 28, 28), None, "model.name=fasttext cannot take the data's images or vectors"),
        (
            "mlp",
            (200,),
            100,
            "model.name=mlp cannot take the data's token ids (text); use model.name=fasttext or lstm or transformer",
        ),
    ],
)
def test_a_model_for_the_other_kind_of_input_is_refused(name, shape, vocab, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_model(name, shape, 4, vocab_size=vocab)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model.name=transformer", "model.embedding_dim=30", "model.num_heads=4"],
            "model.embedding_dim=30 is not a multiple of model.num_heads=4",
        ),
        (["model.name=fasttext", "model.num_layers=3"], "model.num_layers=3 is read only by model.name=transformer"),
        (["model.name=mlp", "model.embedding_dim=16"], "model.embedding_dim=16 is read only by model.name=fasttext"),
        (
            ["model.name=transformer", "model.num_heads=0"],
            "Config key 'model.num_heads' must be an integer >= 1; got 0.",
        ),
    ],
)
def test_bad_model_keys_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


# ---------------------------------------------------------------- methods on token ids


def run_tiny(tmp_path, model: str, method: dict, rounds: int = 1):
    base = {
        "output_dir": str(tmp_path / "runs"),
        "progress_bar": False,
        "data": {
            "source": "agnews",
            "root": str(write_agnews(tmp_path / "data", 96, 32)),
            "num_clients": 3,
            "partition": "iid",
            "max_length": 8,
        },
        "model": {"name": model},
        "method": method,
        "federation": {"rounds": rounds, "lr": 0.1, "batch_size": 10},
    }
    return run_experiment(validate(OmegaConf.create(base)))


@pytest.mark.parametrize(
    "method",
    [
        {"name": "fedavg"},
        {"name": "fedala", "p": 2},
        {"name": "fedrep"},
        {"name": "perfedavg", "variant": "fo"},
        {"name": "perfedavg", "variant": "hf"},
    ],
)
def test_methods_train_fasttext_on_token_ids(tmp_path, method):
    run_dir, summary = run_tiny(tmp_path, "fasttext", method)
    assert summary["status"] == "completed"
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert len(rows) == 3  # header, round 0, round 1


def test_fedavg_transformer_learns_the_tiny_topics(tmp_path):
    run_dir, summary = run_tiny(tmp_path, "transformer", {"name": "fedavg"}, rounds=3)
    header, *rows = [line.split(",") for line in (run_dir / "metrics.csv").read_text().splitlines()]
    accuracy = [float(r[header.index("accuracy")]) for r in rows]
    assert accuracy[-1] > accuracy[0] + 0.2  # 4 classes, one topic word per text decides it


# ---------------------------------------------------------------- real data


@reads_shared_data(AG_NEWS)
def test_fedala_agnews_config_reads_the_shared_files():
    cfg = load_config(ROOT / "configs" / "fedala-agnews.yaml")
    assert cfg.data.root == str(AG_NEWS.resolve())
    data = load_federated_data(OmegaConf.to_object(cfg.data), seed=0)
    assert len(data.clients) == 20 and data.num_classes == 4 and data.input_shape == (200,)
    assert sum(c.num_train + c.num_test for c in data.clients) == 10_429 + 7_600
    labels = torch.cat([torch.cat([c.y_train, c.y_test]) for c in data.clients])
    assert torch.bincount(labels).tolist() == [2630 + 1900, 2452 + 1900, 2594 + 1900, 2753 + 1900]
    assert 10_000 < data.vocab_size < cfg.data.vocab_size  # the training texts' words, under the cap
