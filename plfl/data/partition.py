"""Splitting one pooled data set over clients, and each client into train/test.

Every function takes a ``numpy.random.Generator``: the same generator state
gives the same split. Index arrays refer to positions in ``labels``.
"""

from __future__ import annotations

import numpy as np
from sklearn.model_selection import train_test_split

from plfl.errors import DataError


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
    labels: np.ndarray, num_clients: int, classes_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Each client holds exactly ``classes_per_client`` (c) distinct classes.

    Client ``i`` gets classes ``sorted_classes[(i*c + j) mod K]`` for ``j < c``;
    each class's shuffled samples are split near-equally among the clients
    holding it. Samples of a class no client holds (``num_clients * c < K``)
    are left out.

    Args:
        labels: int array ``(n,)`` of class labels; K = number of distinct labels.
        num_clients: number of clients.
        classes_per_client: c, the classes per client.
        rng: source of randomness.

    Returns:
        ``num_clients`` disjoint int64 index arrays.

    Raises:
        DataError: ``c > K``, or a class has fewer samples than clients sharing it.
    """
    classes = np.unique(labels)
    k, c = len(classes), classes_per_client
    if c > k:
        raise DataError(
            f"data.classes_per_client={c} exceeds the {k} classes in the data set. "
            f"Set data.classes_per_client to at most {k}."
        )
    holders: list[list[int]] = [[] for _ in range(k)]
    for client in range(num_clients):
        for j in range(c):
            holders[(client * c + j) % k].append(client)
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
    n_test = min(max(int(np.ceil(test_fraction * n)), 1), n - 1)
    y = labels[indices]
    counts = np.unique(y, return_counts=True)[1]
    stratifiable = counts.min() >= 2 and min(n_test, n - n_test) >= len(counts)
    train, test = train_test_split(
        indices,
        test_size=n_test,
        stratify=y if stratifiable else None,
        random_state=int(rng.integers(2**32)),
    )
    return train, test
