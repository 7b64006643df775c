"""FedFomo (Zhang et al., ICLR 2021, arXiv:2012.08565): downloaded models weighted by their validation-loss gain.

Client i holds out a validation split V_i of its training data. Each round it downloads
M other clients' latest models θ_1..θ_M and, w_i its current model, computes (Sec. 3)

    s_n = (L_{V_i}(w_i) − L_{V_i}(θ_n)) / ‖θ_n − w_i‖,   w_n = max(s_n, 0) / Σ_m max(s_m, 0),
    w_i ← w_i + Σ_n w_n (θ_n − w_i)   (w_i unchanged when no s_n > 0),

then trains w_i on the rest of its training data and uploads it with the scores s_n. The
server adds the scores to an affinity matrix P (N × N, the identity at the start),
P_{i,n} += s_n, and sends client i the M models with the largest P_{i,n}, n ≠ i.

Hooks: ``server_message`` sends the M models stacked (name → ``(M, *shape)``); ``local_train``
evaluates them and its own model on its validation split (evaluation tasks), scores and combines
them (``fomo_scores``, ``fomo_weights``, ``fomo_update``) and trains;
``client_message`` uploads the trained model and the scores; ``aggregate`` stores the models
and updates P. The client's kept model, its last trained one, is what it evaluates.

As PFLlib (serverfomo.py, clientfomo.py): M = 5; 20 % of the training split for validation,
training on the rest; L the mean cross-entropy; ‖·‖ over the parameters, plus 1e-5; only
parameters are combined and sent; the top-M choice without the paper's ε-greedy exploration;
P accumulates the signed s_n; nothing is sent before the first uploads. PFLlib validates on
the last 20 % of the stored training data; plfl draws that 20 % once per run (stream
"validation_split", ``validation_split``), since a partition may store samples grouped by class.

Departures: PFLlib scores against the model the client had before its previous local
training (its ``old_model``) and, P starting at the identity, downloads the client's own
latest model too; plfl scores against the current w_i, as the paper does, against which
the client's own copy would score 0, so the M models are other clients'. Ties in P go to
the lower client id (``torch.topk`` leaves their order unspecified).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from plfl.errors import ConfigError
from plfl.fields import checked
from plfl.methods.base import FederationContext, Method, MethodConfig, require_private_steps
from plfl.seeding import derive_seed
from plfl.state import Params
from plfl.tasks import EvalTask, TrainResult, Work

SCORES = "fedfomo_scores"  # the upload's key for the scores s_n, (M,), in download order


@dataclass
class FedFomoConfig(MethodConfig):
    """FedFomo's keys (Zhang et al., ICLR 2021, Sec. 3); defaults: PFLlib's. The client combines the
    downloaded models itself before training, so there is no ``method.ala``."""

    m: int = checked(
        5,
        lambda v: v >= 1,
        "an integer >= 1",
        "M: models of other clients each client downloads per round, those of the largest "
        "affinity P_{i,n} (PFLlib's -M, 5)",
    )
    val_ratio: float = checked(
        0.2,
        lambda v: 0 < v < 1,
        "a number in (0, 1)",
        "share of each client's training split held out to score the downloaded models; "
        "training uses the rest (PFLlib's clientfomo.py val_ratio, 0.2)",
    )


def validation_split(n: int, ratio: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training, validation) sample indices, each sorted: max(1, int(ratio · n)) of 0..n-1 drawn from ``seed``.

    Raises:
        ConfigError: n < 2 (no sample would be left for one of the two).
    """
    if n < 2:
        raise ConfigError(
            f"FedFomo needs 2 or more training samples per client to hold out a validation split; "
            f"a client has {n}. Use a partition that gives every client more data (data.min_samples)."
        )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    size = min(n - 1, max(1, int(ratio * n)))
    return order[size:].sort().values, order[:size].sort().values


def fomo_scores(own_loss: float, losses: torch.Tensor, distances: torch.Tensor) -> torch.Tensor:
    """s_n = (L(w_i) − L(θ_n)) / (‖θ_n − w_i‖ + 1e-5); ``losses``, ``distances``: (M,) → (M,)."""
    return (own_loss - losses) / (distances + 1e-5)


