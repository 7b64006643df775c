r"""FedPAC (Xu, Tong and Huang, "Personalized Federated Learning with Feature Alignment and Classifier
Collaboration", ICLR 2023, arXiv:2306.11867): a shared body aligned to global class prototypes, and per-client
heads combined across clients.

The model is a body f (the feature extractor, ``body.*``, features z = f(x) of F dimensions) and a linear head
ψ_i per client (``head.*``), never averaged plainly. Round t (Alg. 1), a sampled client i, from the received
global body and the head it holds (``local_train``):

1. statistics of the received body's features on its n_i training samples (:func:`feature_statistics`), for the
   server's classifier combination: with p_k = n_{i,k}/n_i and μ_k the mean feature of class k,

   .. math:: h_{i,k} = p_k \mu_k = \tfrac{1}{n_i} \textstyle\sum_{l: y_l = k} z_l, \qquad
      V_i = \textstyle\sum_k \big(p_k\, \mathbb{E}[\lVert z\rVert^2 \mid k] - p_k^2 \lVert\mu_k\rVert^2\big)
      = \tfrac{1}{n_i}\sum_l \lVert z_l\rVert^2 - \sum_k \lVert h_{i,k}\rVert^2;

   h_i (C × F) estimates E[z 1{y = k}], and V_i/n_i is the variance of that estimate, which is uploaded;
2. one epoch of SGD on the head alone, body frozen (stream "head_training");
3. ``federation.local_epochs`` epochs of SGD on the body alone, head frozen, on the cross-entropy plus λ times
   the feature alignment term (:func:`~plfl.methods.prototypes.prototype_penalty`, λ = ``method.lam``; the step
   task :class:`FedPACStep`, stream "local_training"): the mean over the batch's samples and the F feature dimensions of
   ‖z − c_y‖², c_y the global prototype of the sample's class; a sample whose class has none counts 0 (all do in
   the first round);
4. its local prototypes, the mean trained-body feature of each class it holds
   (:func:`~plfl.methods.prototypes.local_prototypes`).

It uploads (``client_message``) its body, head, prototypes (``prototype/<k>``), V_i/n_i (``fedpac/variance``)
and h_i (``fedpac/h``). The server (``aggregate``) sets the global body to the sample-weighted mean of the
bodies, the global prototypes to the per-class mean of the uploaded ones
(:func:`~plfl.methods.prototypes.aggregate_prototypes`; classes nobody uploaded this round have none), and, for each
uploading client i, solves the paper's Eq. 9 over
the round's uploaders j (:func:`combination_weights`):

.. math:: \alpha_i = \arg\min_{\alpha \in \Delta} \alpha^\top P^{(i)} \alpha, \qquad
   P^{(i)}_{ab} = \delta_{ab} \tfrac{V_a}{n_a} + \textstyle\sum_k (h_{i,k} - h_{a,k})^\top (h_{i,k} - h_{b,k}),

on the simplex Δ; on Δ the objective is ‖h_i − Σ_j α_j h_j‖² + Σ_j α_j² V_j/n_j, the bias and variance terms
of the estimated test loss (:func:`combination_matrix`, :func:`simplex_qp`). Weights below 10⁻³ are set to 0
(not renormalised, as PFLlib). Client i is sent (``server_message``) the global body, its combined head Σ_j
α_ij ψ_j (:func:`combine_heads`; only a client that uploaded this round gets one, the others keep their own
head, as in PFLlib) and the global prototypes; its model is the received body under the received head, or
under its own (``pre_local_init``; before its first round, the initial head), which is what is evaluated. The
store keeps each client's model; the server keeps the global body, prototypes and the round's combined heads
(``server_state``). ``round_tables`` logs α (table ``head_weights``: a row per uploading client, ``w<j>`` the
weight of client j's head).

The QP is solved with SciPy's SLSQP on P/max(diag P), from the uniform weights; where it fails, the client
is sent its own trained head back (α = e_i: PFLlib's fallback, which sends nothing) with a warning.

Departures, where plfl follows PFLlib's clientpac.py/serverpac.py: the global prototype is the plain mean over
clients (the authors' code weights each client's prototype by its class count); weights below 10⁻³ are zeroed
without renormalising (the authors' code divides by their sum); a sample whose class has no global prototype
adds nothing to the alignment term (the authors' code aligns it to the client's own prototype before training);
both parts train with plain SGD at ``federation.lr`` (the authors' code trains the head at lr 0.1, and both
parts with momentum 0.5 and weight decay 5·10⁻⁴). Departures from PFLlib: the statistics and prototypes use all
training samples, in the training mode of the step tasks' network (PFLlib's loader drops the last incomplete
batch of a shuffled pass, takes the class shares p_k from another such pass and divides V_i by all n_i samples;
it collects prototypes in eval mode, which only matters with BatchNorm or dropout); PFLlib projects P onto its
eigenvalues ≥ 0.01 when a rounding error makes it indefinite (P is positive semi-definite by construction),
which plfl does not; PFLlib's fallback takes the head of the uploader at the client's id's position
(``uploaded_heads[cid]``), plfl the client's own; PFLlib's uploads are the clients' head modules themselves,
into which its loop sets each combined head in turn, so a later client combines heads already combined for
earlier ones, where plfl combines the heads as trained. The body steps are plain SGD (``federation.momentum`` must
be 0) without ``data.augment``; the reported loss is the cross-entropy of both trainings.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from scipy.optimize import minimize
from torch import nn
from torch.func import grad_and_value

from plfl.errors import ConfigError, PlflWarning
from plfl.fields import checked
from plfl.methods.base import FederationContext, MethodConfig, require_plain_steps
from plfl.methods.partial import PartialSharing, module_keys
from plfl.methods.prototypes import (
    PREFIX,
    aggregate_prototypes,
    class_sums,
    local_prototypes,
    one_hot,
    prototype_penalty,
    prototype_table,
)
from plfl.models import BodyHeadModel
from plfl.robust import weighted_average
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

VARIANCE, MEANS = "fedpac/variance", "fedpac/h"  # an upload's V_i/n_i (0-dim) and h_i (C, F)
TABLE, PRESENT = "fedpac/prototypes", "fedpac/present"  # a step's global prototypes (C, F) and 1/0 flags (C,)
SMALL_WEIGHT = 1e-3  # combination weights below it are set to 0 (PFLlib's and the authors' eps)


@dataclass
class FedPACConfig(MethodConfig):
    """FedPAC's keys (Xu et al., ICLR 2023, Alg. 1); the body epochs are ``federation.local_epochs``, the head
    trains one epoch. A client keeps its head (its local initialisation), so there is no ``method.ala``."""

    lam: float = checked(
        1.0,
        lambda v: v >= 0,
        "a number >= 0",
        "λ: weight of the feature alignment term (features to their class's global prototype) in the body's "
        "loss (PFLlib's -lam and the authors' --lam default, 1)",
    )


def feature_statistics(features: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A client's statistics for the classifier combination, from its m features z_l (m, F) and labels (m,):

    h_k = (1/m) Σ_{l: y_l = k} z_l = p_k μ_k, and V = (1/m) Σ_l ‖z_l‖² − Σ_k ‖h_k‖²
    = Σ_k (p_k E[‖z‖² | k] − p_k² ‖μ_k‖²), the total variance of z·1{y = k} over the classes.

    Returns:
        (V/m, a 0-dim tensor: the variance of the estimate h; h, (num_classes, F)), in the features' dtype
        (computed in float64); zeros when m = 0.
    """
    m, dtype = len(y), features.dtype
    if m == 0:
        return torch.zeros((), dtype=dtype), torch.zeros(num_classes, features.shape[1], dtype=dtype)
    z = features.double()
    h = one_hot(y, num_classes, z.dtype).T @ z / m
    variance = z.square().sum() / m - h.square().sum()
    return (variance / m).to(dtype), h.to(dtype)


