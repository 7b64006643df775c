"""APPLE (Luo and Wu, IJCAI 2022, arXiv:2110.08394): personalized models mix all clients' core models, learned weights.

Client i owns a core model w_i^(c) and a directed-relationship (DR) vector p_i ∈ R^N; its
personalized model is w_i^(p) = Σ_j p_ij w_j^(c). Each round the server sends every client all N
core models (``server_message``, name → ``(N, *shape)``; PFLlib's serverapple.py sends all, and the
FedALA paper ran APPLE with M = N = 20 downloads); the client builds w_i^(p) from them
(``pre_local_init``: what is evaluated) and, per mini-batch of ``federation.local_epochs`` epochs
(``local_train``, the step task :class:`APPLEStep`), takes one gradient step on its loss
F_i(w_i^(p)) + λ(r) μ/2 ‖p_i − p_i^(0)‖² in its own core and in p_i, both at the same point, the
other cores fixed:

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
⟨∇F, w_j^(c)⟩ by the mean over tensors of the element-wise mean of ∇F ⊙ w_j^(c); after a client's
training it replaces the client's core by a copy of its personalized model (``self.model_c =
copy.deepcopy(self.model)``; the restoring loop before it copies the core onto itself), so from the
second round on the cores PFLlib shares are mixtures (docs: fidelity, "Beside PFLlib"); the authors' code
uses SGD with momentum 0.9, and its term μ‖p_i − p_i^(0)‖² has no ½. Here both steps are plain
gradient steps (``federation.momentum`` must be 0), without ``data.augment``. The
paper's limited-bandwidth variant (M < N downloads chosen by p_i) is not implemented. BatchNorm
statistics are not mixed: w_i^(p) takes its own core's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch.func import grad

from plfl.fields import checked
from plfl.methods.base import FederationContext, Method, MethodConfig, require_plain_steps
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
    sample_count,
)

RELATIONSHIPS = "relationships"  # store key: the client's DR vector p_i, (N,)


@dataclass
class APPLEConfig(MethodConfig):
    """APPLE's keys (Luo and Wu, IJCAI 2022). The core models step by ``federation.lr`` × N, as PFLlib's
    clientapple.py. Its personalized models are its own, so there is no ``method.ala``."""

    dr_lr: float = checked(
        0.001,
        lambda v: v >= 0,
        "a number >= 0",
        "η_p: step size of the directed-relationship vector p_i (the authors' lr_coef, 0.001; "
        "PFLlib's dr_learning_rate default 0 never moves p_i)",
    )
    mu: float = checked(
        0.1,
        lambda v: v >= 0,
        "a number >= 0",
        "μ: weight of λ(r) μ/2 ‖p_i − p_i^(0)‖² (the authors' --mu, 0.1, whose term has no ½; "
        "PFLlib's shared -mu default 0 drops the term)",
    )
    schedule_rounds: Optional[int] = checked(
        None,
        lambda v: v is None or v >= 0,
        "null or an integer >= 0",
        "L: λ(r) falls from 1 to 0 by a cosine over training rounds r = 0..L−1, then stays 0; null: "
        "federation.rounds, as PFLlib's -L default 1.0 (L = 1.0 × rounds; then extending a run by --resume "
        "moves L for the rounds still to come)",
    )


def proximal_weight(round_index: int, mu: float, end: int) -> float:
    """λ(r) μ = μ (1 + cos(π r / L)) / 2 for training rounds r < L (counted from 0), 0 from r = L on."""
    return mu * (1 + math.cos(math.pi * round_index / end)) / 2 if round_index < end else 0.0


def mixture(p: torch.Tensor, own_index: torch.Tensor, cores: Params, own: Params) -> Params:
    """w^(p) = Σ_{j≠i} p_j w_j^(c) + p_i w_i^(c) for the tensors of ``own`` (w_i^(c)); p: (N,), own_index:
    (N,) one-hot of i, cores: name → ``(N, *shape)``, whose row i is replaced by ``own``."""
    others, self_weight = p * (1 - own_index), (p * own_index).sum()
    return {k: torch.tensordot(others, cores[k], dims=1) + self_weight * v for k, v in own.items()}


@dataclass(frozen=True)
class APPLEStep(Step):
    """One mini-batch of APPLE's local training: a gradient step in w_i^(c) and p_i at the same point.

    State: w_i^(c) (the ``parameters`` and the buffers of the model) and ``relationships`` (p_i, (N,));
    inputs: ``own_index`` (the one-hot (N,) of i) and ``p0`` (p_i^(0), (N,)); shared: every client's core
    (name → ``(N, *shape)``). ``weight``: λ(r) μ; ``core_lr``: η_c; ``dr_lr``: η_p. The loss returned is the
    cross-entropy F_i(w_i^(p)) before the step.
    """

    work = "APPLE's local steps"
    parameters: tuple[str, ...]
    weight: float
    core_lr: float
    dr_lr: float

    def __call__(self, network: Network, state: Params, inputs: Params, shared: Params, batch: Batch) -> StepOutput:
        buffers = {k: v for k, v in state.items() if k not in self.parameters and k != RELATIONSHIPS}

        def loss(own: Params, p: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, Params]]:
            personal = mixture(p, inputs["own_index"], shared, own)
            logits, statistics = network({**buffers, **personal}, batch.x, batch.mask)
            cross_entropy = masked_cross_entropy(logits, batch.y, batch.mask)
            return cross_entropy + self.weight / 2 * (p - inputs["p0"]).square().sum(), (cross_entropy, statistics)

        own, p = {k: state[k] for k in self.parameters}, state[RELATIONSHIPS]
        (own_grads, p_grad), (cross_entropy, statistics) = grad(loss, argnums=(0, 1), has_aux=True)(own, p)
        new_own = {k: v - self.core_lr * own_grads[k] for k, v in own.items()}
        return StepOutput(
            {**statistics, **new_own, RELATIONSHIPS: p - self.dr_lr * p_grad}, cross_entropy, sample_count(batch)
        )


class APPLE(Method):
    """APPLE (Luo and Wu, IJCAI 2022): personalized mixtures of all core models, weights learned.

    Clients learn p_i over all downloaded core models and train their own core (see the module docstring).
    """

    name = "apple"
    not_averaging = "mixes the clients' downloaded core models per client with learned weights"
    config_class = APPLEConfig
    server_state = ("cores",)

    def __init__(self, config: APPLEConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_plain_steps("apple", context, "the core models and p_i")
        self.parameter_names = tuple(name for name, _ in context.architecture.named_parameters())
        clients = context.data.clients
        self.cores = {k: torch.stack([v] * len(clients)) for k, v in initial_params.items()}  # w_j^(c): (N, ...)
        sizes = torch.tensor([c.num_train for c in clients], dtype=torch.float32)
        self.p0 = sizes / sizes.sum()

    def server_message(self, client_id: int, round_: int) -> Params:
        """All N core models, name → ``(N, *shape)``: the same tensors for every client."""
        return self.cores

    def pre_local_init(self, client_id: int, message: Params, round_: int) -> Params:
        """w_i^(p) = Σ_j p_ij w_j^(c) from the received cores; buffers are the client's own core's."""
        p = self.store.get(client_id, RELATIONSHIPS, self.p0)
        return {
            k: torch.tensordot(p, v, dims=1) if k in self.parameter_names else v[client_id].clone()
            for k, v in message.items()
        }

    def local_train(self, client_id: int, params: Params, message: Params, round_: int) -> Work[TrainResult]:
        """One step of w_i^(c) and p_i per mini-batch; keeps p_i, returns the new w_i^(p) and uploads w_i^(c)."""
        cfg, federation = self.config, self.context.federation
        end = federation.rounds if cfg.schedule_rounds is None else cfg.schedule_rounds
        step = APPLEStep(
            self.parameter_names,
            proximal_weight(round_ - 1, cfg.mu, end),
            federation.lr * len(self.context.data.clients),
            cfg.dr_lr,
        )
        own_index = torch.zeros(len(self.p0)).index_fill_(0, torch.tensor([client_id]), 1.0)
        state = {
            **{k: v[client_id].clone() for k, v in message.items()},
            RELATIONSHIPS: self.store.get(client_id, RELATIONSHIPS, self.p0),
        }
        result: StepResult = yield self.step_task(
            client_id,
            step,
            state,
            round_,
            "local_training",
            shared=message,
            inputs={"own_index": own_index, "p0": self.p0},
        )
        p = result.state[RELATIONSHIPS]
        self.store.set(client_id, RELATIONSHIPS, p)
        own = {k: result.state[k] for k in message}  # the model's key order
        parameters = mixture(p, own_index, message, {k: own[k] for k in self.parameter_names})
        personal = {k: parameters.get(k, v) for k, v in own.items()}
        return TrainResult(personal, result.loss, result.samples_seen, upload=own)

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        """w_i^(c) ← each trained client's upload, in new tensors (messages already sent keep their values)."""
        self.cores = {
            k: torch.stack([messages[j][k] if j in messages else old for j, old in enumerate(stacked)])
            for k, stacked in self.cores.items()
        }

    def round_metrics(self, round_: int) -> dict[str, float]:
        """``dr_self_mean``: mean over clients of their own weight p_ii."""
        n = len(self.context.data.clients)
        return {"dr_self_mean": sum(self.store.get(i, RELATIONSHIPS, self.p0)[i].item() for i in range(n)) / n}
