"""APPLE (Luo and Wu, IJCAI 2022, arXiv:2110.08394): personalized models mix all clients' core models, learned weights.

Client i owns a core model w_i^(c) and a directed-relationship (DR) vector p_i ∈ R^N; its
personalized model is w_i^(p) = Σ_j p_ij w_j^(c). Each round the server sends every client all N
core models (``server_message``; PFLlib's serverapple.py sends all, and the FedALA paper ran APPLE
with M = N = 20 downloads); the client builds w_i^(p) from them (``pre_local_init``: what is
evaluated) and, per mini-batch of ``federation.local_epochs`` epochs (``local_train``), takes one
gradient step on its loss F_i(w_i^(p)) + λ(r) μ/2 ‖p_i − p_i^(0)‖² in its own core and in p_i,
both at the same point, the other cores fixed:

    w_i^(c) ← w_i^(c) − η_c p_ii ∇F_i(w_i^(p))
    p_ij    ← p_ij − η_p (⟨∇F_i(w_i^(p)), w_j^(c)⟩ + λ(r) μ (p_ij − p_ij^(0)))

λ(r) = (1 + cos(π r / L)) / 2 for the training rounds r = 0, 1, ... below L, then 0 (the cosine
loss scheduler; ``proximal_weight``), so p_i may leave its start p_i^(0) = (n_j / Σ_k n_k)_j (the
clients' training-set shares) more and more. The client uploads w_i^(c); the server stores it
(``aggregate``). Core models are server state, p_i and w_i^(p) the client's (store).

Sources: the update rules, p_i^(0) and λ(r) at round r as in the authors' code (pFL-APPLE:
train_APPLE.py, utils/losses.py, utils/apple.py); η_c = ``federation.lr`` × N and the end of the
cosine schedule, L = R = ``federation.rounds`` (``method.schedule_rounds`` sets another L), as in
PFLlib's clientapple.py. Departures: PFLlib starts p_i at 1/N, lags λ by a round, and replaces
⟨∇F, w_j^(c)⟩ by the mean over tensors of the element-wise mean of ∇F ⊙ w_j^(c); the authors' code
uses SGD with momentum 0.9, and its term μ‖p_i − p_i^(0)‖² has no ½. Here both steps are plain
gradient steps (``federation.momentum`` must be 0), on the CPU, without ``data.augment``. The
paper's limited-bandwidth variant (M < N downloads chosen by p_i) is not implemented. BatchNorm
statistics are not mixed: w_i^(p) takes its own core's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from plfl.client import TrainResult
from plfl.methods.base import FederationContext, Method, require_plain_steps
from plfl.methods.batches import client_batches
from plfl.methods.schemas import APPLEConfig
from plfl.seeding import LOCAL_TRAINING, derive_seed
from plfl.state import Params

RELATIONSHIPS = "relationships"  # store key: the client's DR vector p_i, (N,)


def proximal_weight(round_index: int, mu: float, end: int) -> float:
    """λ(r) μ = μ (1 + cos(π r / L)) / 2 for training rounds r < L (counted from 0), 0 from r = L on."""
    return mu * (1 + math.cos(math.pi * round_index / end)) / 2 if round_index < end else 0.0


def stacked_cores(message: Params, keys: list[str], n: int) -> Params:
    """The N core models of a message (keys ``"j/name"``) as name → (N, *shape), for ``keys`` in order."""
    return {k: torch.stack([message[f"{j}/{k}"] for j in range(n)]) for k in keys}


def mixture(p: torch.Tensor, others: Params, own: Params, client_id: int) -> Params:
    """w^(p) = Σ_{j≠i} p_j w_j^(c) + p_i w_i^(c) per tensor; p: (N,), others: name → (N, *shape) with zeros
    in row i = ``client_id``, own: name → (*shape), w_i^(c)."""
    return {k: torch.tensordot(p, others[k], dims=1) + p[client_id] * v for k, v in own.items()}


def local_step(model: nn.Module, own: Params, p: torch.Tensor, others: Params, buffers: Params, client_id: int,
               batch: tuple[torch.Tensor, torch.Tensor], p0: torch.Tensor, weight: float, core_lr: float,
               dr_lr: float) -> tuple[Params, torch.Tensor, float]:
    """One mini-batch of APPLE's local training: a gradient step in w_i^(c) and p_i at the same point.

    Args:
        model: the architecture; own: w_i^(c)'s parameters; p: p_i (N,); others: the cores (see
            :func:`mixture`); buffers: w_i^(c)'s buffers (BatchNorm updates them in place);
        batch: (x, y); p0: p_i^(0) (N,); weight: λ(r) μ; core_lr: η_c; dr_lr: η_p.

    Returns:
        the new w_i^(c) and p_i, and the cross-entropy F_i(w_i^(p)) before the step.
    """
    own = {k: v.detach().requires_grad_() for k, v in own.items()}
    p = p.detach().requires_grad_()
    x, y = batch
    cross_entropy = F.cross_entropy(functional_call(model, {**buffers, **mixture(p, others, own, client_id)}, (x,)), y)
    loss = cross_entropy + weight / 2 * (p - p0).square().sum()
    *own_grads, p_grad = torch.autograd.grad(loss, [*own.values(), p])
    new_own = {k: (v - core_lr * g).detach() for (k, v), g in zip(own.items(), own_grads)}
    return new_own, (p - dr_lr * p_grad).detach(), cross_entropy.item()


class APPLE(Method):
    """Clients learn p_i over all downloaded core models and train their own core (see the module docstring)."""

    name = "apple"
    server_state = ("cores",)

    def __init__(self, config: APPLEConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_plain_steps("apple", context, "the core models and p_i")
        self.parameter_names = [name for name, _ in context.model.named_parameters()]
        clients = context.data.clients
        self.cores = {k: torch.stack([v] * len(clients)) for k, v in initial_params.items()}  # w_j^(c): (N, ...)
        sizes = torch.tensor([c.num_train for c in clients], dtype=torch.float32)
        self.p0 = sizes / sizes.sum()

    def server_message(self, client_id: int) -> Params:
        """All N core models, w_j^(c) under the keys ``"j/name"``."""
        return {f"{j}/{k}": stacked[j] for k, stacked in self.cores.items() for j in range(len(stacked))}

    def pre_local_init(self, client_id: int, message: Params, round_: int) -> Params:
        """w_i^(p) = Σ_j p_ij w_j^(c) from the received cores; buffers are the client's own core's."""
        cores = stacked_cores(message, list(self.cores), len(self.context.data.clients))
        p = self.store.get(client_id, RELATIONSHIPS, self.p0)
        return {k: torch.tensordot(p, v, dims=1) if k in self.parameter_names else v[client_id].clone()
                for k, v in cores.items()}

    def local_train(self, client_id: int, params: Params, round_: int) -> TrainResult:
        """One step of w_i^(c) and p_i per mini-batch; keeps p_i, returns the new w_i^(p) and uploads w_i^(c)."""
        cfg, federation = self.config, self.context.federation
        # The cores received at this round's broadcast: the server changes them only in aggregate.
        cores = stacked_cores(self.server_message(client_id), list(self.cores), len(self.context.data.clients))
        own = {k: cores[k][client_id].clone() for k in self.parameter_names}
        buffers = {k: v[client_id].clone() for k, v in cores.items() if k not in own}
        index = torch.tensor([client_id])
        others = {k: cores[k].index_fill(0, index, 0.0) for k in self.parameter_names}
        p = self.store.get(client_id, RELATIONSHIPS, self.p0)
        end = federation.rounds if cfg.schedule_rounds is None else cfg.schedule_rounds
        weight = proximal_weight(round_ - 1, cfg.mu, end)
        core_lr = federation.lr * len(self.context.data.clients)
        seed = derive_seed(self.seed, round_, client_id, LOCAL_TRAINING)
        self.context.model.train()
        loss_sum, seen = 0.0, 0
        for x, y in client_batches(self.context.data.clients[client_id], federation.batch_size, seed,
                                   federation.local_epochs, self.context.local_trainer.batch_norm):
            own, p, loss = local_step(self.context.model, own, p, others, buffers, client_id, (x, y), self.p0, weight,
                                      core_lr, cfg.dr_lr)
            loss_sum, seen = loss_sum + loss * len(y), seen + len(y)
        self.store.set(client_id, RELATIONSHIPS, p)
        personal = {**buffers, **mixture(p, others, own, client_id)}
        in_order = lambda state: {k: state[k] for k in cores}  # noqa: E731  the model's key order
        return TrainResult(in_order(personal), loss_sum / seen, seen, upload=in_order({**buffers, **own}))

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        """w_i^(c) ← each trained client's upload, in new tensors (messages already sent keep their values)."""
        self.cores = {k: torch.stack([messages[j][k] if j in messages else old for j, old in enumerate(stacked)])
                      for k, stacked in self.cores.items()}

    def round_metrics(self) -> dict[str, float]:
        """``dr_self_mean``: mean over clients of their own weight p_ii."""
        n = len(self.context.data.clients)
        return {"dr_self_mean": sum(self.store.get(i, RELATIONSHIPS, self.p0)[i].item() for i in range(n)) / n}