def combination_matrix(variances: torch.Tensor, means: torch.Tensor, client: int) -> np.ndarray:
    """P of client ``client``'s QP (Eq. 9), over the n uploading clients: P_ab = δ_ab variances[a] +
    Σ_k (h_client,k − h_a,k)·(h_client,k − h_b,k), so that α^T P α = Σ_j α_j² V_j/n_j + ‖h_client − Σ_j α_j h_j‖²
    for Σ_j α_j = 1.

    Args:
        variances: (n,) V_j/n_j.
        means: (n, C, F) h_j.
        client: the row of ``means`` that is client i's.

    Returns:
        (n, n) float64, symmetric positive semi-definite.
    """
    gaps = (means[client] - means).double().flatten(1)  # (n, C·F): h_i − h_a
    return (torch.diag(variances.double()) + gaps @ gaps.T).numpy()


def simplex_qp(p: np.ndarray) -> Optional[np.ndarray]:
    """argmin_α α^T P α subject to Σ_j α_j = 1, α ≥ 0, for a symmetric positive semi-definite (n, n) P: SciPy's
    SLSQP on P / max(diag P), from the uniform weights. Returns (n,) float64 weights, or None when the solver
    does not converge."""
    n = len(p)
    scale = float(np.max(np.diag(p)))
    q = p / scale if scale > 0 else p
    result = minimize(
        lambda a: a @ q @ a,
        np.full(n, 1.0 / n),
        jac=lambda a: 2 * q @ a,
        method="SLSQP",
        bounds=[(0.0, 1.0)] * n,
        constraints=({"type": "eq", "fun": lambda a: a.sum() - 1.0, "jac": lambda a: np.ones_like(a)},),
        options={"ftol": 1e-12, "maxiter": 1000},
    )
    if not result.success:
        return None
    return np.clip(result.x, 0.0, 1.0)


