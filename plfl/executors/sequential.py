"""The sequential executor: one client after another on one :class:`~plfl.client.LocalTrainer`
(one ClientModule on one reused Lightning Trainer); ALA's weight learning in a plain autograd loop."""

from __future__ import annotations

import copy
from functools import cached_property

import torch
from torch import nn

from plfl.client import EvalResult, LocalTrainer, TrainResult
from plfl.data import FederatedData
from plfl.errors import PlflError
from plfl.executors.tasks import ClientFailure, EvalTask, LocalAggregationTask, TrainTask, checked, raised
from plfl.methods.ala import AdaptiveLocalAggregation, ALAOutcome


class SequentialExecutor:
    """Runs each task with ``LocalTrainer.train`` / ``evaluate`` on the client's split of ``data``."""

    def __init__(self, data: FederatedData, trainer: LocalTrainer):
        self.data = data
        self.trainer = trainer

    def train(self, tasks: list[TrainTask]) -> list[TrainResult | ClientFailure]:
        return [self._train(task) for task in tasks]

    def _train(self, task: TrainTask) -> TrainResult | ClientFailure:
        client = self.data.clients[task.client_id]
        x, y = client.x_train, client.y_train
        if task.samples is not None:
            x, y = x[task.samples], y[task.samples]
        try:
            result = self.trainer.train(task.params, x, y, seed=task.seed,
                                        epochs=task.epochs, steps=task.steps, trainable=task.trainable,
                                        proximal=task.proximal)
        except PlflError:
            raise  # bad input or options: every client would fail the same way
        except Exception as error:  # noqa: BLE001  one client's failure must not end the federation
            return raised(error)
        return checked(result)

    def aggregate_locally(self, tasks: list[LocalAggregationTask]) -> list[ALAOutcome | ClientFailure]:
        return [self._aggregate_locally(task) for task in tasks]

    def _aggregate_locally(self, task: LocalAggregationTask) -> ALAOutcome | ClientFailure:
        client = self.data.clients[task.client_id]
        ala = AdaptiveLocalAggregation(task.config, self.architecture, self.trainer.batch_size)
        try:
            outcome = ala(task.global_params, task.local_params, task.weights, client.x_train, client.y_train,
                          torch.Generator().manual_seed(task.seed), task.client_id)
        except PlflError:
            raise
        except Exception as error:  # noqa: BLE001  one client's failure must not end the federation
            return raised(error, "ALA")
        return checked(outcome)

    @cached_property
    def architecture(self) -> nn.Module:
        """A CPU copy of the clients' model for ALA's functional calls (the trainer's may sit on a GPU)."""
        return copy.deepcopy(self.trainer.module.model).cpu()

    def evaluate(self, tasks: list[EvalTask]) -> list[EvalResult]:
        return [self.trainer.evaluate(task.params, *self.test_split(task.client_id)) for task in tasks]

    def close(self) -> None:
        """Nothing to release: everything runs in this process."""

    def test_split(self, client_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of client ``client_id``'s test split; None: all clients' (:attr:`union_test_split`)."""
        if client_id is None:
            return self.union_test_split
        client = self.data.clients[client_id]
        return client.x_test, client.y_test

    @cached_property
    def union_test_split(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All clients' test samples together: the global model's test set."""
        clients = self.data.clients
        return torch.cat([c.x_test for c in clients]), torch.cat([c.y_test for c in clients])
