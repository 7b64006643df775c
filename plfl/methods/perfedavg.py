"""Per-FedAvg (Fallah, Mokhtari and Ozdaglar, NeurIPS 2020, arXiv:2002.07948): FedAvg of MAML steps.

The clients learn a shared w that one gradient step adapts to each of them: the objective is
F(w) = 1/n Σ_i f_i(w − α∇f_i(w)), with ∇F_i(w) = (I − α∇²f_i(w)) ∇f_i(w − α∇f_i(w)). Client
(``local_train``, Algorithm 1): from the received global w, each step draws batches D, D′ (, D″),
takes the temporary step w̃ = w − α∇f_i(w; D), then

- FO (Per-FedAvg (FO)): w ← w − β∇f_i(w̃; D′), the Hessian term dropped;
- HF (Per-FedAvg (HF)): w ← w − β(I − α∇²f_i(w; D″))∇f_i(w̃; D′).

Server (``aggregate``): FedAvg's average. Evaluated (``pre_local_init``, PFLlib's
``evaluate_one_step``): the received w after one step of α on one training batch; the next
round's training starts from the received w again. As PFLlib's ``clientperavg.py``: a step takes
one loader batch of 2B samples (3B for HF; B = ``federation.batch_size``, plfl's seeded order)
split into D, D′ (, D″) of B each, and α = β = ``federation.lr`` by default.
Departures: HF's Hessian-vector product is exact (double backward, the Hessian never formed),
where the paper takes a gradient difference with a small δ; PFLlib has no HF. PFLlib drops the
last short loader batch; here it is used while it holds a sample for each of D, D′ (, D″).
PFLlib's server calls each client's ``train()`` twice per round; ``federation.local_epochs=2``
matches that.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from plfl.client import TrainResult, batch_loader
from plfl.methods.base import FederationContext, require_plain_steps
from plfl.methods.fedavg import FedAvg
from plfl.methods.schemas import PerFedAvgConfig
from plfl.seeding import ADAPTATION, LOCAL_TRAINING, derive_seed
from plfl.state import Params

Batch = tuple[torch.Tensor, torch.Tensor]
Loss = Callable[[Params, torch.Tensor, torch.Tensor], torch.Tensor]  # f(w; (x, y)), a scalar


def gradient(value: torch.Tensor, params: Params, **options) -> Params:
    """∂ value / ∂ params by reverse-mode autodiff (``torch.autograd.grad`` with ``options``)."""
    return dict(zip(params, torch.autograd.grad(value, list(params.values()), **options)))


def leaves(params: Params) -> Params:
    """Detached copies of ``params`` that record gradients."""
    return {k: v.detach().requires_grad_() for k, v in params.items()}


def hessian_vector_product(loss: Loss, params: Params, vector: Params, batch: Batch) -> Params:
    """∇²f(w; D″) v by double backward: the gradient of ⟨∇f(w; D″), v⟩; the Hessian is never formed.

    Args:
        loss: f, twice differentiable in its params; params: w; vector: v, the same keys and shapes;
        batch: D″ = (x, y).
    """
    w = leaves(params)
    first = gradient(loss(w, *batch), w, create_graph=True)
    return gradient(list(first.values()), w, grad_outputs=[vector[k] for k in w])


def meta_gradient(loss: Loss, params: Params, batches: list[Batch], alpha: float) -> tuple[Params, float]:
    """Per-FedAvg's stochastic gradient of F_i at w, and f(w; D).

    Args:
        loss: f; params: w (name → tensor); alpha: α > 0.
        batches: [D, D′] for FO: ∇f(w̃; D′) with w̃ = w − α∇f(w; D); [D, D′, D″] for HF:
            (I − α∇²f(w; D″)) ∇f(w̃; D′).

    Returns:
        (the gradient, same keys and shapes as ``params``; f(w; D)).
    """
    (x, y), outer, *hessian = batches
    w = leaves(params)
    value = loss(w, x, y)
    inner = gradient(value, w)
    adapted = leaves({k: params[k] - alpha * inner[k] for k in params})
    outer_gradient = gradient(loss(adapted, *outer), adapted)
    if hessian:
        product = hessian_vector_product(loss, params, outer_gradient, hessian[0])
        outer_gradient = {k: g - alpha * product[k] for k, g in outer_gradient.items()}
    return outer_gradient, value.item()


def cross_entropy(model: nn.Module, buffers: Params) -> Loss:
    """f(w; (x, y)): ``model``'s mean cross-entropy with parameters w and the given buffers."""
    return lambda params, x, y: F.cross_entropy(functional_call(model, {**params, **buffers}, (x,)), y)