def combination_weights(variances: torch.Tensor, means: torch.Tensor) -> list[Optional[torch.Tensor]]:
    """Every uploading client's weights α_i over the n uploaders' heads (Eq. 9, :func:`combination_matrix`,
    :func:`simplex_qp`), weights below 10⁻³ set to 0 without renormalising (PFLlib's); None for a client whose
    QP was not solved.

    Args:
        variances: (n,) V_j/n_j.
        means: (n, C, F) h_j.

    Returns:
        n entries, each (n,) float64 or None.
    """
    weights = []
    for i in range(len(variances)):
        alpha = simplex_qp(combination_matrix(variances, means, i))
        weights.append(None if alpha is None else torch.from_numpy(np.where(alpha > SMALL_WEIGHT, alpha, 0.0)))
    return weights


def combine_heads(heads: list[Params], alpha: torch.Tensor) -> Params:
    """Σ_j α_j ψ_j per tensor, in the heads' dtype. ``heads``: n heads with the same keys; ``alpha``: (n,)."""
    return {
        key: sum(float(a) * head[key].double() for a, head in zip(alpha, heads)).to(first.dtype)
        for key, first in heads[0].items()
    }


@dataclass(frozen=True)
class FedPACStep(Step):
    """One SGD step of the body on the cross-entropy plus λ times
    :func:`~plfl.methods.prototypes.prototype_penalty`, the head frozen. The state holds the body (the
    ``parameters`` and its buffers); the inputs the head (``head.*``), the global
    prototypes ``fedpac/prototypes`` (C, F) and their flags ``fedpac/present`` (C,)
    (:func:`~plfl.methods.prototypes.prototype_table`).
    The loss returned is the cross-entropy."""

    work = "FedPAC's body steps"
    parameters: tuple[str, ...]
    lam: float
    lr: float

    def __call__(self, network: Network, state: Params, inputs: Params, shared: Params, batch: Batch) -> StepOutput:
        buffers = {k: v for k, v in state.items() if k not in self.parameters}
        head = {k: v for k, v in inputs.items() if k not in (TABLE, PRESENT)}

        def loss(w: Params) -> tuple[torch.Tensor, tuple[torch.Tensor, Params]]:
            features, statistics = network({**buffers, **w}, batch.x, batch.mask, "body")
            logits, _ = network(head, features, batch.mask, "head")
            cross_entropy = masked_cross_entropy(logits, batch.y, batch.mask)
            penalty = prototype_penalty(features, batch.y, inputs[TABLE], inputs[PRESENT], batch.mask)
            return cross_entropy + self.lam * penalty, (cross_entropy, statistics)

        w = {k: state[k] for k in self.parameters}
        grads, (_, (cross_entropy, statistics)) = grad_and_value(loss, has_aux=True)(w)
        return StepOutput(
            {**buffers, **statistics, **{k: v - self.lr * grads[k] for k, v in w.items()}},
            cross_entropy,
            sample_count(batch),
        )


