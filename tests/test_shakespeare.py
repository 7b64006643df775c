"""data.source=shakespeare (LEAF's next-character task from a play text) and the lstm model."""

import csv
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from plfl.config import DataConfig, validate
from plfl.data import load_federated_data
from plfl.data.shakespeare import ALL_LETTERS
from plfl.errors import ConfigError, DataError
from plfl.experiment import run_experiment
from plfl.models import build_model

from conftest import SHARED_DATA, reads_shared_data

ROOT = Path(__file__).resolve().parents[1]
TINY_SHAKESPEARE = SHARED_DATA / "shakespeare" / "input.txt"
WORDS = "thou art the very king of men and I do love thee well; what, ho! speak again".split()


def play(tmp_path: Path, speeches: list[tuple[str, list[str]]], name: str = "input.txt") -> Path:
    """A play text in tiny Shakespeare's layout: heading line, speech lines, blank line between speeches."""
    path = tmp_path / name
    path.write_text("\n\n".join("\n".join([f"{speaker}:", *lines]) for speaker, lines in speeches) + "\n")
    return path


def synthetic_play(tmp_path: Path, roles=("ROMEO", "JULIET", "Nurse"), speeches=12, seed=0) -> Path:
    """Speeches of 3-6 lines of random words, the roles taking turns."""
    rng = np.random.default_rng(seed)
    text = [
        (roles[i % len(roles)], [" ".join(rng.choice(WORDS, 8)) for _ in range(rng.integers(3, 7))])
        for i in range(speeches)
    ]
    return play(tmp_path, text)


def load(root, **keys):
    return load_federated_data(DataConfig(source="shakespeare", root=str(root), **keys), 0)


def decode(ids) -> str:
    return "".join(ALL_LETTERS[i] for i in ids)


# ---------------------------------------------------------------- reader


def test_roles_become_clients_with_leaf_windows_and_ids(tmp_path):
    line = "But, soft! what light through yonder window breaks? " * 5
    n = len(line)  # 260: the second line's newline is sample n
    path = play(
        tmp_path,
        [
            ("ROMEO", [line, "It is the east,  and Juliet is the sun."]),
            ("JULIET", ["Ay me!"] * 60),
            ("ROMEO", ["Arise, fair sun."] * 10),
            ("Nurse", ["Anon!"]),
        ],
    )
    data = load(path, min_chars=400)
    assert data.name == "shakespeare:input.txt" and len(data.clients) == 2  # Nurse's 6 characters are too few
    assert data.num_classes == data.vocab_size == len(ALL_LETTERS) == 80 and data.input_shape == (80,)
    romeo = data.clients[0]
    x, y = romeo.x_train, romeo.y_train  # the first 376 of ROMEO's 470 samples
    assert x.dtype == y.dtype == torch.int64 and x.shape[1] == 80
    # The first window of a line is 80 spaces; every later one slides by a character, within the line.
    assert decode(x[0]) == " " * 80 and decode(y[:4]) == "But,"
    assert decode(x[100]) == line[20:100] and decode(y[100:102]) == line[100:102]
    assert decode(y[n : n + 3]) == "\nIt" and decode(x[n + 1]) == " " * 80  # the newline is a target, then a new line
    assert decode(x[n + 1 + 30])[-30:] == "It is the east, and Juliet is "  # the double space collapsed
    assert ALL_LETTERS.index("\n") == 0 and ALL_LETTERS.index(" ") == 1


def test_split_keeps_text_order_and_leafs_79_window_gap(tmp_path):
    data = load(
        play(tmp_path, [("KING", [f"Line number {i} of the king's long speech." for i in range(30)])]), min_chars=400
    )
    (king,) = data.clients
    n = sum(len(f"Line number {i} of the king's long speech.") + 1 for i in range(30))
    assert king.num_train == int(0.8 * n) and king.num_test == n - int(0.8 * n) - 79
    # Sample k predicts character k of the role's text: test targets lie after every train window's input.
    text = "".join(f"Line number {i} of the king's long speech.\n" for i in range(30))
    assert decode(king.y_train) == text[: king.num_train]
    assert decode(king.y_test) == text[king.num_train + 79 :]


def test_directory_root_unknown_characters_and_role_names(tmp_path):
    first, second = "Wife, $ is not a letter here " * 20, "Again. " * 30
    play(tmp_path, [("LADY  CAPULET", [first]), ("LADY CAPULET", [second])])  # one role: whitespace collapsed
    (lady,) = load(tmp_path, min_chars=400).clients  # data.root: the directory holding input.txt
    assert decode(lady.y_train[:12]) == "Wife,   is n"  # LEAF's unknown symbol is a space
    assert lady.num_train + lady.num_test + 79 == len(first) + 1 + len(second) + 1


