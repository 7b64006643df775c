"""Tests for plfl.data: partitioners, the safe .npz loader, and the data sources."""

from __future__ import annotations

import json
import os
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from plfl.config import DataConfig
from plfl.data import load_federated_data
from plfl.data.partition import dirichlet_partition, iid_partition, pathological_partition, split_train_test
from plfl.data.safe_npz import load_npz_dict
from plfl.errors import DataError

from conftest import FEDALA_MNIST, SHARED_DATA, reads_shared_data

PFLLIB_FMNIST = SHARED_DATA / "pfllib-fmnist-19clients"


@pytest.fixture(scope="module")
def digit_labels() -> np.ndarray:
    return load_digits().target.astype(np.int64)


def partition(name: str, labels: np.ndarray, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if name == "dirichlet":
        return dirichlet_partition(labels, 20, 0.1, 10, 100, rng)
    if name == "pathological":
        return pathological_partition(labels, 20, 2, rng)
    return iid_partition(labels, 20, rng)


def mean_label_entropy(parts: list[np.ndarray], labels: np.ndarray) -> float:
    entropies = []
    for idx in parts:
        p = np.bincount(labels[idx]) / len(idx)
        p = p[p > 0]
        entropies.append(-(p * np.log(p)).sum())
    return float(np.mean(entropies))


# ---------------------------------------------------------------- partitioners


@pytest.mark.parametrize("name", ["dirichlet", "pathological", "iid"])
def test_partition_covers_data_with_disjoint_clients(name, digit_labels):
    parts = partition(name, digit_labels, seed=0)
    assert len(parts) == 20
    assert sum(len(p) for p in parts) == len(digit_labels)
    assert len(np.unique(np.concatenate(parts))) == len(digit_labels)


@pytest.mark.parametrize("name", ["dirichlet", "pathological", "iid"])
def test_partition_same_seed_reproduces_other_seed_differs(name, digit_labels):
    a, b, c = (partition(name, digit_labels, seed) for seed in (0, 0, 1))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, z) for x, z in zip(a, c))


def test_dirichlet_label_skew_grows_as_beta_shrinks():
    labels = np.repeat(np.arange(10), 300)
    entropy = {
        beta: mean_label_entropy(dirichlet_partition(labels, 10, beta, 2, 1000, np.random.default_rng(0)), labels)
        for beta in (0.05, 1.0, 100.0)
    }
    assert entropy[0.05] < entropy[1.0] < entropy[100.0]
    assert entropy[100.0] > 0.95 * np.log(10)  # near-uniform labels on every client


def test_dirichlet_gives_every_client_min_samples(digit_labels):
    parts = dirichlet_partition(digit_labels, 20, 0.1, 30, 1000, np.random.default_rng(3))
    assert min(len(p) for p in parts) >= 30


def test_dirichlet_impossible_minimum_is_refused_up_front(digit_labels):
    with pytest.raises(DataError, match=r"100 clients at least 50 samples.*only 1797 samples.*Lower data.num_clients"):
        dirichlet_partition(digit_labels, 100, 0.1, 50, 100, np.random.default_rng(0))


def test_dirichlet_exhausted_retries_name_the_settings(digit_labels):
    with pytest.raises(DataError, match=r"fewer than 85 samples in all 3 draws.*Raise data.beta"):
        dirichlet_partition(digit_labels, 20, 0.01, 85, 3, np.random.default_rng(0))


def test_pathological_clients_hold_exactly_c_classes(digit_labels):
    parts = pathological_partition(digit_labels, 10, 3, np.random.default_rng(0))
    for i, idx in enumerate(parts):
        assert set(np.unique(digit_labels[idx])) == {(i * 3 + j) % 10 for j in range(3)}
    assert sum(len(p) for p in parts) == len(digit_labels)


def test_pathological_refuses_more_classes_than_exist(digit_labels):
    with pytest.raises(DataError, match=r"classes_per_client=11 exceeds the 10 classes"):
        pathological_partition(digit_labels, 5, 11, np.random.default_rng(0))


def test_pathological_refuses_class_smaller_than_its_clients():
    labels = np.array([0] * 3 + [1] * 50)
    with pytest.raises(DataError, match=r"Class 0 has 3 samples but 4 clients share it"):
        pathological_partition(labels, 8, 1, np.random.default_rng(0))


def test_split_train_test_is_stratified_and_disjoint():
    labels = np.repeat(np.arange(4), 20)
    idx = np.arange(80)
    train, test = split_train_test(idx, labels, 0.25, np.random.default_rng(0))
    assert len(test) == 20 and len(train) == 60
    assert sorted(np.concatenate([train, test])) == list(idx)
    assert np.array_equal(np.bincount(labels[test]), [5, 5, 5, 5])


