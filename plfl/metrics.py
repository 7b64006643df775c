"""Per-client evaluation results → federation-level metrics."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import numpy as np

from plfl.tasks import EvalResult

WORST_FRACTION = 0.1
LARGEST_FRACTION = 0.1


def federation_metrics(results: Mapping[int, EvalResult], sizes: Mapping[int, int]) -> dict[str, float]:
    """Summaries of every client's model on its own test split.

    ``results``: client id → its model's result on its test split; ``sizes``: client id → the client's
    samples, train + test (every client in ``results`` that has test samples needs one).

    Returns:
        Accuracies as fractions in [0, 1]: ``accuracy``, total correct / total test samples over all clients
        (the papers' "averaged accuracy"); ``client_accuracy_mean`` and ``client_accuracy_std``, the unweighted
        mean and (population) std over the clients that have test samples; ``worst10_accuracy``, the mean
        accuracy of the worst ⌈10 %⌉ of those clients (Self-FL, Chen et al., NeurIPS 2022, Table 1: "worst
        10 % clients' average test accuracy"); ``largest10_accuracy``, the sample-weighted accuracy of the
        ⌈10 %⌉ of those clients with the most samples (see :func:`largest_accuracy`); and ``test_loss``, the
        sample-weighted mean cross-entropy.

    Raises:
        ValueError: no results, no test samples at all, or a client with test samples missing from ``sizes``.
    """
    total = sum(r.total for r in results.values())
    if not results or total == 0:
        raise ValueError("no client test samples to evaluate")
    accuracies = np.sort([r.accuracy for r in results.values() if r.total])
    return {
        "accuracy": sum(r.correct for r in results.values()) / total,
        "client_accuracy_mean": float(accuracies.mean()),
        "client_accuracy_std": float(accuracies.std()),
        "worst10_accuracy": tail_means(accuracies)[0],
        "largest10_accuracy": largest_accuracy(results, sizes),
        "test_loss": sum(r.loss * r.total for r in results.values() if r.total) / total,
    }


def hurt_fraction(personal: Mapping[int, EvalResult], global_: Mapping[int, EvalResult]) -> float:
    """The fraction of clients whose personalized model is less accurate on their test split than the global
    model (Motley, Wu et al., 2022: the clients that personalization hurts); over the clients of ``personal``
    that have test samples, each needing its ``global_`` result on the same split.

    Raises:
        ValueError: no client has test samples.
    """
    tested = [i for i, r in personal.items() if r.total]
    if not tested:
        raise ValueError("no client test samples to evaluate")
    return sum(personal[i].accuracy < global_[i].accuracy for i in tested) / len(tested)


def selected_round(rows: Iterable[Mapping[str, Any]]) -> Optional[tuple[int, float]]:
    """The round chosen on validation data and its test accuracy: ``(round, accuracy)`` of the row with the
    highest ``val_accuracy``, the earliest of equal ones; None when no row has a (non-NaN) ``val_accuracy``.

    ``rows``: metrics.csv rows in round order (dicts with ``round``, ``accuracy`` and, in evaluated rounds of a
    run with validation splits, ``val_accuracy``; other rows are skipped). The rule of pFL-Bench (Chen et al.,
    NeurIPS 2022) and Motley (Wu et al., 2022): the round is selected without looking at the test data, unlike
    the best test accuracy over rounds (``best_accuracy``), which is optimistic.
    """
    best: Optional[Mapping[str, Any]] = None
    for row in rows:
        value = row.get("val_accuracy")
        if value is None or math.isnan(value):
            continue
        if best is None or value > best["val_accuracy"]:
            best = row
    return None if best is None else (int(best["round"]), float(best["accuracy"]))


def tail_means(accuracies) -> tuple[float, float]:
    """Mean accuracy of the worst and of the best ⌈10 %⌉ of ``accuracies``.

    ``accuracies``: one fraction in [0, 1] per client that has test samples, any order.

    Raises:
        ValueError: ``accuracies`` is empty.
    """
    ordered = np.sort(np.asarray(accuracies, dtype=float))
    if not ordered.size:
        raise ValueError("no client accuracies")
    tail = math.ceil(WORST_FRACTION * ordered.size)
    return float(ordered[:tail].mean()), float(ordered[-tail:].mean())


def largest_clients(sizes: Mapping[int, int], clients) -> list[int]:
    """The ⌈10 %⌉ of ``clients`` (ids) with the most samples by ``sizes``, largest first; of clients with
    equal sizes the lower id comes first. At least one client whenever ``clients`` is not empty (⌈10 %⌉ of
    1..10 clients is 1).

    Raises:
        ValueError: a client of ``clients`` is missing from ``sizes``.
    """
    clients = list(clients)
    missing = [i for i in clients if i not in sizes]
    if missing:
        raise ValueError(f"no sample count for clients {missing}")
    count = math.ceil(LARGEST_FRACTION * len(clients))
    return sorted(clients, key=lambda i: (-sizes[i], i))[:count]


def largest_accuracy(results: Mapping[int, EvalResult], sizes: Mapping[int, int]) -> float:
    """Test accuracy of the clients with the most samples: total correct / total test samples over the
    :func:`largest_clients` among the clients in ``results`` that have test samples, ranked by ``sizes``
    (client id → train + test samples). Self-FL (Chen et al., NeurIPS 2022), Table 1: "weighted test
    accuracy of the clients that have top 10 % most samples". A fraction in [0, 1].

    Raises:
        ValueError: no client has test samples, or one that has is missing from ``sizes``.
    """
    tested = [i for i, r in results.items() if r.total]
    if not tested:
        raise ValueError("no client test samples to evaluate")
    largest = largest_clients(sizes, tested)
    return sum(results[i].correct for i in largest) / sum(results[i].total for i in largest)
