"""Per-client evaluation results → federation-level metrics."""

from __future__ import annotations

import math

import numpy as np

from plfl.tasks import EvalResult

WORST_FRACTION = 0.1


def federation_metrics(results: dict[int, EvalResult]) -> dict[str, float]:
    """Summaries of every client's model on its own test split.

    Returns:
        Accuracies as fractions in [0, 1]: ``accuracy``, total correct / total test samples over all clients
        (the papers' "averaged accuracy"); ``client_accuracy_mean`` and ``client_accuracy_std``, the unweighted
        mean and (population) std over the clients that have test samples; ``worst10_accuracy``, the mean
        accuracy of the worst ⌈10 %⌉ of those clients; and ``test_loss``, the sample-weighted mean
        cross-entropy.

    Raises:
        ValueError: no results, or no test samples at all.
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
        "test_loss": sum(r.loss * r.total for r in results.values() if r.total) / total,
    }


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
