"""Executors: where and how the clients' work runs (``federation.executor``).

Every executor runs the four kinds of task of :mod:`plfl.tasks` (local training, a method's own steps,
features, evaluation) with the same results for the same seeds: ``sequential`` one client after another, ``vectorized``
a round's clients stacked on one device, ``ray`` on a pool of Ray actors. Their names and keys are declared in
:mod:`plfl.executors.options`; an executor's module (torch, Lightning, Ray) is imported when it is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plfl.errors import ConfigError
from plfl.executors.options import ClientWorkOptions, ExecutorOptions, Ray, Vectorized

if TYPE_CHECKING:
    from torch import nn

    from plfl.data.federated import FederatedData
    from plfl.executors.base import Executor

__all__ = ["Executor", "SequentialExecutor", "VectorizedExecutor", "build_executor", "drive"]

DEVICES = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "mps": "mps"}  # trainer.accelerator → torch device


def build_executor(
    work: ClientWorkOptions, options: ExecutorOptions, data: FederatedData, architecture: nn.Module
) -> Executor:
    """The executor ``work.federation.executor`` names, with its ``options`` (its section of the config), for
    clients of ``architecture`` over ``data``: the vectorized one on the device of ``trainer.accelerator``, the
    Ray one connected and its actors started.

    Raises:
        ConfigError: a vectorized executor on an accelerator other than cpu, gpu, cuda, mps or auto;
            ``data.augment`` for data that are not images; for the Ray executor, see
            :class:`~plfl.executors.ray_actors.RayExecutor`.
    """
    from plfl.executors.sequential import SequentialExecutor

    if isinstance(options, Ray):
        from plfl.executors.ray_actors import RayExecutor

        return RayExecutor(options, work, data, architecture)
    if not isinstance(options, Vectorized):
        return SequentialExecutor.of(work, data, architecture)
    import torch

    from plfl.executors.vectorized import VectorizedExecutor

    accelerator = work.trainer.accelerator
    devices = {**DEVICES, "auto": "cuda" if torch.cuda.is_available() else "cpu"}
    if accelerator not in devices:
        raise ConfigError(
            f"federation.executor=vectorized runs on trainer.accelerator cpu, gpu, cuda, mps or auto, "
            f"not {accelerator}. Set federation.executor=sequential."
        )
    fallback = SequentialExecutor.of(work, data, architecture)
    return VectorizedExecutor(data, architecture, work, options, torch.device(devices[accelerator]), fallback)


def __getattr__(name: str) -> Any:
    # The executors import torch and Lightning: only when asked for.
    if name in ("Executor", "drive"):
        from plfl.executors import base

        return getattr(base, name)
    if name == "SequentialExecutor":
        from plfl.executors.sequential import SequentialExecutor

        return SequentialExecutor
    if name == "VectorizedExecutor":
        from plfl.executors.vectorized import VectorizedExecutor

        return VectorizedExecutor
    raise AttributeError(f"module 'plfl.executors' has no attribute {name!r}")
