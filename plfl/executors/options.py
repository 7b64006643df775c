"""The executors ``federation.executor`` names, each with its own section of keys, and what every executor reads
of the run's config. Plain declarations (no torch): a config is checked against them; the executors themselves
are imported when :func:`plfl.executors.build_executor` builds one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from plfl.cluster import import_ray
from plfl.fields import Component, checked, documented, registry
from plfl.sections import DPSGDNoise, FederationConfig, TrainerConfig


@dataclass(frozen=True)
class ClientWorkOptions:
    """What every executor reads of a run's config: the local training (``federation.*``), the Lightning
    Trainer's options (``trainer.*``), whether training batches are augmented (``data.augment``) and, with
    ``privacy.level=sample``, DP-SGD's noise in every local step."""

    federation: FederationConfig
    trainer: TrainerConfig
    augment: bool = False
    dp_sgd: Optional[DPSGDNoise] = None


@dataclass
class ExecutorOptions(Component):
    """An executor (``federation.executor``) and the keys of its own section (``<its name>.*``), which a run's
    config sets only when it chooses that executor."""


@dataclass
class Sequential(ExecutorOptions):
    """One client after another on one reused Lightning Trainer; no keys of its own."""

    choice = "sequential"


@dataclass
class Vectorized(ExecutorOptions):
    """A round's clients stacked and trained in lock-step with ``torch.func`` (``vectorized.*``)."""

    choice = "vectorized"
    cohort_size: Optional[int] = checked(
        None,
        lambda v: v is None or v >= 1,
        "null or an integer >= 1",
        "the most clients stacked at once (null: all of a call's); memory grows linearly with it",
    )
    cuda_graphs: bool = documented(
        True,
        "on CUDA: capture each lock-step step once per shape as a CUDA graph and replay it (false: launch its "
        "kernels one by one)",
    )


@dataclass
class Ray(ExecutorOptions):
    """Tasks spread over a pool of Ray actors (``ray.*``); Ray is optional: ``pip install -e '.[ray]'``."""

    choice = "ray"
    address: str = documented(
        "local",
        "local: start Ray in the plfl process with the actors' CPUs; auto: join the cluster of this host (ray "
        "start); HOST:PORT: a cluster's head; ray://HOST:10001: a remote cluster through Ray Client",
    )
    num_actors: int = checked(2, lambda v: v >= 1, "an integer >= 1", "Ray actors, each running one task at a time")
    num_cpus_per_actor: float = checked(
        1.0, lambda v: v > 0, "a number > 0", "Ray CPUs per actor (its torch threads); fractions share a CPU"
    )
    num_gpus_per_actor: float = checked(
        0.0, lambda v: v >= 0, "a number >= 0", "Ray GPUs per actor; fractions such as 0.25 share a GPU"
    )

    def check(self) -> None:
        import_ray("federation.executor=ray")  # not installed: the install command, before anything runs


def executors() -> dict[str, type[ExecutorOptions]]:
    """``federation.executor`` → its :class:`ExecutorOptions`."""
    return registry(ExecutorOptions)
