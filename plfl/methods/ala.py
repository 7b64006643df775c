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
``max_init_epochs`` (a cap the reference code lacks: it can loop forever); afterwards exactly one epoch.

With sample-level DP (``privacy.level=sample``) Eq. 5 is a DP-SGD step on :math:`W_i`: the per-sample gradients
:math:`\nabla_{W_i} \ell_j = \nabla_{\hat\Theta} \ell_j \odot (\Theta - \Theta_i)` are clipped and noised as the
local training's are (:func:`plfl.privacy.private_gradient`, the same σ and C), and each of ALA's steps is one
step of the client's accountant at sample rate B / n. It is then exactly one epoch every round: the initial
stage's stopping rule reads the losses of the client's samples, so its length would depend on them. Each
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
from torch.func import grad_and_value, vmap

from plfl.errors import ConfigError, PlflWarning
from plfl.fields import checked
from plfl.models import BodyHeadModel
from plfl.plots import Panel, Panels
from plfl.privacy import private_gradient
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
    masked_mean,
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
    batches hold the fixed global body's features and the loss is the head's: the same numbers for less work.
    A batch with noise (sample-level DP) takes DP-SGD's private gradient of W_i instead, its per-sample
    gradients clipped to ``max_grad_norm`` C and the sum divided by the expected batch size ``batch_size`` B."""

    work = "ALA"
    eta: float
    top: tuple[str, ...]
    head_only: bool
    max_grad_norm: float = 1.0
    batch_size: int = 1

    def __call__(self, network: Network, state: Params, inputs: Params, shared: Params, batch: Batch) -> StepOutput:
        module = "head" if self.head_only else ""

        def loss(theta: Params, x: torch.Tensor, y: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
            logits, _ = network({**shared, **theta}, x, mask, module)
            return masked_cross_entropy(logits, y, mask)

        theta = {k: inputs[f"local/{k}"] + inputs[f"gap/{k}"] * state[k] for k in self.top}
        if batch.noise is None:
            grads, value = grad_and_value(loss)(theta, batch.x, batch.y, batch.mask)
            weights = {k: torch.clamp(state[k] - self.eta * grads[k] * inputs[f"gap/{k}"], 0, 1) for k in self.top}
            return StepOutput(weights, value, sample_count(batch))

        def sample_loss(theta: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return loss(theta, x[None], y[None], None)

        grads, losses = vmap(grad_and_value(sample_loss), in_dims=(None, 0, 0))(theta, batch.x, batch.y)
        mask = torch.ones_like(losses) if batch.mask is None else batch.mask
        per_sample = [grads[k] * inputs[f"gap/{k}"] for k in self.top]  # ∇_W ℓ_j, (W, *shape)
        noise = [batch.noise[k] for k in self.top]
        private = private_gradient(per_sample, mask, noise, self.max_grad_norm, self.batch_size)
        weights = {k: torch.clamp(state[k] - self.eta * g, 0, 1) for k, g in zip(self.top, private)}
        return StepOutput(weights, masked_mean(losses, mask), sample_count(batch))


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
    sample drawn from the stream ``ala_subset`` of ``round_``, one epoch per step task, and returns Θ̂. With
    sample-level DP (``context.dp_sgd``) the steps are private, one epoch, each step accounted.

    Warns:
        PlflWarning: the initial stage hit ``max_init_epochs`` before the losses settled.
    """
    store, architecture, batch_size = context.store, context.architecture, context.federation.batch_size
    dp_sgd = context.dp_sgd
    top = top_names(architecture, config.p)
    weights = store.get(client_id, "ala_weights")
    seed = derive_seed(context.federation.seed, round_, client_id, "ala_subset")
    sample = sample_index(context.data.clients[client_id].num_train, config.s, torch.Generator().manual_seed(seed))
    data = None
    if head_only(architecture, top):  # the body's features of the sample, once for every epoch
        features: FeatureResult = yield FeatureTask(client_id, message, sample, batch_size)
        if len(features.y):  # none when BatchNorm leaves a sample of one out: then no epoch has a batch anyway
            data, sample = (features.x, features.y), torch.arange(len(features.y))
    step, private = ALAStep(config.eta, tuple(top), data is not None), {}
    if dp_sgd is not None:
        noise = dp_sgd.noise
        step = dataclasses.replace(step, max_grad_norm=noise.max_grad_norm, batch_size=batch_size)
        private = {"noise_std": noise.noise_multiplier * noise.max_grad_norm, "min_last_batch": dp_sgd.min_last}
        dp_sgd.account(client_id, context.data.clients[client_id].num_train, 1, None, config.s / 100)
    task = StepTask(
        client_id,
        step,
        weights or {k: torch.ones_like(message[k]) for k in top},
        seed,
        batch_size,
        epochs=1,
        inputs={**{f"local/{k}": local[k] for k in top}, **{f"gap/{k}": message[k] - local[k] for k in top}},
        shared=message,
        ordered_samples=sample,
        data=data,
        **private,
    )
    result: StepResult = yield task
    losses = list(result.epoch_losses)
    if weights is None and dp_sgd is None:  # the initial stage: an epoch at a time until the losses settle
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

    def local_lengths(self) -> list[dict[str, float]]:
        """The method's trainings and ALA's epoch on its s % sample, which sample-level DP accounts: ALA runs
        at every round's broadcast, on every client."""
        return [*super().local_lengths(), {"epochs": 1, "share": self.ala.s / 100}]


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