def test_split_train_test_keeps_one_of_each_for_tiny_clients():
    labels = np.array([0, 1, 1])
    for n in (2, 3):
        train, test = split_train_test(np.arange(n), labels, 0.01, np.random.default_rng(0))
        assert len(train) >= 1 and len(test) == 1 and len(train) + len(test) == n
    with pytest.raises(DataError, match="needs at least 2"):
        split_train_test(np.arange(1), labels, 0.25, np.random.default_rng(0))


# ---------------------------------------------------------------- pooled sources


def test_digits_clients_are_reproducible_tensors():
    cfg = DataConfig(source="digits", num_clients=8, partition="dirichlet", beta=0.5)
    a, b, c = (load_federated_data(cfg, seed) for seed in (7, 7, 8))
    assert a.name == "digits" and a.num_classes == 10 and a.input_shape == (1, 8, 8) and len(a.clients) == 8
    assert sum(cl.num_train + cl.num_test for cl in a.clients) == 1797
    for ca, cb in zip(a.clients, b.clients):
        assert ca.x_train.shape == (ca.num_train, 1, 8, 8) and ca.x_train.dtype == torch.float32
        assert ca.y_test.dtype == torch.int64 and ca.x_test.is_contiguous()
        assert 0 <= ca.x_train.min() and ca.x_train.max() <= 1
        assert torch.equal(ca.x_train, cb.x_train) and torch.equal(ca.y_test, cb.y_test)
    assert any(not torch.equal(ca.y_train, cc.y_train) for ca, cc in zip(a.clients, c.clients))


def test_default_is_twenty_clients():
    assert len(load_federated_data(DataConfig(source="digits", partition="iid"), 0).clients) == 20


def test_partition_error_names_the_client():
    cfg = DataConfig(source="digits", partition="iid", num_clients=1000)  # clients 797.. get 1 sample
    with pytest.raises(DataError, match=r"Client 797 of the iid partition: A client has 1 sample"):
        load_federated_data(cfg, 0)


@pytest.mark.parametrize(
    "source, folder", [("mnist", "MNIST/raw"), ("fashionmnist", "FashionMNIST/raw"), ("cifar10", "cifar-10-batches-py")]
)
def test_missing_torchvision_files_say_where_they_belong(tmp_path, source, folder):
    cfg = DataConfig(source=source, root=str(tmp_path))
    with pytest.raises(DataError) as info:
        load_federated_data(cfg, 0)
    message = str(info.value)
    assert str(tmp_path / folder) in message
    assert "data.download is false" in message and "set data.download=true" in message


class _FakeCifar10:
    """Stands in for torchvision's CIFAR10: uint8 (n, 32, 32, 3) numpy images, list targets."""

    def __init__(self, root, train, download):
        n = 60 if train else 20
        self.data = np.full((n, 32, 32, 3), [0, 255, 51], dtype=np.uint8)
        self.targets = [i % 10 for i in range(n)]


def test_torchvision_images_are_pooled_chw_in_minus_one_to_one(tmp_path, monkeypatch):
    import torchvision.datasets

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", _FakeCifar10)
    data = load_federated_data(DataConfig(source="cifar10", root=str(tmp_path), num_clients=4, partition="iid"), 0)
    assert data.input_shape == (3, 32, 32) and data.num_classes == 10
    assert sum(c.num_train + c.num_test for c in data.clients) == 80  # train and test sets pooled
    x = data.clients[0].x_train
    assert x.is_contiguous() and x.dtype == torch.float32
    assert torch.allclose(x[0, :, 0, 0], torch.tensor([-1.0, 1.0, -0.6]))  # (v/255 - 0.5) / 0.5 per channel


def test_torchvision_source_needs_root():
    with pytest.raises(DataError, match=r"data.source=mnist needs data.root"):
        load_federated_data(DataConfig(source="mnist"), 0)


# ---------------------------------------------------------------- real PFLlib data


@reads_shared_data(FEDALA_MNIST)
def test_fedala_mnist_loads_with_train_i_naming():
    data = load_federated_data(DataConfig(source="pfllib", root=str(FEDALA_MNIST)), 0)
    assert data.name == "pfllib:fedala-mnist-dir0.1"
    assert len(data.clients) == 20 and data.num_classes == 10 and data.input_shape == (1, 28, 28)
    assert sum(c.num_train for c in data.clients) == 52_492
    assert sum(c.num_test for c in data.clients) == 17_508
    for c in data.clients:
        assert c.x_train.shape == (c.num_train, 1, 28, 28) and c.x_test.shape == (c.num_test, 1, 28, 28)
        assert c.x_train.dtype == torch.float32 and c.y_train.dtype == torch.int64
        assert 0 <= int(c.y_train.min()) and int(torch.cat([c.y_train, c.y_test]).max()) <= 9
    assert float(data.clients[0].x_train.min()) == -1.0 and float(data.clients[0].x_train.max()) == 1.0


