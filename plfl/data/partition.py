"""Splitting one pooled data set over clients, each client into train/test, and a client's training split into
what it trains on and its validation split.

Every function takes a ``numpy.random.Generator``: the same generator state
gives the same split. Index arrays refer to positions in ``labels``. Each
partition ``data.partition`` names is a :class:`Partition`: the keys it reads
(``data.beta``, ...) and the function it calls, at the end of this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

import numpy as np

from plfl.errors import ConfigError, DataError
from plfl.fields import Component, checked, one_of, registry


def dirichlet_partition(
    labels: np.ndarray,
    num_clients: int,
    beta: float,
    min_samples: int,
    max_retries: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Label-skewed split: each class is divided over clients in Dir(β) proportions.

    As in PFLlib/FedALA: per class, shuffle its indices, draw proportions
    ~ Dir(β, ..., β) over clients and cut the indices at their cumulative sums;
    a client that already holds ``len(labels) / num_clients`` samples gets none
    of the next classes. The whole draw is repeated until every client has at
    least ``min_samples`` samples. Smaller β gives fewer classes per client.

    Args:
        labels: int array ``(n,)`` of class labels.
        num_clients: number of clients.
        beta: Dirichlet concentration, > 0.
        min_samples: fewest samples (train + test) any client may get.
        max_retries: most draws to try.
        rng: source of randomness.

    Returns:
        ``num_clients`` disjoint int64 index arrays covering all of ``labels``.

    Raises:
        DataError: ``num_clients * min_samples > n`` (impossible for any draw),
            or no draw in ``max_retries`` gave every client ``min_samples``.
    """
    n = len(labels)
    if num_clients * min_samples > n:
        raise DataError(
            f"Cannot give each of {num_clients} clients at least {min_samples} samples: the data set has "
            f"only {n} samples ({num_clients} x {min_samples} = {num_clients * min_samples}). "
            "Lower data.num_clients or data.min_samples."
        )
    by_class = [np.flatnonzero(labels == k) for k in np.unique(labels)]
    fair_share = n / num_clients
    for _ in range(max_retries):
        chunks: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for idx in by_class:
            idx = rng.permutation(idx)
            p = rng.dirichlet(np.full(num_clients, beta))
            capped = p * (sizes < fair_share)
            # With tiny β all the mass can fall on capped clients; keep the raw draw then.
            if capped.sum() > 0:
                p = capped / capped.sum()
            cuts = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
            for client, part in enumerate(np.split(idx, cuts)):
                chunks[client].append(part)
                sizes[client] += len(part)
        if sizes.min() >= min_samples:
            return [np.concatenate(c) for c in chunks]
    raise DataError(
        f"The Dirichlet partition (beta={beta}) gave some client fewer than {min_samples} samples in all "
        f"{max_retries} draws over {num_clients} clients and {n} samples. Raise data.beta (less skew), "
        "lower data.num_clients or data.min_samples, or raise data.max_retries."
    )


