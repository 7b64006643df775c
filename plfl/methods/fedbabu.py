"""FedBABU (Oh, Kim and Yun, ICLR 2022, arXiv:2106.06042): federated body, a head that never trains until fine-tuning.

The model is a body (``body.*``) and a head (the last classifier layer, ``head.*``). The head keeps its random
initial weights, the same on every client, through federated training (Sec. 4, Alg. 1): a sampled client
trains the body alone, under the initial head, for ``federation.local_epochs`` epochs of SGD from the received
body (``local_train``) and uploads the body; the server sets the body to the sample-size weighted mean of the
sampled clients' bodies (``aggregate``, FedAvg's) and sends it to every client. The head is
never sent: every client already holds it.

Personalization (Sec. 4): in the last round (``federation.rounds``) every client fine-tunes the
whole model, body and head, from the global body under the initial head for ``method.fine_tuning_epochs`` epochs of
SGD on its training split (stream "fine_tuning"; ``pre_local_init``), and that personalized model is what the last
round evaluates. Every earlier round evaluates the global model (the global body under the initial head) on each
client's test split, and every round evaluates it on all clients' test data (``global_accuracy``): the paper's
"initial" accuracy, before fine-tuning. A run continued past its last round (``plfl fit --resume`` with more
rounds) trains on from the received global body, never from a fine-tuned model.

Departures: the server's mean is weighted by the clients' training samples, as PFLlib's serverbabu.py; the
fine-tuning epochs default to PFLlib's ``fine_tuning_epochs`` (10; the paper evaluates several fine-tuning
lengths). PFLlib fine-tunes, after its last round, each client's own body from its last local training instead of
the aggregated one, after one round more than it evaluates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from torch import nn

from plfl.fields import checked
from plfl.methods.base import FederationContext, MethodConfig
from plfl.methods.partial import PartialSharing, module_keys
from plfl.state import Params
from plfl.tasks import TrainResult, Work


@dataclass
class FedBABUConfig(MethodConfig):
    """FedBABU's keys; the body's local epochs are ``federation.local_epochs``. The initial head is every client's
    local initialisation, so there is no ``method.ala``."""

    fine_tuning_epochs: int = checked(
        10,
        lambda v: v >= 0,
        "an integer >= 0",
        "τ_f: epochs of fine-tuning the whole model in the last round before it is evaluated; 0 evaluates the "
        "global model (PFLlib's fine_tuning_epochs, 10)",
    )


class FedBABU(PartialSharing):
    """FedBABU (Oh et al., ICLR 2022): the body is federated under a fixed random head, then fine-tuned.

    FedAvg on the body with the initial head frozen; every client fine-tunes body and head in the last round.
    """

    name = "fedbabu"
    config_class = FedBABUConfig

    def __init__(self, config: FedBABUConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        parameters = {name for name, _ in context.architecture.named_parameters()}
        self.body_parameters = frozenset(parameters - self.local_keys)

    def keep_local(self, model: nn.Module) -> frozenset[str]:
        return module_keys(model, lambda name, _: name == "head")

    def global_model(self, round_: int) -> Params:
        """The global body under the initial head."""
        return {**self.initial_params, **self.global_params}

    def pre_local_init(self, client_id: int, message: Params, round_: int) -> Params | Work[Params]:
        """The global model (``message`` under the initial head); in the last round, fine-tuned whole."""
        model = {**self.initial_params, **message}
        if round_ < self.context.federation.rounds or self.config.fine_tuning_epochs == 0:
            return model
        tuned = yield self.train_task(client_id, model, round_, "fine_tuning", epochs=self.config.fine_tuning_epochs)
        return tuned.params

    def private_steps(self, steps: Callable[[dict[str, float]], int], rounds: int) -> int:
        """The rounds' trainings and the last round's fine-tuning, τ_f epochs."""
        return super().private_steps(steps, rounds) + steps({"epochs": self.config.fine_tuning_epochs})

    def local_train(self, client_id: int, params: Params, message: Optional[Params], round_: int) -> Work[TrainResult]:
        """The body's epochs from the received body under the initial head, the head frozen."""
        return (
            yield self.train_task(
                client_id,
                {**self.initial_params, **message},
                round_,
                "local_training",
                **self.context.federation.local_length(),
                trainable=self.body_parameters,
            )
        )
