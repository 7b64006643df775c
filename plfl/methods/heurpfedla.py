r"""HeurpFedLA (Ma et al., CVPR 2022, Alg. 2, Eq. 12): pFedLA (:mod:`plfl.methods.pfedla`) whose clients keep
the k layers with the largest self-weights :math:`\alpha_i^{l,i}` local: the server neither aggregates nor sends
them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plfl.errors import ConfigError
from plfl.fields import checked
from plfl.methods.base import FederationContext
from plfl.methods.pfedla import PFedLA, PFedLAConfig
from plfl.state import Params


@dataclass
class HeurpFedLAConfig(PFedLAConfig):
    k: int = checked(
        1,
        lambda v: v >= 0,
        "an integer >= 0",
        "layers with the k largest self-weights stay local (Eq. 12); k = 0 is pFedLA",
    )


class HeurpFedLA(PFedLA):
    """HeurpFedLA (Ma et al., CVPR 2022): pFedLA keeping k layers local.

    pFedLA whose clients keep their k layers with the largest self-weights α_i^{l,i} local (Alg. 2, Eq. 12).
    """

    name = "heurpfedla"
    config_class = HeurpFedLAConfig
    matrix_options = {"method.k": 1}

    def __init__(self, config: HeurpFedLAConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        if config.k > len(self.layers):
            raise ConfigError(
                f"method.k={config.k} exceeds the model's {len(self.layers)} layers "
                f"(method.granularity={config.granularity}); choose k <= {len(self.layers)}."
            )

    def retained_layers(self, client_id: int, alpha: torch.Tensor) -> frozenset[str]:
        names = list(self.layers)
        return frozenset(names[i] for i in torch.topk(alpha[:, client_id], self.config.k).indices.tolist())

    def round_metrics(self, round_: int) -> dict[str, float]:
        """Also ``retained_params_mean``: scalars each client keeps local, mean over clients."""
        sizes = {layer: sum(self.thetas[key][0].numel() for key in keys) for layer, keys in self.layers.items()}
        retained = [sum(sizes[layer] for layer in sent.retained) for sent in self.sent]
        return {**super().round_metrics(round_), "retained_params_mean": sum(retained) / len(retained)}
