"""Local training only: no communication; each client trains its own model from the shared initialisation."""

from __future__ import annotations

from typing import Optional

from plfl.methods.base import Method
from plfl.state import Params
from plfl.tasks import TrainResult


class Local(Method):
    """Local: every client trains its own model; nothing is sent.

    Client i keeps training Θ_i; the server sends and receives nothing.
    """

    name = "local"
    uploads_model = False
    not_averaging = "aggregates nothing"

    def server_message(self, client_id: int, round_: int) -> None:
        return None

    def pre_local_init(self, client_id: int, message: Optional[Params], round_: int) -> Params:
        # Before its first training every client starts from the same initial model.
        return self.own_model(client_id, self.global_params)

    def new_client_model(self, round_: int) -> Params:
        """The initial model: a new client, too, trains alone (``eval.finetune_epochs``)."""
        return self.global_params

    def client_message(self, client_id: int, result: TrainResult, round_: int) -> None:
        return None

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        pass
