"""FedProto (Tan, Long, Liu, Zhou, Lu, Jiang and Zhang, "FedProto: Federated Prototype Learning across
Heterogeneous Clients", AAAI 2022, arXiv:2105.00243).

No model leaves a client: clients and server exchange class prototypes, the mean representations of the classes.
With f_i(x) the body's output (the features the classifier head reads) of client i's model, D_{i,j} its
training samples of class j and C̄^{(j)} the global prototype of class j:

- local prototype: C_i^{(j)} = (1/n_{i,j}) Σ_{(x, y) ∈ D_{i,j}} f_i(x), n_{i,j} the size of D_{i,j} (the paper's
  local prototype, Alg. 1);
- global prototype: C̄^{(j)} = the mean of C_i^{(j)} over the clients i that uploaded one for class j
  (:func:`~plfl.methods.prototypes.aggregate_prototypes`);
- local loss (the paper's local objective): CE(x, y) + λ R, with R the mean squared distance of f_i(x) to
  C̄^{(y)} over the batch's samples and feature dimensions, samples of a class without a global prototype
  counting 0 (:func:`~plfl.methods.prototypes.prototype_penalty`, PFLlib's MSE; λ = ``method.lam``).

Round t, a sampled client (``local_train``, the step task :class:`FedProtoStep`): its own model (body and head)
trains for ``federation.local_epochs`` epochs, one SGD step per mini-batch on the local loss with the global
prototypes it received, and sums each class's features of the batches as they go (the features of the step's
forward pass, before its update: :func:`~plfl.methods.prototypes.class_sums`); the means, one per class the
client saw, are its local prototypes and all it uploads (``client_message``). The server replaces the global
prototypes by the mean of
the round's uploads (``aggregate``) and sends them to every client (``server_message``: ``prototype/<class>``
tensors of the classes that have one). Before the first aggregation there is none: the first training is
cross-entropy alone, as in PFLlib.

Inference (``method.inference``): ``prototypes`` (default), as the paper and PFLlib test, classifies a sample
by the global prototype nearest to its features, argmin_j ‖f_i(x) − C̄^{(j)}‖². The evaluated model
(``pre_local_init``) is the client's body under a linear head that computes exactly this
(:func:`prototype_classifier`: logit_j = −‖f − C̄^{(j)}‖²/F up to a term common to all classes); a class
without a global prototype gets the logit −10³⁰, so it is never predicted (PFLlib's infinite distance). The
client's own head, trained with its body, is kept in the store (``fedproto_head``) and trained on; ``head``
evaluates the client's own model instead. Before any global prototype exists (round 0) a client evaluates its
own model either way.

Departures: the paper's global prototype weights each client's C_i^{(j)} by n_{i,j}; plfl takes the plain mean
over clients, as PFLlib's serverproto.py and the authors' code do. The local prototypes are the features of all
the round's training steps (every epoch's), as PFLlib's clientproto.py collects them (the authors' code keeps
the last epoch's). PFLlib reports 0 % accuracy before the first aggregation (no prototype to classify with),
where plfl evaluates the initial model; the cross-entropy logged for ``prototypes`` is that of the softmax over
−‖f − C̄^{(j)}‖²/F (PFLlib reports none). The steps are plain SGD (``federation.momentum`` must be 0) without
``data.augment``; the reported loss is the cross-entropy alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import grad

from plfl.errors import ConfigError
from plfl.fields import checked, one_of
from plfl.methods.base import FederationContext, Method, MethodConfig, require_plain_steps
from plfl.methods.partial import module_keys
from plfl.methods.prototypes import (
    aggregate_prototypes,
    class_sums,
    local_prototypes,
    prototype_penalty,
    prototype_table,
)
from plfl.models import BodyHeadModel
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

HEAD = "fedproto_head"  # the store's key of a client's own head
SUMS, COUNTS = "fedproto/sums", "fedproto/counts"  # a step's running per-class feature sums (C, F) and counts (C,)
TABLE, PRESENT = "fedproto/prototypes", "fedproto/present"  # a step's global prototypes (C, F) and 1/0 flags (C,)
ABSENT_LOGIT = -1e30  # the prototype classifier's logit of a class without a global prototype


@dataclass
class FedProtoConfig(MethodConfig):
    """FedProto's keys (Tan et al., AAAI 2022). A client keeps its whole model and receives no model, so there
    is no ``method.ala``."""

    lam: float = checked(
        1.0,
        lambda v: v >= 0,
        "a number >= 0",
        "λ: weight of the distance of the features to their class's global prototype in the local loss "
        "(PFLlib's -lam default 1)",
    )
    inference: str = one_of(
        "prototypes",
        ("prototypes", "head"),
        "what a client classifies with: prototypes, the global prototype nearest to the body's output (the "
        "paper's and PFLlib's test); head, its own model's head",
    )


def prototype_classifier(table: torch.Tensor, present: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear head (weight (C, F), bias (C,)) whose logits are −‖f − C̄^{(j)}‖²/F + ‖f‖²/F = (2 C̄^{(j)}·f −
    ‖C̄^{(j)}‖²)/F for every class j with a global prototype (``present`` 1) and :data:`ABSENT_LOGIT` for the
    others: its argmax is the nearest global prototype."""
    dim = table.shape[1]
    weight = 2 * table / dim * present[:, None]
    bias = torch.where(present > 0, -table.square().sum(1) / dim, torch.full_like(present, ABSENT_LOGIT))
    return weight, bias


