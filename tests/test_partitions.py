"""pFedLA's data settings (the classes and dominant partitions, the pathological partition's class stride), FedProx's
MNIST federation (the fedprox partition), re-partitioned PFLlib data, and their key checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from sklearn.datasets import load_digits

from plfl.config import DataConfig, load_config
from plfl.data import load_federated_data
from plfl.data.partition import classes_partition, dominant_partition, fedprox_partition, pathological_partition
from plfl.errors import ConfigError, DataError

from conftest import FEDALA_MNIST, reads_shared_data
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


# ---------------------------------------------------------------- pathological with a class stride (pFedLA's Fig. 6)


def test_pathological_stride_one_gives_neighbours_three_of_four_classes():
    # Fig. 6: 8 clients of 4 classes, client i holding i, i+1, i+2, i+3 (mod 10). By hand: class 0 is held by clients
    # 0 and 7, class 1 by 0-1, 2 by 0-2, 3 to 7 by four clients each, 8 by 5-7, 9 by 6-7.
    labels = np.repeat(np.arange(10), 12)  # 12 samples a class: divisible by its 2, 3 or 4 holders
    parts = pathological_partition(labels, 8, 4, np.random.default_rng(0), class_stride=1)
    expected = [
        {0, 1, 2, 3},
        {1, 2, 3, 4},
        {2, 3, 4, 5},
        {3, 4, 5, 6},
        {4, 5, 6, 7},
        {5, 6, 7, 8},
        {6, 7, 8, 9},
        {7, 8, 9, 0},
    ]
    assert [set(np.unique(labels[idx])) for idx in parts] == expected
    holders = {0: 2, 1: 2, 2: 3, 3: 4, 4: 4, 5: 4, 6: 4, 7: 4, 8: 3, 9: 2}
    counts = class_counts(parts, labels)
    for cls, h in holders.items():
        assert sorted(counts[:, cls][counts[:, cls] > 0]) == [12 // h] * h  # the class split evenly over its holders
    assert [len(idx) for idx in parts] == [
        6 + 6 + 4 + 3,
        6 + 4 + 3 + 3,
        4 + 3 + 3 + 3,
        12,
        12,
        3 + 3 + 3 + 4,
        3 + 3 + 4 + 6,
        3 + 4 + 6 + 6,
    ]
    assert_disjoint_subset(parts, len(labels))
    assert sum(len(idx) for idx in parts) == len(labels)  # every class has a holder: nothing left out


def test_pathological_default_stride_is_c_and_gives_the_clients_it_always_gave():
    labels = np.repeat(np.arange(5), [4, 5, 6, 7, 8])
    default = pathological_partition(labels, 3, 2, np.random.default_rng(1))
    # The clients before the stride existed, for this seed: client 2 wraps round to class 0.
    assert [idx.tolist() for idx in default] == [
        [0, 1, 7, 4, 5, 8, 6],
        [10, 14, 11, 12, 13, 9, 18, 15, 16, 19, 20, 21, 17],
        [2, 3, 25, 23, 27, 29, 28, 22, 24, 26],
    ]
    explicit = pathological_partition(labels, 3, 2, np.random.default_rng(1), class_stride=2)
    assert all(np.array_equal(a, b) for a, b in zip(default, explicit))
    wider = pathological_partition(labels, 3, 2, np.random.default_rng(1), class_stride=3)
    assert [set(np.unique(labels[idx])) for idx in wider] == [{0, 1}, {3, 4}, {1, 2}]  # (3i + j) mod 5


def test_class_stride_is_read_and_checked_by_the_config():
    cfg = load_config(CONFIGS / "pfedla-figure6.yaml")
    assert (cfg.data.partition, cfg.data.num_clients, cfg.data.classes_per_client, cfg.data.class_stride) == (
        "pathological",
        8,
        4,
        1,
    )
    assert load_config(None, ["data.partition=pathological"]).data.class_stride is None
    with pytest.raises(ConfigError, match=r"data.class_stride' must be null or an integer >= 1; got 0"):
        load_config(None, ["data.partition=pathological", "data.class_stride=0"])
    with pytest.raises(ConfigError, match=r"data.class_stride=1 is read only by data.partition=pathological"):
        load_config(None, ["data.partition=dirichlet", "data.class_stride=1"])


# ---------------------------------------------------------------- fedprox (FedProx's MNIST)


def fedprox_cases() -> list:
    """(labels, N, c, m): synthetic equal and unequal classes, and the digits' labels (about 180 per class)."""
    equal = np.repeat(np.arange(10), 1000)
    digits = load_digits().target.astype(np.int64)
    return [
        pytest.param(equal, 100, 2, 5, id="10x1000-N100-c2"),
        pytest.param(equal, 37, 3, 10, id="10x1000-N37-c3"),
        pytest.param(LABELS, 25, 10, 1, id="unequal-N25-c10"),
        pytest.param(digits, 50, 3, 5, id="digits-N50-c3"),
    ]


