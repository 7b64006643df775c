"""FedFTHA: local head fine-tuning and server-side head aggregation (FedFT, without the aggregation:
:mod:`plfl.methods.fedft`).

"FedFTHA: A Fine-Tuning and Head Aggregation Method in Federated Learning",
IEEE IoT-J 2023, Eq. 5–9. The model is a body G (representation) and a head
H (the last classifier layer, ``head.*``); every client keeps its own head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from plfl.fields import checked
from plfl.methods.base import FederationContext, Method, MethodConfig
from plfl.robust import weighted_average
from plfl.state import Params
from plfl.tasks import TrainResult, Work


@dataclass
class FedFTHAConfig(MethodConfig):
    """τ_sync (Eq. 6) is ``federation.local_epochs``; τ_head (Eq. 7) is ``head_epochs``."""

    head_epochs: int = checked(
        5,
        lambda v: v >= 0,
        "an integer >= 0",
        "τ_head: epochs of head-only training after the joint epochs, body frozen (Eq. 7)",
    )


class FedFTHA(Method):
    r"""FedFTHA (IEEE IoT-J 2023): FedFT plus a global head averaged over all heads.

    Client (``local_train`` + ``post_train``): :math:`\tau_{sync}` epochs on body and head
    (Eq. 6), then :math:`\tau_{head}` epochs on the head alone (Eq. 7); it uploads both.
    Server (``aggregate``): the new body is the unweighted mean of the
    participants' bodies (Eq. 9); a head dictionary keeps each client's latest
    head; the global head is the mean of all heads in it (FedHA, Eq. 8).

    A client that has trained receives only the body and keeps its own head;
    one that never trained receives the global model (body + global head).
    The personalized model (evaluated per client) is the global body with the
    client's head; the global model is evaluated on all clients' test data.
    """

    name = "fedftha"
    not_averaging = "averages the heads of every client seen so far (FedHA, Eq. 8), not one round's uploads"
    config_class = FedFTHAConfig
    server_state = ("global_params", "heads")

    def __init__(self, config: FedFTHAConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        self.head_keys = {k for k in initial_params if k.startswith("head.")}
        self.head_parameters = {n for n, _ in context.architecture.named_parameters() if n.startswith("head.")}
        self.heads: dict[int, Params] = {}  # client → its latest uploaded head

    def post_train(self, client_id: int, result: TrainResult, round_: int) -> Work[TrainResult]:
        """τ_head epochs of head-only training; the reported loss stays that of the joint epochs."""
        if self.config.head_epochs == 0:
            return result
        tuned = yield self.train_task(
            client_id,
            result.params,
            round_,
            "post_training",
            epochs=self.config.head_epochs,
            trainable=self.head_parameters,
        )
        return TrainResult(tuned.params, result.loss, result.samples_seen + tuned.samples_seen)

    def local_lengths(self) -> list[dict[str, float]]:
        """The joint epochs and τ_head head-only ones (none when ``head_epochs`` is 0)."""
        head = [{"epochs": self.config.head_epochs}] if self.config.head_epochs else []
        return [*super().local_lengths(), *head]

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        bodies = [self.body(m) for m in messages.values()]
        for client_id, message in messages.items():
            self.heads[client_id] = {k: message[k] for k in self.head_keys}
        self.global_params = {**weighted_average(bodies, [1.0] * len(bodies)), **self.global_head()}

    def global_head(self) -> Params:
        """FedHA (Eq. 8): the mean of all stored heads (the current global head before any upload)."""
        if not self.heads:
            return {k: self.global_params[k] for k in self.head_keys}
        return weighted_average(list(self.heads.values()), [1.0] * len(self.heads))

    def server_message(self, client_id: int, round_: int) -> Params:
        return self.body(self.global_params) if client_id in self.heads else self.global_params

    def pre_local_init(self, client_id: int, message: Optional[Params], round_: int) -> Params:
        """The received body (and head, if sent) over the client's own model."""
        return self.received_over_own(client_id, message, {})

    def global_model(self, round_: int) -> Params:
        return self.global_params

    def new_client_model(self, round_: int) -> Params:
        """What a client that never trained receives: the global body with the global head (FedFT: the
        initial head)."""
        return self.global_params

    def round_metrics(self, round_: int) -> dict[str, float]:
        return {"heads_stored": len(self.heads)}

    def body(self, params: Params) -> Params:
        return {k: v for k, v in params.items() if k not in self.head_keys}
