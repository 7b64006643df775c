"""FedRoD (Chen and Chao, "On Bridging Generic and Personalized Federated Learning for Image Classification",
ICLR 2022, arXiv:2107.00778): a generic model trained for balanced risk, a personal head per client on top.

The model is a body f(·; θ) (``body.*``) and a linear generic head g(·; ψ) (``head.*``), shared by all
clients as FedAvg's model; client m also keeps a personal head h(·; φ_m) of the same shape, which never
leaves it. Client m's personalized prediction adds both heads' logits: ŷ = g(f(x)) + h_m(f(x)).
Per round, a sampled client starts θ, ψ from the received model and φ_m from its store (before its
first training, the initial model's head, as PFLlib's copy of it), and per mini-batch (x, y) of
``federation.local_epochs`` epochs (stream "local_training"; ``local_train``, the step task
:class:`FedRoDStep`), from one forward pass z = f(x; θ):

- θ, ψ ← one SGD step on the balanced softmax loss of the generic logits (the paper's balanced risk,
  instantiated by the balanced softmax of Ren et al., 2020; :func:`balanced_softmax_loss`):
  L_BSM = −log( n_{m,y} e^{g(z)_y} / Σ_c n_{m,c} e^{g(z)_c} ) = CE(g(z) + log n_m, y),
  n_{m,c} the client's training samples of class c (a class it lacks drops out of the softmax);
- φ_m ← one SGD step on CE(sg[g(z)] + h(sg[z]; φ_m), y), the body's features and the generic logits
  detached (sg), so the personal loss trains the personal head alone.

Both steps use η = ``federation.lr``. The client uploads θ and ψ; the server averages them as FedAvg
(sample-weighted); φ_m stays in the store. Both heads are linear maps of the same features, so
g(z) + h_m(z) = (W_g + W_m) z + (b_g + b_m): ``pre_local_init`` returns the received model with the head
W_g + W_m, b_g + b_m (:func:`summed_head`), the personalized model that is evaluated, while
``local_train`` trains from the received model itself (its real generic head) and the stored φ_m. The
generic model θ, ψ is evaluated on all clients' test data (``global_accuracy``), the paper's generic
(G-FL) accuracy. A model whose head is not one ``nn.Linear`` is refused (ConfigError). BatchNorm
statistics in the body follow the one forward pass and are averaged with the body. The reported loss
is the personalized CE above.

ALA (``method.ala``) is refused: the received model is what the client trains from, but ALA's output
would be the model handed to ``local_train``, which trains from the received model and the stored
personal head instead, so ALA would change only the evaluated model.

Departures: as PFLlib's clientrod.py where the paper leaves the order open, both steps take the same
forward pass (the personal step sees the body and generic head before their step), the personal head
starts as the initial model's head, and its step size is the clients' lr; the server's mean is
weighted by the clients' training samples (serverbase.py). PFLlib counts n_{m,c} over the batches of
one shuffled pass that drops the last incomplete batch; plfl counts all the client's training samples,
as the paper defines them. The paper's hypernetwork variant of the personal head (FedRoD with a
hypernetwork) is not implemented. The steps are plain gradient steps (``federation.momentum`` must be 0,
no ``data.augment``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.func import grad_and_value

from plfl.methods.base import FederationContext, MethodConfig, require_linear_head, require_plain_steps
from plfl.methods.fedavg import FedAvg
from plfl.methods.partial import module_keys
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
    non_finite,
    sample_count,
)

PERSONAL_HEAD = "personal_head"  # store key: φ_m, the head's state dict names (head.weight, head.bias)
ABSENT_CLASS = -1e9  # log n_c for a class with no training sample: e^(z − 1e9) is 0, as for log 0 = −∞, yet finite


def log_class_counts(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """log n_c of the (n,) int64 ``labels`` for c = 0..num_classes − 1: a (num_classes,) float32 tensor, with
    :data:`ABSENT_CLASS` for a class without a sample (so that a padded row's loss stays finite)."""
    counts = torch.bincount(labels, minlength=num_classes).float()
    return torch.where(counts > 0, counts.log(), torch.tensor(ABSENT_CLASS))


def balanced_softmax_loss(
    logits: torch.Tensor, y: torch.Tensor, log_counts: torch.Tensor, mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The balanced softmax loss −log(n_y e^{z_y} / Σ_c n_c e^{z_c}) = CE(z + log n, y), a 0-dim tensor: the mean
    over the real samples (``mask`` 1; all when None).

    Args:
        logits: z, (W, classes).
        y: (W,) int64 labels.
        log_counts: (classes,) log n_c (:func:`log_class_counts`).
        mask: (W,) float 1/0, or None.
    """
    return masked_cross_entropy(logits + log_counts, y, mask)


def summed_head(params: Params, personal: Params) -> Params:
    """``params`` with every ``personal`` tensor (the personal head's, by the model's names) added to its own:
    the generic head W_g, b_g becomes W_g + W_m, b_g + b_m, so that the model's logits are g(z) + h_m(z)."""
    return {k: v + personal[k] if k in personal else v for k, v in params.items()}


@dataclass(frozen=True)
class FedRoDStep(Step):
    """One mini-batch of FedRoD: from one pass of the body, an SGD step of the body and generic head on the
    balanced softmax loss and one of the personal head on the detached features' summed logits. The state is
    the model (body and generic head, by its names) and the personal head under ``personal/<name>``; the input
    ``log_counts`` is the client's log n_c. The loss returned is the personalized cross-entropy."""

    work = "FedRoD's local steps"
    parameters: tuple[str, ...]  # the model's parameters: body and generic head
    lr: float

    def __call__(self, network: Network, state: Params, inputs: Params, shared: Params, batch: Batch) -> StepOutput:
        model = {k: v for k, v in state.items() if not k.startswith("personal/")}
        personal = {k.removeprefix("personal/"): v for k, v in state.items() if k.startswith("personal/")}

        def generic_loss(params: Params) -> tuple[torch.Tensor, tuple]:
            features, statistics = network({**model, **params}, batch.x, batch.mask, "body")
            logits, _ = network(params, features, batch.mask, "head")
            loss = balanced_softmax_loss(logits, batch.y, inputs["log_counts"], batch.mask)
            return loss, (features, logits, statistics)

        def personal_loss(head: Params, features: torch.Tensor, generic: torch.Tensor) -> torch.Tensor:
            logits, _ = network(head, features, batch.mask, "head")
            return masked_cross_entropy(generic + logits, batch.y, batch.mask)

        params = {k: model[k] for k in self.parameters}
        grads, (_, (features, generic, statistics)) = grad_and_value(generic_loss, has_aux=True)(params)
        personal_grads, value = grad_and_value(personal_loss)(personal, features.detach(), generic.detach())
        new_model = {**model, **statistics, **{k: v - self.lr * grads[k] for k, v in params.items()}}
        new_personal = {f"personal/{k}": v - self.lr * personal_grads[k] for k, v in personal.items()}
        return StepOutput({**new_model, **new_personal}, value, sample_count(batch))


class FedRoD(FedAvg):
    """FedRoD (Chen and Chao, ICLR 2022): a balanced-risk generic model plus a personal head per client.

    FedAvg on the body and generic head (balanced softmax); personal heads add their logits.
    """

    name = "fedrod"
    config_class = MethodConfig
    matrix_options = {"federation.batch_size": 7}  # short last batches: padding in the vectorized steps

    def __init__(self, config: MethodConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_plain_steps("fedrod", context, "the generic model and the personal head")
        require_linear_head(
            "fedrod", context, "adds a personal head's logits to the generic head's as one summed linear head"
        )
        architecture = context.architecture
        head = module_keys(architecture, lambda name, _: name == "head")
        self.head_keys = tuple(k for k in initial_params if k in head)  # the model's order
        self.parameter_names = tuple(name for name, _ in architecture.named_parameters())
        self.initial_head = {k: initial_params[k].clone() for k in self.head_keys}
        self.num_classes = context.data.num_classes

    def personal_head(self, client_id: int) -> Params:
        """φ_m from the store; before the client's first training, the initial model's head."""
        return self.store.get(client_id, PERSONAL_HEAD) or self.initial_head

    def pre_local_init(self, client_id: int, message: Params, round_: int) -> Params:
        """The personalized model: the received body under the summed head W_g + W_m, b_g + b_m."""
        return summed_head(message, self.personal_head(client_id))

    def local_train(self, client_id: int, params: Params, message: Params, round_: int) -> Work[TrainResult]:
        """From the received model (not ``params``, whose head is the summed one) and the stored personal head,
        one step of each per mini-batch; keeps the personal head (unless training diverged), uploads the body
        and generic head, returns the personalized model."""
        labels = self.context.data.clients[client_id].y_train
        state = {**message, **{f"personal/{k}": v for k, v in self.personal_head(client_id).items()}}
        step = FedRoDStep(self.parameter_names, self.context.federation.lr)
        result: StepResult = yield self.step_task(
            client_id,
            step,
            state,
            round_,
            "local_training",
            inputs={"log_counts": log_class_counts(labels, self.num_classes)},
        )
        generic = {k: result.state[k] for k in message}
        personal = {k: result.state[f"personal/{k}"] for k in self.head_keys}
        if non_finite(generic) is None and non_finite(personal) is None:
            self.store.set(client_id, PERSONAL_HEAD, personal)  # a diverged client keeps its head and fails
        return TrainResult(summed_head(generic, personal), result.loss, result.samples_seen, upload=generic)

    def global_model(self, round_: int) -> Params:
        """The generic model (body and generic head): the paper's G-FL accuracy."""
        return self.global_params
