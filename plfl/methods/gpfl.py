"""GPFL (Zhang, Hua, Wang, Song, Xue, Ma, Cao and Guan, "GPFL: Simultaneously Learning Global and Personalized
Feature Information for Personalized Federated Learning", ICCV 2023, arXiv:2308.10279).

A client's model is a feature extractor φ (the body of ``model.name``'s network, ``body.backbone.*``), a
Conditional Valve CoV (``body.valve.*``), a head h (``head.*``) and a Global Category Embedding layer GCE, a
table W of one F-dimensional embedding per class (``embedding.weight``, (C, F)); the clients' architecture is
:func:`plfl.models.networks.valved` of the network (:meth:`GPFL.client_network`). From the features f = φ(x)
(B, F) and a conditional input c (F,), the CoV gives ReLU(f ⊙ (γ(c) + 1) + β(c)) with γ, β two
Linear → ReLU → LayerNorm stacks (:func:`valve_output`). Client i holds two conditional inputs, built from a
GCE table W and its class frequencies α_{i,c} = n_{i,c} / n_i (:func:`conditional_inputs`):

    g_i = (1/C) Σ_c W[c]      (the global conditional input)
    p_i = Σ_c α_{i,c} W[c]    (the personalized conditional input)

Per mini-batch (x, y) of ``federation.local_epochs`` epochs (``local_train``, the step task :class:`GPFLStep`),
from one pass f = φ(x): the global feature f_G = CoV(f, g_i) and the personalized feature f_P = CoV(f, p_i), and
one SGD step at η = ``federation.lr`` of all of φ, CoV, h and W on

    L = CE(h(f_P), y) + L_alg + λ L_mlg + (μ/2)(‖θ_CoV‖² + ‖W‖²)

- L_alg, the angle-level guidance (:func:`angle_loss`): the batch mean of −log softmax_y(cos(f_G, W[c])_c), the
  cross-entropy of the cosine similarities of the global feature to every class embedding;
- L_mlg, the magnitude-level guidance (:func:`magnitude_loss`): ‖f_G − W̄[y]‖, the Euclidean norm over the whole
  batch (B × F) of the global features' distance to their class embeddings in W̄, the GCE table the client
  received at the last broadcast, held fixed;
- the μ term: weight decay μ on the CoV and the GCE (λ = ``method.lam``, μ = ``method.mu``).

What is shared (``server_message`` and ``client_message``, the same keys both ways): φ, the CoV and the GCE; the
server sets each to the mean of the round's uploads weighted by the clients' training samples (FedAvg's
``aggregate``) and sends them to every client. What stays on client i: its head h_i, its class frequencies and
its conditional inputs; p_i is the model's ``body.condition`` buffer (so the evaluated model is
h_i(CoV(φ(x), p_i)), the personalized route) and g_i is kept in the store. At each broadcast
(``pre_local_init``) a client first recomputes g_i and p_i from the GCE table it holds, the one it trained this
round or, if it did not train, the one it last received, and then takes the received φ, CoV and GCE under its own
head; before the first broadcast of a trained table (round 0) both are zero vectors, so the first training and the
round-0 evaluation see g_i = p_i = 0.

Departures from the paper: plfl follows the authors' code and PFLlib's clientgpfl.py/servergpfl.py (commit
d832e76, the same computation) where they are more specific than the paper or read differently: the conditional
inputs come from the client's own GCE table just before the new global one replaces it (for a client that trained,
the table it trained), not from the received global table, and are zero until the first aggregation; L_mlg is one
norm over the whole batch rather than a sum or mean of per-sample norms; the regularisation is SGD weight decay μ
(the penalty μ/2 ‖·‖²); φ, CoV, h and W take one step per batch with the one lr. Defaults: the authors' code's
λ = 0.01, μ = 0.1 for the 4-layer CNN (their run_me.sh; PFLlib's shared ``-lam``/``-mu`` defaults are 1 and 0).
Departures from PFLlib: PFLlib counts the class frequencies over one pass that drops the last
incomplete batch (shuffled), plfl over all the client's training samples; PFLlib drops every
incomplete last batch in training, plfl trains on it unless ``federation.drop_last=true``; PFLlib averages the
body's parameters only, plfl its buffers too (BatchNorm statistics, if the body has any). The reported loss is the
personalized cross-entropy alone. The steps are plain SGD (``federation.momentum`` must be 0) without
``data.augment``; ``method.ala`` is not offered (a client's model is not the received model). A client that never
took part (``federation.unseen_clients``) gets the global φ, CoV and GCE under the initial head with zero
conditional inputs, which is what a client holds after its first broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad

from plfl.errors import ConfigError
from plfl.fields import checked
from plfl.methods.base import FederationContext, MethodConfig, require_plain_steps
from plfl.methods.fedavg import FedAvg
from plfl.models.networks import ValvedModel, modulated, valved
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

EMBEDDING = "embedding.weight"  # the GCE table W, (C, F)
CONDITION = "body.condition"  # the personalized conditional input p_i, (F,): a buffer of the client's model
VALVE = "body.valve."  # the CoV's tensors
OWN_TABLE = "gpfl_table"  # store: the GCE table the client holds (trained or last received), (C, F)
GLOBAL_CONDITION = "gpfl_global_condition"  # store: the client's global conditional input g_i, (F,)
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, as the CoV's layers have it


@dataclass
class GPFLConfig(MethodConfig):
    """GPFL's keys (Zhang et al., ICCV 2023): the guidance and regularisation weights."""

    lam: float = checked(
        0.01,
        lambda v: v >= 0,
        "a number >= 0",
        "λ: weight of the magnitude-level guidance loss ‖f_G − W[y]‖; the authors' 0.01 for the 4-layer CNN "
        "(PFLlib's shared -lam default is 1)",
    )
    mu: float = checked(
        0.1,
        lambda v: v >= 0,
        "a number >= 0",
        "μ: weight decay of the Conditional Valve and the Global Category Embedding layer; the authors' 0.1 for "
        "the 4-layer CNN (PFLlib's shared -mu default is 0)",
    )


