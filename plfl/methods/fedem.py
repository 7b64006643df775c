r"""FedEM (Marfoq, Neglia, Bellet, Kameni and Vidal, "Federated Multi-Task Learning under a Mixture of Distributions",
NeurIPS 2021, arXiv:2108.10252): each client's distribution is a mixture of M shared components, learned by a
federated EM algorithm (Alg. 1; detailed in the appendix's Alg. 2).

The server keeps M component models ("learners") :math:`\theta_1, \dots, \theta_M`, stacked on a leading axis
(name → ``(M, *shape)``), and sends all of them to every client (``server_message``). Client t keeps its mixture
weights :math:`\pi_t \in \Delta^M` (uniform 1/M before its first training) in its own state; they never leave it.
In round k a sampled client, from the received learners :math:`\theta^{k-1}` (``local_train``):

- E-step (Alg. 1; :func:`responsibilities`): for each training sample i,
  :math:`q_t^k(z_i = m) \propto \pi_{tm}^{k-1} \exp(-\ell(h_{\theta_m^{k-1}}(x_i), y_i))`, ℓ the cross-entropy;
- M-step for the weights: :math:`\pi_{tm}^k = \frac{1}{n_t} \sum_i q_t^k(z_i = m)`;
- M-step for the learners (Alg. 1's LocalSolver): ``federation.local_epochs`` epochs (or
  ``federation.local_steps`` steps) of SGD at ``federation.lr`` from :math:`\theta^{k-1}` on
  :math:`\frac{1}{n_t} \sum_i \sum_m q_t^k(z_i = m)\, \ell(h_{\theta_m}(x_i), y_i)`, whose mini-batch estimate is
  :math:`\frac{1}{|B|} \sum_{i \in B} \sum_m q_{im} \ell_{im}` (FL-bench's normalisation), in the
  one batch order of every method (the step task :class:`FedEMStep`; the terms are separable, so each learner
  takes its own step on its own weighted loss);

and uploads the M trained learners. The server sets each learner to the mean of its uploads weighted by the
clients' training samples (Alg. 1, :math:`\theta_m = \sum_t \frac{n_t}{n} \theta_{m,t}`; ``aggregate``). At the
broadcast every client's model is the received learners with its own :math:`\pi_t` (``pre_local_init``), and it
predicts the mixture :math:`p_t(y \mid x) = \sum_m \pi_{tm}\, \mathrm{softmax}(h_{\theta_m}(x))_y` (the paper's
predictor under its Assumption 2; :class:`FedEMForward`, through :meth:`FedEM.prediction`), evaluated as the logits
:math:`\log \sum_m \pi_{tm}\, \mathrm{softmax}(h_{\theta_m}(x))` (:func:`mixture_log_probabilities`), whose
cross-entropy is the mixture's negative log-likelihood.

How it runs: the E-step's losses over the client's whole training split come from M feature tasks (the learners'
outputs, ``module=""``), which give :math:`\pi_t^k`; the local solver's step recomputes the q of each mini-batch's
samples from the same received learners (the step's ``shared`` tensors, one copy for all clients) and
:math:`\pi_t^{k-1}` (its ``inputs``), so that no per-sample tensor travels with the task and every executor runs it
as a plain step. Learner 0 starts from the run's initial model, learner m > 0 from a fresh initialisation of the
architecture drawn from the stream "fedem_init" (:func:`plfl.methods.ifca.fresh_initialisation`).
``tables/mixture_weights.csv`` holds every client's :math:`\pi_t` each round (``pi<m>``; the heatmap of ``plfl
report``); ``mixture_entropy`` in metrics.csv is the clients' mean entropy of :math:`\pi_t` (nats; log M when
uniform). Communication is honest: M models down to every client, M models up from every trained one.

Departures from the paper: the E-step's and the step's forward passes run the network in training mode, so a model
with BatchNorm normalises them by the batch's statistics (and the E-step leaves out a last batch of one sample);
FL-bench computes them in evaluation mode. The reported training loss is the q-weighted cross-entropy above. The
steps are plain SGD (``federation.momentum`` must be 0, no ``data.augment``). There is no global model (no
``global_accuracy``) and no model for unseen clients: a new client's :math:`\pi` would be learned by E- and M-steps
on data the server never sees. ALA (``method.ala``) is not offered: the client's model is M learners and
:math:`\pi_t`, not the architecture's, its learners restart from the received ones every round, and
:math:`\pi_t` is already the client's learned local weighting of them.

Departures of FL-bench's fedem.py from the paper, where plfl follows the paper: FL-bench mixes the learners' raw
outputs (logits) with :math:`\pi_t`, not their softmax probabilities; it keeps every client's :math:`\pi_t` and
per-sample weights on the server and sends them to the client each round (the paper's :math:`\pi_t` stays on the
client); it skips training batches of one sample; and it draws the M learners' initialisations from torch's
global generator. Both compute the E-step with :math:`\pi_t^{k-1}` before the round's training and normalise the
weighted loss per batch as plfl does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.func import grad_and_value

from plfl.fields import checked
from plfl.methods.base import FederationContext, Method, MethodConfig, require_plain_steps
from plfl.methods.ifca import fresh_initialisation
from plfl.plots import Heatmaps
from plfl.state import Params
from plfl.tasks import (
    Batch,
    FeatureResult,
    FeatureTask,
    Forward,
    Network,
    Step,
    StepOutput,
    StepResult,
    TrainResult,
    Work,
    masked_mean,
    non_finite,
    sample_count,
)

WEIGHTS = "fedem/weights"  # π_t, (M,) float32: in a client's model, a step's inputs, and the store's key
TABLE = "mixture_weights"

# The last round's π: a row per client, a column per component.
WEIGHTS_HEATMAP = Heatmaps(
    "Mixture weights π of {run}, round {round}",
    TABLE,
    facet=None,
    row="client",
    prefix="pi",
    value="π",
    column="component",
)


@dataclass
class FedEMConfig(MethodConfig):
    """FedEM's keys (Marfoq et al., NeurIPS 2021); the local solver's steps take ``federation.lr``. The client's
    model is M learners and its mixture weights, so there is no ``method.ala``."""

    components: int = checked(
        3,
        lambda v: v >= 1,
        "an integer >= 1",
        "M: the mixture's components, one learner each (the paper's and FL-bench's 3)",
    )


def component(models: Params, m: int) -> Params:
    """Learner ``m``'s state dict from stacked ``models`` (name → ``(M, *shape)``); keys under ``fedem/`` (π) are
    not the architecture's and are left out."""
    return {k: v[m] for k, v in models.items() if not k.startswith("fedem/")}


