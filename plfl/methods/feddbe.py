"""FedDBE (Zhang, Hua, Cao, Wang, Song, Xue, Ma and Guan, "Eliminating Domain Bias for Federated Learning in
Representation Space", NeurIPS 2023, arXiv:2311.14975): FedAvg with the Domain Bias Eliminator (DBE).

The model is a body (the feature extractor, ``body.*``, features z^g = f(x) of F dimensions) and a linear head
(``head.*``), both averaged as FedAvg's model. DBE adds two parts on each client i:

- the Personalized Representation Bias Memory (PRBM): a trainable vector z̄^p_i (F,), added to every feature
  before the head, ŷ = h(z^g + z̄^p_i); it starts at 0, trains with the model and never leaves the client
  (the store's ``feddbe_prbm``);
- Mean Regularization (MR): while the client trains, it keeps a moving average of its batches' mean features,
  z̄^g_i ← (1 − μ) z̄^g_i + μ mean_batch(z^g), from 0 at the start of each local training (μ = ``method.mu``;
  the current batch's mean keeps its gradient, the earlier ones are constants), and adds
  κ · mean_k ½ (z̄^g_{i,k} − z̄^g_k)² to the cross-entropy (:func:`mean_regularization`, κ = ``method.kappa``),
  z̄^g the consensus global mean of the features.

The consensus is formed once, in an initialization period before the first round, as PFLlib's serverdbe.py and
the authors' own code (TsingZ0/DBE, whose client and server are PFLlib's line for line) form it: at the
broadcast of round 0 every client trains a copy of the initial model for ``federation.local_epochs`` epochs on
the cross-entropy alone, without PRBM and MR, tracking z̄^g_i as above (``pre_local_init``, stream
"initialization"); it uploads its final z̄^g_i, keeps the received initial model (the
trained copy is discarded) and the server sets z̄^g = Σ_i n_i z̄^g_i / Σ_i n_i over all clients (n_i their
training samples) and sends it to every client (:meth:`FedDBE.round_metrics` of round 0, the server's hook
after that broadcast). Round 0's ``params_sent``/``bytes_sent`` add the N sent means to the broadcast, and its
``params_received``/``bytes_received`` count the N uploaded ones.

Round t (``local_train``, the step task :class:`DBEStep`, stream "local_training"): a sampled client trains the
received global model and its PRBM with one SGD step per mini-batch at ``federation.lr`` on
CE(h(z^g + z̄^p_i), y) + MR; it uploads the model (not the PRBM); the server averages the models weighted by
the clients' training samples (FedAvg). The evaluated model of client i is the received model with
h(z + z̄^p_i): for the linear head W z + b this is the head W z + (b + W z̄^p_i) (:func:`folded_head`), which
``pre_local_init`` returns; the global model (no PRBM) is evaluated on all clients' test splits
(``global_accuracy``) and is what a new client receives.

Defaults and departures: κ = 50 is the authors' released command (TsingZ0/DBE's run_me.sh, FMNIST); PFLlib's
and the authors' ``-klw`` default 0 switches MR off. μ = 0.1 is PFLlib's and the authors' ``-mo`` default
(their released command uses μ = 1, the last batch's mean alone). MR's distance is PFLlib's mean over the F
dimensions of ½ (z̄^g_i − z̄^g)². As in PFLlib, the consensus is never updated after the initialization period,
the initialization period trains every client whatever ``federation.join_ratio``, and the PRBM steps at the
clients' lr. PFLlib's loader drops each client's last incomplete batch; plfl trains on it unless
``federation.drop_last=true`` (its batch mean is over the real samples). ALA (``method.ala``) is refused: the
client trains from the received model and its stored PRBM, so ALA's initialisation would go untrained, as for
FedRoD. The steps are plain SGD (``federation.momentum`` must be 0) without ``data.augment``; the reported loss
is the cross-entropy alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.func import grad

from plfl.fields import checked
from plfl.methods.base import FederationContext, MethodConfig, nbytes, numel, require_linear_head, require_plain_steps
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
    non_finite,
    sample_count,
)

PRBM = "feddbe_prbm"  # the store's key of a client's z̄^p_i (F,)
LOCAL_MEAN = "feddbe_local_mean"  # the store's key of a client's z̄^g_i of the initialization period (uploaded)
CONSENSUS = "feddbe_consensus"  # the store's key of the z̄^g a client received
# A step's state and inputs: the PRBM (F,), the running mean z̄^g_i (F,) and the consensus z̄^g (F,).
STATE_PRBM, RUNNING, TARGET = "feddbe/prbm", "feddbe/running_mean", "feddbe/consensus"


@dataclass
class FedDBEConfig(MethodConfig):
    """FedDBE's keys (Zhang et al., NeurIPS 2023). A client trains from the received model and its PRBM, so there
    is no ``method.ala``."""

    kappa: float = checked(
        50.0,
        lambda v: v >= 0,
        "a number >= 0",
        "κ: weight of Mean Regularization, the distance of the client's running mean feature to the consensus "
        "(the authors' released 50; PFLlib's -klw default 0 switches it off)",
    )
    mu: float = checked(
        0.1,
        lambda v: 0 < v <= 1,
        "a number in (0, 1]",
        "μ: momentum of the running mean of the batches' mean features, z̄ ← (1 − μ) z̄ + μ mean(z) "
        "(PFLlib's -mo default 0.1; 1 keeps the last batch's mean)",
    )


def masked_feature_mean(features: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The mean of (W, F) ``features`` over the real samples (``mask`` (W,) 1/0; all when None): (F,)."""
    if mask is None:
        return features.mean(0)
    return (features * mask[:, None]).sum(0) / mask.sum()


