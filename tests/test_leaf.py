"""data.source=leaf: LEAF's JSON files (users, num_samples, user_data), one client per user."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from plfl.cli import main
from plfl.config import DataConfig, load_config, validate
from plfl.data import load_federated_data
from plfl.errors import ConfigError, DataError

from conftest import SHARED_DATA, reads_shared_data

ROOT = Path(__file__).resolve().parents[1]
FEMNIST = SHARED_DATA / "femnist-leaf-subset"


def pixels(*values: float) -> list[list[float]]:
    """One 2×2 image row per value: [v, v, 1.0, 0.0]."""
    return [[v, v, 1.0, 0.0] for v in values]


def leaf_json(path: Path, users: dict[str, tuple[list, list]]) -> dict:
    """Write ``users`` (user -> (x rows, y)) to ``path`` in LEAF's schema; return the written object."""
    data = {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return data


TRAIN = {"w2": (pixels(0.5, 0.25, 0.75), [3, 0, 3]), "w1": (pixels(0.125, 1.0), [1, 2])}
TEST = {"w1": (pixels(0.0), [4]), "w2": (pixels(0.5), [0])}


def write_femnist_like(root: Path, train=TRAIN, test=TEST) -> Path:
    leaf_json(root / "train.json", train)
    leaf_json(root / "test.json", test)
    return root


def read(root: Path, **keys) -> object:
    return load_federated_data(DataConfig(source="leaf", root=str(root), **{"image_shape": [1, 2, 2], **keys}), 0)


def test_one_client_per_user_sorted_by_id_with_the_files_own_split(tmp_path):
    data = read(write_femnist_like(tmp_path))
    assert data.name == f"leaf:{tmp_path.name}" and data.input_shape == (1, 2, 2) and data.vocab_size is None
    assert data.num_classes == 5  # label 4 occurs only in the test split
    w1, w2 = data.clients  # sorted by user id, as LEAF's read_data does
    assert w1.y_train.tolist() == [1, 2] and w1.y_test.tolist() == [4]
    assert w2.y_train.tolist() == [3, 0, 3] and w2.y_test.tolist() == [0]
    assert w2.x_train.dtype == torch.float32 and w2.y_train.dtype == torch.int64
    # Values as stored (no rescaling), each row reshaped row-major to (1, 2, 2).
    assert w2.x_train[1].tolist() == [[[0.25, 0.25], [1.0, 0.0]]]


def test_folders_of_several_files_read_as_their_merge(tmp_path):
    leaf_json(tmp_path / "train" / "all_data_0_train_9.json", {"w2": TRAIN["w2"]})
    leaf_json(tmp_path / "train" / "all_data_1_train_9.json", {"w1": TRAIN["w1"]})
    leaf_json(tmp_path / "test" / "all_data_0_test_9.json", TEST)
    (tmp_path / "test" / "notes.txt").write_text("not data")
    merged, single = read(tmp_path), read(write_femnist_like(tmp_path / "single"))
    for a, b in zip(merged.clients, single.clients, strict=True):
        assert all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("x_train", "y_train", "x_test", "y_test"))


def test_stated_num_classes_covers_classes_absent_from_the_files(tmp_path):
    assert read(write_femnist_like(tmp_path), num_classes=62).num_classes == 62
    with pytest.raises(DataError, match=r"test.json, user 'w1' holds label 4, but data.num_classes=3 allows 0..2"):
        read(tmp_path, num_classes=3)


def test_num_clients_must_match_the_users(tmp_path):
    assert len(read(write_femnist_like(tmp_path), num_clients=2).clients) == 2
    with pytest.raises(DataError, match=r"data.num_clients=3 but the LEAF files under .* hold 2 users"):
        read(tmp_path, num_clients=3)