def responsibilities(weights: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
    """The E-step (Alg. 1): q_im = π_m exp(−ℓ_im) / Σ_m' π_m' exp(−ℓ_im'), as softmax_m(log π_m − ℓ_im).

    Args:
        weights: π, (M,) non-negative, summing to 1.
        losses: ℓ, (n, M) per-sample cross-entropy of each component.

    Returns:
        q, (n, M): each row sums to 1 (a component with π_m = 0 gets q 0).
    """
    return torch.softmax(torch.log(weights) - losses, dim=-1)


def mixture_log_probabilities(weights: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """log Σ_m π_m softmax(logits_m), the log-probabilities of the mixture's prediction (the paper's predictor).

    Args:
        weights: π, (M,).
        logits: (M, W, classes), the components' outputs.

    Returns:
        (W, classes), computed as logsumexp_m(log π_m + log_softmax(logits_m)).
    """
    return torch.logsumexp(torch.log(weights)[:, None, None] + F.log_softmax(logits, dim=-1), dim=0)


def mixture_entropy(weights: torch.Tensor) -> float:
    """−Σ_m π_m log π_m in nats (0 log 0 = 0) of π (M,)."""
    positive = weights[weights > 0]
    return float(-(positive * positive.log()).sum())


@dataclass(frozen=True)
class FedEMForward(Forward):
    """A client's mixture prediction (:func:`mixture_log_probabilities`) from its model: the M learners stacked
    under the architecture's names and π under ``fedem/weights``."""

    work = "FedEM's prediction"
    components: int

    def __call__(self, network: Network, params: Params, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        logits = torch.stack([network(component(params, m), x)[0] for m in range(self.components)])
        return mixture_log_probabilities(params[WEIGHTS], logits)


@dataclass(frozen=True)
class FedEMStep(Step):
    """One SGD step of every learner on the q-weighted cross-entropy of a mini-batch (Alg. 1's LocalSolver). State: the
    M learners, name → ``(M, *shape)``; inputs: π^{k−1} (``fedem/weights``); shared: the received learners, from
    which the batch's q is computed (:func:`responsibilities`). The loss returned is
    (1/|B|) Σ_{i∈B} Σ_m q_im ℓ_im before the step."""

    work = "FedEM's local steps"
    parameters: tuple[str, ...]
    components: int
    lr: float

    def __call__(self, network: Network, state: Params, inputs: Params, shared: Params, batch: Batch) -> StepOutput:
        received = torch.stack(
            [
                F.cross_entropy(network(component(shared, m), batch.x, batch.mask)[0], batch.y, reduction="none")
                for m in range(self.components)
            ],
            dim=-1,
        )
        q = responsibilities(inputs[WEIGHTS], received)
        buffers = {k: v for k, v in state.items() if k not in self.parameters}

        def loss(params: Params) -> tuple[torch.Tensor, list[Params]]:
            total, statistics = 0.0, []
            for m in range(self.components):
                logits, after = network({**component(buffers, m), **component(params, m)}, batch.x, batch.mask)
                total = total + masked_mean(q[:, m] * F.cross_entropy(logits, batch.y, reduction="none"), batch.mask)
                statistics.append(after)
            return total, statistics

        params = {k: state[k] for k in self.parameters}
        grads, (value, statistics) = grad_and_value(loss, has_aux=True)(params)
        new = {k: v - self.lr * grads[k] for k, v in params.items()}
        stacked = {k: torch.stack([s[k] for s in statistics]) for k in statistics[0]}
        return StepOutput({**buffers, **stacked, **new}, value, sample_count(batch))


class FedEM(Method):
    """FedEM (Marfoq et al., NeurIPS 2021): each client's data a mixture of M shared components, learned by EM.

    Clients weight their samples by the E-step, train all M learners and keep their mixture weights π.
    """

    name = "fedem"
    not_averaging = None
    config_class = FedEMConfig
    matrix_options = {"federation.batch_size": 7}  # short last batches: padding in the vectorized steps
    figures = (WEIGHTS_HEATMAP,)

    def __init__(self, config: FedEMConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_plain_steps("fedem", context, "the M learners (Alg. 1's local solver)")
        self.parameter_names = tuple(name for name, _ in context.architecture.named_parameters())
        starts = [initial_params] + [
            fresh_initialisation(context.architecture, self.seed, m, "fedem_init") for m in range(1, config.components)
        ]
        self.global_params = {k: torch.stack([s[k] for s in starts]) for k in initial_params}  # name → (M, *shape)

    def mixture_weights(self, client_id: int) -> torch.Tensor:
        """π_t of client ``client_id``: its own, or uniform 1/M before its first training."""
        weights = self.store.get(client_id, WEIGHTS)
        return torch.full((self.config.components,), 1.0 / self.config.components) if weights is None else weights

    def server_message(self, client_id: int, round_: int) -> Params:
        """All M learners, name → ``(M, *shape)``: the same tensors for every client."""
        return self.global_params

    def pre_local_init(self, client_id: int, message: Params, round_: int) -> Params:
        """The received learners with the client's own π_t: the model its mixture predicts from."""
        return {**message, WEIGHTS: self.mixture_weights(client_id)}

    def prediction(self) -> FedEMForward:
        return FedEMForward(self.config.components)

    def local_train(self, client_id: int, params: Params, message: Params, round_: int) -> Work[TrainResult]:
        """Alg. 2's client: the E-step on the whole training split with the received learners (``message``) and the
        client's π^{k−1}, π^k its mean, then the local solver from the received learners; keeps π^k (unless
        training diverged) and uploads the trained learners."""
        federation, components = self.context.federation, self.config.components
        previous = self.mixture_weights(client_id)
        samples = torch.arange(self.context.data.clients[client_id].num_train)
        outputs: list[FeatureResult] = yield [
            FeatureTask(client_id, component(message, m), samples, federation.batch_size, module="")
            for m in range(components)
        ]
        weights = previous
        if len(outputs[0].y):
            losses = torch.stack([F.cross_entropy(o.x, o.y, reduction="none") for o in outputs], dim=-1)
            weights = responsibilities(previous, losses).mean(0)
        step = FedEMStep(self.parameter_names, components, federation.lr)
        result: StepResult = yield self.step_task(
            client_id, step, dict(message), round_, "local_training", inputs={WEIGHTS: previous}, shared=message
        )
        learners = {k: result.state[k] for k in message}  # the model's key order
        if non_finite(learners) is None and torch.isfinite(weights).all():
            self.store.set(client_id, WEIGHTS, weights)  # a diverged client keeps its π and fails
        return TrainResult({**learners, WEIGHTS: weights}, result.loss, result.samples_seen, upload=learners)

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        """Each learner ← the mean of its uploads weighted by the clients' training samples (Alg. 1; or
        ``aggregation.rule``, :meth:`average`, over all learners together)."""
        sizes = [self.context.data.clients[i].num_train for i in messages]
        self.global_params = self.average(list(messages.values()), sizes, self.global_params, round_)

    def new_client_model(self, round_: int) -> Optional[Params]:
        """None: a new client's mixture weights are learned on data the server never sees."""
        return None

    def round_metrics(self, round_: int) -> dict[str, float]:
        """``mixture_entropy``: the clients' mean entropy of π_t in nats (log M while uniform)."""
        entropies = [mixture_entropy(self.mixture_weights(i)) for i in range(len(self.store))]
        return {"mixture_entropy": sum(entropies) / len(entropies)}

    def round_tables(self, round_: int) -> dict[str, list[dict[str, Any]]]:
        """``mixture_weights``: a row per client, its π_t as ``pi<m>`` and its largest component as ``component``."""
        rows = []
        for i in range(len(self.store)):
            weights = self.mixture_weights(i)
            row = {f"pi{m}": float(w) for m, w in enumerate(weights)}
            rows.append({"client": i, "component": int(weights.argmax()), **row})
        return {TABLE: rows}
