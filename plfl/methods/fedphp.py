"""FedPHP (Li, Zhan, Shao, Li and Song, ECML-PKDD 2021, doi:10.1007/978-3-030-86486-6_36): inherited private models.

Client i keeps a personalized model v_i, the "inherited private model". In round t a sampled client,
from the global model w^t it received (``local_train``, the step task :class:`FedPHPStep`):

- trains a copy w of w^t for ``federation.local_epochs`` epochs, one SGD step per mini-batch (x, y)
  on (1 − λ) CE(w; x, y) + λ MMD²(φ_w(x), φ_{v_i}(x)): the cross-entropy plus a knowledge transfer
  that pulls w's features φ (the model's body) toward those of the frozen v_i;
- uploads w, and inherits: v_i ← μ_t v_i + (1 − μ_t) w, with μ_t = μ · min(1, (t − 1) / T) growing
  linearly from 0 in the first training round (``inheritance_weight``; T = ``federation.rounds``, or
  ``method.inheritance_rounds``).

The server averages the uploads as FedAvg. v_i is what the client evaluates (``pre_local_init``:
the initial model before its first training); the global model gives ``global_accuracy``.
MMD² is PFLlib's biased estimate over the B × B feature pairs (:func:`mmd`), with the kernel
k(a, b) = Σ_{s ∈ {10, 15, 20, 50}} exp(−‖a − b‖² / (2s)).

Sources: PFLlib's clientphp.py (the loss, the kernel, μ_t linear in the round, μ_t = 0 at the first
training round); the authors' FedRepo (algorithms/fedphp.py, train_dir.py: v_i evaluated, the whole
floating-point state inherited, μ rising to 0.9, λ = 0.1 with MMD). Departures: PFLlib evaluates
each client's trained w right after its local training (not v_i), and inherits parameters only;
``method.mu=0`` makes v_i the trained w, as PFLlib evaluates (the documentation's fidelity page,
"Beside PFLlib"). FedRepo takes μ_t from the client's participations
(not the round), chooses the kernels' bandwidths from the batch's distances and clips gradients.
Here the steps are plain SGD (``federation.momentum`` must be 0), without ``data.augment``; the
reported loss is the cross-entropy alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.func import grad

from plfl.fields import checked
from plfl.methods.base import FederationContext, MethodConfig, require_plain_steps
from plfl.methods.fedavg import FedAvg
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

BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)  # PFLlib's "rbf" kernel


@dataclass
class FedPHPConfig(MethodConfig):
    """FedPHP's keys (Li et al., ECML-PKDD 2021). The kept personalized model is FedPHP's own local
    initialisation, so there is no ``method.ala``."""

    mu: float = checked(
        0.9,
        lambda v: 0 <= v <= 1,
        "a number in [0, 1]",
        "μ: the inheritance v_i ← μ_t v_i + (1 − μ_t) w uses μ_t = μ (t − 1) / T (the authors' "
        "FedRepo rises to 0.9; PFLlib's shared -mu default 0 makes v_i the last local model)",
    )
    lam: float = checked(
        0.1,
        lambda v: 0 <= v <= 1,
        "a number in [0, 1]",
        "λ: local loss (1 − λ) CE + λ MMD² of the features of w and v_i (the authors' 0.1 with "
        "MMD; PFLlib's shared -lam default 1 would leave no cross-entropy)",
    )
    inheritance_rounds: Optional[int] = checked(
        None,
        lambda v: v is None or v >= 1,
        "null or an integer >= 1",
        "T: μ_t grows linearly to μ over T training rounds; null: federation.rounds, as PFLlib's μ / "
        "global_rounds × t (then extending a run by --resume changes T for the rounds still to come)",
    )


def mmd(x: torch.Tensor, y: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """MMD² of two feature batches x, y: (B, F) → a scalar, mean over all (a, b) of
    k(x_a, x_b) + k(y_a, y_b) − 2 k(x_a, y_b) (diagonals included, as PFLlib); 0 for x = y. With a (B,) 0/1
    ``mask``, over the pairs of real samples only."""

    def kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # ‖a − b‖² expanded: differentiable where a = b, unlike the norm of torch.cdist.
        squared = a.square().sum(1, keepdim=True) + b.square().sum(1) - 2 * a @ b.T
        return sum(torch.exp(-squared / (2 * s)) for s in BANDWIDTHS)

    pairs = kernel(x, x) + kernel(y, y) - 2 * kernel(x, y)
    return pairs.mean() if mask is None else (pairs * mask[:, None] * mask).sum() / mask.sum().square()


def inheritance_weight(round_: int, mu: float, rounds: int) -> float:
    """μ_t = μ · min(1, (t − 1) / T) for training round t = 1, 2, ... of T."""
    return mu * min(1.0, (round_ - 1) / rounds)


def inherit(personal: Params, local: Params, mu: float) -> Params:
    """v ← μ v + (1 − μ) w per floating-point tensor; integer buffers (BatchNorm's counter) are w's."""
    return {k: mu * personal[k] + (1 - mu) * w if w.is_floating_point() else w for k, w in local.items()}


@dataclass(frozen=True)
class FedPHPStep(Step):
    """One SGD step of w on (1 − λ) CE + λ MMD²(φ_w(x), φ_v(x)), v_i frozen: the state is w (the
    ``parameters`` and the model's buffers), the input ``personal`` v_i's state dict (its BatchNorm
    statistics are used as they are). The loss returned is the cross-entropy."""

    work = "FedPHP's local steps"
    parameters: tuple[str, ...]
    lam: float
    lr: float

    def __call__(self, network: Network, state: Params, inputs: Params, shared: Params, batch: Batch) -> StepOutput:
        personal_features, _ = network(inputs, batch.x, batch.mask, "body")
        buffers = {k: v for k, v in state.items() if k not in self.parameters}

        def loss(w: Params) -> tuple[torch.Tensor, tuple[torch.Tensor, Params]]:
            features, body_statistics = network({**buffers, **w}, batch.x, batch.mask, "body")
            logits, head_statistics = network({**buffers, **w}, features, batch.mask, "head")
            cross_entropy = masked_cross_entropy(logits, batch.y, batch.mask)
            knowledge = mmd(features, personal_features.detach(), batch.mask)
            return (1 - self.lam) * cross_entropy + self.lam * knowledge, (
                cross_entropy,
                {**body_statistics, **head_statistics},
            )

        w = {k: state[k] for k in self.parameters}
        grads, (cross_entropy, statistics) = grad(loss, has_aux=True)(w)
        return StepOutput(
            {**statistics, **{k: v - self.lr * grads[k] for k, v in w.items()}}, cross_entropy, sample_count(batch)
        )


class FedPHP(FedAvg):
    """FedPHP (Li et al., ECML-PKDD 2021): personalized models inherited by a moving average.

    FedAvg's server; clients train with knowledge transfer from their inherited v_i and keep v_i.
    """

    name = "fedphp"
    config_class = FedPHPConfig

    def __init__(self, config: FedPHPConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_plain_steps("fedphp", context, "w (its loss has the MMD term)")
        self.parameter_names = tuple(name for name, _ in context.architecture.named_parameters())

    def pre_local_init(self, client_id: int, message: Params, round_: int) -> Params:
        """The client's own v_i; before its first training, the received global model."""
        return self.own_model(client_id, message)

    def local_train(self, client_id: int, params: Params, message: Params, round_: int) -> Work[TrainResult]:
        """w trained from the received w^t (``message``) with knowledge transfer from v_i (``params``),
        uploaded; v_i inherits."""
        cfg, federation = self.config, self.context.federation
        step = FedPHPStep(self.parameter_names, cfg.lam, federation.lr)
        result: StepResult = yield self.step_task(client_id, step, message, round_, "local_training", inputs=params)
        upload = {k: result.state[k] for k in message}
        rounds = federation.rounds if cfg.inheritance_rounds is None else cfg.inheritance_rounds
        mu = inheritance_weight(round_, cfg.mu, rounds)
        return TrainResult(inherit(params, upload, mu), result.loss, result.samples_seen, upload=upload)

    def global_model(self, round_: int) -> Params:
        return self.global_params
