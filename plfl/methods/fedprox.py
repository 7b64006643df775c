"""FedProx (Li et al., MLSys 2020, arXiv:1812.06127): FedAvg with a proximal term in local training.

Client k of round t approximately minimises h_k(w; w^t) = F_k(w) + μ/2 ‖w − w^t‖² (Eq. 2),
w^t the global model it received, so each SGD step adds μ(w − w^t) to the gradient of the
local cross-entropy F_k. ``local_train`` implements it with
:class:`plfl.client.ProximalTerm` anchored at the server's message; every other hook is
FedAvg's (the received global model is the local initialisation and what gets evaluated,
unless ``method.ala`` replaces it). μ = 0 is FedAvg.

Departures: the server averages with FedAvg's sample-size weights over uniformly sampled
clients, as PFLlib does, where Alg. 2 samples clients by their data share and takes the plain
mean; every client runs the full ``federation.local_epochs`` (no stragglers doing partial work,
Sec. 5.2). The term covers the model's parameters, not its buffers (BatchNorm statistics),
as PFLlib's optimizer does.
"""

from __future__ import annotations

from plfl.client import ProximalTerm, TrainResult
from plfl.executors import Trains
from plfl.methods.fedavg import FedAvg
from plfl.seeding import LOCAL_TRAINING
from plfl.state import Params


class FedProx(FedAvg):
    """FedAvg's server; clients train on F_k(w) + μ/2 ‖w − w^t‖² (Eq. 2), w^t the received model."""

    name = "fedprox"

    def local_train(self, client_id: int, params: Params, round_: int) -> Trains[TrainResult]:
        """``federation.local_epochs`` epochs from ``params`` with the proximal term anchored at the
        global model the client received (which ALA may have changed ``params`` from)."""
        proximal = ProximalTerm(self.server_message(client_id), self.config.mu)
        return (yield self.train_task(client_id, params, round_, LOCAL_TRAINING,
                                      epochs=self.context.federation.local_epochs, proximal=proximal))
