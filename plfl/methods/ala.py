r"""Adaptive Local Aggregation (ALA), FedALA's local initialisation, as a component of any method.

Zhang et al., "FedALA: Adaptive Local Aggregation for Personalized Federated Learning", AAAI 2023, Eq. 3–5
and Algorithm 1 (lines 6–16). With :math:`\Theta` the received global model, :math:`\Theta_i` the client's old
local model and the top p parameter tensors (``named_parameters`` order, counted from the end):

- lower tensors: :math:`\hat\Theta = \Theta` (Eq. 4);
- top tensors: :math:`\hat\Theta = \Theta_i + (\Theta - \Theta_i) \odot W_i` (Eq. 3);
- per mini-batch of an s % sample of :math:`D_i` (the same batches every epoch), then recompute
  :math:`\hat\Theta` (:class:`ALAStep`):

  .. math:: W_i \leftarrow \mathrm{clamp}\big(W_i - \eta\, \nabla_{\hat\Theta} L(\hat\Theta) \odot
     (\Theta - \Theta_i),\ 0,\ 1\big) \qquad \text{(Eq. 5)}

The first time it runs for a client (:math:`W_i` absent, all ones to start: the "initial stage") it repeats epochs
until more than ``num_pre_loss`` epoch losses are recorded and the std of the last ``num_pre_loss`` is below
``threshold`` (the recorded loss is each epoch's last batch loss, :func:`settled`), at most
``max_init_epochs`` (a cap the reference code lacks: it can loop forever); afterwards exactly one epoch. Each
epoch is one step task (:mod:`plfl.tasks`), so every executor runs it and the clients' initial stages go on in
lock-step, each until its own losses settle. When every top tensor is in the head, the global body's features of
the sample are computed once (a feature task) and every epoch steps on them.

:class:`AdaptiveLocalAggregation` puts ALA after a method's own ``pre_local_init``: FedALA is FedAvg with it,
and ``method.ala: {...}`` composes it with any method whose client starts from a received model (FedALA
paper, Table 4; :func:`with_ala`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch
from torch import nn
from torch.func import grad_and_value

from plfl.errors import ConfigError, PlflWarning
from plfl.fields import checked
from plfl.methods.base import require_private_steps
from plfl.models import BodyHeadModel
from plfl.plots import Panel, Panels
from plfl.seeding import derive_seed
from plfl.state import ClientStateStore, Params
from plfl.tasks import (
    Batch,
    FeatureResult,
    FeatureTask,
    Network,
    Step,
    StepOutput,
    StepResult,
    StepTask,
    Work,
    masked_cross_entropy,
    resolved,
    sample_count,
)

if TYPE_CHECKING:
    from plfl.methods.base import FederationContext, Method


@dataclass
class ALAConfig:
    """ALA's hyperparameters (FedALA, Eq. 3–5; the reference code's defaults, the paper used threshold 0.01)."""

    s: float = checked(
        80.0,
        lambda v: 0 < v <= 100,
        "a percentage in (0, 100]",
        "percentage of the client's training data used to learn the weights",
    )
    p: int = checked(
        2,
        lambda v: v >= 1,
        "an integer >= 1",
        "parameter tensors, counted from the end, that ALA aggregates element-wise",
    )
    eta: float = checked(1.0, lambda v: v > 0, "a number > 0", "learning rate of the aggregation weights")
    threshold: float = checked(
        0.1,
        lambda v: v > 0,
        "a number > 0",
        "the initial stage ends when the std of the last num_pre_loss epoch losses is below it",
    )
    num_pre_loss: int = checked(10, lambda v: v >= 1, "an integer >= 1", "epoch losses the threshold looks at")
    max_init_epochs: int = checked(
        100,
        lambda v: v >= 1,
        "an integer >= 1",
        "cap on the initial stage's epochs (the reference has none and can hang)",
    )


@dataclass(frozen=True)
class ALAStep(Step):
    """Eq. 5 on one batch: the state is W_i (the top tensors' names), the inputs ``local/<name>`` (Θ_i) and
    ``gap/<name>`` (Θ − Θ_i), shared the received Θ. With ``head_only`` (every top tensor in the head) the
    batches hold the fixed global body's features and the loss is the head's: the same numbers for less work."""

    work = "ALA"
    eta: float
    top: tuple[str, ...]
    head_only: bool

    def __call__(self, network: Network, state: Params, inputs: Params, shared: Params, batch: Batch) -> StepOutput:
        def loss(theta: Params) -> torch.Tensor:
            logits, _ = network({**shared, **theta}, batch.x, batch.mask, "head" if self.head_only else "")
            return masked_cross_entropy(logits, batch.y, batch.mask)

        theta = {k: inputs[f"local/{k}"] + inputs[f"gap/{k}"] * state[k] for k in self.top}
        grads, value = grad_and_value(loss)(theta)
        weights = {k: torch.clamp(state[k] - self.eta * grads[k] * inputs[f"gap/{k}"], 0, 1) for k in self.top}
        return StepOutput(weights, value, sample_count(batch))


def settled(epoch_losses: list[float], num_pre_loss: int, threshold: float) -> bool:
    """Whether the initial stage ends: more than ``num_pre_loss`` epoch losses, the std of the last
    ``num_pre_loss`` of them below ``threshold`` (Algorithm 1, line 13)."""
    recent = epoch_losses[-num_pre_loss:]
    return len(epoch_losses) > num_pre_loss and float(np.std(recent)) < threshold


def local_aggregation(
    config: ALAConfig, context: FederationContext, client_id: int, message: Params, local: Params, round_: int
) -> Work[Params]:
    """ALA's initialisation of client ``client_id``'s model from the received ``message`` (Θ) and its old
    ``local`` model (Θ_i): learns W_i (kept in the store as ``ala_weights``, with ``ala_epochs``) on an s %
    sample drawn from the stream ``ala_subset`` of ``round_``, one epoch per step task, and returns Θ̂.

    Warns:
        PlflWarning: the initial stage hit ``max_init_epochs`` before the losses settled.
    """
    store, architecture, batch_size = context.store, context.architecture, context.federation.batch_size
    top = top_names(architecture, config.p)
    weights = store.get(client_id, "ala_weights")
    seed = derive_seed(context.federation.seed, round_, client_id, "ala_subset")
    sample = sample_index(context.data.clients[client_id].num_train, config.s, torch.Generator().manual_seed(seed))
    data = None
    if head_only(architecture, top):  # the body's features of the sample, once for every epoch
        features: FeatureResult = yield FeatureTask(client_id, message, sample, batch_size)
        if len(features.y):  # none when BatchNorm leaves a sample of one out: then no epoch has a batch anyway
            data, sample = (features.x, features.y), torch.arange(len(features.y))
    task = StepTask(
        client_id,
        ALAStep(config.eta, tuple(top), data is not None),
        weights or {k: torch.ones_like(message[k]) for k in top},
        seed,
        batch_size,
        epochs=1,
        inputs={**{f"local/{k}": local[k] for k in top}, **{f"gap/{k}": message[k] - local[k] for k in top}},
        shared=message,
        ordered_samples=sample,
        data=data,
    )
    result: StepResult = yield task
    losses = list(result.epoch_losses)
    if weights is None:  # the initial stage: an epoch at a time until the losses settle
        while not settled(losses, config.num_pre_loss, config.threshold) and len(losses) < config.max_init_epochs:
            result = yield dataclasses.replace(task, state=result.state)
            losses += result.epoch_losses
        if not settled(losses, config.num_pre_loss, config.threshold):
            warn_capped(config, client_id, losses)
    store.set(client_id, "ala_weights", result.state)
    store.set(client_id, "ala_epochs", len(losses))
    params = {k: v.clone() for k, v in message.items()}
    params.update({k: local[k] + (message[k] - local[k]) * result.state[k] for k in top})
    return params


class AdaptiveLocalAggregation:
    """ALA after a method's own local initialisation (the mixin of :func:`with_ala`, and FedALA's).

    A client's model from the method's ``pre_local_init`` becomes the received model Θ of Eq. 3–5, its model
    before the broadcast the old local model Θ_i; a client without one (before its first training) keeps the
    method's. ``round_metrics`` adds :func:`ala_metrics`. The settings are ``method.ala`` (:attr:`ala`).

    Raises:
        ConfigError: at construction, a ``p`` beyond the model's parameter tensors.
    """

    config: Any
    context: FederationContext
    store: ClientStateStore
    figures = (
        Panels(
            "ALA weight statistics",
            (Panel("ala_weight_mean", "mean ALA weight"), Panel("ala_epochs_mean", "mean ALA epochs")),
        ),
    )

    def __init__(self, config: Any, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_private_steps(
            f"{self.name} (its ALA)", context, "learns ALA's aggregation weights on its samples in steps of its own"
        )
        top_names(context.architecture, self.ala.p)  # refuses a p beyond the model's tensors before training

    @property
    def ala(self) -> ALAConfig:
        return self.config.ala

    def pre_local_init(self, client_id: int, message: Optional[Params], round_: int) -> Work[Params]:
        local = self.store.get(client_id, "model")
        received = yield from resolved(super().pre_local_init(client_id, message, round_))
        if local is None:
            return received
        return (yield from local_aggregation(self.ala, self.context, client_id, received, local, round_))

    def round_metrics(self, round_: int) -> dict[str, float]:
        return {**ala_metrics(self.store), **super().round_metrics(round_)}


@functools.cache
def with_ala(method: type[Method]) -> type[Method]:
    """``method`` with ALA after its local initialisation (FedALA paper, Table 4): the class a run with
    ``method.ala`` set builds."""
    return type(f"{method.__name__}WithALA", (AdaptiveLocalAggregation, method), {"__module__": method.__module__})


def ala_metrics(store: ClientStateStore) -> dict[str, float]:
    """Mean, std, and fractions at 0 (local value kept) and 1 (global value taken) of all clients'
    element-wise weights W_i, and mean epochs of their last ALA (empty before any ALA)."""
    weights = [w for i in range(len(store)) if (w := store.get(i, "ala_weights"))]
    epochs = [e for i in range(len(store)) if (e := store.get(i, "ala_epochs"))]
    if not weights:
        return {}
    flat = torch.cat([t.flatten() for w in weights for t in w.values()])
    return {
        "ala_weight_mean": flat.mean().item(),
        "ala_weight_std": flat.std(correction=0).item(),
        "ala_weight_zero_fraction": (flat == 0).float().mean().item(),
        "ala_weight_one_fraction": (flat == 1).float().mean().item(),
        "ala_epochs_mean": sum(epochs) / len(epochs),
    }


def top_names(model: nn.Module, p: int) -> list[str]:
    """The names of the top ``p`` parameter tensors (``named_parameters`` order, counted from the end).

    Raises:
        ConfigError: the model has fewer than ``p`` parameter tensors.
    """
    names = [name for name, _ in model.named_parameters()]
    if p > len(names):
        raise ConfigError(f"ALA p={p} exceeds the model's {len(names)} parameter tensors; lower p.")
    return names[-p:]


def head_only(model: nn.Module, top: list[str]) -> bool:
    """Whether ALA aggregates head tensors only, so that the body is the fixed global body in every epoch."""
    return isinstance(model, BodyHeadModel) and all(k.startswith("head.") for k in top)


def sample_index(n: int, s: float, generator: torch.Generator) -> torch.Tensor:
    """(max(1, ⌊s/100 · n⌋),) int64: the s % sample of n training samples that ALA learns on, in data order."""
    count = max(1, int(s / 100 * n))
    return torch.randperm(n, generator=generator)[:count].sort().values


def warn_capped(config: ALAConfig, client_id: int, losses: list[float]) -> None:
    """Warn that client ``client_id``'s initial stage hit ``max_init_epochs`` before its ``losses`` settled."""
    warnings.warn(
        f"ALA's initial stage for client {client_id} stopped at method.max_init_epochs={config.max_init_epochs} "
        f"epochs before its loss settled (std of the last {config.num_pre_loss} epoch losses "
        f"{np.std(losses[-config.num_pre_loss :]):.4f} >= threshold {config.threshold}). "
        "Raise method.threshold or method.max_init_epochs.",
        PlflWarning,
        stacklevel=2,
    )
