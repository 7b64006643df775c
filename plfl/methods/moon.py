"""MOON (Li, He and Song, "Model-Contrastive Federated Learning", CVPR 2021, arXiv:2103.16257).

FedAvg whose clients add a model-level contrastive term to their local loss. In round t a sampled client i,
from its initialised model (the received global model w^t, or ALA's initialisation with ``method.ala``),
trains w for ``federation.local_epochs`` epochs, one SGD step per mini-batch (x, y) (``local_train``, the
step task :class:`MOONStep`) on

    ℓ = ℓ_sup(w; x, y) + μ ℓ_con                                                          (Eq. 4)
    ℓ_con = −log( exp(sim(z, z_glob)/τ) / (exp(sim(z, z_glob)/τ) + exp(sim(z, z_prev)/τ)) )   (Eq. 3)

with ℓ_sup the cross-entropy, sim the cosine similarity and z, z_glob, z_prev the representations of x by
the model being trained, by the frozen global model w^t and by the frozen model the client trained in its
previous round (:func:`contrastive_loss`, averaged over the batch; μ = ``method.mu``, τ = ``method.tau``).
The client uploads w and keeps it as its next z_prev model (the store's ``moon_previous``, written in
``client_message``, which runs only for clients whose training succeeded); before its first training a
client's previous model is the initial model, as PFLlib's copy of it. The server averages the uploads weighted
by the clients' training samples, as FedAvg (Alg. 1), and each client evaluates its initialised model (the
received global model, or ALA's initialisation of it).

Departures: the paper computes z with a projection head (a 2-layer MLP) on top of the base encoder, trained
with it; plfl's models have no such head, so z is the body's output (the features the classifier head
reads), as PFLlib's clientmoon.py takes ``model.base``. PFLlib's shared ``-mu`` default (0) would switch the
term off: μ = 1 and τ = 0.5 are the authors' code defaults (the paper tuned μ per data set: 5 for CIFAR-10,
1 for CIFAR-100 and Tiny-ImageNet, τ = 0.5 throughout). The frozen models run in training mode, as
PFLlib's (their BatchNorm layers, if any, normalise by the batch's statistics; their running statistics are
left as they are). The steps are plain SGD (``federation.momentum`` must be 0) without ``data.augment``; the
reported loss is the cross-entropy alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.func import grad

from plfl.fields import checked
from plfl.methods.base import FederationContext, require_plain_steps
from plfl.methods.fedavg import FedAvg, FedAvgConfig
from plfl.state import Params
from plfl.tasks import (
    Batch,
    Network,
    Step,
    StepOutput,
    StepResult,
    TrainResult,
    Work,
    masked_cross_entropy,
    masked_mean,
    sample_count,
)

PREVIOUS = "moon_previous"  # the store's key of a client's model from its last training


@dataclass
class MOONConfig(FedAvgConfig):
    """MOON's keys (Li et al., CVPR 2021, Eq. 3–4). Derived from FedAvgConfig: a client starts from the
    received model, so ``method.ala`` works here too."""

    mu: float = checked(
        1.0,
        lambda v: v >= 0,
        "a number >= 0",
        "μ: weight of the model-contrastive loss ℓ_con (Eq. 4); the authors' code default 1 (PFLlib's shared "
        "-mu default 0 switches MOON off)",
    )
    tau: float = checked(
        0.5,
        lambda v: v > 0,
        "a number > 0",
        "τ: temperature of ℓ_con (Eq. 3); the paper's 0.5 (PFLlib's -tau default is 1)",
    )


def contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """ℓ_con of Eq. 3 per sample: −log(e^{s_g/τ} / (e^{s_g/τ} + e^{s_p/τ})) = softplus((s_p − s_g)/τ), with
    s_g = sim(z, z_glob) and s_p = sim(z, z_prev) the cosine similarities of each row.

    Args:
        z, z_glob, z_prev: (B, F) representations of one batch by the trained, the global and the previous model.
        tau: τ > 0.

    Returns:
        (B,) the per-sample losses, in (0, ∞); log 2 where z_glob and z_prev agree.
    """
    s_glob = F.cosine_similarity(z, z_glob, dim=1)
    s_prev = F.cosine_similarity(z, z_prev, dim=1)
    return F.softplus((s_prev - s_glob) / tau)


@dataclass(frozen=True)
class MOONStep(Step):
    """One SGD step of w on ℓ_sup + μ ℓ_con (Eq. 4) on a mini-batch: the state is w (the ``parameters`` and the
    model's buffers), the input the client's previous model and the shared tensors the received global model
    (both state dicts, frozen). The loss returned is the cross-entropy."""

    work = "MOON's local steps"
    parameters: tuple[str, ...]
    mu: float
    tau: float
    lr: float

    def __call__(self, network: Network, state: Params, inputs: Params, shared: Params, batch: Batch) -> StepOutput:
        z_glob, _ = network(shared, batch.x, batch.mask, "body")
        z_prev, _ = network(inputs, batch.x, batch.mask, "body")
        buffers = {k: v for k, v in state.items() if k not in self.parameters}

        def loss(w: Params) -> tuple[torch.Tensor, tuple[torch.Tensor, Params]]:
            z, body_statistics = network({**buffers, **w}, batch.x, batch.mask, "body")
            logits, head_statistics = network({**buffers, **w}, z, batch.mask, "head")
            cross_entropy = masked_cross_entropy(logits, batch.y, batch.mask)
            contrastive = masked_mean(contrastive_loss(z, z_glob.detach(), z_prev.detach(), self.tau), batch.mask)
            return cross_entropy + self.mu * contrastive, (cross_entropy, {**body_statistics, **head_statistics})

        w = {k: state[k] for k in self.parameters}
        grads, (cross_entropy, statistics) = grad(loss, has_aux=True)(w)
        return StepOutput(
            {**statistics, **{k: v - self.lr * grads[k] for k, v in w.items()}}, cross_entropy, sample_count(batch)
        )


class MOON(FedAvg):
    """MOON (Li et al., CVPR 2021): FedAvg with a model-contrastive term in the local loss.

    Clients pull their representations toward the global model's and away from their previous model's.
    """

    name = "moon"
    config_class = MOONConfig

    def __init__(self, config: MOONConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_plain_steps("moon", context, "w (its loss has the contrastive term)")
        self.parameter_names = tuple(name for name, _ in context.architecture.named_parameters())
        self.initial_params = initial_params  # every client's previous model before its first training

    def previous_model(self, client_id: int) -> Params:
        """The model client ``client_id`` trained in its last round (z_prev's); the initial model before then."""
        return self.store.get(client_id, PREVIOUS) or self.initial_params

    def local_train(self, client_id: int, params: Params, message: Params, round_: int) -> Work[TrainResult]:
        """w trained from ``params`` (the client's initialised model) on Eq. 4, with the received global model
        (``message``) and the client's previous model frozen; w is uploaded."""
        cfg = self.config
        step = MOONStep(self.parameter_names, cfg.mu, cfg.tau, self.context.federation.lr)
        result: StepResult = yield self.step_task(
            client_id,
            step,
            params,
            round_,
            "local_training",
            inputs=self.previous_model(client_id),
            shared=message,
        )
        return TrainResult({k: result.state[k] for k in params}, result.loss, result.samples_seen)

    def client_message(self, client_id: int, result: TrainResult, round_: int) -> Optional[Params]:
        """The trained w, uploaded; the client also keeps it as its previous model for the next round's z_prev
        (only clients whose training succeeded get here)."""
        self.store.set(client_id, PREVIOUS, result.params)
        return super().client_message(client_id, result, round_)
