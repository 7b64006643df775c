r"""pFedLA and HeurpFedLA (Ma et al., CVPR 2022): layer-wise personalized aggregation by hypernetworks.

The server keeps every client's latest trained parameters :math:`\theta_j` and, for every
client i, a hypernetwork :math:`HN_i(v_i; \psi_i)` with a learnable embedding :math:`v_i` whose
output :math:`\alpha_i` (L layers × N clients) weights the clients' layers (Eq. 3–6):

.. math:: \bar\theta_i^l = \sum_j \alpha_i^{l,j} \theta_j^l.

Client i trains from :math:`\bar\theta_i` and uploads :math:`\theta_i^{new}`; the server sets
:math:`\theta_i \leftarrow \theta_i^{new}` and moves :math:`v_i, \psi_i` one step down
:math:`\tfrac12 \lVert \bar\theta_i - \theta_i^{new} \rVert^2`, whose gradient is
:math:`-(\partial\bar\theta_i / \partial\psi_i)^\top \Delta\theta_i` with
:math:`\Delta\theta_i = \theta_i^{new} - \bar\theta_i` (Eq. 10–11; likewise :math:`v_i`).

HeurpFedLA (Alg. 2, Eq. 12) keeps, for client i, the k layers with the
largest self-weights :math:`\alpha_i^{l,i}` local: the server neither aggregates nor
sends them. BatchNorm running statistics are never aggregated or sent.

The paper's: the hypernetwork's structure, :math:`\bar\theta_i`, the loss of Eq. 10–11 and
its sign, HeurpFedLA's rule (:mod:`plfl.methods.heurpfedla`). plfl's choices,
where the paper gives no value or its literal form does not learn, each a key
(why, with the measurements: the documentation's fidelity page, "pFedLA"):

- the step: Adam (``method.hn_optimizer``, ``method.hn_lr`` 0.003); plain SGD
  at the re-implementations' 5e-3 moves no weight;
- :math:`\alpha` = softmax of the heads' outputs o bounded by :math:`R \tanh(o/R)`
  (``method.activation``, ``method.logit_bound`` R = 3): no weight falls below
  :math:`e^{-2R}` times the largest of its row; the outputs start at zero, so
  :math:`\alpha` starts uniform. The paper's ReLU / row sum is ``method.activation=relu``;
- decoupled weight decay of the heads (``method.hn_weight_decay`` 100, AdamW),
  so that an output does not run on past the bound, where tanh's gradient
  vanishes;
- no step while every stored :math:`\theta_j` is still the initial model: :math:`\bar\theta_i`
  then does not depend on :math:`\alpha_i`, and the gradient is rounding noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from plfl.fields import checked, one_of
from plfl.methods.base import FederationContext, Method, MethodConfig
from plfl.methods.hypernetwork import descend
from plfl.plots import Heatmaps
from plfl.seeding import derive_seed
from plfl.state import Params
from plfl.tasks import TrainResult


@dataclass
class PFedLAConfig(MethodConfig):
    """pFedLA's keys (``method.*``); the hypernetwork's structure is the paper's."""

    embedding_dim: int = checked(
        100, lambda v: v >= 1, "an integer >= 1", "size of each client's embedding v_i, the hypernetwork's input"
    )
    hidden_dim: int = checked(
        100, lambda v: v >= 1, "an integer >= 1", "width of the hypernetwork's three hidden layers"
    )
    hn_optimizer: str = one_of("adam", ("adam", "sgd"), "optimiser of v_i and ψ_i on Eq. 10–11's loss")
    hn_lr: float = checked(0.003, lambda v: v > 0, "a number > 0", "β of Eq. 10–11: step size of v_i and ψ_i")
    hn_weight_decay: float = checked(
        100.0,
        lambda v: v >= 0,
        "a number >= 0",
        "decoupled weight decay of the output heads: each step shrinks them by "
        "hn_lr × hn_weight_decay (0.3), keeping the logits near logit_bound",
    )
    activation: str = one_of(
        "softmax",
        ("softmax", "relu"),
        "α from the hypernetwork's outputs: softmax, or the paper's ReLU / row sum (Eq. 3)",
    )
    logit_bound: float = checked(
        3.0,
        lambda v: v > 0,
        "a number > 0",
        "R: softmax of R·tanh(output / R), so no weight is below e^(-2R) (1/403) times the largest of its row",
    )
    granularity: str = one_of(
        "module", ("module", "tensor"), "what one weight α_i^{l,j} covers: a module's parameters, or one tensor"
    )
    weights_every: int = checked(
        10,
        lambda v: v >= 1,
        "an integer >= 1",
        "write the weights α (tables/aggregation_weights.csv) every this many rounds",
    )