class PerFedAvg(FedAvg):
    """FedAvg's server; the clients take Per-FedAvg's steps and are evaluated one step adapted."""

    name = "perfedavg"

    def __init__(self, config: PerFedAvgConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_plain_steps("perfedavg", context, "w (Algorithm 1's meta-steps)")
        lr = context.federation.lr
        self.alpha = lr if config.alpha is None else config.alpha
        self.beta = lr if config.beta is None else config.beta
        self.batches_per_step = 3 if config.variant == "hf" else 2
        self.parameter_names = {name for name, _ in context.model.named_parameters()}
        self.state_keys = list(initial_params)  # the state dict's order, kept in what is returned

    def split(self, state: Params) -> tuple[Params, Params]:
        """Fresh copies of (parameters, buffers) of a state dict (buffers change in place in train mode)."""
        params = {k: v.clone() for k, v in state.items() if k in self.parameter_names}
        return params, {k: v.clone() for k, v in state.items() if k not in self.parameter_names}

    def join(self, params: Params, buffers: Params) -> Params:
        return {k: params[k] if k in params else buffers[k] for k in self.state_keys}

    def pre_local_init(self, client_id: int, message: Optional[Params], round_: int) -> Params:
        """The evaluated model: the received w after one step of α on one training batch of B samples
        (stream ADAPTATION)."""
        data = self.context.data.clients[client_id]
        seed = derive_seed(self.seed, round_, client_id, ADAPTATION)
        x, y = next(iter(batch_loader(data.x_train, data.y_train, self.context.federation.batch_size, seed)))
        params, buffers = self.split(message)
        self.context.model.train()
        w = leaves(params)
        step = gradient(cross_entropy(self.context.model, buffers)(w, x, y), w)
        return self.join({k: v - self.alpha * step[k] for k, v in params.items()}, buffers)

    def local_train(self, client_id: int, params: Params, round_: int) -> TrainResult:
        """``federation.local_epochs`` passes of Per-FedAvg steps (Algorithm 1) from the received global
        model, not from ``params`` (the evaluated, adapted one). The loss reported is f(w; D)."""
        data, fed = self.context.data.clients[client_id], self.context.federation
        weights, buffers = self.split(self.server_message(client_id))
        loss = cross_entropy(self.context.model, buffers)
        self.context.model.train()
        k = self.batches_per_step
        loader = batch_loader(data.x_train, data.y_train, k * fed.batch_size,
                              derive_seed(self.seed, round_, client_id, LOCAL_TRAINING))
        loss_sum, first_samples, seen = 0.0, 0, 0
        for epoch in range(fed.local_epochs):
            loader.sampler.set_epoch(epoch)
            for x, y in loader:
                batches = list(zip(x.split(fed.batch_size), y.split(fed.batch_size)))
                if len(batches) < k:  # the last loader batch, too short for D, D′ (, D″)
                    continue
                step, value = meta_gradient(loss, weights, batches, self.alpha)
                weights = {name: w - self.beta * step[name] for name, w in weights.items()}
                loss_sum += value * len(batches[0][1])
                first_samples += len(batches[0][1])
                seen += len(y)
        mean = loss_sum / first_samples if first_samples else float("nan")
        return TrainResult(self.join(weights, buffers), mean, seen)
