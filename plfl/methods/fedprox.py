r"""FedProx (Li et al., MLSys 2020, arXiv:1812.06127): FedAvg with a proximal term in local training.

Client k of round t approximately minimises
:math:`h_k(w; w^t) = F_k(w) + \frac{\mu}{2} \lVert w - w^t \rVert^2` (Eq. 2),
:math:`w^t` the global model it received, so each SGD step adds :math:`\mu(w - w^t)` to the gradient of the
local cross-entropy :math:`F_k`. ``local_train`` implements it with
:class:`plfl.tasks.ProximalTerm` anchored at the server's message; every other hook is
FedAvg's (the received global model is the local initialisation and what gets evaluated,
unless ``method.ala`` replaces it). μ = 0 is FedAvg.

Departures: the server averages with FedAvg's sample-size weights over uniformly sampled
clients, as PFLlib does, where Alg. 2 samples clients by their data share and takes the plain
mean; every client runs the full ``federation.local_epochs`` (no stragglers doing partial work,
Sec. 5.2). The term covers the model's parameters, not its buffers (BatchNorm statistics),
as PFLlib's optimizer does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plfl.fields import checked
from plfl.methods.fedavg import FedAvg, FedAvgConfig
from plfl.state import Params
from plfl.tasks import ProximalTerm, TrainResult, Work


def proximal_mu() -> Any:
    """FedProx's μ as a config field (one definition for fedprox and fedprox_c)."""
    return checked(
        0.01,
        lambda v: v >= 0,
        "a number >= 0",
        "μ: weight of the proximal term μ/2‖w − w^t‖² (Eq. 2); 0.01 as plfl's comparisons with PFLlib "
        "set it (PFLlib's argparse default is 0, i.e. FedAvg); the FedProx code suggests tuning it in "
        "{0.001, 0.01, 0.1, 0.5, 1}",
    )


@dataclass
class FedProxConfig(FedAvgConfig):
    """FedProx's keys (Li et al., MLSys 2020); μ = 0 is FedAvg. Derived from FedAvgConfig, so
    ``method.ala`` works here too (FedALA paper, Table 4)."""

    mu: float = proximal_mu()


class FedProx(FedAvg):
    """FedProx (Li et al., MLSys 2020): FedAvg with a proximal term μ/2 ‖w − w_global‖².

    FedAvg's server; clients train on F_k(w) + μ/2 ‖w − w^t‖² (Eq. 2), w^t the received model.
    """

    name = "fedprox"
    config_class = FedProxConfig
    matrix_options = {"method.mu": 0.1}

    def local_train(self, client_id: int, params: Params, message: Params, round_: int) -> Work[TrainResult]:
        """``federation.local_epochs`` epochs from ``params`` with the proximal term anchored at the
        global model the client received (which ALA may have changed ``params`` from)."""
        proximal = ProximalTerm(message, self.config.mu)
        return (
            yield self.train_task(
                client_id,
                params,
                round_,
                "local_training",
                **self.context.federation.local_length(),
                proximal=proximal,
            )
        )
