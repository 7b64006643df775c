"""The federation callback interface: cross-cutting concerns outside the loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from plfl.tasks import TrainResult


@dataclass
class RunInfo:
    """What a callback learns when a run starts."""

    config: DictConfig  # the resolved, validated config
    run_dir: Path
    num_clients: int
    num_parameters: int  # scalars in the global model
    # Rounds finished before this start (restored from a checkpoint by plfl fit --resume); empty for a new run.
    history: list[RoundResult] = field(default_factory=list)


@dataclass
class RoundResult:
    """Everything measured in one round (round 0: the initial model, no training).

    ``metrics`` is one row of metrics.csv: ``round``, the accuracy metrics of
    :func:`plfl.metrics.federation_metrics` (absent when the round was not
    evaluated), ``best_accuracy``/``best_round`` so far, ``train_loss`` (mean
    local training loss, sample-weighted), ``seconds`` (wall time),
    ``params_sent``/``params_received`` (scalars the server sent/received),
    ``bytes_sent``/``bytes_received`` (their size), ``global_accuracy`` when
    the method has a global model to evaluate, and the method's own statistics.
    ``clients`` holds one row per client when evaluated; ``tables`` the
    method's per-round tables (:meth:`plfl.methods.base.Method.round_tables`).
    """

    round: int
    metrics: dict[str, Any]
    clients: list[dict[str, Any]] = field(default_factory=list)
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


class FederationCallback:
    """Override the hooks you need; :class:`plfl.federation.FederationLoop` calls each with the run first,
    in this order: ``on_fit_start``, then per round ``on_round_start``, ``on_client_end`` for every client
    that trained, ``on_round_end``; at the end ``on_fit_end``, or ``on_fit_error`` when the run fails or is
    stopped."""

    def on_fit_start(self, run: RunInfo) -> None:
        """Called when the run starts or resumes (``run.history``: the rounds finished before)."""

    def on_round_start(self, run: RunInfo, round_: int) -> None:
        """Called before round ``round_`` trains (round 0: before the first broadcast)."""

    def on_client_end(self, run: RunInfo, round_: int, client_id: int, result: TrainResult) -> None:
        """Called after a client's local training and ``post_train`` in ``round_``, before the aggregation."""

    def on_round_end(self, run: RunInfo, result: RoundResult) -> None:
        """Called when a round is finished: aggregated, broadcast and (when due) evaluated."""

    def on_fit_end(self, run: RunInfo, summary: dict[str, Any]) -> None:
        """Called after the last round; ``summary`` is what summary.json holds, ``summary["status"]`` is
        "completed"."""

    def on_fit_error(self, run: RunInfo, summary: dict[str, Any]) -> None:
        """Called when the run ends before its last round, with the results so far: it failed (``summary`` has
        ``status: failed`` and ``error``) or a signal stopped it (``status: interrupted`` and ``signal``)."""