@reads_shared_data(PFLLIB_FMNIST)
def test_fmnist_loads_with_i_naming():
    data = load_federated_data(DataConfig(source="pfllib", root=str(PFLLIB_FMNIST)), 0)
    assert len(data.clients) == 19 and data.input_shape == (1, 28, 28)
    assert sum(c.num_train + c.num_test for c in data.clients) == 35_939


@reads_shared_data(FEDALA_MNIST)
def test_safe_loader_reads_a_real_file():
    d = load_npz_dict(FEDALA_MNIST / "train" / "train0_.npz")
    assert d["x"].dtype == np.float32 and d["x"].shape[1:] == (1, 28, 28) and d["y"].shape == (len(d["x"]),)


@reads_shared_data(FEDALA_MNIST)
def test_num_clients_disagreeing_with_config_json():
    with pytest.raises(DataError, match=r"data.num_clients=5 but .*config.json says num_clients=20"):
        load_federated_data(DataConfig(source="pfllib", root=str(FEDALA_MNIST), num_clients=5), 0)


# ---------------------------------------------------------------- the safe loader


class _RunsCommand:
    """Pickles as a call to os.system: what a crafted PFLlib file would hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _ExecsCode:
    """Pickles as a call to exec() of Python code that creates the marker."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"import pathlib; pathlib.Path({str(self.marker)!r}).touch()",)


@pytest.mark.parametrize(
    "payload, global_name", [(_RunsCommand, r"(posix|os)\.system"), (_ExecsCode, r"builtins\.exec")]
)
def test_crafted_npz_is_refused_without_running_it(tmp_path, payload, global_name):
    marker = tmp_path / "pwned"
    path = tmp_path / "0.npz"
    np.savez_compressed(path, data={"x": payload(marker), "y": np.zeros(1, dtype=np.int64)})
    message = rf"{re.escape(str(path))} contains a pickled {global_name}; plfl loads only NumPy arrays"
    with pytest.raises(DataError, match=message):
        load_npz_dict(path)
    assert not marker.exists()

    # Control: the file really is an exploit when loaded the unsafe way.
    with np.load(path, allow_pickle=True) as unsafe:
        unsafe["data"]
    assert marker.exists()


def test_corrupt_and_truncated_npz_are_refused(tmp_path):
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip file at all")
    with pytest.raises(DataError, match=rf"{re.escape(str(garbage))} is corrupt or truncated"):
        load_npz_dict(garbage)

    good = tmp_path / "good.npz"
    np.savez_compressed(good, data={"x": np.random.rand(50, 1, 4, 4).astype(np.float32), "y": np.zeros(50, np.int64)})
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(DataError, match=rf"{re.escape(str(truncated))} is corrupt or truncated"):
        load_npz_dict(truncated)

    # Valid zip, but the .npy member's payload is cut short (a bad member, not a bad archive).
    short = tmp_path / "short.npz"
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(short, "w") as zout:
        zout.writestr("data.npy", zin.read("data.npy")[:300])
    with pytest.raises(DataError, match=rf"{re.escape(str(short))} is corrupt or truncated"):
        load_npz_dict(short)


def test_npz_without_a_data_dict_is_refused(tmp_path):
    no_data = tmp_path / "no_data.npz"
    np.savez(no_data, x=np.zeros(3))
    with pytest.raises(DataError, match=rf"{re.escape(str(no_data))} has no 'data' entry"):
        load_npz_dict(no_data)

    plain = tmp_path / "plain.npz"
    np.savez(plain, data=np.zeros(3))
    message = rf"{re.escape(str(plain))} holds a float64 array of shape \(3,\) under 'data', not a dict"
    with pytest.raises(DataError, match=message):
        load_npz_dict(plain)

    no_y = tmp_path / "no_y.npz"
    np.savez(no_y, data={"x": np.zeros(3)})
    with pytest.raises(DataError, match=rf"{re.escape(str(no_y))} holds a dict with keys \['x'\]"):
        load_npz_dict(no_y)


def test_missing_npz_names_the_path(tmp_path):
    with pytest.raises(DataError, match=rf"Client file {re.escape(str(tmp_path / 'nope.npz'))} does not exist"):
        load_npz_dict(tmp_path / "nope.npz")


# ---------------------------------------------------------------- synthetic PFLlib directories