def pathological_partition(
    labels: np.ndarray,
    num_clients: int,
    classes_per_client: int,
    rng: np.random.Generator,
    class_stride: Optional[int] = None,
) -> list[np.ndarray]:
    """Each client holds exactly ``classes_per_client`` (c) distinct classes.

    Client ``i`` gets classes ``sorted_classes[(i*s + j) mod K]`` for ``j < c``,
    s = ``class_stride`` (default c: consecutive clients hold consecutive
    blocks of c classes); each class's shuffled samples are split near-equally
    among the clients holding it. A stride below c makes neighbours overlap:
    with s = 1, clients i and i + 1 share c - 1 classes (pFedLA, Ma et al.,
    CVPR 2022, Sec. 4.3 and Fig. 6: 8 clients of 4 classes each, adjacent ids
    sharing 3). Samples of a class no client holds are left out.

    Args:
        labels: int array ``(n,)`` of class labels; K = number of distinct labels.
        num_clients: number of clients.
        classes_per_client: c, the classes per client.
        rng: source of randomness.
        class_stride: s >= 1, the shift of the first class from one client to the next; None: c.

    Returns:
        ``num_clients`` disjoint int64 index arrays.

    Raises:
        DataError: ``c > K``, or a class has fewer samples than clients sharing it.
    """
    classes = np.unique(labels)
    k, c = len(classes), classes_per_client
    stride = c if class_stride is None else class_stride
    if c > k:
        raise DataError(
            f"data.classes_per_client={c} exceeds the {k} classes in the data set. "
            f"Set data.classes_per_client to at most {k}."
        )
    holders: list[list[int]] = [[] for _ in range(k)]
    for client in range(num_clients):
        for j in range(c):
            holders[(client * stride + j) % k].append(client)
    chunks: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for cls, owners in zip(classes, holders):
        if not owners:
            continue
        idx = rng.permutation(np.flatnonzero(labels == cls))
        if len(idx) < len(owners):
            raise DataError(
                f"Class {cls} has {len(idx)} samples but {len(owners)} clients share it in the pathological "
                "partition. Lower data.num_clients or data.classes_per_client."
            )
        for client, part in zip(owners, np.array_split(idx, len(owners))):
            chunks[client].append(part)
    return [np.concatenate(ch) for ch in chunks]