def layer_groups(model: nn.Module, granularity: str) -> dict[str, list[str]]:
    """Layer name → its parameter names, in ``named_parameters`` order.

    ``module``: a module's parameters form one layer; ``tensor``: each
    parameter is a layer. Buffers (BatchNorm statistics) belong to no layer.
    """
    layers: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        layer = (name.rpartition(".")[0] or "<root>") if granularity == "module" else name
        layers.setdefault(layer, []).append(name)
    return layers


def mix(weights: torch.Tensor, stacked: torch.Tensor) -> torch.Tensor:
    """Σ_j weights[j] · stacked[j] (Eq. 6); weights: (N,), stacked: (N, *shape) → (*shape)."""
    return torch.tensordot(weights, stacked, dims=1)


class LayerWeightNet(nn.Module):
    """HN_i(v_i; ψ_i) (Eq. 4, paper Fig. 3): v_i → 3 × (Linear + ReLU) → a Linear(hidden, N) head per layer.

    ``forward()`` returns α_i, shape (L, N), each layer's row a distribution over
    the clients (Eq. 3): ``activation="relu"`` is the paper's ReLU divided by
    the row sum (a row that is all zero falls back to the one-hot weight on
    client i itself); ``"softmax"``, plfl's default, is the softmax of the
    outputs bounded to (−R, R) by R·tanh(·/R), R = ``logit_bound`` (see the module docstring).
    """

    def __init__(
        self,
        client_id: int,
        num_clients: int,
        num_layers: int,
        embedding_dim: int,
        hidden_dim: int,
        activation: str = "softmax",
        logit_bound: float = 3.0,
    ):
        super().__init__()
        self.shape = (num_layers, num_clients)
        self.activation = activation
        self.logit_bound = logit_bound
        self.embedding = nn.Parameter(torch.randn(embedding_dim))  # v_i, N(0, 1) as nn.Embedding
        self.trunk = nn.Sequential(
            nn.Linear(embedding_dim, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, hidden_dim),
            nn.ReLU(),
        )
        # The L heads as one Linear(hidden, L·N): its rows are independent.
        self.heads = nn.Linear(hidden_dim, num_layers * num_clients)
        nn.init.zeros_(self.heads.bias)
        if activation == "softmax":  # α starts uniform: zero outputs
            nn.init.zeros_(self.heads.weight)
        else:
            # PyTorch's default init makes about half of the outputs negative: zero after the ReLU, and without
            # gradient, so those weights (self-weights included) would stay zero for good. Non-negative head
            # weights on the trunk's non-negative features start every α positive and near uniform.
            nn.init.uniform_(self.heads.weight, 0.0, 1.0)
        self.register_buffer("own", F.one_hot(torch.tensor(client_id), num_clients).float())

    def forward(self) -> torch.Tensor:
        outputs = self.heads(self.trunk(self.embedding)).view(self.shape)
        if self.activation == "relu":
            return normalized(outputs, self.own)
        bound = self.logit_bound
        return (bound * torch.tanh(outputs / bound)).softmax(dim=1)