def write_pfllib(
    root: Path,
    clients: list[tuple[list[int], list[int]]],
    num_classes: int = 3,
    naming: str = "pfllib",
    sizes: bool = True,
) -> Path:
    """A PFLlib directory with one (train labels, test labels) pair per client; x is (n, 1, 4, 4)."""
    for split in ("train", "test"):
        (root / split).mkdir(parents=True)
    for i, (train_y, test_y) in enumerate(clients):
        for split, y in (("train", train_y), ("test", test_y)):
            name = f"{i}.npz" if naming == "pfllib" else f"{split}{i}_.npz"
            x = np.full((len(y), 1, 4, 4), 0.5, dtype=np.float32)
            np.savez_compressed(root / split / name, data={"x": x, "y": np.array(y, dtype=np.int64)})
    config = {"num_clients": len(clients), "num_classes": num_classes}
    if sizes:
        config["Size of samples for labels in clients"] = [
            [[int(label), int(count)] for label, count in zip(*np.unique(train + test, return_counts=True))]
            for train, test in clients
        ]
    (root / "config.json").write_text(json.dumps(config))
    return root


def pfllib_cfg(root: Path, **kwargs) -> DataConfig:
    return DataConfig(source="pfllib", root=str(root), **kwargs)


@pytest.mark.parametrize("naming", ["pfllib", "fedala"])
def test_synthetic_pfllib_dir_loads_in_both_namings(tmp_path, naming):
    root = write_pfllib(tmp_path / "d", [([0, 1, 1], [1]), ([2, 2], [0, 2])], naming=naming)
    data = load_federated_data(pfllib_cfg(root), 0)
    assert [c.y_train.tolist() for c in data.clients] == [[0, 1, 1], [2, 2]]
    assert [c.num_test for c in data.clients] == [1, 2]
    assert data.num_classes == 3 and data.input_shape == (1, 4, 4)


def test_label_counts_disagreeing_with_config_json(tmp_path):
    root = write_pfllib(tmp_path / "d", [([0, 1], [1]), ([2, 2], [0])])
    config = json.loads((root / "config.json").read_text())
    config["Size of samples for labels in clients"][1] = [[0, 1], [2, 3]]
    (root / "config.json").write_text(json.dumps(config))
    with pytest.raises(DataError, match=r"Client 1 holds 2 samples of label 2 .*but .*config.json says 3"):
        load_federated_data(pfllib_cfg(root), 0)


def test_client_count_disagreeing_with_config_json(tmp_path):
    root = write_pfllib(tmp_path / "d", [([0], [1]), ([1], [0])], sizes=False)
    (root / "config.json").write_text(json.dumps({"num_clients": 3, "num_classes": 3}))
    with pytest.raises(DataError, match=rf"Client file {re.escape(str(root / 'train' / '2.npz'))} .*does not exist"):
        load_federated_data(pfllib_cfg(root), 0)
    (root / "config.json").write_text(json.dumps({"num_clients": 1, "num_classes": 3}))
    with pytest.raises(DataError, match=r"holds 2 client files but .*config.json says num_clients=1"):
        load_federated_data(pfllib_cfg(root), 0)


def test_label_outside_num_classes(tmp_path):
    root = write_pfllib(tmp_path / "d", [([0, 1], [1]), ([0, 5], [0])], num_classes=3, sizes=False)
    with pytest.raises(DataError, match=rf"{re.escape(str(root / 'train' / '1.npz'))} holds label 5, outside 0..2"):
        load_federated_data(pfllib_cfg(root), 0)


def test_client_without_training_samples(tmp_path):
    root = write_pfllib(tmp_path / "d", [([0, 1], [1]), ([], [0])])
    with pytest.raises(DataError, match=r"Client 1 has no training samples"):
        load_federated_data(pfllib_cfg(root), 0)


def test_inconsistent_sample_shapes(tmp_path):
    root = write_pfllib(tmp_path / "d", [([0], [1]), ([1], [0])], sizes=False)
    bad = {"x": np.zeros((1, 1, 5, 5), np.float32), "y": np.zeros(1, np.int64)}
    np.savez_compressed(root / "test" / "1.npz", data=bad)
    with pytest.raises(DataError, match=r"1.npz holds samples of shape \(1, 5, 5\) but .* holds \(1, 4, 4\)"):
        load_federated_data(pfllib_cfg(root), 0)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(DataError, match=rf"{re.escape(str(tmp_path / 'absent'))} does not exist"):
        load_federated_data(pfllib_cfg(tmp_path / "absent"), 0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=rf"{re.escape(str(tmp_path / 'empty' / 'config.json'))} does not exist"):
        load_federated_data(pfllib_cfg(tmp_path / "empty"), 0)
    with pytest.raises(DataError, match=r"data.source=pfllib needs data.root"):
        load_federated_data(DataConfig(source="pfllib"), 0)
