"""Executors: where and how the clients' local training and evaluation run (``federation.executor``)."""

from plfl.executors.base import Executor, drive, resolved
from plfl.executors.sequential import SequentialExecutor
from plfl.executors.tasks import ClientFailure, EvalTask, Trains, TrainTask

__all__ = ["ClientFailure", "EvalTask", "Executor", "SequentialExecutor", "TrainTask", "Trains", "drive",
           "resolved"]
