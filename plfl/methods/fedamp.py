"""FedAMP (Huang et al., AAAI 2021, arXiv:2007.03797): cloud models weighting all clients' models by similarity.

The server keeps every client's latest uploaded model w_j and builds, for client i, the
personalized cloud model (Eq. 6)

    u_i = Σ_j ξ_{i,j} w_j,  ξ_{i,j} = α_K A'(‖w_i − w_j‖²) (j ≠ i),  ξ_{i,i} = 1 − Σ_{j≠i} ξ_{i,j},

with the attention-inducing function A(x) = 1 − e^{−x/σ}, so A'(x) = e^{−x/σ}/σ: the
closer two models, the more they weigh in each other's cloud model (``attention_weights``,
``cloud_model``). Client i then trains its own w_i on F_i(w) + λ/(2α_K) ‖w − u_i‖² (Eq. 8),
a :class:`~plfl.tasks.ProximalTerm` with μ = λ/α_K anchored at u_i.

Hooks: ``aggregate`` stores the uploads and computes ξ; ``server_message`` sends u_i;
``pre_local_init`` keeps the client's own w_i, which is what it evaluates; ``local_train``
trains w_i from itself with the proximal term. As PFLlib (serveramp.py, clientamp.py):
training starts from the client's own model, not from u_i, and that model is evaluated;
defaults α_K = σ = λ = 1; only parameters are mixed and sent (buffers stay with the client);
before any upload, every w_j is the initial model and so is u_i.

Departures: PFLlib's current client adds λ/(2α_K)‖w − u_i‖ (the norm, not its square; its earlier versions
squared it, as Eq. 8 does), and builds it from detached copies (``.data``) of both models, so the term has no
gradient: PFLlib's FedAMP clients train as its Local clients do (the documentation's fidelity page, "Beside
PFLlib"). plfl squares the norm and differentiates it, as Eq. 8. PFLlib mixes the last round's uploads only;
plfl every client's latest (the same with join ratio 1). u_i is computed as w_i + Σ_{j≠i} ξ_{i,j} (w_j − w_i),
equal to Eq. 6, so that identical models give u_i = w_i bit for bit. Nothing keeps ξ_{i,i} ≥ 0: with α_K / σ >
1 / (N − 1) and close models it is negative and u_i extrapolates; ``self_weight_min`` logs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plfl.fields import checked
from plfl.methods.base import FederationContext, Method, MethodConfig
from plfl.state import Params
from plfl.tasks import ProximalTerm, TrainResult, Work


@dataclass
class FedAMPConfig(MethodConfig):
    """FedAMP's keys (Huang et al., AAAI 2021, Eq. 6 and 8); defaults: PFLlib's (main.py). The client keeps
    and trains its own model, so there is no ``method.ala``."""

    alpha_k: float = checked(
        1.0,
        lambda v: v > 0,
        "a number > 0",
        "α_K: step of the attentive message passing, ξ_ij = α_K e^(−‖w_i − w_j‖²/σ)/σ; "
        "the proximal weight is λ/α_K (PFLlib's alphaK, 1.0)",
    )
    sigma: float = checked(
        1.0,
        lambda v: v > 0,
        "a number > 0",
        "σ: scale of the attention-inducing function A(x) = 1 − e^(−x/σ) (PFLlib's sigma, 1.0)",
    )
    lam: float = checked(
        1.0,
        lambda v: v >= 0,
        "a number >= 0",
        "λ: the client trains on F_i(w) + λ/(2α_K)‖w − u_i‖² (PFLlib's lamda, 1.0)",
    )


def attention_weights(models: Params, alpha: float, sigma: float) -> torch.Tensor:
    """ξ (Eq. 6) of N models; ``models``: name → (N, *shape) → (N, N), rows summing to 1.

    ξ_{i,j} = α e^{−‖w_i − w_j‖²/σ}/σ for j ≠ i (‖·‖ over all tensors of a model),
    ξ_{i,i} = 1 − Σ_{j≠i} ξ_{i,j}.
    """
    flat = torch.cat([t.flatten(1) for t in models.values()], dim=1)
    squared = torch.stack([(flat - row).square().sum(dim=1) for row in flat])  # exact: no ‖a‖²+‖b‖²−2ab
    xi = alpha * torch.exp(-squared / sigma) / sigma
    xi.fill_diagonal_(0.0)
    return xi + torch.diag(1.0 - xi.sum(dim=1))


def cloud_model(xi: torch.Tensor, client_id: int, models: Params) -> Params:
    """u_i = w_i + Σ_{j≠i} ξ_{i,j} (w_j − w_i), i.e. Σ_j ξ_{i,j} w_j (Eq. 6); ``xi``: ξ's row i, (N,)."""
    others = xi.clone()
    others[client_id] = 0.0
    return {k: w[client_id] + torch.tensordot(others, w - w[client_id], dims=1) for k, w in models.items()}


class FedAMP(Method):
    """FedAMP (Huang et al., AAAI 2021): cloud models mixing all clients' models by similarity.

    Clients train their own models pulled towards similarity-weighted cloud models (Eq. 6, 8).
    """

    name = "fedamp"
    not_averaging = "builds each client's cloud model from attention weights over the uploads"
    config_class = FedAMPConfig
    server_state = ("global_params", "models", "xi")

    def __init__(self, config: FedAMPConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        num_clients = len(context.data.clients)
        # w_j: every client's latest upload, parameters only, stacked (N, ...); the initial model at first.
        self.models = {
            name: torch.stack([initial_params[name]] * num_clients)
            for name, _ in context.architecture.named_parameters()
        }
        self.xi = attention_weights(self.models, config.alpha_k, config.sigma)

    def server_message(self, client_id: int, round_: int) -> Params:
        """u_i (Eq. 6)."""
        return cloud_model(self.xi[client_id], client_id, self.models)

    def pre_local_init(self, client_id: int, message: Params, round_: int) -> Params:
        """The client's own w_i (before its first training, the initial model)."""
        return self.own_model(client_id, self.global_params)

    def local_train(self, client_id: int, params: Params, message: Params, round_: int) -> Work[TrainResult]:
        """w_i trained from itself on F_i(w) + λ/(2α_K)‖w − u_i‖² (Eq. 8), u_i the received cloud model."""
        proximal = ProximalTerm(message, self.config.lam / self.config.alpha_k)
        return (
            yield self.train_task(
                client_id,
                params,
                round_,
                "local_training",
                **self.context.federation.local_length(),
                proximal=proximal,
            )
        )

    def client_message(self, client_id: int, result: TrainResult, round_: int) -> Params:
        """The trained w_i's parameters."""
        return {name: result.params[name] for name in self.models}

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        """w_j ← the uploads (new tensors), then ξ of the updated models."""
        self.models = {
            name: torch.stack([messages[j][name] if j in messages else old for j, old in enumerate(w)])
            for name, w in self.models.items()
        }
        self.xi = attention_weights(self.models, self.config.alpha_k, self.config.sigma)

    def round_metrics(self, round_: int) -> dict[str, float]:
        """``self_weight_mean`` and ``self_weight_min``: ξ_{i,i} over clients i (< 0: u_i extrapolates)."""
        diagonal = self.xi.diagonal()
        return {"self_weight_mean": diagonal.mean().item(), "self_weight_min": diagonal.min().item()}