def change(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def set_user(split: str, user: str, x=None, y=None):
    def edit(root: Path) -> None:
        def apply(data):
            record = data["user_data"][user]
            record.update({k: v for k, v in (("x", x), ("y", y)) if v is not None})
            data["num_samples"][data["users"].index(user)] = len(record["y"])

        change(root / f"{split}.json", apply)

    return edit


# case -> (damage done to a valid directory, the message expected, with {r} for the root)
MALFORMED = {
    "split missing": (
        lambda r: (r / "test.json").unlink(),
        r"Neither {r}/test/ \(LEAF's layout: one or more .json files\) nor {r}/test.json exists",
    ),
    "empty folder": (lambda r: ((r / "test.json").unlink(), (r / "test").mkdir()), r"{r}/test holds no .json files"),
    "both layouts": (lambda r: (r / "train").mkdir(), r"{r} holds both {r}/train/ and {r}/train.json"),
    "invalid JSON": (
        lambda r: (r / "train.json").write_text('{"users": ["w1"],\n "num_samples": [2,,\n'),
        r"{r}/train.json is not valid JSON \(line 2, column 20: Expecting value\)",
    ),
    "no users": (lambda r: leaf_json(r / "train.json", {}), r"The LEAF train files under {r} list no users"),
    "not LEAF's schema": (
        lambda r: (r / "test.json").write_text('{"users": []}'),
        r"{r}/test.json holds keys \['users'\]; a LEAF file is an object with the lists",
    ),
    "user without user_data": (
        lambda r: change(r / "train.json", lambda d: d["user_data"].pop("w2")),
        r"{r}/train.json lists user 'w2' in 'users' but has no entry in 'user_data'",
    ),
    "user_data of an unlisted user": (
        lambda r: change(r / "train.json", lambda d: d["user_data"].update(w9={"x": [], "y": []})),
        r"{r}/train.json has user_data for 'w9', which 'users' does not list",
    ),
    "num_samples disagrees": (
        lambda r: change(r / "train.json", lambda d: d["num_samples"].__setitem__(0, 4)),
        r"{r}/train.json, user 'w2': 'num_samples' says 4 samples but 'x' has 3 rows and 'y' 3",
    ),
    "x row of the wrong length": (
        set_user("train", "w1", x=[[0.0] * 4, [0.0] * 5]),
        r"{r}/train.json, user 'w1': row 1 of 'x' has 5 values, but "
        r"data.image_shape=\[1, 2, 2\] needs 4",
    ),
    "x row not a list": (set_user("test", "w2", x=[0.5]), r"{r}/test.json, user 'w2': row 0 of 'x' has a float"),
    "text among images": (
        set_user("train", "w1", x=["good morning", "bad night"]),
        r"{r}/train.json, user 'w1': 'x' holds text, but data.image_shape=\[1, 2, 2\] is set",
    ),
    "fractional label": (
        set_user("train", "w2", y=[3, 0.5, 1]),
        r"{r}/train.json, user 'w2': 'y' holds 0.5; "
        r"LEAF's labels are integer class indices >= 0",
    ),
    "string label": (
        set_user("test", "w1", y=["a"]),
        r"{r}/test.json, user 'w1': 'y' holds \"a\".*"
        r"LEAF's Shakespeare: use data.source=shakespeare",
    ),
    "negative label": (set_user("test", "w1", y=[-1]), r"{r}/test.json, user 'w1': 'y' holds -1"),
    "user without test samples": (
        set_user("test", "w1", x=[], y=[]),
        r"User 'w1' has no test samples in {r}/test.json. Every client needs at least one",
    ),
    "user in one split only": (
        lambda r: change(
            r / "test.json", lambda d: (d["users"].remove("w2"), d["num_samples"].pop(), d["user_data"].pop("w2"))
        ),
        r"User 'w2' is in {r}/train.json but in no test file under {r} \(1 such users\).*"
        r"sample-based split \(preprocess.sh -t sample\)",
    ),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_files_are_refused_naming_file_user_and_fix(case, tmp_path):
    damage, message = MALFORMED[case]
    root = write_femnist_like(tmp_path / "femnist")
    damage(root)
    with pytest.raises(DataError, match=message.replace("{r}", re.escape(str(root)))):
        read(root)


def test_a_user_twice_in_one_split_is_refused(tmp_path):
    leaf_json(tmp_path / "train" / "a.json", TRAIN)
    leaf_json(tmp_path / "train" / "b.json", {"w1": TRAIN["w1"]})
    leaf_json(tmp_path / "test.json", TEST)
    with pytest.raises(DataError, match=r"User 'w1' appears in both .*train/a.json and .*train/b.json"):
        read(tmp_path)


def tweet(user: str, text: str) -> list[str]:
    """A row of LEAF's Sent140: [tweet id, date, query, user, text]."""
    return ["1467810369", "Mon Apr 06 22:19:45 PDT 2009", "NO_QUERY", user, text]


SENT140_TRAIN = {
    "u2": ([tweet("u2", "Good good day"), tweet("u2", "awful day !")], [1, 0]),
    "u1": ([tweet("u1", "good night")], [1]),
}
SENT140_TEST = {"u1": ([tweet("u1", "awful unseen words")], [0]), "u2": ([tweet("u2", "good")], [1])}


def read_text(root: Path, **keys) -> object:
    return load_federated_data(DataConfig(source="leaf", root=str(root), **keys), 0)


def test_sent140_records_become_token_ids_from_the_training_texts_vocabulary(tmp_path):
    data = read_text(write_femnist_like(tmp_path, SENT140_TRAIN, SENT140_TEST), max_length=4)
    # Training words by count, ties in string order: good 3, day 2, !, awful, night; then [PAD] 0 and [UNK] 1.
    good, day, bang, awful, night = 2, 3, 4, 5, 6
    assert data.vocab_size == 7 and data.input_shape == (4,) and data.num_classes == 2
    u1, u2 = data.clients
    assert u2.x_train.tolist() == [[good, good, day, 0], [awful, day, bang, 0]] and u2.y_train.tolist() == [1, 0]
    assert u1.x_train.tolist() == [[good, night, 0, 0]] and u2.x_test.tolist() == [[good, 0, 0, 0]]
    assert u1.x_test.tolist() == [[awful, 1, 1, 0]]  # test-only words are unknown: the vocabulary saw no test text
    assert read_text(tmp_path, max_length=2, vocab_size=4).clients[1].x_train.tolist() == [[2, 2], [1, 3]]


def test_plain_text_rows_read_as_the_records_last_field(tmp_path):
    plain = {
        split: {u: ([row[-1] for row in x], y) for u, (x, y) in users.items()}
        for split, users in (("train", SENT140_TRAIN), ("test", SENT140_TEST))
    }
    records = read_text(write_femnist_like(tmp_path / "records", SENT140_TRAIN, SENT140_TEST))
    rows = read_text(write_femnist_like(tmp_path / "plain", plain["train"], plain["test"]))
    for a, b in zip(records.clients, rows.clients, strict=True):
        assert all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("x_train", "y_train", "x_test", "y_test"))


def test_a_text_row_that_is_neither_a_string_nor_a_record_is_refused(tmp_path):
    root = write_femnist_like(tmp_path, SENT140_TRAIN, SENT140_TEST)
    set_user("train", "u1", x=[["1", "date", 7]])(root)
    with pytest.raises(
        DataError,
        match=r"train.json, user 'u1': row 0 of 'x' is \[\"1\", \"date\", 7\]; text rows "
        r"are strings or LEAF's Sent140 records",
    ):
        read_text(root)


def test_a_text_federation_trains_through_plfl_fit(tmp_path):
    root = write_femnist_like(tmp_path / "sent140", SENT140_TRAIN, SENT140_TEST)
    out = tmp_path / "runs"
    status = main(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "fedavg-femnist.yaml"),
            f"data.root={root}",
            "data.image_shape=null",
            "data.max_length=5",
            "model.name=fasttext",
            "federation.rounds=1",
            f"output_dir={out}",
            "progress_bar=false",
            "logger.name=csv",
        ]
    )
    assert status == 0
    metrics = next(out.rglob("metrics.csv")).read_text().splitlines()
    assert [row.split(",")[0] for row in metrics] == ["round", "0", "1"]