def running_mean(previous: torch.Tensor, batch_mean: torch.Tensor, mu: float) -> torch.Tensor:
    """z̄ ← (1 − μ) z̄ + μ m: the moving average of the batches' mean features; (F,) each, ``previous`` treated as
    a constant (only the current batch's mean carries a gradient)."""
    return (1 - mu) * previous.detach() + mu * batch_mean


def mean_regularization(local: torch.Tensor, consensus: torch.Tensor, kappa: float) -> torch.Tensor:
    """MR: κ · (1/F) Σ_k ½ (local_k − consensus_k)², a 0-dim tensor; ``local`` z̄^g_i and ``consensus`` z̄^g, (F,)."""
    return kappa * (0.5 * (local - consensus).square()).mean()


def folded_head(params: Params, prbm: torch.Tensor) -> Params:
    """``params`` with the head's bias b replaced by b + W z̄^p, so that its logits are h(z + z̄^p) for the linear
    head h(z) = W z + b; ``prbm`` z̄^p (F,). The other tensors are ``params``' own."""
    return {**params, "head.bias": params["head.bias"] + params["head.weight"] @ prbm}


def consensus_mean(means: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """z̄^g = Σ_i w_i z̄^g_i / Σ_i w_i of the clients' (F,) means.

    Raises:
        ValueError: no means, or weights that do not sum to a positive number.
    """
    total = float(sum(weights))
    if not means or total <= 0:
        raise ValueError(f"cannot average {len(means)} feature means with weights summing to {total}")
    return sum(w / total * m for w, m in zip(weights, means))


@dataclass(frozen=True)
class DBEStep(Step):
    """One mini-batch of FedDBE's local training: the running mean z̄^g_i (``feddbe/running_mean`` in the state)
    takes the batch's mean feature, then one SGD step of the model (the ``parameters`` and its buffers) and the
    PRBM (``feddbe/prbm``) on CE(h(z + z̄^p), y) + MR against the input ``feddbe/consensus``. With ``personal``
    false (the initialization period) the state has no PRBM and the loss is CE(h(z), y) alone. The loss returned
    is the cross-entropy."""

    work = "FedDBE's local steps"
    parameters: tuple[str, ...]
    kappa: float
    mu: float
    lr: float
    personal: bool = True

    def __call__(self, network: Network, state: Params, inputs: Params, shared: Params, batch: Batch) -> StepOutput:
        trained = self.parameters + ((STATE_PRBM,) if self.personal else ())
        buffers = {k: v for k, v in state.items() if k not in trained and k != RUNNING}

        def loss(w: Params) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, Params]]:
            model = {**buffers, **{k: v for k, v in w.items() if k != STATE_PRBM}}
            features, statistics = network(model, batch.x, batch.mask, "body")
            mean = running_mean(state[RUNNING], masked_feature_mean(features, batch.mask), self.mu)
            if not self.personal:
                logits, _ = network(model, features, batch.mask, "head")
                cross_entropy = masked_cross_entropy(logits, batch.y, batch.mask)
                return cross_entropy, (cross_entropy, mean, statistics)
            logits, _ = network(model, features + w[STATE_PRBM], batch.mask, "head")
            cross_entropy = masked_cross_entropy(logits, batch.y, batch.mask)
            total = cross_entropy + mean_regularization(mean, inputs[TARGET], self.kappa)
            return total, (cross_entropy, mean, statistics)

        w = {k: state[k] for k in trained}
        grads, (cross_entropy, mean, statistics) = grad(loss, has_aux=True)(w)
        return StepOutput(
            {**buffers, **statistics, **{k: v - self.lr * grads[k] for k, v in w.items()}, RUNNING: mean.detach()},
            cross_entropy,
            sample_count(batch),
        )


