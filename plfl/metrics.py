"""Per-client evaluation results → federation-level metrics."""

from __future__ import annotations

import math

import numpy as np

from plfl.client import EvalResult

WORST_FRACTION = 0.1


def federation_metrics(results: dict[int, EvalResult]) -> dict[str, float]:
    """Summaries of every client's model on its own test split.

    Returns (accuracies are fractions in [0, 1]):
        accuracy: total correct / total test samples over all clients (the papers' "averaged accuracy");
        client_accuracy_mean / client_accuracy_std: unweighted mean and (population) std over
            the clients that have test samples;
        worst10_accuracy: mean accuracy of the worst ⌈10 %⌉ of those clients;
        test_loss: sample-weighted mean cross-entropy.

    Raises:
        ValueError: no results, or no test samples at all.
    """
    total = sum(r.total for r in results.values())
    if not results or total == 0:
        raise ValueError("no client test samples to evaluate")
    accuracies = np.sort([r.accuracy for r in results.values() if r.total])
    worst = accuracies[: math.ceil(WORST_FRACTION * len(accuracies))]
    return {
        "accuracy": sum(r.correct for r in results.values()) / total,
        "client_accuracy_mean": float(accuracies.mean()),
        "client_accuracy_std": float(accuracies.std()),
        "worst10_accuracy": float(worst.mean()),
        "test_loss": sum(r.loss * r.total for r in results.values() if r.total) / total,
    }