def test_image_shape_is_required_and_named_with_the_row_length(tmp_path):
    with pytest.raises(
        DataError,
        match=r"data.image_shape is not set, and .*train.json, user 'w2' holds images "
        r"as rows of 4 values",
    ):
        read(write_femnist_like(tmp_path), image_shape=None)
    with pytest.raises(DataError, match=r"data.source=leaf needs data.root"):
        load_federated_data(DataConfig(source="leaf", image_shape=[1, 2, 2]), 0)


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"source": "digits", "image_shape": [1, 8, 8]}, "data.image_shape=[1, 8, 8] is read only by data.source=leaf"),
        ({"source": "pfllib", "num_classes": 10}, "data.num_classes=10 is read only by data.source=leaf"),
        ({"source": "leaf", "beta": 0.5}, "data.beta=0.5 has no effect: data.source=leaf keeps the users"),
        ({"source": "leaf", "repartition": True}, "data.repartition=true with data.source=leaf pools images only"),
        ({"source": "mnist", "repartition": True}, "data.repartition=true is read only by data.source=leaf or pfllib"),
    ],
)
def test_leaf_keys_and_partition_keys_are_refused_where_they_have_no_effect(keys, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(OmegaConf.create({"data": keys}))


def test_image_shape_range_is_checked():
    with pytest.raises(ConfigError, match=r"'data.image_shape' must be null or a non-empty list of integers >= 1"):
        load_config(ROOT / "configs" / "fedavg-femnist.yaml", ["data.image_shape=[1,0,28]"])


def test_a_broken_leaf_file_through_plfl_fit_exits_2_without_a_run_directory(tmp_path, capsys):
    root = write_femnist_like(tmp_path / "femnist")
    (root / "test.json").write_text("{")
    out = tmp_path / "runs"
    status = main(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "fedavg-femnist.yaml"),
            f"data.root={root}",
            "data.image_shape=[1,2,2]",
            "model.name=mlp",
            f"output_dir={out}",
            "progress_bar=false",
        ]
    )
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("plfl fit: ") and f"{root}/test.json is not valid JSON (line 1, column 2" in err
    assert "Traceback" not in err and not out.exists()


