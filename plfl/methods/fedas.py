"""FedAS (Yang, Huang and Ye, "FedAS: Bridging Inconsistency in Personalized Federated Learning", CVPR 2024):
federated parameter alignment and client synchronization.

The model is a shared body f(·; θ) (``body.*``, parameters and buffers) and a personal head (``head.*``, the
last linear layer), which never leaves its client. Round t, as PFLlib's clientas.py/serveras.py run it:

1. Broadcast: the server sends the global body θ^t to the clients sampled for the next round, and to no one
   else (``server_message``). A client that is not sampled receives nothing, does nothing and keeps its model.
2. Parameter alignment (the client's ``local_train``, before its training): the client's own model (θ_i, its
   head), the one it trained in its last round (before its first, the initial model), gives its class
   prototypes p_c = mean of f(x; θ_i) over its training samples of class c (:func:`local_prototypes` of
   :func:`class_sums`). The received θ^t is then trained for ``method.align_epochs`` epochs of plain SGD at
   ``method.align_lr``, in shuffled batches of ``method.align_batch_size`` (stream "alignment"), on

       L_align(θ; B) = Σ_{c ∈ B} 1/(n_c F) Σ_{x ∈ B_c} ‖f(x; θ) − p_c‖²                  (:func:`alignment_loss`)

   B_c the batch's n_c samples of class c, F the feature size (one ``MSELoss`` per class in the batch, summed), so
   that the shared parameters take in the client's local knowledge before they replace its own body
   (:class:`AlignmentStep`). The aligned body under the client's own head is the model it trains.
3. Local training: the whole model (aligned body and own head) for ``federation.local_epochs`` epochs of SGD on
   the cross-entropy (the default training task, stream "local_training").
4. Fisher information: the trained model's empirical Fisher information, reduced to its trace,

       I_i = Σ_B ‖∇_w ℓ(w; B)‖²,   ℓ(w; B) = −1/n_B Σ_{(x, y) ∈ B} log softmax(h(f(x)))_y     (:class:`FisherStep`)

   over one shuffled pass of the client's training split in batches B of ``federation.batch_size`` (stream
   "fisher"), w every parameter of the model (body and head), ℓ the mean negative log-likelihood of B's n_B
   samples. The client uploads its trained body and I_i (``fedas/fisher``, one number); the Fisher trace travels
   with the body and counts in ``params_received``/``bytes_received``.
5. Client synchronization (``aggregate``): θ^{t+1} = Σ_i (I_i / Σ_j I_j) θ_i over the clients that uploaded:
   a client whose model has taken in little of its data (a straggler's under-trained model) has a small
   Fisher trace and weighs little.

Evaluated is each client's own model (its trained model, or the initial one before its first training), as
PFLlib evaluates before its broadcast; the global body is not evaluated alone. A new client (unseen clients)
takes the global body under the initial head. No ``method.ala``: the alignment is the local initialisation.

Departures. plfl follows PFLlib's code (commit d832e76) where it fixes what the paper describes in words: the
personal part is the last linear layer alone; the alignment is one epoch of SGD at 0.01 in batches of 16 (fixed in
PFLlib, plfl's defaults); the Fisher information is its trace, and that trace sums the squared gradients of
batch-mean losses (the empirical Fisher information sums per-sample squared gradients, divided by the samples), so
it grows with the number of batches and falls with their size; it is taken over all parameters, the personal head
included, of the trained model; the weights are the normalised traces, with no sample-size factor. Departures from
PFLlib: PFLlib uploads the whole model and its server averages the heads too, into a global head it never sends
back into use: plfl uploads the body and the trace only. PFLlib's non-sampled clients also compute a Fisher trace,
which nothing uses: plfl's do not. PFLlib computes the prototypes, aligns and takes the Fisher pass on shuffled
batches that drop each client's last incomplete batch; plfl's prototypes take every training sample, and the
alignment and Fisher batches drop a short last batch only under ``federation.drop_last``. PFLlib runs these
passes with the model in eval mode after a client's first round (BatchNorm, if any, by its running statistics);
plfl's steps run the model in training mode (BatchNorm by the batch's statistics; the alignment keeps the running
statistics it updates, the Fisher pass none). A round whose uploaders all have a zero Fisher trace, which PFLlib
turns into NaN, averages the bodies by training samples instead (with a warning). The alignment and Fisher batches
are not augmented (``data.augment`` applies to the local training).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.func import grad_and_value

from plfl.errors import ConfigError, PlflWarning
from plfl.fields import checked
from plfl.methods.base import FederationContext, MethodConfig, require_private_steps
from plfl.methods.partial import PartialSharing, module_keys
from plfl.methods.prototypes import class_sums, local_prototypes, prototype_table
from plfl.models import BodyHeadModel
from plfl.robust import weighted_average
from plfl.seeding import sample_clients
from plfl.state import Params
from plfl.tasks import (
    Batch,
    FeatureResult,
    FeatureTask,
    Network,
    Step,
    StepOutput,
    StepResult,
    TrainResult,
    Work,
    masked_cross_entropy,
    sample_count,
)

FISHER = "fedas/fisher"  # upload key: the trained model's Fisher trace I_i, a 0-dim float tensor
TABLE, PRESENT = "fedas/prototypes", "fedas/present"  # alignment inputs: (C, F) prototypes, (C,) 1/0 flags


@dataclass
class FedASConfig(MethodConfig):
    """FedAS's keys: the parameter alignment (PFLlib's fixed values are the defaults)."""

    align_epochs: int = checked(
        1,
        lambda v: isinstance(v, int) and v >= 0,
        "an integer >= 0",
        "epochs of parameter alignment of the received body to the client's prototypes (0: none, the received body "
        "as it is); PFLlib's 1",
    )
    align_batch_size: int = checked(
        16, lambda v: isinstance(v, int) and v >= 1, "an integer >= 1", "batch size of the alignment; PFLlib's 16"
    )
    align_lr: float = checked(
        0.01, lambda v: v >= 0, "a number >= 0", "SGD step size of the alignment (plain SGD); PFLlib's 0.01"
    )


def alignment_loss(
    features: torch.Tensor, y: torch.Tensor, table: torch.Tensor, present: torch.Tensor, mask: Optional[torch.Tensor]
) -> torch.Tensor:
    """L_align = Σ_c p_c Σ_b m_b [y_b = c] ‖z_b − t_c‖² / (F n_c), n_c = Σ_b m_b [y_b = c]: for every class c in
    the batch with a prototype, the mean squared error between its samples' features and its prototype over the
    samples and the F dimensions (PFLlib's ``MSELoss`` per class), summed over the classes; 0 for an empty batch.

    Args:
        features: (B, F) body outputs z.
        y: (B,) int64 labels.
        table: (C, F) the client's prototypes t (rows of classes without one unused).
        present: (C,) 1/0, the classes with a prototype.
        mask: (B,) 1/0 real samples, or None (all).

    Returns:
        A 0-dim tensor.
    """
    rows = (y[:, None] == torch.arange(table.shape[0], device=y.device)).to(features.dtype)  # (B, C)
    squared = (features - rows @ table).square().sum(1) / features.shape[1]  # (B,)
    counted = rows if mask is None else rows * mask[:, None]
    per_class = counted.T @ squared  # (C,) Σ over the class's real samples
    return (present * per_class / counted.sum(0).clamp(min=1)).sum()


@dataclass(frozen=True)
class AlignmentStep(Step):
    """One SGD step of the body on :func:`alignment_loss`: the state is the body (the ``parameters`` and its
    buffers), the inputs the prototypes ``fedas/prototypes`` (C, F) and their flags ``fedas/present`` (C,)."""

    work = "FedAS's parameter alignment"
    parameters: tuple[str, ...]
    lr: float

    def __call__(self, network: Network, state: Params, inputs: Params, shared: Params, batch: Batch) -> StepOutput:
        buffers = {k: v for k, v in state.items() if k not in self.parameters}

        def loss(w: Params) -> tuple[torch.Tensor, Params]:
            features, statistics = network({**buffers, **w}, batch.x, batch.mask, "body")
            return alignment_loss(features, batch.y, inputs[TABLE], inputs[PRESENT], batch.mask), statistics

        w = {k: state[k] for k in self.parameters}
        grads, (value, statistics) = grad_and_value(loss, has_aux=True)(w)
        return StepOutput(
            {**buffers, **statistics, **{k: v - self.lr * grads[k] for k, v in w.items()}}, value, sample_count(batch)
        )


@dataclass(frozen=True)
class FisherStep(Step):
    """Adds ‖∇_w ℓ(w; B)‖² of the batch-mean negative log-likelihood ℓ to the state's ``fedas/fisher`` (0-dim); the
    model is the input (a whole state dict), w its ``parameters``; the model is not changed. The loss returned
    is ℓ."""

    work = "FedAS's Fisher information"
    parameters: tuple[str, ...]

    def __call__(self, network: Network, state: Params, inputs: Params, shared: Params, batch: Batch) -> StepOutput:
        buffers = {k: v for k, v in inputs.items() if k not in self.parameters}

        def nll(w: Params) -> torch.Tensor:
            logits, _ = network({**buffers, **w}, batch.x, batch.mask, "")
            return masked_cross_entropy(logits, batch.y, batch.mask)

        grads, value = grad_and_value(nll)({k: inputs[k] for k in self.parameters})
        trace = torch.stack([g.square().sum() for g in grads.values()]).sum()
        return StepOutput({FISHER: state[FISHER] + trace}, value, sample_count(batch))


def fisher_weights(traces: list[float]) -> Optional[list[float]]:
    """I_i / Σ_j I_j for the uploaders' Fisher traces; None when the sum is not a positive finite number."""
    total = float(sum(traces))
    if not total > 0 or total == float("inf"):
        return None
    return [t / total for t in traces]


class FedAS(PartialSharing):
    """FedAS (Yang et al., CVPR 2024): aligned shared body, Fisher-weighted aggregation, personal heads.

    Sampled clients align the received body to their own class prototypes, train, and upload with their Fisher
    trace.
    """

    name = "fedas"
    uploads_model = False
    not_averaging = "weights the bodies by their Fisher information, which a robust rule would drop"
    config_class = FedASConfig
    # The executor matrix: clients left out of rounds, short last batches of local training and of alignment.
    matrix_options = {"federation.join_ratio": 0.6, "federation.batch_size": 7, "method.align_batch_size": 6}

    def __init__(self, config: FedASConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_private_steps(
            "fedas", context, "aligns the body and computes its Fisher information in steps of its own"
        )
        model = context.architecture
        if not isinstance(model, BodyHeadModel):
            raise ConfigError("fedas needs a model with a body and a head (every model.name has them).")
        self.parameter_names = tuple(name for name, _ in model.named_parameters())
        self.body_parameters = tuple(p for p in self.parameter_names if p not in self.local_keys)
        self.num_classes, self.dim = model.head.out_features, model.head.in_features
        self.fisher: dict[int, float] = {}  # the last aggregation's I_i by uploading client (round_tables)
        self.weights: dict[int, float] = {}  # and its aggregation weights
        self.aggregated = -1  # the round of that aggregation

    def keep_local(self, model: nn.Module) -> frozenset[str]:
        return module_keys(model, lambda name, _: name == "head")

    def server_message(self, client_id: int, round_: int) -> Optional[Params]:
        """The global body for a client sampled for round ``round_`` + 1; nothing for the others."""
        federation = self.context.federation
        sampled = sample_clients(federation.seed, round_ + 1, len(self.context.data.clients), federation.join_ratio)
        return self.global_params if client_id in sampled else None

    def pre_local_init(self, client_id: int, message: Optional[Params], round_: int) -> Params:
        """The client's own model, as it is (the initial model before its first training): the received body
        replaces the client's only after its alignment, in ``local_train``."""
        return self.own_model(client_id, self.initial_params)

    def local_train(self, client_id: int, params: Params, message: Optional[Params], round_: int) -> Work[TrainResult]:
        """Prototypes of ``params`` (the client's own model), the received body aligned to them, local training of
        the aligned body under the client's head, then the trained model's Fisher trace; the upload is the trained
        body and the trace. The loss is the local training's."""
        cfg, federation = self.config, self.context.federation
        start = dict(params)
        if message is not None:
            body = {k: message[k] for k in self.global_params}
            if cfg.align_epochs > 0:
                samples = torch.arange(self.context.data.clients[client_id].num_train)
                own: FeatureResult = yield FeatureTask(client_id, params, samples, cfg.align_batch_size)
                table, present = prototype_table(
                    local_prototypes(*class_sums(own.x, own.y, self.num_classes)), self.num_classes, self.dim
                )
                aligned: StepResult = yield self.step_task(
                    client_id,
                    AlignmentStep(self.body_parameters, cfg.align_lr),
                    body,
                    round_,
                    "alignment",
                    batch_size=cfg.align_batch_size,
                    epochs=cfg.align_epochs,
                    inputs={TABLE: table, PRESENT: present},
                )
                body = {k: aligned.state[k] for k in body}
            start.update(body)
        trained: TrainResult = yield self.train_task(
            client_id, start, round_, "local_training", **federation.local_length()
        )
        fisher: StepResult = yield self.step_task(
            client_id,
            FisherStep(self.parameter_names),
            {FISHER: torch.zeros(())},
            round_,
            "fisher",
            epochs=1,
            inputs=trained.params,
        )
        upload = {**self.shared(trained.params), FISHER: fisher.state[FISHER]}
        return TrainResult(trained.params, trained.loss, trained.samples_seen, upload=upload)

    def client_message(self, client_id: int, result: TrainResult, round_: int) -> Params:
        """The trained body and its Fisher trace (``fedas/fisher``)."""
        return result.upload

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        """θ ← Σ_i (I_i / Σ_j I_j) θ_i over the uploaded bodies.

        Warns:
            PlflWarning: the traces sum to 0 (or are not finite); the bodies are averaged by training samples.
        """
        ids = list(messages)
        traces = [float(messages[i][FISHER]) for i in ids]
        weights = fisher_weights(traces)
        if weights is None:
            warnings.warn(
                PlflWarning(
                    f"Round {round_}: FedAS's Fisher traces of the uploaded models sum to {sum(traces)}; "
                    "the bodies are averaged by the clients' training samples instead."
                ),
                stacklevel=2,
            )
            sizes = [self.context.data.clients[i].num_train for i in ids]
            weights = [n / sum(sizes) for n in sizes]
        bodies = [{k: messages[i][k] for k in self.global_params} for i in ids]
        self.global_params = weighted_average(bodies, weights)
        self.fisher, self.weights, self.aggregated = dict(zip(ids, traces)), dict(zip(ids, weights)), round_

    def round_tables(self, round_: int) -> dict[str, list[dict[str, Any]]]:
        """``fisher``: a row per client of the round's aggregation, its Fisher trace and aggregation weight."""
        if self.aggregated != round_:
            return {}
        return {"fisher": [{"client": i, "fisher": t, "weight": self.weights[i]} for i, t in self.fisher.items()]}
