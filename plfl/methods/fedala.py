"""FedALA (Zhang et al., AAAI 2023): FedAvg with Adaptive Local Aggregation as local initialisation."""

from __future__ import annotations

from dataclasses import dataclass

from plfl.methods.ala import ALAConfig
from plfl.methods.fedavg import FedAvg


@dataclass
class FedALAConfig(ALAConfig):
    """FedALA's keys are ALA's, at the top of ``method``: ``method.s``, ``method.p``, ..."""

    name: str = "fedala"


class FedALA(FedAvg):
    """FedAvg aggregation on the server; ALA (Eq. 3–5, Alg. 1) initialises every client's model."""

    name = "fedala"
    config_class = FedALAConfig

    def ala_config(self) -> ALAConfig:
        return self.config