@pytest.mark.parametrize(
    "write, message",
    [
        (None, "Play text {t}/none.txt does not exist. Set data.root to a play text"),
        ("", "{t}/p.txt is empty. Point data.root at a play text whose speeches are headed by the speaker's name"),
        ("Once upon a time\nthere was a king.\n", "{t}/p.txt has no speaker headings. data.source=shakespeare needs"),
        (
            "ROMEO:\nHello.\n\nAnd a stage direction.\n\nJULIET:\nHi.\n",
            "{t}/p.txt, line 4: 'And a stage direction.' opens a speech without a speaker heading.",
        ),
        (
            "ROMEO:\nHello.\n",
            "No role in {t}/p.txt has data.min_chars=10000 characters; the longest, 'ROMEO', has 7. "
            "Lower data.min_chars",
        ),
    ],
)
def test_malformed_play_texts_are_refused_with_the_fix(tmp_path, write, message):
    path = tmp_path / ("none.txt" if write is None else "p.txt")
    if write is not None:
        path.write_text(write)
    with pytest.raises(DataError) as e:
        load(path)
    assert message.replace("{t}", str(tmp_path)) in str(e.value)


def test_non_utf8_text_and_unset_root_are_refused(tmp_path):
    (tmp_path / "input.txt").write_bytes(b"ROMEO:\n\xff\xfe\n")
    with pytest.raises(DataError, match="input.txt is not UTF-8 text"):
        load(tmp_path)
    with pytest.raises(DataError, match="data.source=shakespeare needs data.root"):
        load_federated_data(DataConfig(source="shakespeare"), 0)


def test_min_chars_is_range_checked_and_read_only_by_shakespeare():
    raw = {"data": {"source": "digits", "min_chars": 5000}}
    with pytest.raises(ConfigError, match="data.min_chars=5000 is read only by data.source=shakespeare"):
        validate(OmegaConf.create(raw))
    with pytest.raises(ConfigError, match="'data.min_chars' must be an integer >= 400; got 100"):
        validate(OmegaConf.create({"data": {"source": "shakespeare", "min_chars": 100}}))


@reads_shared_data(TINY_SHAKESPEARE)
def test_tiny_shakespeare_gives_36_roles_by_default():
    data = load(TINY_SHAKESPEARE.parent)
    assert len(data.clients) == 36
    assert sum(c.num_train for c in data.clients) == 484_553 and sum(c.num_test for c in data.clients) == 118_315
    assert decode(data.clients[0].y_train[:36]) == "What work's, my countrymen, in hand?"  # MENENIUS
    y = torch.cat([torch.cat([c.y_train, c.y_test]) for c in data.clients])
    assert int(y.min()) == 0 and int(y.max()) < 80


# ---------------------------------------------------------------- model and methods


def test_lstm_is_leafs_stacked_lstm_with_a_linear_head():
    model = build_model("lstm", (80,), 80, vocab_size=80)
    lstm = model.body.lstm
    assert model.body.embedding.weight.shape == (80, 8)
    assert (lstm.input_size, lstm.hidden_size, lstm.num_layers, lstm.batch_first) == (8, 256, 2, True)
    assert [n for n, _ in model.named_parameters()][-2:] == ["head.weight", "head.bias"]
    x = torch.randint(0, 80, (3, 80))
    assert model.body(x).shape == (3, 256) and model(x).shape == (3, 80)
    # The features are the top layer's output at the last time step, which a change there moves.
    _, (h, _) = lstm(model.body.embedding(x))
    assert torch.equal(model.body(x), h[-1])
    x2 = x.clone()
    x2[:, -1] = (x[:, -1] + 1) % 80
    assert not torch.allclose(model.body(x), model.body(x2))


def test_lstm_keys_and_inputs_are_checked():
    small = build_model("lstm", (80,), 80, vocab_size=80, embedding_dim=4, hidden_dim=16)
    assert small.body.embedding.embedding_dim == 4 and small.head.in_features == 16
    with pytest.raises(ConfigError, match="model.name=lstm cannot take the data.s images or vectors"):
        build_model("lstm", (1, 28, 28), 10)
    with pytest.raises(ConfigError, match="model.hidden_dim=64 is read only by model.name=lstm"):
        validate(OmegaConf.create({"model": {"name": "mlp", "hidden_dim": 64}}))


ALA_QUICK = {"num_pre_loss": 2, "threshold": 1.0, "max_init_epochs": 3}  # a short initial stage that settles


@pytest.mark.parametrize("method", ["fedavg", "fedala"])
def test_one_round_on_a_synthetic_play_trains_the_lstm(tmp_path, method):
    root = synthetic_play(tmp_path)
    cfg = validate(
        OmegaConf.create(
            {
                "output_dir": str(tmp_path / "runs"),
                "progress_bar": False,
                "data": {"source": "shakespeare", "root": str(root), "min_chars": 400},
                "model": {"name": "lstm", "hidden_dim": 16},
                "method": {"name": method, **(ALA_QUICK if method == "fedala" else {})},
                "federation": {"rounds": 1, "lr": 0.8, "batch_size": 10},
            }
        )
    )
    run_dir, summary = run_experiment(cfg)
    with open(run_dir / "metrics.csv") as f:
        rounds = list(csv.DictReader(f))
    assert [int(r["round"]) for r in rounds] == [0, 1]
    assert float(rounds[1]["train_loss"]) < np.log(80)  # below chance after one epoch at lr 0.8
    assert float(rounds[1]["accuracy"]) > float(rounds[0]["accuracy"])
    if method == "fedala":  # ALA's initial stage ran: weights learned through functional_call on the LSTM
        assert float(rounds[1]["ala_epochs_mean"]) >= 1 and 0 <= float(rounds[1]["ala_weight_mean"]) <= 1