def fomo_weights(scores: torch.Tensor) -> torch.Tensor:
    """w_n = max(s_n, 0) / Σ_m max(s_m, 0), (M,) → (M,); all zero when no s_n is positive."""
    positive = scores.clamp(min=0)
    total = positive.sum()
    return positive / total if total > 0 else positive


def fomo_update(own: Params, received: Params, weights: torch.Tensor) -> Params:
    """w_i + Σ_n w_n (θ_n − w_i) for the keys of ``received`` (name → ``(M, *shape)``); the others stay ``own``'s."""
    return {k: v + torch.tensordot(weights, received[k] - v, dims=1) if k in received else v for k, v in own.items()}


class FedFomo(Method):
    """FedFomo (Zhang et al., ICLR 2021): M downloaded models weighted by validation-loss gain.

    Clients combine M downloaded models by first-order validation weights, then train (Sec. 3).
    """

    name = "fedfomo"
    not_averaging = "weights other clients' models per client by their loss on its validation split"
    config_class = FedFomoConfig
    server_state = ("global_params", "models", "uploaded", "affinity")

    def __init__(self, config: FedFomoConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_private_steps("fedfomo", context, "weighs the received models by their losses on its validation split")
        clients = context.data.clients
        self.splits = [
            validation_split(c.num_train, config.val_ratio, derive_seed(self.seed, 0, i, "validation_split"))
            for i, c in enumerate(clients)
        ]
        # θ_n: every client's latest upload, parameters only, stacked (N, ...).
        self.models = {
            name: torch.stack([initial_params[name]] * len(clients))
            for name, _ in context.architecture.named_parameters()
        }
        self.uploaded = torch.zeros(len(clients), dtype=torch.bool)
        self.affinity = torch.eye(len(clients))  # P

    def training_samples(self, client_id: int) -> torch.Tensor:
        """The client's training split without its validation samples."""
        return self.splits[client_id][0]

    def selection(self, client_id: int) -> list[int]:
        """The ≤ M clients n ≠ i with an upload and the largest P_{i,n}, ties to the lower id."""
        candidates = [n for n in range(len(self.uploaded)) if n != client_id and self.uploaded[n]]
        ranked = sorted(candidates, key=lambda n: (-self.affinity[client_id, n].item(), n))
        return ranked[: self.config.m]

    def server_message(self, client_id: int, round_: int) -> Optional[Params]:
        """The selected clients' models, name → ``(M, *shape)``; None before any upload."""
        chosen = self.selection(client_id)
        return {k: w[chosen] for k, w in self.models.items()} if chosen else None

    def pre_local_init(self, client_id: int, message: Optional[Params], round_: int) -> Params:
        """The client's own model (before its first training, the initial model)."""
        return self.own_model(client_id, self.global_params)

    def local_train(self, client_id: int, params: Params, message: Optional[Params], round_: int) -> Work[TrainResult]:
        """The first-order update of ``params`` by the received models (``message``) on the validation split,
        then ``federation.local_epochs`` epochs on the rest; the scores go with the upload."""
        scores = torch.zeros(0)
        if message is not None:
            val = self.splits[client_id][1]
            count = len(next(iter(message.values())))
            candidates = [{**params, **{k: v[n] for k, v in message.items()}} for n in range(count)]
            own, *others = yield [EvalTask(client_id, p, samples=val) for p in (params, *candidates)]
            distances = torch.stack(
                [torch.cat([(v[n] - params[k]).flatten() for k, v in message.items()]).norm() for n in range(count)]
            )
            scores = fomo_scores(own.loss, torch.tensor([e.loss for e in others]), distances)
            params = fomo_update(params, message, fomo_weights(scores))
        result = yield self.train_task(
            client_id, params, round_, "local_training", **self.context.federation.local_length()
        )
        result.upload = {**{k: result.params[k] for k in self.models}, SCORES: scores}
        return result

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        """P_{i,n} += s_n for the models each client received, then θ_j ← the uploads."""
        chosen = {j: self.selection(j) for j in messages}  # what each was sent: before anything changes
        for j, message in messages.items():
            self.affinity[j, chosen[j]] += message[SCORES]
            self.uploaded[j] = True
        self.models = {
            name: torch.stack([messages[j][name] if j in messages else old for j, old in enumerate(w)])
            for name, w in self.models.items()
        }
