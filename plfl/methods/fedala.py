"""FedALA (Zhang et al., AAAI 2023, arXiv:2212.01197): FedAvg with Adaptive Local Aggregation as local
initialisation (:mod:`plfl.methods.ala`)."""

from __future__ import annotations

from dataclasses import dataclass

from plfl.methods.ala import AdaptiveLocalAggregation, ALAConfig
from plfl.methods.base import MethodConfig
from plfl.methods.fedavg import FedAvg


@dataclass
class FedALAConfig(ALAConfig, MethodConfig):
    """FedALA's keys are ALA's, at the top of ``method``: ``method.s``, ``method.p``, ..."""


class FedALA(AdaptiveLocalAggregation, FedAvg):
    """FedALA (Zhang et al., AAAI 2023): FedAvg with adaptive local aggregation.

    FedAvg aggregation on the server; ALA (Eq. 3–5, Alg. 1) initialises every client's model.
    """

    name = "fedala"
    config_class = FedALAConfig
    matrix_options = {"method.p": 2}

    @property
    def ala(self) -> ALAConfig:
        return self.config