class FedDBE(FedAvg):
    """FedDBE (Zhang et al., NeurIPS 2023): FedAvg with a personal feature bias and mean regularization.

    Each client adds a private learned vector to its features and pulls its mean feature toward a consensus mean.
    """

    name = "feddbe"
    config_class = FedDBEConfig
    server_state = ("global_params", "consensus")
    matrix_options = {"federation.batch_size": 7}  # short last batches: padding in the vectorized steps

    def __init__(self, config: FedDBEConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_plain_steps("feddbe", context, "the model and the PRBM (their loss has Mean Regularization)")
        require_linear_head("feddbe", context, "adds the PRBM to the features before a linear head")
        architecture = context.architecture
        self.parameter_names = tuple(name for name, _ in architecture.named_parameters())
        self.dim = architecture.head.in_features
        self.consensus: Optional[torch.Tensor] = None  # z̄^g (F,); None until the initialization period is over

    def prbm(self, client_id: int) -> torch.Tensor:
        """z̄^p_i (F,) from the store; zeros before the client's first training."""
        stored = self.store.get(client_id, PRBM)
        dtype = self.global_params["head.weight"].dtype
        return torch.zeros(self.dim, dtype=dtype) if stored is None else stored

    def step(self, personal: bool) -> DBEStep:
        cfg = self.config
        return DBEStep(self.parameter_names, cfg.kappa, cfg.mu, self.context.federation.lr, personal)

    def pre_local_init(self, client_id: int, message: Params, round_: int) -> Params | Work[Params]:
        """The received model with the client's PRBM folded into its head (:func:`folded_head`); at round 0 first
        the initialization period: a copy of the received model trained on the cross-entropy alone, whose final
        running mean z̄^g_i the client uploads (kept in the store for the server)."""
        if round_ == 0:
            return self._initialization(client_id, message)
        return folded_head(message, self.prbm(client_id))

    def _initialization(self, client_id: int, message: Params) -> Work[Params]:
        state = {**message, RUNNING: torch.zeros(self.dim, dtype=message["head.weight"].dtype)}
        result: StepResult = yield self.step_task(client_id, self.step(False), state, 0, "initialization")
        self.store.set(client_id, LOCAL_MEAN, result.state[RUNNING])
        return folded_head(message, self.prbm(client_id))

    def local_train(self, client_id: int, params: Params, message: Params, round_: int) -> Work[TrainResult]:
        """From the received model (not ``params``, whose head has the PRBM folded in) and the stored PRBM, one
        step per mini-batch on CE + MR toward the consensus the client received; keeps the PRBM (unless training
        diverged), uploads the model and returns the model with the PRBM folded in."""
        consensus = self.store.get(client_id, CONSENSUS)
        dtype = message["head.weight"].dtype
        state = {**message, STATE_PRBM: self.prbm(client_id), RUNNING: torch.zeros(self.dim, dtype=dtype)}
        result: StepResult = yield self.step_task(
            client_id, self.step(True), state, round_, "local_training", inputs={TARGET: consensus}
        )
        model = {k: result.state[k] for k in message}
        prbm = result.state[STATE_PRBM]
        if non_finite(model) is None and non_finite({"prbm": prbm}) is None:
            self.store.set(client_id, PRBM, prbm)  # a diverged client keeps its PRBM and fails
        return TrainResult(folded_head(model, prbm), result.loss, result.samples_seen, upload=model)

    def global_model(self, round_: int) -> Params:
        """The averaged model without any PRBM."""
        return self.global_params

    def round_metrics(self, round_: int) -> dict[str, float]:
        """At round 0, the server's side of the initialization period: z̄^g from the clients' uploaded means
        (weighted by their training samples), sent to every client; the row's communication counts then include
        the N means received and the N sent. Every round: ‖z̄^g‖ (``feddbe_consensus_norm``)."""
        metrics: dict[str, float] = {}
        if round_ == 0 and self.consensus is None:
            clients = range(len(self.context.data.clients))
            means = [self.store.get(i, LOCAL_MEAN) for i in clients]
            self.consensus = consensus_mean(means, [self.context.data.clients[i].num_train for i in clients])
            for i in clients:
                self.store.set(i, CONSENSUS, self.consensus)
            broadcast = [self.server_message(i, 0) for i in clients]
            mean = {"consensus": self.consensus}
            metrics.update(
                params_sent=sum(numel(m) for m in broadcast) + len(clients) * numel(mean),
                bytes_sent=sum(nbytes(m) for m in broadcast) + len(clients) * nbytes(mean),
                params_received=len(clients) * numel(mean),
                bytes_received=len(clients) * nbytes(mean),
            )
        if self.consensus is not None:
            metrics["feddbe_consensus_norm"] = float(self.consensus.norm())
        return metrics