def normalized(outputs: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """ReLU(outputs) / row sum; (L, N) → (L, N); all-zero rows become ``own`` (N,), the one-hot on self."""
    w = F.relu(outputs)
    total = w.sum(dim=1, keepdim=True)
    alive = total > 0
    # The denominator of dead rows is 1, not 0: torch.where would otherwise pass NaN gradients.
    return torch.where(alive, w / torch.where(alive, total, torch.ones_like(total)), own)


def hypernetwork_optimizer(hypernetwork: LayerWeightNet, config: PFedLAConfig) -> torch.optim.Optimizer:
    """Adam (decoupled weight decay: AdamW) or SGD over v_i and ψ_i; only the heads decay (``hn_weight_decay``)."""
    groups = [
        {"params": [hypernetwork.embedding, *hypernetwork.trunk.parameters()], "weight_decay": 0.0},
        {"params": list(hypernetwork.heads.parameters()), "weight_decay": config.hn_weight_decay},
    ]
    optimizer = torch.optim.AdamW if config.hn_optimizer == "adam" else torch.optim.SGD  # SGD: L2 = decoupled
    return optimizer(groups, lr=config.hn_lr)


@dataclass
class Broadcast:
    """What the server used for a client's last message, kept for the hypernetwork update."""

    thetas: Params  # the θ_j snapshot: name → (N, *shape); never mutated, so a reference suffices
    alpha: torch.Tensor  # α_i, (L, N), detached
    retained: frozenset[str]  # layers kept local (HeurpFedLA), not sent
    # Some θ_j of the snapshot was trained. While all are the initial model, θ̄_i does not depend on α_i
    # and the loss's gradient is rounding noise, which Adam would turn into a full-size random step.
    informative: bool


class PFedLA(Method):
    """pFedLA (Ma et al., CVPR 2022): layer-wise aggregation weights from hypernetworks.

    Layer-wise personalized aggregation, weights learned by per-client hypernetworks (Alg. 1).
    """

    name = "pfedla"
    not_averaging = "mixes client models per client with weights its hypernetworks learn"
    config_class = PFedLAConfig
    figures = (
        Heatmaps(
            "Aggregation weights α of {run}, round {round}",
            "aggregation_weights",
            facet="layer",
            row="client",
            prefix="w",
            value="α",
            marked="retained",
            marks=("aggregated", "kept local"),
        ),
    )

    def __init__(self, config: PFedLAConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        self.layers = layer_groups(context.architecture, config.granularity)
        num_clients = len(context.data.clients)
        # Every client's latest trained θ_j, initially the initial model; replaced, never mutated, each round.
        self.thetas = {
            key: torch.stack([initial_params[key]] * num_clients) for keys in self.layers.values() for key in keys
        }
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.seed, 0, -1, "hypernetwork_init"))
            self.hypernetworks = [
                LayerWeightNet(
                    i,
                    num_clients,
                    len(self.layers),
                    config.embedding_dim,
                    config.hidden_dim,
                    config.activation,
                    config.logit_bound,
                )
                for i in range(num_clients)
            ]
        self.optimizers = [hypernetwork_optimizer(hn, config) for hn in self.hypernetworks]
        self.trained_any = False  # whether some θ_j differs from the initial model (else α has no gradient)
        self.sent: list[Optional[Broadcast]] = [None] * num_clients

    def retained_layers(self, client_id: int, alpha: torch.Tensor) -> frozenset[str]:
        """Layers client ``client_id`` keeps local, given its α (L, N); pFedLA: none."""
        return frozenset()

    def server_message(self, client_id: int, round_: int) -> Params:
        """θ̄_i (Eq. 5–6) for every layer not retained; buffers are not sent."""
        with torch.no_grad():
            alpha = self.hypernetworks[client_id]()
        retained = self.retained_layers(client_id, alpha)
        self.sent[client_id] = Broadcast(self.thetas, alpha, retained, self.trained_any)
        return {
            key: mix(alpha[index], self.thetas[key])
            for index, (layer, keys) in enumerate(self.layers.items())
            if layer not in retained
            for key in keys
        }

    def new_client_model(self, round_: int) -> Params:
        """Every layer mixed with uniform α over the clients' θ_j (Eq. 6), over the initial buffers: what a new
        client's hypernetwork, initialised as every client's is, gives it under the softmax activation (with
        ReLU, near-uniform α), and it keeps no layer of its own."""
        uniform = torch.full((len(self.context.data.clients),), 1 / len(self.context.data.clients))
        return {**self.global_params, **{key: mix(uniform, stacked) for key, stacked in self.thetas.items()}}

    def pre_local_init(self, client_id: int, message: Params, round_: int) -> Params:
        """The client's state with the received layers replaced: buffers and retained layers stay local."""
        return self.received_over_own(client_id, message, self.global_params)

    def client_message(self, client_id: int, result: TrainResult, round_: int) -> Params:
        """θ_i^new: the trained parameters, all layers (others aggregate the retained ones too), no buffers."""
        return {key: result.params[key] for key in self.thetas}

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        for client_id, trained in messages.items():
            self.update_hypernetwork(client_id, trained)
        # New tensors: the broadcasts so far keep referring to the old θ's.
        self.thetas = {
            key: torch.stack([messages[j][key] if j in messages else old for j, old in enumerate(stacked)])
            for key, stacked in self.thetas.items()
        }
        self.trained_any = self.trained_any or bool(messages)

    def state_dict(self) -> dict[str, Any]:
        """Also θ_j, the hypernetworks' ψ_i and v_i, and each client's last α_i and retained layers.

        A broadcast is saved without its θ snapshot: at a round's end (when
        checkpoints are taken) every client's was just sent from the current θ.
        """
        return {
            **super().state_dict(),
            "thetas": self.thetas,
            "trained_any": self.trained_any,
            "hypernetworks": [hn.state_dict() for hn in self.hypernetworks],
            "optimizers": [opt.state_dict() for opt in self.optimizers],
            "sent": [
                None if b is None else {"alpha": b.alpha, "retained": sorted(b.retained), "informative": b.informative}
                for b in self.sent
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.thetas = state["thetas"]
        self.trained_any = state["trained_any"]
        for hypernetwork, optimizer, hn_state, opt_state in zip(
            self.hypernetworks, self.optimizers, state["hypernetworks"], state["optimizers"]
        ):
            hypernetwork.load_state_dict(hn_state)
            optimizer.load_state_dict(opt_state)
        self.sent = [
            None if b is None else Broadcast(self.thetas, b["alpha"], frozenset(b["retained"]), b["informative"])
            for b in state["sent"]
        ]

    def update_hypernetwork(self, client_id: int, trained: Params) -> None:
        """One optimiser step of v_i, ψ_i on ½‖θ̄_i − θ_i^new‖² (Eq. 10–11).

        θ̄_i is recomputed with autograd from the θ snapshot it was sent from;
        retained layers do not depend on α_i (the client ignores them, Eq. 7),
        so they are left out. No step while the snapshot holds only the initial model.
        """
        sent, hypernetwork = self.sent[client_id], self.hypernetworks[client_id]
        if not sent.informative:
            return
        alpha = hypernetwork()
        mixed, targets = [], []
        for index, (layer, keys) in enumerate(self.layers.items()):
            if layer not in sent.retained:
                mixed += [mix(alpha[index], sent.thetas[key]) for key in keys]
                targets += [trained[key] for key in keys]
        if not mixed:
            return
        # ∂(½‖θ̄ − θ^new‖²)/∂ψ = (∂θ̄/∂ψ)ᵀ (θ̄ − θ^new) = −(∂θ̄/∂ψ)ᵀ Δθ.
        descend(mixed, [m.detach() - t for m, t in zip(mixed, targets)], self.optimizers[client_id])

    def weights(self) -> torch.Tensor:
        """α of this round's broadcast, (N clients i, L layers, N clients j)."""
        return torch.stack([sent.alpha for sent in self.sent])

    def round_metrics(self, round_: int) -> dict[str, float]:
        """``self_weight_mean``: mean of α_i^{l,i} over clients i and layers l."""
        return {"self_weight_mean": self.weights().diagonal(dim1=0, dim2=2).mean().item()}

    def round_tables(self, round_: int) -> dict[str, list[dict[str, Any]]]:
        """``aggregation_weights`` (paper Fig. 6): one row per (client, layer), ``w<j>`` = α_client^{layer,j}."""
        if round_ % self.config.weights_every and round_ != self.context.federation.rounds:
            return {}
        rows = []
        for i, sent in enumerate(self.sent):
            for index, layer in enumerate(self.layers):
                row = {"client": i, "layer": layer, "retained": layer in sent.retained}
                row.update({f"w{j}": w for j, w in enumerate(sent.alpha[index].tolist())})
                rows.append(row)
        return {"aggregation_weights": rows}
