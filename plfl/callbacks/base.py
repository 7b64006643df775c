"""The federation callback interface: cross-cutting concerns outside the loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from plfl.client import TrainResult


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
    """Override the hooks you need; each is called by :class:`plfl.federation.FederationLoop`."""

    def on_fit_start(self, run: RunInfo) -> None:
        pass

    def on_round_start(self, round_: int) -> None:
        pass

    def on_client_end(self, round_: int, client_id: int, result: TrainResult) -> None:
        pass

    def on_round_end(self, result: RoundResult) -> None:
        pass

    def on_fit_end(self, summary: dict[str, Any]) -> None:
        """``summary`` is what summary.json holds; ``summary["status"]`` is "completed"."""

    def on_fit_error(self, summary: dict[str, Any]) -> None:
        """The run failed; ``summary`` has ``status: failed`` and ``error``, with results so far."""
