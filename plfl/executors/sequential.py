"""The sequential executor: one client after another, local training on one :class:`~plfl.client.LocalTrainer`
(one ClientModule on one reused Lightning Trainer), a method's own steps and features in a plain loop."""

from __future__ import annotations

import copy
from functools import cached_property
from typing import TYPE_CHECKING, Callable, Optional, TypeVar

import torch
from torch import nn

from plfl.activity import current as activity
from plfl.batches import has_batch_norm
from plfl.client import ClientModule, LocalTrainer, build_trainer
from plfl.data.augment import augmentation
from plfl.data.federated import FederatedData
from plfl.errors import PlflError
from plfl.executors.steps import FunctionalNetwork, run_feature_task, run_forward_evaluation, run_step_task
from plfl.models import channels_last
from plfl.tasks import (
    ClientFailure,
    EvalResult,
    EvalTask,
    FeatureResult,
    FeatureTask,
    StepResult,
    StepTask,
    TrainResult,
    TrainTask,
    finite_or_failure,
    raised,
)

if TYPE_CHECKING:
    from plfl.executors.options import ClientWorkOptions

R = TypeVar("R")
Outcome = TypeVar("Outcome")


class SequentialExecutor:
    """Runs each task on the client's split of ``data``: training and evaluation with ``trainer``, steps with
    :func:`~plfl.executors.steps.run_step_task` on ``trainer``'s device."""

    def __init__(self, data: FederatedData, trainer: LocalTrainer):
        self.data = data
        self.trainer = trainer

    @classmethod
    def of(
        cls, work: ClientWorkOptions, data: FederatedData, architecture: nn.Module, devices: Optional[int] = None
    ) -> SequentialExecutor:
        """The executor of a run's client work ``work`` over ``data``: a ClientModule with a copy of
        ``architecture`` trained by SGD at ``federation.lr`` and ``federation.momentum`` in batches of
        ``federation.batch_size``, augmented by ``data.augment``, on a Trainer of the ``trainer.*`` options
        (``devices`` of them, default ``trainer.devices``).

        Raises:
            ConfigError: ``data.augment`` for data that are not images.
        """
        federation, options = work.federation, work.trainer
        module = ClientModule(
            copy.deepcopy(architecture),
            data.num_classes,
            federation.lr,
            federation.momentum,
            train_transform=augmentation(work.augment, data),
            dp_sgd=work.dp_sgd,
            batch_size=federation.batch_size,
        )
        trainer = build_trainer(options.accelerator, devices or options.devices, options.precision)
        return cls(data, LocalTrainer(module, trainer, federation.batch_size, federation.drop_last))

    def train(self, tasks: list[TrainTask]) -> list[TrainResult | ClientFailure]:
        activity.start_work("training", len(tasks))
        return [self._guarded(self._train, task, "local training") for task in tasks]

    def _train(self, task: TrainTask) -> TrainResult | ClientFailure:
        x, y = self._training_split(task.client_id, task.samples)
        return finite_or_failure(
            self.trainer.train(
                task.params,
                x,
                y,
                seed=task.seed,
                epochs=task.epochs,
                steps=task.steps,
                trainable=task.trainable,
                proximal=task.proximal,
            )
        )

    def step(self, tasks: list[StepTask]) -> list[StepResult | ClientFailure]:
        activity.start_work(tasks[0].step.work if tasks else "", len(tasks))
        return [self._guarded(self._step, task, task.step.work) for task in tasks]

    def _step(self, task: StepTask) -> StepResult | ClientFailure:
        client = self.data.clients[task.client_id]
        data = (client.x_train, client.y_train) if task.data is None else task.data
        x, y = (t.to(self.device) for t in data)
        result = run_step_task(task, self.network, x, y, self.batch_norm)
        return finite_or_failure(result, result.state)

    def features(self, tasks: list[FeatureTask]) -> list[FeatureResult | ClientFailure]:
        activity.start_work("features", len(tasks))
        return [self._guarded(self._features, task, "feature extraction") for task in tasks]

    def _features(self, task: FeatureTask) -> FeatureResult:
        client = self.data.clients[task.client_id]
        x, y = (t.to(self.device) for t in (client.x_train, client.y_train))
        return run_feature_task(task, self.network, x, y, self.batch_norm)

    def evaluate(self, tasks: list[EvalTask]) -> list[EvalResult]:
        activity.start_work("evaluation", len(tasks))
        results = []
        for task in tasks:
            x, y = self._evaluation_split(task)
            if task.forward is None:
                results.append(self.trainer.evaluate(task.params, x, y))
            else:
                rows = torch.arange(len(y)) if task.samples is None else task.samples
                results.append(
                    run_forward_evaluation(
                        task, self.network, x.to(self.device), y.to(self.device), rows.to(self.device)
                    )
                )
            activity.finish_clients()
        return results

    def close(self) -> None:
        """Nothing to release: everything runs in this process."""

    @staticmethod
    def _guarded(run: Callable[[R], Outcome], task: R, work: str) -> Outcome | ClientFailure:
        try:
            return run(task)
        except PlflError:
            raise  # bad input or options: every client would fail the same way
        except Exception as error:  # noqa: BLE001  one client's failure must not end the federation
            return raised(error, work)
        finally:
            activity.finish_clients()

    @cached_property
    def device(self) -> torch.device:
        return self.trainer.trainer.strategy.root_device

    @cached_property
    def network(self) -> FunctionalNetwork:
        """A copy of the clients' architecture for the steps (the trainer's module is busy between fits)."""
        return FunctionalNetwork(channels_last(copy.deepcopy(self.trainer.module.model)).to(self.device), self.device)

    @cached_property
    def batch_norm(self) -> bool:
        return has_batch_norm(self.trainer.module.model)

    def _training_split(self, client_id: int, samples: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        client = self.data.clients[client_id]
        if samples is None:
            return client.x_train, client.y_train
        return client.x_train[samples], client.y_train[samples]

    def _evaluation_split(self, task: EvalTask) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) that ``task`` evaluates on: a client's test or validation split or samples of its training
        split."""
        if task.samples is not None:
            return self._training_split(task.client_id, task.samples)
        client = self.data.clients[task.client_id]
        return (client.x_val, client.y_val) if task.split == "val" else (client.x_test, client.y_test)