@dataclass(frozen=True)
class FedProtoStep(Step):
    """One SGD step of the client's model on CE + λ R (:func:`prototype_penalty`) on a mini-batch, adding the
    batch's features (before the step) to the per-class sums. The state holds the model (the ``parameters`` and
    its buffers) and ``fedproto/sums`` (C, F), ``fedproto/counts`` (C,); the inputs ``fedproto/prototypes``
    (C, F) and ``fedproto/present`` (C,) (:func:`~plfl.methods.prototypes.prototype_table`). The loss returned is
    the cross-entropy."""

    work = "FedProto's local steps"
    parameters: tuple[str, ...]
    num_classes: int
    lam: float
    lr: float

    def __call__(self, network: Network, state: Params, inputs: Params, shared: Params, batch: Batch) -> StepOutput:
        buffers = {k: v for k, v in state.items() if k not in self.parameters and k not in (SUMS, COUNTS)}

        def loss(w: Params) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, Params]]:
            features, body_statistics = network({**buffers, **w}, batch.x, batch.mask, "body")
            logits, head_statistics = network({**buffers, **w}, features, batch.mask, "head")
            cross_entropy = masked_cross_entropy(logits, batch.y, batch.mask)
            penalty = prototype_penalty(features, batch.y, inputs[TABLE], inputs[PRESENT], batch.mask)
            return cross_entropy + self.lam * penalty, (
                cross_entropy,
                features,
                {**body_statistics, **head_statistics},
            )

        w = {k: state[k] for k in self.parameters}
        grads, (cross_entropy, features, statistics) = grad(loss, has_aux=True)(w)
        sums, counts = class_sums(features.detach(), batch.y, self.num_classes, batch.mask)
        return StepOutput(
            {
                **statistics,
                **{k: v - self.lr * grads[k] for k, v in w.items()},
                SUMS: state[SUMS] + sums,
                COUNTS: state[COUNTS] + counts,
            },
            cross_entropy,
            sample_count(batch),
        )


class FedProto(Method):
    """FedProto (Tan et al., AAAI 2022): clients share class prototypes, never models.

    Each client trains its own model toward the global prototypes and classifies by the nearest one.
    """

    name = "fedproto"
    uploads_model = False
    not_averaging = "averages class prototypes, not models"
    config_class = FedProtoConfig

    def __init__(self, config: FedProtoConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_plain_steps("fedproto", context, "its own model (its loss has the prototype term)")
        model = context.architecture
        if not isinstance(model, BodyHeadModel):
            raise ConfigError("fedproto needs a model with a body and a linear head (every model.name has them).")
        self.head_keys = tuple(sorted(module_keys(model, lambda name, _: name == "head")))
        self.parameter_names = tuple(name for name, _ in model.named_parameters())
        self.num_classes, self.dim = model.head.out_features, model.head.in_features
        self.initial_params = initial_params  # every client's model before its first training
        self.global_params: Params = {}  # the global prototypes, prototype/<j>; none before the first round

    def server_message(self, client_id: int, round_: int) -> Params:
        """The global prototypes (``prototype/<j>``, (F,) each), no model."""
        return self.global_params

    def own_head(self, client_id: int) -> Params:
        """The client's own head, trained with its body (the initial head before its first training)."""
        return self.store.get(client_id, HEAD) or {k: self.initial_params[k] for k in self.head_keys}

    def pre_local_init(self, client_id: int, message: Params, round_: int) -> Params:
        """The client's own body under the nearest-prototype head (``method.inference=prototypes``, once there
        are global prototypes) or under its own head."""
        own = self.store.get(client_id, "model") or self.initial_params
        if self.config.inference == "head" or not message:
            return {**own, **self.own_head(client_id)}
        weight, bias = prototype_classifier(*prototype_table(message, self.num_classes, self.dim))
        return {**own, "head.weight": weight, "head.bias": bias}

    def local_train(self, client_id: int, params: Params, message: Params, round_: int) -> Work[TrainResult]:
        """The client's own model (``params``' body under its own head) trained on CE + λ R with the received
        global prototypes (``message``); its local prototypes are the upload."""
        step = FedProtoStep(self.parameter_names, self.num_classes, self.config.lam, self.context.federation.lr)
        start = {**params, **self.own_head(client_id)}
        table, present = prototype_table(message or {}, self.num_classes, self.dim)
        dtype = table.dtype
        state = {**start, SUMS: torch.zeros(self.num_classes, self.dim, dtype=dtype), COUNTS: torch.zeros_like(present)}
        result: StepResult = yield self.step_task(
            client_id, step, state, round_, "local_training", inputs={TABLE: table, PRESENT: present}
        )
        model = {k: result.state[k] for k in start}
        upload = local_prototypes(result.state[SUMS], result.state[COUNTS])
        return TrainResult(model, result.loss, result.samples_seen, upload=upload)

    def client_message(self, client_id: int, result: TrainResult, round_: int) -> Params:
        """The client's local prototypes (``prototype/<j>`` of the classes it trained on); it keeps its trained
        head (only clients whose training succeeded get here)."""
        self.store.set(client_id, HEAD, {k: result.params[k] for k in self.head_keys})
        return result.upload

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        """The global prototypes ← the mean over the uploading clients, per class."""
        self.global_params = aggregate_prototypes(list(messages.values()))