@pytest.mark.parametrize("labels, num_clients, c, m", fedprox_cases())
def test_fedprox_clients_hold_c_consecutive_classes_and_every_sample(labels, num_clients, c, m):
    parts = fedprox_partition(labels, num_clients, c, m, 2.0, np.random.default_rng(0))
    counts = class_counts(parts, labels)
    assert len(parts) == num_clients and all(p.dtype == np.int64 for p in parts)
    for u, row in enumerate(counts):
        assert set(np.flatnonzero(row)) == {(u + j) % 10 for j in range(c)}
        assert row[row > 0].min() >= m  # every slot got its min_per_class first
    assert_disjoint_subset(parts, len(labels))
    assert sum(len(p) for p in parts) == len(labels)  # every class is held: nothing is left over


def test_fedprox_leaves_out_only_the_classes_no_client_holds():
    labels = np.repeat(np.arange(10), 50)
    parts = fedprox_partition(labels, 2, 2, 5, 2.0, np.random.default_rng(0))  # clients hold {0, 1} and {1, 2}
    pooled = np.concatenate(parts)
    assert np.array_equal(np.sort(pooled), np.flatnonzero(labels <= 2))


def test_fedprox_one_class_per_client_gets_the_whole_class():
    labels = np.repeat(np.arange(3), [7, 11, 13])
    parts = fedprox_partition(labels, 3, 1, 2, 2.0, np.random.default_rng(0))
    assert [sorted(p) for p in parts] == [list(range(7)), list(range(7, 18)), list(range(18, 31))]


def test_fedprox_rounds_the_shares_by_largest_remainder():
    # One class of 23 over 4 slots, m = 2: 15 left, near-equal weights give 3.75 each, so three slots get 3 + 1.
    labels = np.zeros(23, dtype=np.int64)
    parts = fedprox_partition(labels, 4, 1, 2, 1e-9, np.random.default_rng(0))
    assert sorted(len(p) for p in parts) == [5, 6, 6, 6]


def test_fedprox_huge_sigma_still_uses_every_sample():
    labels = np.repeat(np.arange(10), 1000)
    parts = fedprox_partition(labels, 100, 2, 5, 1000.0, np.random.default_rng(0))
    sizes = np.array([len(p) for p in parts])
    assert sizes.sum() == len(labels) and sizes.min() >= 10
    # The weights are powers of e^1000: one of each class's 20 slots takes all 900 left after the 20 x 5.
    counts = class_counts(parts, labels)
    assert (counts.max(axis=0) == 905).all() and ((counts == 5).sum(axis=0) == 19).all()


def test_fedprox_sample_counts_are_heavy_tailed():
    # FedProx's MNIST shape: 1000 clients of 2 classes, 7000 samples per class.
    labels = np.repeat(np.arange(10), 7000)
    for seed in range(3):
        sizes = np.array([len(p) for p in fedprox_partition(labels, 1000, 2, 5, 2.0, np.random.default_rng(seed))])
        assert sizes.sum() == 70_000 and sizes.min() >= 10
        median = np.median(sizes)
        assert sizes.max() > 10 * median  # a power law, not near-equal clients
        assert sizes.std() > sizes.mean()  # FedProx's table: mean 69, std 106 samples per device
        assert median < sizes.mean() / 2  # most clients small
    equal = fedprox_partition(labels, 1000, 2, 5, 1e-9, np.random.default_rng(0))
    assert np.ptp([len(p) for p in equal]) <= 2  # σ → 0: every slot 35 samples, up to rounding


def test_fedprox_same_seed_reproduces_other_seed_differs():
    labels = np.repeat(np.arange(10), 1000)
    a, b, c = (fedprox_partition(labels, 100, 2, 5, 2.0, np.random.default_rng(seed)) for seed in (0, 0, 1))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert [len(x) for x in a] != [len(z) for z in c]


