"""FedRep (Collins et al., ICML 2021, arXiv:2102.07078): a shared representation, a personal head per client.

The model is a body φ (the representation, ``body.*``) and a head h_i (the last classifier
layer, ``head.*``); the head never leaves client i. Round t (Alg. 1), on a sampled client,
starting from the received φ^t and its own head h_i (``local_train``):

    h_i ← τ_h epochs of SGD on L_i(h, φ^t) over h alone, φ^t frozen     (``method.head_epochs``)
    φ_i ← τ_φ epochs of SGD on L_i(h_i, φ) over φ alone, h_i frozen     (``federation.local_epochs``)

The client uploads φ_i; the server sets φ^{t+1} to the sampled clients' mean of φ_i
(``aggregate``, FedAvg's) and sends it to every client, which puts it under its own head
(``pre_local_init``; before its first round, the initial head). The personalized model
φ^{t+1} + h_i is what is evaluated.

Departures: the server's mean is weighted by the clients' training samples, as PFLlib's
serverrep.py (Alg. 1 averages unweighted); τ_h defaults to PFLlib's ``plocal_epochs`` = 1
(the paper's experiments use 10 head epochs). The head epochs draw their batches from the
"head_training" stream, the body epochs from "local_training". BatchNorm running statistics in the
body (``model.batch_norm``) still move during the head epochs, which run in training mode
as PFLlib's do; the body's parameters do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

from plfl.fields import checked
from plfl.methods.base import FederationContext, MethodConfig
from plfl.methods.partial import PartialSharing, module_keys
from plfl.state import Params
from plfl.tasks import TrainResult, Work


@dataclass
class FedRepConfig(MethodConfig):
    """FedRep's keys; τ_φ (the body epochs) is ``federation.local_epochs``."""

    head_epochs: int = checked(
        1,
        lambda v: v >= 1,
        "an integer >= 1",
        "τ_h: epochs of head-only training, body frozen, before the body epochs "
        "(PFLlib's plocal_epochs default; the paper used 10)",
    )


class FedRep(PartialSharing):
    """FedRep (Collins et al., ICML 2021): shared body, personal heads trained first.

    FedAvg on the body; each client keeps its head and trains head, then body (Alg. 1).
    """

    name = "fedrep"
    config_class = FedRepConfig

    def __init__(self, config: FedRepConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        parameters = {name for name, _ in context.architecture.named_parameters()}
        self.head_parameters = parameters & self.local_keys
        self.body_parameters = parameters - self.local_keys

    def keep_local(self, model: nn.Module) -> frozenset[str]:
        return module_keys(model, lambda name, _: name == "head")

    def local_lengths(self) -> list[dict[str, float]]:
        """τ_h head epochs and the federation's local length on the body."""
        return [{"epochs": self.config.head_epochs}, self.context.federation.local_length()]

    def local_train(self, client_id: int, params: Params, message: Optional[Params], round_: int) -> Work[TrainResult]:
        """τ_h head epochs with the body frozen, then τ_φ body epochs with the head frozen; the
        reported loss is the sample-weighted mean over both."""
        head = yield self.train_task(
            client_id, params, round_, "head_training", epochs=self.config.head_epochs, trainable=self.head_parameters
        )
        body = yield self.train_task(
            client_id,
            head.params,
            round_,
            "local_training",
            **self.context.federation.local_length(),
            trainable=self.body_parameters,
        )
        samples = head.samples_seen + body.samples_seen
        loss = (head.loss * head.samples_seen + body.loss * body.samples_seen) / samples
        return TrainResult(body.params, loss, samples)
