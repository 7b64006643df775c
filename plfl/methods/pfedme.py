"""pFedMe (Dinh, Tran and Nguyen, NeurIPS 2020, arXiv:2006.08848): personalized models from Moreau envelopes.

Client i's objective is the Moreau envelope F_i(w) = min_θ f_i(θ) + λ/2 ‖θ − w‖² of its loss f_i;
the minimiser θ̂_i(w) is its personalized model. Alg. 1, per round, a sampled client
starts its local w and θ from the received global Θ and, per mini-batch D of
``federation.local_epochs`` epochs (``local_train``):

- θ ≈ argmin_θ f_i(θ; D) + λ/2 ‖θ − w‖² by K gradient steps
  θ ← θ − lr_p (∇f_i(θ; D) + λ (θ − w)) (``inner_solution``; K = ``method.k``,
  lr_p = ``method.personal_lr``), warm-started from the previous batch's θ;
- w ← w − η λ (w − θ) (``local_update``; η = ``federation.lr``); w is uploaded.

Server (``aggregate``): Θ ← (1 − β) Θ + β Θ̄, Θ̄ the uploads' mean (``beta_mix``; β = ``method.beta``).
The client keeps and evaluates its last θ (``pre_local_init``); the global Θ is evaluated on all
clients' test data. Batches come from the same shuffling as every method's local training
(stream LOCAL_TRAINING); the loop is functional (torch.func), on the CPU, with plain gradient
steps, so ``federation.momentum`` must be 0. The reported loss is f_i(θ; D) averaged over all
inner steps; BatchNorm statistics, if any, follow the inner steps and go with both θ and w.
Departures: Θ̄ is the sample-weighted mean, as PFLlib computes it (Alg. 1: the
plain mean); PFLlib's inner step adds a weight decay 0.001·θ that the paper lacks, left out here;
PFLlib's per-client evaluation ends up evaluating the received global model (its θ and the
model share tensors), while plfl evaluates θ, as the paper does.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value

from plfl.client import TrainResult, batch_loader
from plfl.methods.base import FederationContext, require_plain_steps
from plfl.methods.fedavg import FedAvg
from plfl.methods.schemas import PFedMeConfig
from plfl.seeding import LOCAL_TRAINING, derive_seed
from plfl.state import Params

# θ → (∇_θ f(θ; D), f(θ; D)) on one mini-batch D.
GradFn = Callable[[Params], tuple[Params, torch.Tensor]]


def inner_solution(grad_fn: GradFn, theta: Params, w: Params, lam: float, lr: float,
                   steps: int) -> tuple[Params, float]:
    """``steps`` (K) gradient steps θ ← θ − lr (∇f(θ) + λ (θ − w)) on f(θ) + λ/2 ‖θ − w‖².

    Returns:
        the new θ (same keys as ``theta``) and the mean of f over the steps (at each step's start).
    """
    total = 0.0
    for _ in range(steps):
        grads, loss = grad_fn(theta)
        theta = {k: t - lr * (grads[k] + lam * (t - w[k])) for k, t in theta.items()}
        total += float(loss)
    return theta, total / steps


def local_update(w: Params, theta: Params, lam: float, lr: float) -> Params:
    """w ← w − η λ (w − θ): the local model's step towards the personalized θ (Alg. 1)."""
    return {k: v - lr * lam * (v - theta[k]) for k, v in w.items()}


def beta_mix(previous: Params, average: Params, beta: float) -> Params:
    """(1 − β) Θ + β Θ̄ per floating-point tensor (Alg. 1); integer buffers are Θ̄'s. β = 1 gives Θ̄."""
    return {k: (1 - beta) * previous[k] + beta * v if v.is_floating_point() else v for k, v in average.items()}


class PFedMe(FedAvg):
    """Clients upload w after Alg. 1's bi-level updates and keep θ; the server mixes by β."""

    name = "pfedme"

    def __init__(self, config: PFedMeConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_plain_steps("pfedme", context, "θ and w (Alg. 1)")
        model = context.model
        self.parameter_names = [name for name, _ in model.named_parameters()]

        def loss(theta: Params, buffers: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(functional_call(model, {**buffers, **theta}, (x,)), y)

        self.loss_grad = grad_and_value(loss)

    def pre_local_init(self, client_id: int, message: Params, round_: int) -> Params:
        """The client's own θ; before its first training, the received global model."""
        return self.store.get(client_id, "model") or {k: v.clone() for k, v in message.items()}

    def local_train(self, client_id: int, params: Params, round_: int) -> TrainResult:
        """Alg. 1's client: from w = θ = Θ, per mini-batch K inner steps for θ, then one step of w."""
        cfg, federation = self.config, self.context.federation
        received = self.server_message(client_id)  # Θ: unchanged since this round's broadcast
        # Copied: BatchNorm updates its statistics in place, which must not reach the global model.
        buffers = {k: v.clone() for k, v in received.items() if k not in self.parameter_names}
        w = {k: received[k] for k in self.parameter_names}
        theta = w
        data = self.context.data.clients[client_id]
        loader = batch_loader(data.x_train, data.y_train, federation.batch_size,
                              derive_seed(self.seed, round_, client_id, LOCAL_TRAINING))
        self.context.model.train()
        loss_sum, seen = 0.0, 0
        for epoch in range(federation.local_epochs):
            loader.sampler.set_epoch(epoch)  # the epoch's batch order, as Lightning asks for it
            for x, y in loader:
                theta, loss = inner_solution(lambda t: self.loss_grad(t, buffers, x, y), theta, w,
                                             cfg.lam, cfg.personal_lr, cfg.k)
                w = local_update(w, theta, cfg.lam, federation.lr)
                loss_sum, seen = loss_sum + loss * len(y), seen + len(y)
        state = lambda new: {k: new[k] if k in new else buffers[k] for k in received}  # noqa: E731  in order
        return TrainResult(state(theta), loss_sum / seen, seen, upload=state(w))

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        previous = self.global_params
        super().aggregate(messages, round_)  # self.global_params = Θ̄
        self.global_params = beta_mix(previous, self.global_params, self.config.beta)

    def global_model(self) -> Params:
        return self.global_params
