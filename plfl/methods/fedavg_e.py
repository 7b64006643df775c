"""FedAvg-e (Self-FL paper: Chen et al., NeurIPS 2022, arXiv:2204.08069, Sec. 4): FedAvg with
equal client weights.

Self-FL's experiments compare FedAvg-w, FedAvg's sample-size weighted mean
Θ^t = Σ_{i∈S_t} n_i Θ_i^t / Σ_{i∈S_t} n_i, with FedAvg-e, the plain mean of the round's
uploads: Θ^t = (1/∣S_t∣) Σ_{i∈S_t} Θ_i^t. Only ``aggregate`` changes; clients, local
initialisation and evaluation are FedAvg's (so ``method.ala`` works). Integer buffers (e.g.
BatchNorm's counter) are taken from the first upload, as FedAvg takes them.
"""

from __future__ import annotations

from plfl.methods.fedavg import FedAvg
from plfl.state import Params


class FedAvgE(FedAvg):
    """FedAvg-e (Self-FL paper, NeurIPS 2022): FedAvg with equal client weights.

    Θ^t = (1/∣S_t∣) Σ_{i∈S_t} Θ_i^t: every uploading client weighs the same.
    """

    name = "fedavg_e"

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        self.global_params = self.average(list(messages.values()), [1.0] * len(messages), self.global_params, round_)
