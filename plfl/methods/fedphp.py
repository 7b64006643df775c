"""FedPHP (Li, Zhan, Shao, Li and Song, ECML-PKDD 2021, doi:10.1007/978-3-030-86486-6_36): inherited private models.

Client i keeps a personalized model v_i, the "inherited private model". In round t a sampled client,
from the global model w^t it received (``local_train``):

- trains a copy w of w^t for ``federation.local_epochs`` epochs, one SGD step per mini-batch (x, y)
  on (1 − λ) CE(w; x, y) + λ MMD²(φ_w(x), φ_{v_i}(x)): the cross-entropy plus a knowledge transfer
  that pulls w's features φ (the model's body) toward those of the frozen v_i;
- uploads w, and inherits: v_i ← μ_t v_i + (1 − μ_t) w, with μ_t = μ · min(1, (t − 1) / T) growing
  linearly from 0 in the first training round (``inheritance_weight``; T = ``federation.rounds``, or
  ``method.inheritance_rounds``).

The server averages the uploads as FedAvg. v_i is what the client evaluates (``pre_local_init``:
the initial model before its first training); the global model gives ``global_accuracy``.
MMD² is PFLlib's biased estimate over the B × B feature pairs (``mmd``), with the kernel
k(a, b) = Σ_{s ∈ {10, 15, 20, 50}} exp(−‖a − b‖² / (2s)).

Sources: PFLlib's clientphp.py (the loss, the kernel, μ_t linear in the round, μ_t = 0 at the first
training round); the authors' FedRepo (algorithms/fedphp.py, train_dir.py: v_i evaluated, the whole
floating-point state inherited, μ rising to 0.9, λ = 0.1 with MMD). Departures: PFLlib evaluates
the trained w and inherits parameters only; FedRepo takes μ_t from the client's participations
(not the round), chooses the kernels' bandwidths from the batch's distances and clips gradients.
Here the steps are plain SGD (``federation.momentum`` must be 0), on the CPU, without
``data.augment``; the reported loss is the cross-entropy alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import functional_call

from plfl.client import TrainResult
from plfl.methods.base import FederationContext, require_plain_steps
from plfl.methods.batches import Batch, client_batches
from plfl.methods.fedavg import FedAvg
from plfl.methods.schemas import FedPHPConfig
from plfl.models import BodyHeadModel
from plfl.seeding import LOCAL_TRAINING, derive_seed
from plfl.state import Params

BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)  # PFLlib's "rbf" kernel


def mmd(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """MMD² of two feature batches x, y: (B, F) → a scalar, mean over all (a, b) of
    k(x_a, x_b) + k(y_a, y_b) − 2 k(x_a, y_b) (diagonals included, as PFLlib); 0 for x = y."""

    def kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # ‖a − b‖² expanded: differentiable where a = b, unlike the norm of torch.cdist.
        squared = a.square().sum(1, keepdim=True) + b.square().sum(1) - 2 * a @ b.T
        return sum(torch.exp(-squared / (2 * s)) for s in BANDWIDTHS)

    return (kernel(x, x) + kernel(y, y) - 2 * kernel(x, y)).mean()


def inheritance_weight(round_: int, mu: float, rounds: int) -> float:
    """μ_t = μ · min(1, (t − 1) / T) for training round t = 1, 2, ... of T."""
    return mu * min(1.0, (round_ - 1) / rounds)


def inherit(personal: Params, local: Params, mu: float) -> Params:
    """v ← μ v + (1 − μ) w per floating-point tensor; integer buffers (BatchNorm's counter) are w's."""
    return {k: mu * personal[k] + (1 - mu) * w if w.is_floating_point() else w for k, w in local.items()}


def features_and_logits(model: BodyHeadModel, state: Params, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """φ(x) = body(x), (B, F), and head(φ(x)), (B, classes), of ``model`` with ``state`` (a state_dict)."""
    part = lambda prefix: {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}  # noqa: E731
    features = functional_call(model.body, part("body."), (x,))
    return features, functional_call(model.head, part("head."), (features,))


def local_step(model: BodyHeadModel, w: Params, buffers: Params, personal: Params, batch: Batch, lam: float,
               lr: float) -> tuple[Params, float]:
    """One SGD step of w's parameters on (1 − λ) CE + λ MMD²(φ_w(x), φ_v(x)); returns them and the CE.

    ``buffers`` (w's) and ``personal`` (v's state_dict) may be updated in place by BatchNorm's statistics.
    """
    x, y = batch
    with torch.no_grad():
        personal_features, _ = features_and_logits(model, personal, x)
    w = {k: v.detach().requires_grad_() for k, v in w.items()}
    features, logits = features_and_logits(model, {**buffers, **w}, x)
    cross_entropy = F.cross_entropy(logits, y)
    loss = (1 - lam) * cross_entropy + lam * mmd(features, personal_features)
    grads = torch.autograd.grad(loss, list(w.values()))
    return {k: (v - lr * g).detach() for (k, v), g in zip(w.items(), grads)}, cross_entropy.item()


class FedPHP(FedAvg):
    """FedAvg's server; clients train with knowledge transfer from their inherited v_i and keep v_i."""

    name = "fedphp"

    def __init__(self, config: FedPHPConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_plain_steps("fedphp", context, "w (its loss has the MMD term)")
        self.parameter_names = [name for name, _ in context.model.named_parameters()]

    def pre_local_init(self, client_id: int, message: Params, round_: int) -> Params:
        """The client's own v_i; before its first training, the received global model."""
        return self.store.get(client_id, "model") or {k: v.clone() for k, v in message.items()}

    def local_train(self, client_id: int, params: Params, round_: int) -> TrainResult:
        """w trained from the received w^t with knowledge transfer from v_i (``params``), uploaded; v_i inherits."""
        cfg, federation = self.config, self.context.federation
        received = self.server_message(client_id)  # w^t: unchanged since this round's broadcast
        w = {k: received[k] for k in self.parameter_names}
        buffers = {k: v.clone() for k, v in received.items() if k not in w}
        personal = {k: v if k in w else v.clone() for k, v in params.items()}  # v_i's statistics stay as they are
        seed = derive_seed(self.seed, round_, client_id, LOCAL_TRAINING)
        self.context.model.train()
        loss_sum, seen = 0.0, 0
        for x, y in client_batches(self.context.data.clients[client_id], federation.batch_size, seed,
                                   federation.local_epochs, self.context.local_trainer.batch_norm):
            w, loss = local_step(self.context.model, w, buffers, personal, (x, y), cfg.lam, federation.lr)
            loss_sum, seen = loss_sum + loss * len(y), seen + len(y)
        upload = {k: w[k] if k in w else buffers[k] for k in received}
        rounds = federation.rounds if cfg.inheritance_rounds is None else cfg.inheritance_rounds
        mu = inheritance_weight(round_, cfg.mu, rounds)
        return TrainResult(inherit(params, upload, mu), loss_sum / seen, seen, upload=upload)

    def global_model(self) -> Params:
        return self.global_params