def test_fedprox_refuses_impossible_settings():
    labels = np.repeat(np.arange(10), 20)
    with pytest.raises(DataError, match=r"data.classes_per_client=11 exceeds the 10 classes.*at most 10"):
        fedprox_partition(labels, 10, 11, 5, 2.0, np.random.default_rng(0))
    with pytest.raises(
        DataError,
        match=r"Class 0 has 20 samples, too few for data.min_per_class=7 on each of the 3 clients .*\(3 x 7 = 21\)\. "
        r"Lower data.min_per_class, data.num_clients or data.classes_per_client",
    ):
        fedprox_partition(labels, 10, 3, 7, 2.0, np.random.default_rng(0))
    fedprox_partition(labels, 10, 3, 6, 2.0, np.random.default_rng(0))  # 3 x 6 = 18 fits


def test_fedprox_keys_are_read_and_checked_by_the_config():
    cfg = load_config(
        None,
        [
            "data.partition=fedprox",
            "data.classes_per_client=3",
            "data.min_per_class=10",
            "data.sigma=1.5",
            "data.test_fraction=0.1",
        ],
    )
    assert (cfg.data.classes_per_client, cfg.data.min_per_class, cfg.data.sigma) == (3, 10, 1.5)
    with pytest.raises(ConfigError, match=r"Config key 'data.sigma' must be a number > 0; got 0.0"):
        load_config(None, ["data.partition=fedprox", "data.sigma=0"])
    with pytest.raises(ConfigError, match=r"Config key 'data.min_per_class' must be an integer >= 1; got 0"):
        load_config(None, ["data.partition=fedprox", "data.min_per_class=0"])


def test_fedprox_through_the_loader(tmp_path):
    labels = np.repeat(np.arange(3), [40, 50, 60])
    data = load_federated_data(
        DataConfig(
            source="pfllib",
            root=str(write_pfllib(tmp_path / "d", [(labels[:75].tolist(), labels[75:].tolist())])),
            repartition=True,
            num_clients=6,
            partition="fedprox",
            classes_per_client=2,
            test_fraction=0.1,
        ),
        0,
    )
    assert len(data.clients) == 6
    for u, client in enumerate(data.clients):
        y = torch.cat([client.y_train, client.y_test])
        assert set(y.unique().tolist()) == {u % 3, (u + 1) % 3}
        assert client.num_test == int(np.ceil(0.1 * len(y)))
    assert sum(c.num_train + c.num_test for c in data.clients) == 150


@reads_shared_data(FEDALA_MNIST)
def test_fedprox_mnist_gives_fedprox_federation():
    cfg = DataConfig(
        source="pfllib",
        root=str(FEDALA_MNIST),
        repartition=True,
        num_clients=1000,
        partition="fedprox",
        classes_per_client=2,
        test_fraction=0.1,
    )
    data = load_federated_data(cfg, 0)
    assert len(data.clients) == 1000 and data.num_classes == 10
    sizes = []
    for u, client in enumerate(data.clients):
        y = torch.cat([client.y_train, client.y_test])
        assert set(y.unique().tolist()) == {u % 10, (u + 1) % 10}
        sizes.append(len(y))
    assert sum(sizes) == 70_000  # every MNIST sample, on one client each
    assert max(sizes) > 10 * np.median(sizes)


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
            r"data.repartition=true is read only by data.source=leaf or pfllib, not by data.source=mnist",
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
            r"data.classes_per_client=4 is read only by data.partition=classes or fedprox or pathological",
        ),
        (
            ["data.partition=dirichlet", "data.dominant_fraction=0.9"],
            r"data.dominant_fraction=0.9 is read only by data.partition=dominant, .*set data.partition=dominant",
        ),
        (
            ["data.partition=dirichlet", "data.sigma=1.5"],
            r"data.sigma=1.5 is read only by data.partition=fedprox, not by data.partition=dirichlet\. Remove "
            r"data.sigma \(or set its default, data.sigma=2.0\), or set data.partition=fedprox\.",
        ),
        (
            ["data.partition=pathological", "data.min_per_class=10"],
            r"data.min_per_class=10 is read only by data.partition=fedprox, not by data.partition=pathological",
        ),
        (
            ["data.source=pfllib", "data.sigma=1.5"],
            r"data.sigma=1.5 has no effect: data.source=pfllib keeps .*Set data.repartition=true",
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
