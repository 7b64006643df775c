"""The federation loop: rounds, client sampling, method hooks, evaluation, callbacks.

Round numbering follows the reference code (PFLlib/FedALA): the evaluation
logged as round r comes after r completed rounds of training and
aggregation. Round 0 only initialises every client from the initial global
model and evaluates; rounds 1..R train the sampled clients, aggregate,
broadcast and evaluate. Evaluation uses each client's model right after its
local initialisation (``pre_local_init``) and before its local training, on
its own test split, as the reference code evaluates.
"""

from __future__ import annotations

import time
from functools import cached_property
from typing import Any, Optional

import torch

from plfl.callbacks.base import FederationCallback, RoundResult, RunInfo
from plfl.methods.base import FederationContext, Method, nbytes, numel
from plfl.metrics import federation_metrics
from plfl.seeding import sample_clients


class FederationLoop:
    """Runs ``rounds`` rounds of ``method`` over the clients in ``context``."""

    def __init__(
        self,
        method: Method,
        context: FederationContext,
        callbacks: list[FederationCallback],
        run: RunInfo,
    ):
        self.method = method
        self.context = context
        self.callbacks = callbacks
        self.run_info = run
        self.federation = context.federation
        self.history: list[RoundResult] = []
        self.best: Optional[tuple[float, int]] = None  # (accuracy, round)

    @property
    def num_clients(self) -> int:
        return len(self.context.data.clients)

    def run(self) -> dict[str, Any]:
        """Run rounds 0..R and return the summary (see :meth:`summary`).

        Exceptions propagate after every callback's ``on_fit_error`` has seen
        a summary with ``status: failed``, the error, and the rounds finished so far.
        """
        self._emit("on_fit_start", self.run_info)
        try:
            for round_ in range(self.federation.rounds + 1):
                self._emit("on_round_start", round_)
                result = self.run_round(round_)
                self.history.append(result)
                self._emit("on_round_end", result)
        except BaseException as error:
            summary = self.summary(status="failed")
            summary["error"] = f"{type(error).__name__}: {error}"
            self._emit("on_fit_error", summary)
            raise
        summary = self.summary(status="completed")
        self._emit("on_fit_end", summary)
        return summary

    def run_round(self, round_: int) -> RoundResult:
        start = time.perf_counter()
        row: dict[str, Any] = {"round": round_}
        if round_ > 0:
            row.update(self._train_and_aggregate(round_))
        row.update(self._broadcast(round_))
        clients: list[dict[str, Any]] = []
        if round_ % self.federation.eval_every == 0 or round_ == self.federation.rounds:
            evaluated, clients = self._evaluate(round_)
            row.update(evaluated)
        row.update(self.method.round_metrics())
        if self.best is not None:
            row["best_accuracy"], row["best_round"] = self.best
        row["seconds"] = time.perf_counter() - start
        return RoundResult(round_, row, clients, self.method.round_tables(round_))

    def _train_and_aggregate(self, round_: int) -> dict[str, float]:
        """Local training of the sampled clients, then the server's aggregation."""
        method, store = self.method, self.context.store
        messages, loss_sum, samples = {}, 0.0, 0
        for client_id in sample_clients(self.federation.seed, round_, self.num_clients, self.federation.join_ratio):
            result = method.local_train(client_id, store.get(client_id, "model"), round_)
            result = method.post_train(client_id, result, round_)
            store.set(client_id, "model", result.params)
            messages[client_id] = method.client_message(client_id, result)
            loss_sum += result.loss * result.samples_seen
            samples += result.samples_seen
            self._emit("on_client_end", round_, client_id, result)
        method.aggregate(messages, round_)
        return {
            "train_loss": loss_sum / samples if samples else float("nan"),
            "params_received": sum(numel(m) for m in messages.values()),
            "bytes_received": sum(nbytes(m) for m in messages.values()),
        }

    def _broadcast(self, round_: int) -> dict[str, int]:
        """Every client receives the server's message and initialises its model; returns what was sent."""
        params = size = 0
        for client_id in range(self.num_clients):
            message = self.method.server_message(client_id)
            params, size = params + numel(message), size + nbytes(message)
            self.context.store.set(client_id, "model", self.method.pre_local_init(client_id, message, round_))
        return {"params_sent": params, "bytes_sent": size}

    def _evaluate(self, round_: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
        results = {}
        for client_id, data in enumerate(self.context.data.clients):
            model = self.context.store.get(client_id, "model")
            results[client_id] = self.context.local_trainer.evaluate(model, data.x_test, data.y_test)
        metrics = federation_metrics(results)
        global_model = self.method.global_model()
        if global_model is not None:
            x, y = self.union_test_split
            result = self.context.local_trainer.evaluate(global_model, x, y)
            metrics.update(global_accuracy=result.accuracy, global_test_loss=result.loss)
        if self.best is None or metrics["accuracy"] > self.best[0]:
            self.best = (metrics["accuracy"], round_)
        rows = [
            {"round": round_, "client": i, "num_test": r.total, "correct": r.correct,
             "accuracy": r.accuracy, "test_loss": r.loss}
            for i, r in results.items()
        ]
        return metrics, rows

    @cached_property
    def union_test_split(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All clients' test samples together: the global model's test set."""
        clients = self.context.data.clients
        return torch.cat([c.x_test for c in clients]), torch.cat([c.y_test for c in clients])

    def summary(self, status: str) -> dict[str, Any]:
        """Best and final metrics and per-round costs of the rounds run so far.

        ``seconds_per_round`` and ``params_{sent,received}_per_round`` are means
        over the training rounds 1..R (round 0 alone when no round trained).
        """
        trained = [r.metrics for r in self.history if r.round > 0] or [r.metrics for r in self.history]
        evaluated = [r.metrics for r in self.history if "accuracy" in r.metrics]
        mean = lambda key: sum(m.get(key, 0) for m in trained) / len(trained) if trained else None  # noqa: E731
        return {
            "status": status,
            "method": self.method.name,
            "rounds": self.history[-1].round if self.history else None,
            "best_accuracy": self.best[0] if self.best else None,
            "best_round": self.best[1] if self.best else None,
            "final_accuracy": evaluated[-1]["accuracy"] if evaluated else None,
            "final_round": evaluated[-1]["round"] if evaluated else None,
            "seconds_per_round": mean("seconds"),
            "total_seconds": sum(r.metrics["seconds"] for r in self.history),
            "params_sent_per_round": mean("params_sent"),
            "params_received_per_round": mean("params_received"),
            "bytes_sent_per_round": mean("bytes_sent"),
            "bytes_received_per_round": mean("bytes_received"),
            "num_clients": self.num_clients,
            "num_parameters": self.run_info.num_parameters,
        }

    def _emit(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(*args)
