"""Client work as data: what an executor is asked to run, and what it returns for a client that failed.

A task names its client by id (the executor holds the federation's data) and
carries everything else by value, so that any executor (in-process,
vectorized, on a remote worker) can run it the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, Optional, TypeVar

import torch

from plfl.client import ProximalTerm, TrainResult
from plfl.methods.ala import ALAOutcome
from plfl.methods.schemas import ALAConfig
from plfl.state import Params

T = TypeVar("T")
# A hook that trains: it yields TrainTasks (or LocalAggregationTasks), receives each one's TrainResult
# (ALAOutcome), and returns its own value.
Trains = Generator["TrainTask | LocalAggregationTask", "TrainResult | ALAOutcome", T]


@dataclass(frozen=True, eq=False)
class TrainTask:
    """Local training of client ``client_id`` on its training split: the options of
    :meth:`plfl.client.LocalTrainer.train`.

    Raises:
        ValueError: not exactly one of ``epochs`` and ``steps``, or one below 1.
    """

    client_id: int
    params: Params  # the starting state (not modified)
    seed: int  # batch order and augmentation draws (derive_seed of run, round, client, stream)
    epochs: Optional[int] = None
    steps: Optional[int] = None
    trainable: Optional[frozenset[str]] = None  # parameter names to update (None: all); any set is frozen
    proximal: Optional[ProximalTerm] = None  # μ/2 ‖θ − anchor‖² added to the loss (FedProx, Ditto)
    samples: Optional[torch.Tensor] = None  # (n,) int64 indices into the training split; None: all of it

    def __post_init__(self) -> None:
        if (self.epochs is None) == (self.steps is None) or (self.epochs or self.steps) < 1:
            raise ValueError(f"a TrainTask takes exactly one of epochs and steps, >= 1; got epochs={self.epochs}, "
                             f"steps={self.steps}")
        if self.trainable is not None:
            object.__setattr__(self, "trainable", frozenset(self.trainable))


@dataclass(frozen=True, eq=False)
class LocalAggregationTask:
    """Adaptive local aggregation of client ``client_id`` on its training split (FedALA, Eq. 3–5, Alg. 1
    lines 6–16): the arguments of :class:`plfl.methods.ala.AdaptiveLocalAggregation`; the result is an
    :class:`~plfl.methods.ala.ALAOutcome`."""

    client_id: int
    global_params: Params  # Θ, the received global model (not modified)
    local_params: Params  # Θ_i, the client's old local model (not modified)
    weights: Optional[Params]  # W_i from the client's last ALA; None before its first (the initial stage)
    seed: int  # draws the s % sample of the training split
    config: ALAConfig


@dataclass(frozen=True, eq=False)
class EvalTask:
    """Evaluation of ``params`` on client ``client_id``'s test split; None: on all clients' test splits together
    (the global model's test set)."""

    client_id: Optional[int]
    params: Params


@dataclass(frozen=True)
class ClientFailure:
    """Why a client's work failed (an exception, or NaN/Inf in its trained parameters); the loop leaves the
    client out of its round."""

    reason: str


def raised(error: Exception, work: str = "local training") -> ClientFailure:
    """The failure of a client whose ``work`` raised ``error``."""
    return ClientFailure(f"{work} raised {type(error).__name__}: {error}")


def checked(result: T) -> T | ClientFailure:
    """``result`` (a TrainResult or an ALAOutcome), or a failure when its parameters hold NaN or Inf."""
    bad = non_finite(result.params)
    if bad is None:
        return result
    return ClientFailure(f"its trained parameter {bad!r} holds NaN or Inf (training diverged)")


def non_finite(params: Optional[Params]) -> Optional[str]:
    """The name of the first floating tensor in ``params`` that holds NaN or Inf; None if there is none."""
    for name, tensor in (params or {}).items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            return name
    return None