class FedPAC(PartialSharing):
    """FedPAC (Xu et al., ICLR 2023): a shared body aligned to global prototypes, heads combined per client.

    Clients train head then body (with feature alignment); the server averages bodies and solves a QP per client.
    """

    name = "fedpac"
    uploads_model = False
    not_averaging = "combines classifier heads by a per-client quadratic program and averages prototypes"
    config_class = FedPACConfig
    server_state = ("global_params", "prototypes", "combined_heads")

    def __init__(self, config: FedPACConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_plain_steps("fedpac", context, "the body epochs (their loss has the feature alignment term)")
        model = context.architecture
        if not isinstance(model, BodyHeadModel):
            raise ConfigError("fedpac needs a model with a body and a linear head (every model.name has them).")
        parameters = [name for name, _ in model.named_parameters()]
        self.head_keys = tuple(k for k in initial_params if k in self.local_keys)
        self.head_parameters = frozenset(p for p in parameters if p in self.local_keys)
        self.body_parameters = tuple(p for p in parameters if p not in self.local_keys)
        self.num_classes, self.dim = model.head.out_features, model.head.in_features
        self.prototypes: Params = {}  # the global prototypes, prototype/<k>; none before the first aggregation
        self.combined_heads: dict[int, Params] = {}  # the last aggregation's Σ_j α_ij ψ_j, by uploading client i
        self.head_weights: dict[int, dict[int, float]] = {}  # the last aggregation's α_ij by i, then j (round_tables)

    def keep_local(self, model: nn.Module) -> frozenset[str]:
        return module_keys(model, lambda name, _: name == "head")

    def server_message(self, client_id: int, round_: int) -> Params:
        """The global body, the client's combined head if it uploaded in the last aggregation, and the global
        prototypes (``prototype/<k>``)."""
        return {**self.global_params, **self.combined_heads.get(client_id, {}), **self.prototypes}

    def pre_local_init(self, client_id: int, message: Params, round_: int) -> Params:
        """The received body (and combined head, if any) over the client's own model (the initial model before
        its first round)."""
        model = {k: v for k, v in message.items() if not k.startswith(PREFIX)}
        return self.received_over_own(client_id, model, self.initial_params)

    def local_train(self, client_id: int, params: Params, message: Optional[Params], round_: int) -> Work[TrainResult]:
        """The received body's feature statistics, one head epoch (body frozen), ``federation.local_epochs`` body
        epochs with the feature alignment term (head frozen), then the trained body's local prototypes; the
        upload is the model with the prototypes and statistics. The loss is the sample-weighted mean
        cross-entropy of both trainings."""
        federation = self.context.federation
        samples = torch.arange(self.context.data.clients[client_id].num_train)
        received: FeatureResult = yield FeatureTask(client_id, params, samples, federation.batch_size)
        variance, means = feature_statistics(received.x, received.y, self.num_classes)
        head = yield self.train_task(
            client_id, params, round_, "head_training", epochs=1, trainable=self.head_parameters
        )
        prototypes = {k: v for k, v in (message or {}).items() if k.startswith(PREFIX)}
        table, present = prototype_table(prototypes, self.num_classes, self.dim)
        step = FedPACStep(self.body_parameters, self.config.lam, federation.lr)
        body: StepResult = yield self.step_task(
            client_id,
            step,
            {k: v for k, v in head.params.items() if k not in self.local_keys},
            round_,
            "local_training",
            inputs={**{k: head.params[k] for k in self.head_keys}, TABLE: table, PRESENT: present},
        )
        trained = {k: body.state.get(k, head.params[k]) for k in params}
        features: FeatureResult = yield FeatureTask(client_id, trained, samples, federation.batch_size)
        upload = {
            **trained,
            **local_prototypes(*class_sums(features.x, features.y, self.num_classes)),
            VARIANCE: variance,
            MEANS: means,
        }
        seen = head.samples_seen + body.samples_seen
        loss = (head.loss * head.samples_seen + body.loss * body.samples_seen) / seen if seen else float("nan")
        return TrainResult(trained, loss, seen, upload=upload)

    def client_message(self, client_id: int, result: TrainResult, round_: int) -> Params:
        """Body, head, local prototypes (``prototype/<k>``), V_i/n_i (``fedpac/variance``) and h_i
        (``fedpac/h``)."""
        return result.upload

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        """The sample-weighted mean of the bodies, the per-class mean of the prototypes, and every uploader's
        combined head from the QP (Eq. 9); an uploader whose QP is not solved gets its own head back (α = e_i).

        Warns:
            PlflWarning: a client's QP was not solved.
        """
        ids = list(messages)
        uploads = [messages[i] for i in ids]
        sizes = [self.context.data.clients[i].num_train for i in ids]
        self.global_params = weighted_average([{k: u[k] for k in self.global_params} for u in uploads], sizes)
        self.prototypes = aggregate_prototypes([{k: v for k, v in u.items() if k.startswith(PREFIX)} for u in uploads])
        heads = [{k: u[k] for k in self.head_keys} for u in uploads]
        variances, means = torch.stack([u[VARIANCE] for u in uploads]), torch.stack([u[MEANS] for u in uploads])
        weights = combination_weights(variances, means)
        for index, alpha in enumerate(weights):
            if alpha is None:  # the client's own head: α = e_i
                weights[index] = torch.zeros(len(ids), dtype=torch.float64).index_fill_(0, torch.tensor(index), 1.0)
                warnings.warn(
                    PlflWarning(
                        f"Round {round_}: FedPAC's QP for client {ids[index]}'s head weights did not converge; "
                        "it keeps its own head."
                    ),
                    stacklevel=2,
                )
        self.head_weights = {i: dict(zip(ids, alpha.tolist())) for i, alpha in zip(ids, weights)}
        self.combined_heads = {i: combine_heads(heads, alpha) for i, alpha in zip(ids, weights)}

    def round_tables(self, round_: int) -> dict[str, list[dict[str, Any]]]:
        """``head_weights``: a row per client of the round's aggregation, ``w<j>`` its weight α_ij of client j's
        head (0 for clients that did not upload)."""
        if round_ == 0:
            return {}
        clients = range(len(self.context.data.clients))
        return {
            "head_weights": [
                {"client": i, **{f"w{j}": alpha.get(j, 0.0) for j in clients}} for i, alpha in self.head_weights.items()
            ]
        }