def classes_partition(
    labels: np.ndarray, num_clients: int, classes_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """pFedLA's non-IID_1: each client holds ``classes_per_client`` (c) random classes, equally many of each.

    Every client draws its c distinct classes uniformly, independently of the
    other clients (so a class may be held by several clients, or by none). A
    class held by h clients can give each of them ``n_class // h`` samples;
    the smallest of these over the held classes, s, is what every client gets
    of each of its classes. So all clients hold ``c * s`` samples, ``s`` per
    class (pFedLA, Ma et al., CVPR 2022: "the same amount of data on each
    class", Sec. 4.1, and all clients "have the same amount of training
    data", Sec. 4.2). FL-bench's ``randomly_assign_classes`` draws the classes
    the same way but gives each holder ``n_class // h`` of its class, so there
    the amounts differ between classes. Left unused: the samples of classes no
    client holds, and of each held class all but ``h * s``.

    Args:
        labels: int array ``(n,)`` of class labels; K = number of distinct labels.
        num_clients: number of clients (N).
        classes_per_client: c, distinct classes per client.
        rng: source of randomness.

    Returns:
        ``num_clients`` disjoint int64 index arrays of ``c * s`` samples each.

    Raises:
        DataError: ``c > K``, or the draw puts more clients on some class than it has samples.
    """
    classes, counts = np.unique(labels, return_counts=True)
    held = _draw_classes(len(classes), num_clients, classes_per_client, "classes_per_client", rng)
    holders = held.sum(axis=0)
    shares = np.where(holders > 0, counts // np.maximum(holders, 1), counts.max())
    tightest = int(np.argmin(shares))
    if shares[tightest] == 0:
        raise DataError(
            f"Class {classes[tightest]} has {counts[tightest]} samples but {holders[tightest]} clients hold it in "
            f"the classes partition (each client draws {classes_per_client} classes at random; the draw depends on "
            "federation.seed). Lower data.num_clients or data.classes_per_client."
        )
    return _take_quotas(labels, classes, held, int(shares[tightest]), 0, rng)


def dominant_partition(
    labels: np.ndarray,
    num_clients: int,
    dominant_classes: int,
    dominant_fraction: float,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """pFedLA's non-IID_2: every client holds every class, ``dominant_classes`` of them in larger numbers.

    Each client draws d = ``dominant_classes`` distinct classes uniformly,
    independently of the other clients. Every client gets ``a`` samples of
    each of its d classes and ``b`` of each of the other K - d classes, so
    its d classes hold ``d a / (d a + (K - d) b)`` ≈ ``dominant_fraction``
    (f) of its samples. m, the client size, is the largest the data allow: a
    class that h clients favour must supply ``m (h f / d + (N - h) (1 - f) /
    (K - d))`` samples. Then ``b = floor(m (1 - f) / (K - d))`` and ``a`` is
    the integer nearest ``b (K - d) f / (d (1 - f))``, at most ``m f / d``.
    pFedLA (Ma et al., CVPR 2022, Sec. 4.1) says only that two classes (of
    10) have more samples than the others; f = 0.8 is the dominant share of
    FedAMP's practical non-IID setting (Huang et al., AAAI 2021, pFedLA's
    reference [15]). Left unused: what a class has beyond ``h a + (N - h)
    b``, most of all in the classes that few clients favour.

    Args:
        labels: int array ``(n,)`` of class labels; K = number of distinct labels.
        num_clients: number of clients (N).
        dominant_classes: d, in [1, K).
        dominant_fraction: f, the share of a client's samples in its d classes, in (d / K, 1).
        rng: source of randomness.

    Returns:
        ``num_clients`` disjoint int64 index arrays of ``d a + (K - d) b`` samples each.

    Raises:
        DataError: ``d >= K``, ``f <= d / K`` (the classes would not dominate),
            or too few samples for one of each class on every client.
    """
    classes, counts = np.unique(labels, return_counts=True)
    k, d = len(classes), dominant_classes
    if d >= k:
        raise DataError(
            f"data.dominant_classes={d} leaves no other classes: the data set has {k} classes. "
            f"Set data.dominant_classes to at most {k - 1}."
        )
    if dominant_fraction * k <= d:
        raise DataError(
            f"data.dominant_fraction={dominant_fraction} does not favour the {d} dominant classes: spread evenly, "
            f"{d} of {k} classes already hold {d / k:.3g} of the samples. Set data.dominant_fraction above {d / k:.3g}."
        )
    held = _draw_classes(k, num_clients, d, "dominant_classes", rng)
    # Exact arithmetic: a size rounded up by float error could ask a class for a sample it lacks.
    f = Fraction(dominant_fraction)
    holders = held.sum(axis=0)
    per_size = [h * f / d + (num_clients - h) * (1 - f) / (k - d) for h in holders]
    sizes = [Fraction(int(n)) / p for n, p in zip(counts, per_size)]
    tightest = min(range(k), key=sizes.__getitem__)
    size = sizes[tightest]
    b = int(size * (1 - f) / (k - d))
    if b == 0:
        raise DataError(
            f"The dominant partition can give each client only {float(size):.0f} samples, too few for one sample "
            f"of each of its {k - d} other classes at data.dominant_fraction={dominant_fraction}: class "
            f"{classes[tightest]} has {counts[tightest]} samples for {num_clients} clients and dominates "
            f"{holders[tightest]} of them. Lower data.num_clients or data.dominant_fraction."
        )
    # a from b rather than from the size: flooring a small b would otherwise push the fraction well above f.
    a = min(int(size * f / d), round(b * (k - d) * f / (d * (1 - f))))
    return _take_quotas(labels, classes, held, a, b, rng)


def _draw_classes(k: int, num_clients: int, per_client: int, key: str, rng: np.random.Generator) -> np.ndarray:
    """Bool ``(num_clients, k)``: row i marks the ``per_client`` distinct classes client i drew uniformly."""
    if per_client > k:
        raise DataError(
            f"data.{key}={per_client} exceeds the {k} classes in the data set. Set data.{key} to at most {k}."
        )
    held = np.zeros((num_clients, k), dtype=bool)
    for row in held:
        row[rng.choice(k, per_client, replace=False)] = True
    return held


def _take_quotas(
    labels: np.ndarray,
    classes: np.ndarray,
    held: np.ndarray,
    quota_held: int,
    quota_other: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Deal each class's shuffled samples out: ``quota_held`` to every client marked in ``held``, ``quota_other``
    to every other client; what is left of the class is unused (the caller checks that the quotas fit)."""
    chunks: list[list[np.ndarray]] = [[] for _ in range(len(held))]
    for j, cls in enumerate(classes):
        quotas = np.where(held[:, j], quota_held, quota_other)
        idx = rng.permutation(np.flatnonzero(labels == cls))[: quotas.sum()]
        for client, part in enumerate(np.split(idx, np.cumsum(quotas)[:-1])):
            chunks[client].append(part)
    return [np.concatenate(ch).astype(np.int64) for ch in chunks]


def fedprox_partition(
    labels: np.ndarray,
    num_clients: int,
    classes_per_client: int,
    min_per_class: int,
    sigma: float,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """FedProx's MNIST federation: c consecutive classes per client, sample counts following a power law.

    Client u holds the c = ``classes_per_client`` classes ``sorted_classes[(u + j) mod K]``, j < c: its slots
    (u, j). Every slot first gets ``min_per_class`` (m) samples of its class; the rest of a class, ``n_class - m
    h`` for its h slots, is divided over those slots in proportions w / sum(w), w ~ lognormal(0, σ) drawn per slot
    and normalised per class, so that a few clients hold most of the samples. The share of a slot is rounded down
    and the samples left over go one each to the slots with the largest remainders, so every sample of a class
    some client holds is used. Each class's samples are shuffled before being cut. Samples of a class no client
    holds (``num_clients * c < K``) are left out.

    FedProx (Li et al., MLSys 2020; its ``data/mnist/generate_niid.py``: 1000 clients, c = 2, m = 5,
    σ = 2, 10 % of each client for test) builds its MNIST so; Self-FL (Chen et al., NeurIPS 2022, Sec. 4.1)
    runs on it. The reference rounds each share down (``int``) and leaves the samples that rounding drops unused.
    pFedMe's CIFAR-10 federation (Dinh et al., NeurIPS 2020) draws the same way with c = 3 and m = 10 and adds a
    uniform random count to every slot; plfl leaves that count out.

    Args:
        labels: int array ``(n,)`` of class labels; K = number of distinct labels.
        num_clients: number of clients (N).
        classes_per_client: c, in [1, K].
        min_per_class: m >= 1, samples of each of its classes that every client gets at least.
        sigma: σ > 0 of the lognormal weights; larger is more skewed.
        rng: source of randomness.

    Returns:
        ``num_clients`` disjoint int64 index arrays, together every sample of the held classes.

    Raises:
        DataError: ``c > K``, or a class has fewer than ``m h`` samples for its h slots.
    """
    classes, counts = np.unique(labels, return_counts=True)
    k, c = len(classes), classes_per_client
    if c > k:
        raise DataError(
            f"data.classes_per_client={c} exceeds the {k} classes in the data set. "
            f"Set data.classes_per_client to at most {k}."
        )
    owners = np.repeat(np.arange(num_clients), c)  # slot (u, j) at row u * c + j
    slot_class = (owners + np.tile(np.arange(c), num_clients)) % k
    # Normal draws, exponentiated per class after subtracting the class's largest: lognormal weights that no σ
    # overflows.
    log_weights = rng.normal(0.0, sigma, len(owners))
    chunks: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for j, (cls, n) in enumerate(zip(classes, counts)):
        slots = np.flatnonzero(slot_class == j)
        if len(slots) == 0:
            continue
        if n < min_per_class * len(slots):
            raise DataError(
                f"Class {cls} has {n} samples, too few for data.min_per_class={min_per_class} on each of the "
                f"{len(slots)} clients holding it in the fedprox partition ({len(slots)} x {min_per_class} = "
                f"{len(slots) * min_per_class}). Lower data.min_per_class, data.num_clients or "
                "data.classes_per_client."
            )
        z = log_weights[slots]
        w = np.exp(z - z.max())
        shares = (n - min_per_class * len(slots)) * (w / w.sum())
        extra = np.floor(shares).astype(np.int64)
        left = int(n - min_per_class * len(slots) - extra.sum())
        extra[np.argsort(extra - shares, kind="stable")[:left]] += 1  # largest remainders first
        idx = rng.permutation(np.flatnonzero(labels == cls))
        for client, part in zip(owners[slots], np.split(idx, np.cumsum(min_per_class + extra)[:-1])):
            chunks[client].append(part)
    return [np.concatenate(ch).astype(np.int64) for ch in chunks]


def iid_partition(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle all indices and cut them into ``num_clients`` near-equal parts.

    Args:
        labels: array ``(n,)``; only its length is used.

    Returns:
        ``num_clients`` disjoint int64 index arrays covering all of ``labels``.

    Raises:
        DataError: fewer samples than clients.
    """
    n = len(labels)
    if n < num_clients:
        raise DataError(f"Cannot split {n} samples over {num_clients} clients. Lower data.num_clients.")
    return np.array_split(rng.permutation(n), num_clients)


def split_train_test(
    indices: np.ndarray, labels: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Split one client's samples into train and test index arrays.

    ``ceil(test_fraction * n)`` samples (clamped to ``[1, n-1]``) go to test.
    The split is stratified by label when every class present has at least 2
    samples and both sides can hold one of each class; otherwise it is a plain
    random split.

    Args:
        indices: the client's int index array ``(n,)`` into ``labels``.
        labels: int array of all labels.
        test_fraction: fraction in (0, 1) held out for test.
        rng: source of randomness.

    Returns:
        ``(train_idx, test_idx)``, disjoint, each non-empty, together ``indices``.

    Raises:
        DataError: ``n < 2`` (cannot have both a train and a test sample).
    """
    n = len(indices)
    if n < 2:
        raise DataError(
            f"A client has {n} sample(s); it needs at least 2 to hold out a test sample. "
            "Lower data.num_clients (or, for the Dirichlet partition, raise data.min_samples)."
        )
    return _hold_out(indices, labels, test_fraction, rng)


def split_train_val(
    indices: np.ndarray, labels: np.ndarray, val_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Split one client's training samples into what it trains on and its validation split (``data.val_fraction``),
    as :func:`split_train_test` splits train from test: ``ceil(val_fraction * n)`` samples (clamped to
    ``[1, n-1]``), stratified by label where possible. Both index arrays come back sorted.

    Args:
        indices: the client's int index array ``(n,)`` into ``labels``: its training split.
        labels: int array of the labels ``indices`` point into.
        val_fraction: fraction in (0, 1) held out for validation.
        rng: source of randomness.

    Returns:
        ``(train_idx, val_idx)``, disjoint, each non-empty and sorted, together ``indices``.

    Raises:
        DataError: ``n < 2`` (cannot keep a training sample and hold out a validation one).
    """
    n = len(indices)
    if n < 2:
        raise DataError(
            f"A client has {n} training sample(s); data.val_fraction={val_fraction} needs at least 2, one to train "
            "on and one to hold out. Set data.val_fraction=0, or give every client more samples (a partitioned "
            "source: lower data.num_clients)."
        )
    kept, held = _hold_out(indices, labels, val_fraction, rng)
    return np.sort(kept), np.sort(held)


def _hold_out(
    indices: np.ndarray, labels: np.ndarray, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``(kept, held)``: ``ceil(fraction * n)`` of ``indices`` (n >= 2; clamped to ``[1, n-1]``) held out,
    stratified by label when every class present has at least 2 samples and both sides can hold one of each
    class, else at random; one draw from ``rng``."""
    from sklearn.model_selection import train_test_split  # scikit-learn's import is slow: only when splitting

    n = len(indices)
    n_held = min(max(int(np.ceil(fraction * n)), 1), n - 1)
    y = labels[indices]
    counts = np.unique(y, return_counts=True)[1]
    stratifiable = counts.min() >= 2 and min(n_held, n - n_held) >= len(counts)
    kept, held = train_test_split(
        indices,
        test_size=n_held,
        stratify=y if stratifiable else None,
        random_state=int(rng.integers(2**32)),
    )
    return kept, held


@dataclass
class Partition(Component):
    """How a pooled data set is split over clients (``data.partition``) and each client into train and test:
    the keys every partition reads; a subclass adds its own and :meth:`split` calls its function."""

    partition: str = one_of(
        "dirichlet",
        lambda: tuple(partitions()),
        "how a pooled data set is split over clients: Dirichlet label skew, pathological (c classes each, "
        "disjoint samples), classes (pFedLA's non-IID_1), dominant (pFedLA's non-IID_2), fedprox (FedProx's MNIST: "
        "c classes each, power-law sizes), iid",
    )
    test_fraction: float = checked(
        0.25, lambda v: 0 < v < 1, "a number in (0, 1)", "share of each client's samples held out as its test split"
    )

    def split(self, labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
        """The clients' index arrays into ``labels`` (n,).

        Raises:
            DataError: the partition is impossible with these keys (the message names the key to change).
        """
        raise NotImplementedError


@dataclass
class Dirichlet(Partition):
    choice = "dirichlet"
    beta: float = checked(0.1, lambda v: v > 0, "a number > 0", "dirichlet: concentration β; smaller is more skewed")
    min_samples: int = checked(
        10, lambda v: v >= 2, "an integer >= 2", "dirichlet: every client gets at least this many samples"
    )
    max_retries: int = checked(
        100, lambda v: v >= 1, "an integer >= 1", "dirichlet: draws tried before giving up on min_samples"
    )

    def split(self, labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
        return dirichlet_partition(labels, num_clients, self.beta, self.min_samples, self.max_retries, rng)


@dataclass
class ClassesPerClient(Partition):
    """A partition that gives every client ``classes_per_client`` classes."""

    classes_per_client: int = checked(
        2, lambda v: v >= 1, "an integer >= 1", "pathological, classes and fedprox: distinct classes per client (c)"
    )


@dataclass
class Pathological(ClassesPerClient):
    choice = "pathological"
    class_stride: Optional[int] = checked(
        None,
        lambda v: v is None or v >= 1,
        "null or an integer >= 1",
        "pathological: client i holds classes (i × stride + j) mod K, j < c; null: c (disjoint blocks of c "
        "classes); 1: neighbouring clients share c − 1 classes (pFedLA's Fig. 6)",
    )

    def split(self, labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
        return pathological_partition(labels, num_clients, self.classes_per_client, rng, self.class_stride)


@dataclass
class Classes(ClassesPerClient):
    choice = "classes"

    def split(self, labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
        return classes_partition(labels, num_clients, self.classes_per_client, rng)


@dataclass
class FedProxPartition(ClassesPerClient):
    """FedProx's MNIST federation (:func:`fedprox_partition`); the method is :mod:`plfl.methods.fedprox`."""

    choice = "fedprox"
    min_per_class: int = checked(
        5, lambda v: v >= 1, "an integer >= 1", "fedprox: samples of each of its classes every client gets first"
    )
    sigma: float = checked(
        2.0,
        lambda v: v > 0,
        "a number > 0",
        "fedprox: σ of the lognormal(0, σ) shares of the rest of each class; larger is more skewed",
    )

    def split(self, labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
        return fedprox_partition(labels, num_clients, self.classes_per_client, self.min_per_class, self.sigma, rng)


@dataclass
class Dominant(Partition):
    choice = "dominant"
    dominant_classes: int = checked(
        2, lambda v: v >= 1, "an integer >= 1", "dominant: classes per client that hold dominant_fraction of it (d)"
    )
    dominant_fraction: float = checked(
        0.8,
        lambda v: 0 < v < 1,
        "a number in (0, 1)",
        "dominant: share of a client's samples from its dominant classes (f; 0.8 is FedAMP's practical non-IID)",
    )

    def split(self, labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
        return dominant_partition(labels, num_clients, self.dominant_classes, self.dominant_fraction, rng)


@dataclass
class IID(Partition):
    choice = "iid"

    def split(self, labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
        return iid_partition(labels, num_clients, rng)


def partitions() -> dict[str, type[Partition]]:
    """``data.partition`` → its :class:`Partition`."""
    return registry(Partition)


# Flower Datasets' partitioners (data.partition=flwr) ----------------------------------------------------------------

_FLOWER_INDEX = "__plfl_index__"  # the column of each row's position in the pool, read back from the partitions
# Classes of flwr_datasets.partitioner that a config cannot drive: the base class, the one that needs a callable,
# and the vertical ones, which split columns rather than samples.
_FLOWER_UNUSABLE = ("Partitioner", "IdToSizeFncPartitioner", "VerticalEvenPartitioner", "VerticalSizePartitioner")


@dataclass
class Flower(Partition):
    """A partitioner of Flower Datasets (``flwr_datasets.partitioner``, flwr-datasets >= 0.6), by class name.

    The partitioner partitions a ``datasets.Dataset`` plfl builds from the pool: the column ``label`` (the
    labels), the source's column that ``partition_by`` names when it is another (``data.source=hf`` hands over
    its per-sample columns, e.g. FEMNIST's ``writer_id`` for ``NaturalIdPartitioner``), and each row's position.
    The rows are shuffled first, as Flower's ``FederatedDataset`` shuffles a split before partitioning it: the
    IID and size-based partitioners cut contiguous blocks, which on a pool in class order would be class blocks.
    Partition i is client i; plfl then splits each client into train and test like every partition.
    """

    choice = "flwr"
    partitioner: Optional[str] = checked(
        None,
        lambda v: v is None or v.isidentifier(),
        "null or a class name of flwr_datasets.partitioner",
        "flwr: a Flower Datasets partitioner by class name (DirichletPartitioner, PathologicalPartitioner, "
        "ShardPartitioner, IidPartitioner, NaturalIdPartitioner, ...); needs pip install -e '.[hf]'",
    )
    partitioner_args: Optional[dict] = checked(
        None,
        lambda v: v is None or "num_partitions" not in v,
        "null or a mapping of keyword arguments without num_partitions (data.num_clients gives it)",
        "flwr: the partitioner's keyword arguments, e.g. {alpha: 0.5}; num_partitions is data.num_clients, "
        "partition_by defaults to label (the classes), seed is drawn from federation.seed unless given",
    )

    def check(self) -> None:
        if self.partitioner is None:
            raise ConfigError(
                "data.partition=flwr needs data.partitioner: the class name of a Flower Datasets partitioner, e.g. "
                "data.partitioner=DirichletPartitioner with data.partitioner_args={alpha: 0.5}."
            )

    def split(
        self,
        labels: np.ndarray,
        num_clients: int,
        rng: np.random.Generator,
        columns: Optional[Mapping[str, np.ndarray]] = None,
        num_clients_set: bool = True,
    ) -> list[np.ndarray]:
        """The partitions of ``data.partitioner`` (with ``data.partitioner_args``) as index arrays into ``labels``.

        Draws from ``rng``, in this order: the seed of the rows' shuffle (``datasets.Dataset.shuffle``), then the
        partitioner's ``seed`` when it takes one and ``data.partitioner_args`` gives none.

        Args:
            labels: int ``(n,)``, the data set's column ``label``.
            num_clients: the partitioner's ``num_partitions``, when it takes one.
            rng: source of the seeds.
            columns: further per-sample columns ``(n,)`` by name; the one ``partition_by`` names joins the data set.
            num_clients_set: whether ``data.num_clients`` was set: a partitioner that fixes its own count
                (``NaturalIdPartitioner``: one per id) must then agree with it; unset, its count stands.

        Returns:
            One int64 index array per partition, partition i being client i.

        Raises:
            ConfigError: flwr-datasets is not installed; ``data.partitioner`` names no usable partitioner (the
                message lists them); ``data.partitioner_args`` do not fit it; ``partition_by`` names no column.
            DataError: the partitioner cannot partition these labels (its own message), or its count of partitions
                differs from a set ``data.num_clients``.
        """
        import inspect

        name, cls = self.partitioner, _flower_partitioners().get(self.partitioner)
        if cls is None:
            raise ConfigError(
                f"data.partitioner={name} is not a Flower Datasets partitioner plfl can run. Set it to one of: "
                f"{', '.join(_flower_partitioners())}."
            )
        params = inspect.signature(cls).parameters
        args = {key: _plain(value) for key, value in (self.partitioner_args or {}).items()}
        for key, value in args.items():  # a list where only an array will do (DistributionPartitioner)
            hint = str(params[key].annotation) if key in params else ""
            if isinstance(value, list) and "ndarray" in hint.lower() and "list" not in hint:
                args[key] = np.asarray(value)
        if "num_partitions" in params:
            args["num_partitions"] = num_clients
        if "partition_by" in params:
            args.setdefault("partition_by", "label")
        shuffle_seed = int(rng.integers(2**32))
        if "seed" in params and "seed" not in args:
            args["seed"] = int(rng.integers(2**32))
        unknown = [key for key in args if key not in params]
        try:
            if unknown:
                raise TypeError(f"it takes no keyword {', '.join(map(repr, unknown))}")
            inspect.signature(cls).bind(**args)
            partitioner = cls(**args)
        except (TypeError, ValueError) as e:
            keywords = ", ".join(p if p != "num_partitions" else "num_partitions (data.num_clients)" for p in params)
            raise ConfigError(
                f"data.partitioner_args do not fit {name} ({e}). Its keyword arguments: {keywords}."
            ) from None
        table = {"label": labels}
        by = args.get("partition_by", "label")
        if by != "label":
            if by not in (columns or {}):
                raise ConfigError(
                    f"data.partitioner_args.partition_by={by} names no column of the pool: it has "
                    f"{', '.join(['label (the classes)', *(columns or {})])}. data.source=hf hands over its data "
                    "set's other class, integer and string columns; the other sources have label only."
                )
            table[by] = np.asarray(columns[by])
        table[_FLOWER_INDEX] = np.arange(len(labels))
        import datasets

        partitioner.dataset = datasets.Dataset.from_dict(table).shuffle(seed=shuffle_seed)
        try:
            count = partitioner.num_partitions
            if "num_partitions" not in params and num_clients_set and count != num_clients:
                raise DataError(
                    f"{name} makes {count} partitions but data.num_clients={num_clients}. Remove data.num_clients "
                    f"(the partitioner sets the count) or set it to {count}."
                )
            return [
                partitioner.load_partition(i).with_format("arrow")[_FLOWER_INDEX].to_numpy().astype(np.int64)
                for i in range(count)
            ]
        except (ValueError, KeyError, IndexError) as e:
            raise DataError(
                f"{name} could not partition the {len(labels)} samples ({type(e).__name__}: {e}). Change "
                "data.partitioner_args or data.num_clients."
            ) from None


def _flower_partitioners() -> dict[str, type]:
    """Class name → class of the partitioners in ``flwr_datasets.partitioner`` that a config can drive, sorted.

    Raises:
        ConfigError: flwr-datasets is not installed.
    """
    try:
        from flwr_datasets import partitioner
    except ImportError:
        raise ConfigError(
            "data.partition=flwr runs Flower Datasets' partitioners, and flwr-datasets is not installed. Install "
            "plfl's hf extra: pip install -e '.[hf]' (in plfl's directory)."
        ) from None
    found = {
        name: cls
        for name, cls in vars(partitioner).items()
        if isinstance(cls, type) and issubclass(cls, partitioner.Partitioner) and name not in _FLOWER_UNUSABLE
    }
    return dict(sorted(found.items()))


def _plain(value: object) -> object:
    """A config value (OmegaConf's DictConfig, ListConfig) as plain dicts and lists, for a partitioner's arguments."""
    if isinstance(value, Mapping):
        return {key: _plain(v) for key, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(v) for v in value]
    return value