@reads_shared_data(FEMNIST)
def test_femnist_writers_pooled_and_repartitioned_give_the_asked_clients_and_every_image():
    overrides = ["data.repartition=true", "data.partition=fedprox", "data.num_clients=200"]
    overrides += ["data.classes_per_client=5", "data.min_per_class=2", "data.test_fraction=0.1"]
    cfg = OmegaConf.to_object(load_config(ROOT / "configs" / "selffl-femnist.yaml", overrides))
    data = load_federated_data(cfg.data, 0)
    assert len(data.clients) == 200 and data.num_classes == 62
    assert sum(c.num_train + c.num_test for c in data.clients) == 6716 + 773
    for u, c in enumerate(data.clients):
        assert set(torch.cat([c.y_train, c.y_test]).tolist()) == {(u + j) % 62 for j in range(5)}


@reads_shared_data(FEMNIST)
def test_real_femnist_subset_has_its_documented_writers_classes_and_pixels():
    cfg = OmegaConf.to_object(load_config(ROOT / "configs" / "selffl-femnist.yaml"))
    data = load_federated_data(cfg.data, 0)
    assert len(data.clients) == 51 and data.num_classes == 62 and data.input_shape == (1, 28, 28)
    assert sum(c.num_train for c in data.clients) == 6716 and sum(c.num_test for c in data.clients) == 773
    assert all(c.num_test >= 1 for c in data.clients)
    x = torch.cat([c.x_train for c in data.clients])
    assert x.dtype == torch.float32 and x.min() == 0 and x.max() == 1
    assert (x == 1).float().mean() > 0.5  # mostly white background: the values are not inverted
    labels = torch.cat([c.y_test for c in data.clients])
    assert set(labels.tolist()) == set(range(62))  # the README: all 62 classes in both splits
    # Client 0 is the smallest user id; its test rows are the file's, unchanged.
    first = json.loads((FEMNIST / "test.json").read_text())
    user = sorted(first["users"])[0]
    assert data.clients[0].y_test.tolist() == first["user_data"][user]["y"]
    expected = np.array(first["user_data"][user]["x"], dtype=np.float32).reshape(-1, 1, 28, 28)
    assert np.array_equal(data.clients[0].x_test.numpy(), expected)
