"""pFedLA's data settings: the classes and dominant partitions, re-partitioned PFLlib data, and their key checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from plfl.config import DataConfig, load_config
from plfl.data import load_federated_data
from plfl.data.partition import classes_partition, dominant_partition
from plfl.errors import ConfigError, DataError

from conftest import reads_shared_data
from test_data import PFLLIB_FMNIST, write_pfllib

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# Unequal classes, so that an equal count per class is a property of the partition, not of the data.
LABELS = np.repeat(np.arange(10), np.arange(300, 400, 10))


def class_counts(parts: list[np.ndarray], labels: np.ndarray) -> np.ndarray:
    """``(clients, classes)`` sample counts."""
    return np.stack([np.bincount(labels[idx], minlength=labels.max() + 1) for idx in parts])


def assert_disjoint_subset(parts: list[np.ndarray], n: int) -> None:
    pooled = np.concatenate(parts)
    assert len(np.unique(pooled)) == len(pooled) and pooled.min() >= 0 and pooled.max() < n


# ---------------------------------------------------------------- classes (non-IID_1)


@pytest.mark.parametrize("num_clients, c", [(10, 4), (30, 3)])
def test_classes_clients_hold_c_classes_equally_and_as_many_as_the_data_allow(num_clients, c):
    parts = classes_partition(LABELS, num_clients, c, np.random.default_rng(0))
    counts = class_counts(parts, LABELS)
    held = counts > 0
    assert len(parts) == num_clients and (held.sum(axis=1) == c).all()
    per_class = np.unique(counts[held])
    assert len(per_class) == 1  # the same count on every held class of every client
    holders = held.sum(axis=0)
    available = np.bincount(LABELS)[holders > 0] // holders[holders > 0]
    assert per_class[0] == available.min()  # the most-shared class is used up, not less
    assert_disjoint_subset(parts, len(LABELS))


def test_classes_are_drawn_per_client_so_they_repeat_and_vary():
    held = class_counts(classes_partition(LABELS, 10, 4, np.random.default_rng(0)), LABELS) > 0
    assert held.sum(axis=0).max() > 1  # some class on several clients
    assert len({tuple(row) for row in held}) > 1  # not every client the same classes


def test_classes_refuses_more_classes_than_exist():
    with pytest.raises(DataError, match=r"data.classes_per_client=11 exceeds the 10 classes"):
        classes_partition(LABELS, 5, 11, np.random.default_rng(0))


def test_classes_refuses_a_class_smaller_than_its_holders():
    labels = np.array([0] * 3 + [1] * 50)  # c = 2 of 2 classes: all 4 clients hold class 0
    with pytest.raises(DataError, match=r"Class 0 has 3 samples but 4 clients hold it .*Lower data.num_clients"):
        classes_partition(labels, 4, 2, np.random.default_rng(0))


# ---------------------------------------------------------------- dominant (non-IID_2)


@pytest.mark.parametrize("d, f", [(2, 0.8), (3, 0.6)])
def test_dominant_clients_hold_every_class_with_d_classes_at_the_fraction(d, f):
    parts = dominant_partition(LABELS, 10, d, f, np.random.default_rng(0))
    counts = class_counts(parts, LABELS)
    sizes = counts.sum(axis=1)
    assert (counts > 0).all() and len(set(sizes)) == 1  # every class everywhere, equal clients
    ranked = np.sort(counts, axis=1)
    assert (ranked[:, -d] > ranked[:, -d - 1]).all()  # exactly d classes stand out
    assert len(np.unique(ranked[:, :-d])) == 1 and len(np.unique(ranked[:, -d:])) == 1
    share = ranked[:, -d:].sum(axis=1) / sizes
    assert np.abs(share - f).max() <= d / sizes[0]  # within the rounding of the per-class counts
    assert_disjoint_subset(parts, len(LABELS))


def test_dominant_client_size_is_the_largest_the_data_allow():
    parts = dominant_partition(LABELS, 10, 2, 0.8, np.random.default_rng(0))
    counts = class_counts(parts, LABELS)
    b, a = np.sort(counts, axis=1)[0, [0, -1]]
    assert a == 16 * b  # 2a / (2a + 8b) = 0.8 exactly
    dominated = (counts == a).sum(axis=0)  # clients each class dominates
    left = np.bincount(LABELS) - counts.sum(axis=0)
    # One more sample of each other class per client (and 16 more of each dominant one) does not fit in some class.
    assert (left < dominated * 16 + (10 - dominated)).any()


def test_dominant_refuses_impossible_settings():
    rng = np.random.default_rng(0)
    with pytest.raises(DataError, match=r"data.dominant_classes=10 leaves no other classes: .*at most 9"):
        dominant_partition(LABELS, 10, 10, 0.9, rng)
    with pytest.raises(DataError, match=r"data.dominant_fraction=0.2 does not favour the 2 dominant .*above 0.2"):
        dominant_partition(LABELS, 10, 2, 0.2, rng)
    few = np.repeat(np.arange(10), 5)
    with pytest.raises(DataError, match=r"only \d+ samples, too few for one sample of each of its 8 other classes"):
        dominant_partition(few, 10, 2, 0.8, rng)


@pytest.mark.parametrize("partition", [classes_partition, dominant_partition])
def test_new_partitions_same_seed_reproduces_other_seed_differs(partition):
    args = (LABELS, 10, 2) if partition is classes_partition else (LABELS, 10, 2, 0.8)
    a, b, c = (partition(*args, np.random.default_rng(seed)) for seed in (0, 0, 1))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, z) for x, z in zip(a, c))


# ---------------------------------------------------------------- re-partitioned PFLlib directories


TINY = [([0] * 12 + [1] * 4, [0, 1, 2, 2]), ([1] * 10 + [2] * 6, [1, 1, 0, 0]), ([2] * 8 + [0] * 8, [0, 1, 2, 0])]


def tiny_pfllib(tmp_path: Path) -> Path:
    """3 clients, 3 classes, 60 samples in all (train and test files)."""
    return write_pfllib(tmp_path / "d", TINY)


def test_repartition_pools_every_file_and_gives_the_asked_clients(tmp_path):
    cfg = DataConfig(
        source="pfllib",
        root=str(tiny_pfllib(tmp_path)),
        repartition=True,
        num_clients=4,
        partition="iid",
        test_fraction=0.3,
    )
    data = load_federated_data(cfg, 0)
    assert data.num_classes == 3 and data.input_shape == (1, 4, 4) and len(data.clients) == 4
    y = torch.cat([t for c in data.clients for t in (c.y_train, c.y_test)])
    files_y = np.concatenate([train + test for train, test in TINY])
    assert np.array_equal(np.bincount(y.numpy()), np.bincount(files_y))  # every train and test sample pooled
    assert [c.num_test for c in data.clients] == [5, 5, 5, 5]  # ceil(0.3 * 15): data.test_fraction applies


def test_repartition_applies_the_partition(tmp_path):
    root = tiny_pfllib(tmp_path)
    cfg = DataConfig(
        source="pfllib", root=str(root), repartition=True, num_clients=2, partition="classes", classes_per_client=1
    )
    data = load_federated_data(cfg, 0)
    assert len(data.clients) == 2
    for c in data.clients:
        assert len(torch.cat([c.y_train, c.y_test]).unique()) == 1


def test_pfllib_without_repartition_keeps_its_clients(tmp_path):
    data = load_federated_data(DataConfig(source="pfllib", root=str(tiny_pfllib(tmp_path))), 0)
    assert [c.y_test.tolist() for c in data.clients] == [test for _, test in TINY]


# ---------------------------------------------------------------- keys that other keys make meaningless


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["data.source=mnist", "data.repartition=true"],
            r"data.repartition=true is read only by data.source=pfllib, not by data.source=mnist",
        ),
        (
            ["data.source=pfllib", "data.partition=classes"],
            r"data.partition=classes has no effect: data.source=pfllib keeps .*Set data.repartition=true",
        ),
        (["data.source=pfllib", "data.test_fraction=0.3"], r"data.test_fraction=0.3 has no effect"),
        (
            ["data.partition=classes", "data.beta=0.5"],
            r"data.beta=0.5 is read only by data.partition=dirichlet, not by data.partition=classes",
        ),
        (
            ["data.partition=iid", "data.classes_per_client=4"],
            r"data.classes_per_client=4 is read only by data.partition=classes or pathological",
        ),
        (
            ["data.partition=dirichlet", "data.dominant_fraction=0.9"],
            r"data.dominant_fraction=0.9 is read only by data.partition=dominant, .*set data.partition=dominant",
        ),
    ],
)
def test_meaningless_keys_are_refused_when_the_config_is_read(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_meaningful_combinations_pass():
    cfg = load_config(
        None,
        [
            "data.source=pfllib",
            "data.repartition=true",
            "data.partition=dominant",
            "data.dominant_fraction=0.7",
            "data.test_fraction=0.3",
        ],
    )
    assert cfg.data.dominant_fraction == 0.7 and cfg.data.repartition


# ---------------------------------------------------------------- the shipped configs on the real FMNIST


@reads_shared_data(PFLLIB_FMNIST)
@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*-fmnist-noniid*.yaml")))
def test_fmnist_noniid_configs_give_papers_settings(config):
    cfg = load_config(CONFIGS / config, [f"data.root={PFLLIB_FMNIST}"])
    data = load_federated_data(OmegaConf.to_object(cfg.data), cfg.federation.seed)
    counts = np.stack([np.bincount(torch.cat([c.y_train, c.y_test]).numpy(), minlength=10) for c in data.clients])
    assert counts.shape == (10, 10) and len(set(counts.sum(axis=1))) == 1
    assert all(abs(c.num_test / (c.num_train + c.num_test) - 0.3) < 0.01 for c in data.clients)
    if config.endswith("noniid1.yaml"):
        assert ((counts > 0).sum(axis=1) == 4).all() and len(np.unique(counts[counts > 0])) == 1
    else:
        assert (counts > 0).all()
        assert np.allclose(np.sort(counts, axis=1)[:, -2:].sum(axis=1) / counts.sum(axis=1), 0.8, atol=0.01)
