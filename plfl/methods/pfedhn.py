"""pFedHN (Shamsian, Navon, Fetaya and Chechik, ICML 2021, arXiv:2103.04628): a hypernetwork generates clients' models.

The server holds a hypernetwork h(v_i; φ) that maps client i's embedding v_i to the
parameters of its whole model, θ_i = h(v_i; φ). Per client (Alg. 1): θ_i is sent, the client
trains it to θ̃_i and returns Δθ_i = θ_i − θ̃_i, and the server moves φ and v_i along
(∂θ_i/∂φ)ᵀ Δθ_i and (∂θ_i/∂v_i)ᵀ Δθ_i (Eq. 4), the gradient of ½‖θ_i − θ̃_i‖².

Hooks: ``server_message`` generates θ_i (parameters only); ``pre_local_init`` puts it over
the client's own buffers (BatchNorm statistics, if any): the generated model is what the
client evaluates and trains from; ``local_train`` uploads Δθ_i; ``aggregate`` takes one
step per upload, in client order (:func:`plfl.methods.hypernetwork.descend`).

As the authors' code (AvivSham/pFedHN, experiments/pfedhn): embeddings of size
int(1 + N/4) drawn from N(0, 1) (``nn.Embedding``); an MLP of Linear(embedding, 100) and
3 × (ReLU, Linear(100, 100)); linear heads to every parameter tensor, PyTorch's default
initialisation (the authors' one Linear per tensor is one Linear here, split: the same
initial distribution); SGD on φ and the embeddings with lr 0.01, momentum 0.9, weight decay
1e-3, the gradient clipped to norm 50.

Departures: the clients train as every plfl method does (``federation.local_epochs`` epochs
of ``federation.batch_size`` at ``federation.lr``), where the authors take 50 steps of batch
64 with SGD at 5e-3, momentum 0.9, weight decay 5e-5 and gradient clipping. The authors
train one client per step; here a round's clients all train from the φ of the broadcast and
the server then steps once per client, each step's ∂θ_i/∂φ taken at the current φ (for
the round's first client, the one θ_i came from), as pFedLA's update does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from plfl.fields import checked
from plfl.methods.base import FederationContext, Method, MethodConfig
from plfl.methods.hypernetwork import descend
from plfl.seeding import derive_seed
from plfl.state import Params
from plfl.tasks import TrainResult, Work


@dataclass
class PFedHNConfig(MethodConfig):
    """pFedHN's keys (Shamsian et al., ICML 2021, Alg. 1); PFLlib has no pFedHN: defaults from the authors'
    code (AvivSham/pFedHN, experiments/pfedhn/trainer.py). The generated model is the client's local
    initialisation, so there is no ``method.ala``."""

    embedding_dim: Optional[int] = checked(
        None,
        lambda v: v is None or v >= 1,
        "null or an integer >= 1",
        "size of each client's embedding v_i; null: int(1 + N/4), N clients (the authors' --embed-dim -1)",
    )
    hidden_dim: int = checked(
        100, lambda v: v >= 1, "an integer >= 1", "width of the hypernetwork's MLP (the authors' --hyper-hid, 100)"
    )
    hidden_layers: int = checked(
        3,
        lambda v: v >= 0,
        "an integer >= 0",
        "(ReLU, Linear) blocks after the MLP's first Linear (the authors' --n-hidden, 3)",
    )
    hn_lr: float = checked(
        0.01, lambda v: v > 0, "a number > 0", "SGD step size of φ and the embeddings (the authors' --lr, 0.01)"
    )
    hn_momentum: float = checked(
        0.9, lambda v: 0 <= v < 1, "a number in [0, 1)", "momentum of that SGD (the authors' 0.9)"
    )
    hn_weight_decay: float = checked(
        1e-3, lambda v: v >= 0, "a number >= 0", "weight decay of that SGD (the authors' --wd, 1e-3)"
    )
    max_grad_norm: Optional[float] = checked(
        50.0,
        lambda v: v is None or v > 0,
        "null or a number > 0",
        "clip the hypernetwork's gradient to this 2-norm; null: no clipping (the authors' 50)",
    )


class HyperNetwork(nn.Module):
    """h(v_i; φ): v_i = row i of an (N, embedding_dim) embedding → Linear(embedding_dim, hidden_dim)
    → ``hidden_layers`` × (ReLU, Linear(hidden_dim, hidden_dim)) → Linear(hidden_dim, Σ numel),
    split into the tensors of ``shapes`` (name → shape)."""

    def __init__(
        self, shapes: dict[str, torch.Size], num_clients: int, embedding_dim: int, hidden_dim: int, hidden_layers: int
    ):
        super().__init__()
        self.shapes = shapes
        self.embeddings = nn.Embedding(num_clients, embedding_dim)
        layers: list[nn.Module] = [nn.Linear(embedding_dim, hidden_dim)]
        for _ in range(hidden_layers):
            layers += [nn.ReLU(), nn.Linear(hidden_dim, hidden_dim)]
        self.mlp = nn.Sequential(*layers)
        self.head = nn.Linear(hidden_dim, sum(shape.numel() for shape in shapes.values()))

    def forward(self, client_id: int) -> Params:
        """θ_i: name → tensor of its shape."""
        return self.generate(self.embeddings.weight[client_id])

    def generate(self, embedding: torch.Tensor) -> Params:
        """h(v; φ) for an embedding v of shape (embedding_dim,): name → tensor of its shape."""
        flat = self.head(self.mlp(embedding))
        pieces = flat.split([shape.numel() for shape in self.shapes.values()])
        return {name: piece.view(shape) for (name, shape), piece in zip(self.shapes.items(), pieces)}


class PFedHN(Method):
    """pFedHN (Shamsian et al., ICML 2021): a server hypernetwork generates each client's model.

    Clients train the models the hypernetwork generates; it learns from their changes.
    """

    name = "pfedhn"
    not_averaging = "updates a hypernetwork from the clients' updates, not by averaging models"
    config_class = PFedHNConfig

    def __init__(self, config: PFedHNConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        num_clients = len(context.data.clients)
        shapes = {name: p.shape for name, p in context.architecture.named_parameters()}
        embedding_dim = config.embedding_dim or int(1 + num_clients / 4)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.seed, 0, -1, "hypernetwork_init"))
            self.hypernetwork = HyperNetwork(
                shapes, num_clients, embedding_dim, config.hidden_dim, config.hidden_layers
            )
        self.optimizer = torch.optim.SGD(
            self.hypernetwork.parameters(),
            lr=config.hn_lr,
            momentum=config.hn_momentum,
            weight_decay=config.hn_weight_decay,
        )

    def server_message(self, client_id: int, round_: int) -> Params:
        """θ_i = h(v_i; φ), the model's parameters."""
        with torch.no_grad():
            return self.hypernetwork(client_id)

    def new_client_model(self, round_: int) -> Params:
        """h(v̄; φ) over the initial buffers, v̄ the mean of the clients' embeddings: the hypernetwork's model for
        an embedding it was not trained on (the paper's novel clients then tune their embedding with φ frozen,
        Sec. 5; here ``eval.finetune_epochs`` fine-tunes the model itself)."""
        with torch.no_grad():
            return {**self.global_params, **self.hypernetwork.generate(self.hypernetwork.embeddings.weight.mean(0))}

    def pre_local_init(self, client_id: int, message: Params, round_: int) -> Params:
        """θ_i over the client's buffers (the initial model's before its first training)."""
        return self.received_over_own(client_id, message, self.global_params)

    def local_train(self, client_id: int, params: Params, message: Optional[Params], round_: int) -> Work[TrainResult]:
        """``federation.local_epochs`` epochs from θ_i (``params``); the upload is Δθ_i = θ_i − θ̃_i."""
        result = yield self.train_task(
            client_id, params, round_, "local_training", **self.context.federation.local_length()
        )
        result.upload = {name: params[name] - result.params[name] for name in self.hypernetwork.shapes}
        return result

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        """One step of φ and v_j along (∂θ_j/∂(φ, v_j))ᵀ Δθ_j per upload j (Eq. 4)."""
        for client_id, delta in messages.items():
            generated = self.hypernetwork(client_id)
            descend(
                list(generated.values()), [delta[name] for name in generated], self.optimizer, self.config.max_grad_norm
            )

    def state_dict(self) -> dict[str, Any]:
        """Also the hypernetwork's φ and embeddings and the optimizer's momentum."""
        return {
            **super().state_dict(),
            "hypernetwork": self.hypernetwork.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.hypernetwork.load_state_dict(state["hypernetwork"])
        self.optimizer.load_state_dict(state["optimizer"])
