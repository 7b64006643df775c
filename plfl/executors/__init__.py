"""Executors: where and how the clients' local training and evaluation run (``federation.executor``)."""

from __future__ import annotations

import torch

from plfl.client import LocalTrainer
from plfl.config import FederationConfig, RayConfig
from plfl.data import FederatedData
from plfl.errors import ConfigError
from plfl.executors.base import Executor, drive, resolved
from plfl.executors.sequential import SequentialExecutor
from plfl.executors.tasks import ClientFailure, EvalTask, LocalAggregationTask, Trains, TrainTask
from plfl.executors.vectorized import VectorizedExecutor

__all__ = ["ClientFailure", "EvalTask", "Executor", "LocalAggregationTask", "SequentialExecutor", "TrainTask", "Trains",
           "VectorizedExecutor", "build_executor", "drive", "resolved"]


def build_executor(federation: FederationConfig, data: FederatedData, trainer: LocalTrainer, accelerator: str,
                   precision: str, ray: RayConfig = RayConfig()) -> Executor:
    """The executor ``federation.executor`` names, over ``data``; the vectorized one on the device of
    ``trainer.accelerator``, the Ray one with the ``ray`` options (connected and its actors started).

    Raises:
        ConfigError: a vectorized executor on an accelerator other than cpu, gpu, cuda, mps or auto; for the
            Ray executor, see :class:`~plfl.executors.ray_actors.RayExecutor`.
    """
    if federation.executor == "sequential":
        return SequentialExecutor(data, trainer)
    if federation.executor == "ray":
        from plfl.executors.ray_actors import RayExecutor  # Ray is optional: imported only when asked for

        return RayExecutor(data, trainer, accelerator, precision, ray)
    devices = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "mps": "mps",
               "auto": "cuda" if torch.cuda.is_available() else "cpu"}
    if accelerator not in devices:
        raise ConfigError(f"federation.executor=vectorized runs on trainer.accelerator cpu, gpu, cuda, mps or auto, "
                          f"not {accelerator}. Set federation.executor=sequential.")
    return VectorizedExecutor(data, trainer, torch.device(devices[accelerator]), federation.cohort_size, precision,
                              federation.cuda_graphs)