def conditional_inputs(table: torch.Tensor, frequencies: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The global and personalized conditional inputs g = (1/C) Σ_c W[c] and p = Σ_c α_c W[c].

    Args:
        table: W, (C, F) class embeddings.
        frequencies: α, (C,) the client's class frequencies (summing to 1).

    Returns:
        g and p, (F,) each.
    """
    return table.mean(dim=0), frequencies.to(table.dtype) @ table


def valve_output(valve: Params, features: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
    """The Conditional Valve :class:`~plfl.models.networks.ConditionalValve` with the tensors ``valve`` (its
    ``state_dict`` names: ``gamma.0.weight``, ``gamma.2.bias``, ...) on features (B, F) under a condition (F,):
    ReLU(f ⊙ (γ(c) + 1) + β(c)), γ and β = LayerNorm(ReLU(W c + b)); returns (B, F)."""

    def branch(name: str) -> torch.Tensor:
        hidden = torch.relu(F.linear(condition, valve[f"{name}.0.weight"], valve[f"{name}.0.bias"]))
        return F.layer_norm(
            hidden, hidden.shape[-1:], valve[f"{name}.2.weight"], valve[f"{name}.2.bias"], LAYER_NORM_EPS
        )

    return modulated(features, branch("gamma"), branch("beta"))


def angle_loss(
    features: torch.Tensor, table: torch.Tensor, y: torch.Tensor, mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The angle-level guidance loss: the mean over the real samples (``mask`` 1; all when None) of
    −log softmax_y(cos(f, W[c]) for c = 1..C), a 0-dim tensor (unscaled cosines: each logit lies in [−1, 1]).

    Args:
        features: f_G, (W, F).
        table: W, (C, F).
        y: (W,) int64 labels.
        mask: (W,) float 1/0, or None.
    """
    cosines = F.linear(F.normalize(features, dim=-1), F.normalize(table, dim=-1))
    return masked_cross_entropy(cosines, y, mask)


def magnitude_loss(features: torch.Tensor, targets: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The magnitude-level guidance loss ‖f_G − W̄[y]‖: the Euclidean norm of the differences of the real rows
    (``mask`` 1; all when None), taken over the whole (W, F) block as one vector (PFLlib's ``torch.norm``); 0-dim.

    Args:
        features: f_G, (W, F).
        targets: W̄[y], (W, F) the fixed class embeddings of the samples' labels.
        mask: (W,) float 1/0, or None.
    """
    squares = (features - targets).pow(2).sum(dim=-1)
    if mask is not None:
        squares = squares * mask
    return squares.sum().sqrt()


@dataclass(frozen=True)
class GPFLStep(Step):
    """One SGD step of GPFL on a mini-batch: the state is the client's model (φ, CoV, head, GCE table and the
    buffer p_i, by their names); the inputs are g_i (``global_condition``, (F,)) and the fixed GCE table W̄
    (``table``, (C, F)). The loss returned is the personalized cross-entropy."""

    work = "GPFL's local steps"
    parameters: tuple[str, ...]  # every parameter of the model
    decayed: tuple[str, ...]  # the CoV's and the GCE's: weight decay μ
    lam: float
    mu: float
    lr: float

    def __call__(self, network: Network, state: Params, inputs: Params, shared: Params, batch: Batch) -> StepOutput:
        buffers = {k: v for k, v in state.items() if k not in self.parameters}
        targets = inputs["table"][batch.y]

        def loss(w: Params) -> tuple[torch.Tensor, tuple[torch.Tensor, Params]]:
            tensors = {**buffers, **w}
            features, statistics = network(tensors, batch.x, batch.mask, "body.backbone")
            valve = {k.removeprefix(VALVE): v for k, v in tensors.items() if k.startswith(VALVE)}
            personal = valve_output(valve, features, tensors[CONDITION])
            logits, _ = network(tensors, personal, batch.mask, "head")
            cross_entropy = masked_cross_entropy(logits, batch.y, batch.mask)
            shared_features = valve_output(valve, features, inputs["global_condition"])
            guidance = angle_loss(shared_features, w[EMBEDDING], batch.y, batch.mask)
            guidance = guidance + self.lam * magnitude_loss(shared_features, targets, batch.mask)
            return cross_entropy + guidance, (cross_entropy, statistics)

        w = {k: state[k] for k in self.parameters}
        grads, (cross_entropy, statistics) = grad(loss, has_aux=True)(w)
        updated = {k: v - self.lr * (grads[k] + self.mu * v if k in self.decayed else grads[k]) for k, v in w.items()}
        return StepOutput({**buffers, **statistics, **updated}, cross_entropy, sample_count(batch))


class GPFL(FedAvg):
    """GPFL (Zhang et al., ICCV 2023): a conditional valve splits global and personalized features.

    Shared extractor, valve and class embeddings; each client keeps its head and conditional input.
    """

    name = "gpfl"
    config_class = GPFLConfig
    matrix_options = {"federation.batch_size": 7}  # short last batches: padding in the vectorized steps

    @classmethod
    def client_network(cls, model: nn.Module) -> nn.Module:
        """``model`` with GPFL's modules: the valve between body and head, the class embedding table beside them
        (:func:`plfl.models.networks.valved`).

        Raises:
            ConfigError: ``model``'s head is not one ``nn.Linear`` layer.
        """
        return valved(model)

    def __init__(self, config: GPFLConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        require_plain_steps("gpfl", context, "the extractor, valve, head and class embeddings")
        architecture = context.architecture
        if not isinstance(architecture, ValvedModel):
            raise ConfigError(
                f"gpfl trains a model with a conditional valve and class embeddings (GPFL.client_network); got "
                f"{type(architecture).__name__}. Build the clients' network with GPFL.client_network."
            )
        self.parameter_names = tuple(name for name, _ in architecture.named_parameters())
        self.decayed = tuple(k for k in self.parameter_names if k.startswith(VALVE) or k == EMBEDDING)
        self.local_keys = frozenset({CONDITION, *(f"head.{k}" for k in architecture.head.state_dict())})
        self.initial_params = initial_params  # every client's head (and zero condition) before its first round
        self.global_params = self.shared(initial_params)
        self.num_classes = architecture.head.out_features

    def shared(self, params: Params) -> Params:
        """``params`` without the client's own keys (head, p_i): φ, the CoV and the GCE table."""
        return {k: v for k, v in params.items() if k not in self.local_keys}

    def frequencies(self, client_id: int) -> torch.Tensor:
        """α_i: the client's class frequencies over its training samples, (C,) float32."""
        labels = self.context.data.clients[client_id].y_train
        return torch.bincount(labels, minlength=self.num_classes).float() / len(labels)

    def pre_local_init(self, client_id: int, message: Params, round_: int) -> Params:
        """The client's conditional inputs from the GCE table it holds (zeros before it holds one), then the
        received φ, CoV and GCE over its own head, with p_i as the model's condition; g_i and the received table
        are kept in the store."""
        own = self.store.get(client_id, OWN_TABLE)
        zeros = torch.zeros_like(self.initial_params[CONDITION])
        g, p = (zeros, zeros) if own is None else conditional_inputs(own, self.frequencies(client_id))
        self.store.set(client_id, OWN_TABLE, message[EMBEDDING])
        self.store.set(client_id, GLOBAL_CONDITION, g)
        return {**self.received_over_own(client_id, message, self.initial_params), CONDITION: p}

    def local_train(self, client_id: int, params: Params, message: Params, round_: int) -> Work[TrainResult]:
        """One step of :class:`GPFLStep` per mini-batch from the client's model ``params``, against its g_i and the
        GCE table it received (the model's table before training)."""
        cfg = self.config
        step = GPFLStep(self.parameter_names, self.decayed, cfg.lam, cfg.mu, self.context.federation.lr)
        global_condition = self.store.get(client_id, GLOBAL_CONDITION)
        if global_condition is None:  # a client that trains before any broadcast reached it
            global_condition = torch.zeros_like(params[CONDITION])
        result: StepResult = yield self.step_task(
            client_id,
            step,
            params,
            round_,
            "local_training",
            inputs={"global_condition": global_condition, "table": params[EMBEDDING]},
        )
        return TrainResult({k: result.state[k] for k in params}, result.loss, result.samples_seen)

    def client_message(self, client_id: int, result: TrainResult, round_: int) -> Params:
        """φ, the CoV and the GCE table, uploaded; the client keeps its trained table for its next conditional
        inputs (only clients whose training succeeded get here)."""
        self.store.set(client_id, OWN_TABLE, result.params[EMBEDDING])
        return self.shared(result.params)

    def global_model(self, round_: int) -> None:
        """None: the shared modules have no head of their own to be evaluated with."""
        return None

    def new_client_model(self, round_: int) -> Params:
        """The shared φ, CoV and GCE over the initial head, with zero conditional input: what a client holds after
        its first broadcast."""
        return {**self.initial_params, **self.global_params}
