"""FedAvg (McMahan et al., AISTATS 2017): sample-size weighted averaging of client models."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from plfl.methods.ala import ALAConfig
from plfl.methods.base import Method, MethodConfig
from plfl.state import Params


@dataclass
class FedAvgConfig(MethodConfig):
    """FedAvg's keys; a method whose config derives from this one can take ALA (``method.ala``)."""

    ala: Optional[ALAConfig] = field(
        default=None,
        metadata={
            "doc": "ALA as this method's local initialisation (FedALA paper, Table 4): method.ala.s, .p, ... "
            "take fedala's keys"
        },
    )


class FedAvg(Method):
    r"""FedAvg (McMahan et al., AISTATS 2017): sample-size weighted average of client models.

    :math:`\Theta^t = \sum_{i \in S_t} n_i \Theta_i^t / \sum_{i \in S_t} n_i`, :math:`n_i` the client's training
    samples (Alg. 1).
    """

    name = "fedavg"
    config_class = FedAvgConfig
    not_averaging = None
    # The executor matrix: SGD momentum and short last batches (n mod 7 ≠ 0).
    matrix_options = {"federation.momentum": 0.5, "federation.batch_size": 7}

    def new_client_model(self, round_: int) -> Params:
        """The global model Θ^t, which every client receives."""
        return self.global_params

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        """Θ^t ← the uploads' mean weighted by training samples (or ``aggregation.rule``, :meth:`average`)."""
        sizes = [self.context.data.clients[i].num_train for i in messages]
        self.global_params = self.average(list(messages.values()), sizes, self.global_params, round_)
