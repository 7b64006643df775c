"""FedProx-C (FedALA paper: Zhang et al., AAAI 2023, arXiv:2212.01197, Sec. 5): FedProx whose clients fine-tune
the received global model as local initialisation (FedAvg-C's :class:`~plfl.methods.fedavg_c.FineTunedInit`);
its proximal term is anchored at the received model, not at the fine-tuned one, and the fine-tuning has none."""

from __future__ import annotations

from dataclasses import dataclass

from plfl.methods.fedavg_c import FedAvgCConfig, FineTunedInit
from plfl.methods.fedprox import FedProx, proximal_mu


@dataclass
class FedProxCConfig(FedAvgCConfig):
    """FedProx-C's keys: FedAvg-C's fine-tuning and FedProx's μ."""

    mu: float = proximal_mu()


class FedProxC(FineTunedInit, FedProx):
    """FedProx-C (FedALA paper, AAAI 2023): FedProx, global model fine-tuned locally as init.

    FedProx whose clients start from (and are evaluated with) the fine-tuned global model.
    """

    name = "fedprox_c"
    config_class = FedProxCConfig
