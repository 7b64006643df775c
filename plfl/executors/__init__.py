"""Executors: where and how the clients' work runs (``federation.executor``).

Every executor runs the three kinds of task of :mod:`plfl.tasks` (local training, a method's own steps,
evaluation) with the same results for the same seeds: ``sequential`` one client after another, ``vectorized``
a round's clients stacked on one device, ``ray`` on a pool of Ray actors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from plfl.data import FederatedData
from plfl.errors import ConfigError
from plfl.executors.base import Executor, drive
from plfl.executors.sequential import SequentialExecutor
from plfl.executors.vectorized import VectorizedExecutor

if TYPE_CHECKING:
    from plfl.config import ExperimentConfig

__all__ = ["Executor", "SequentialExecutor", "VectorizedExecutor", "build_executor", "drive"]


def build_executor(config: ExperimentConfig, data: FederatedData, architecture: nn.Module) -> Executor:
    """The executor ``federation.executor`` names, for clients of ``architecture`` over ``data``, with the run
    ``config``'s options: the vectorized one on the device of ``trainer.accelerator``, the Ray one with the
    ``ray.*`` options (connected and its actors started).

    Raises:
        ConfigError: a vectorized executor on an accelerator other than cpu, gpu, cuda, mps or auto;
            ``data.augment`` for data that are not images; for the Ray executor, see
            :class:`~plfl.executors.ray_actors.RayExecutor`.
    """
    name, accelerator = config.federation.executor, config.trainer.accelerator
    if name == "ray":
        from plfl.executors.ray_actors import RayExecutor  # Ray is optional: imported only when asked for

        return RayExecutor(config, data, architecture)
    if name == "sequential":
        return SequentialExecutor.of(config, data, architecture)
    devices = {
        "cpu": "cpu",
        "gpu": "cuda",
        "cuda": "cuda",
        "mps": "mps",
        "auto": "cuda" if torch.cuda.is_available() else "cpu",
    }
    if accelerator not in devices:
        raise ConfigError(
            f"federation.executor=vectorized runs on trainer.accelerator cpu, gpu, cuda, mps or auto, "
            f"not {accelerator}. Set federation.executor=sequential."
        )
    return VectorizedExecutor(
        data,
        architecture,
        config.federation,
        torch.device(devices[accelerator]),
        config.trainer.precision,
        config.data.augment,
        SequentialExecutor.of(config, data, architecture),
    )
