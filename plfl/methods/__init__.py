"""Federated learning methods by ``method.name``: the registry of their schemas and implementations.

This package's import is light (no torch): the config layer checks ``method.*``
against :data:`METHODS` and ``plfl methods`` lists them; a method's code is
imported only when a run builds it (:func:`method_class`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from plfl.errors import ConfigError
from plfl.methods import schemas


@dataclass(frozen=True)
class MethodEntry:
    """One registered method."""

    config: type  # its ``method.*`` schema, a dataclass in plfl.methods.schemas
    implementation: str  # "module:Class", a subclass of plfl.methods.base.Method
    summary: str  # paper and idea in one line (plfl methods)


METHODS: dict[str, MethodEntry] = {
    "fedavg": MethodEntry(schemas.FedAvgConfig, "plfl.methods.fedavg:FedAvg",
                          "FedAvg (McMahan et al., AISTATS 2017): sample-size weighted average of client models"),
    "fedavgm": MethodEntry(schemas.FedAvgMConfig, "plfl.methods.fedavgm:FedAvgM",
                           "FedAvgM (Hsu et al., 2019): FedAvg with server momentum on the averaged update"),
    "local": MethodEntry(schemas.LocalConfig, "plfl.methods.local:Local",
                         "Local: every client trains its own model; nothing is sent"),
    "fedala": MethodEntry(schemas.FedALAConfig, "plfl.methods.fedala:FedALA",
                          "FedALA (Zhang et al., AAAI 2023): FedAvg with adaptive local aggregation"),
    "fedft": MethodEntry(schemas.FedFTConfig, "plfl.methods.fedftha:FedFT",
                         "FedFT (FedFTHA paper, IEEE IoT-J 2023): personal heads fine-tuned, body averaged"),
    "fedftha": MethodEntry(schemas.FedFTHAConfig, "plfl.methods.fedftha:FedFTHA",
                           "FedFTHA (IEEE IoT-J 2023): FedFT plus a global head averaged over all heads"),
    "pfedla": MethodEntry(schemas.PFedLAConfig, "plfl.methods.pfedla:PFedLA",
                          "pFedLA (Ma et al., CVPR 2022): layer-wise aggregation weights from hypernetworks"),
    "heurpfedla": MethodEntry(schemas.HeurpFedLAConfig, "plfl.methods.pfedla:HeurpFedLA",
                              "HeurpFedLA (Ma et al., CVPR 2022): pFedLA keeping k layers local"),
    "selffl": MethodEntry(schemas.SelfFLConfig, "plfl.methods.selffl:SelfFL",
                          "Self-FL (Chen et al., NeurIPS 2022): uncertainty-aware init, steps and aggregation"),
    "perfedavg": MethodEntry(schemas.PerFedAvgConfig, "plfl.methods.perfedavg:PerFedAvg",
                             "Per-FedAvg (Fallah et al., NeurIPS 2020): FedAvg of MAML steps, one-step adapted"),
    "fedprox": MethodEntry(schemas.FedProxConfig, "plfl.methods.fedprox:FedProx",
                           "FedProx (Li et al., MLSys 2020): FedAvg with a proximal term mu/2 |w - w_global|^2"),
    "fedavg_c": MethodEntry(schemas.FedAvgCConfig, "plfl.methods.fedavg_c:FedAvgC",
                            "FedAvg-C (FedALA paper, AAAI 2023): FedAvg, global model fine-tuned locally as init"),
    "fedprox_c": MethodEntry(schemas.FedProxCConfig, "plfl.methods.fedavg_c:FedProxC",
                             "FedProx-C (FedALA paper, AAAI 2023): FedProx, global model fine-tuned locally as init"),
    "fedavg_e": MethodEntry(schemas.FedAvgEConfig, "plfl.methods.fedavg_e:FedAvgE",
                            "FedAvg-e (Self-FL paper, NeurIPS 2022): FedAvg with equal client weights"),
    "ditto": MethodEntry(schemas.DittoConfig, "plfl.methods.ditto:Ditto",
                         "Ditto (Li et al., ICML 2021): FedAvg plus a personal model kept near the global one"),
    "pfedme": MethodEntry(schemas.PFedMeConfig, "plfl.methods.pfedme:PFedMe",
                          "pFedMe (Dinh et al., NeurIPS 2020): personalized models from Moreau envelopes"),
    "fedrep": MethodEntry(schemas.FedRepConfig, "plfl.methods.fedrep:FedRep",
                          "FedRep (Collins et al., ICML 2021): shared body, personal heads trained first"),
    "lgfedavg": MethodEntry(schemas.LGFedAvgConfig, "plfl.methods.lgfedavg:LGFedAvg",
                            "LG-FedAvg (Liang et al., 2020): local bodies, averaged head"),
    "fedbn": MethodEntry(schemas.FedBNConfig, "plfl.methods.fedbn:FedBN",
                         "FedBN (Li et al., ICLR 2021): FedAvg with BatchNorm layers kept local"),
    "fedamp": MethodEntry(schemas.FedAMPConfig, "plfl.methods.fedamp:FedAMP",
                          "FedAMP (Huang et al., AAAI 2021): cloud models mixing all clients' models by similarity"),
    "fedfomo": MethodEntry(schemas.FedFomoConfig, "plfl.methods.fedfomo:FedFomo",
                           "FedFomo (Zhang et al., ICLR 2021): M downloaded models weighted by validation-loss gain"),
    "pfedhn": MethodEntry(schemas.PFedHNConfig, "plfl.methods.pfedhn:PFedHN",
                          "pFedHN (Shamsian et al., ICML 2021): a server hypernetwork generates each client's model"),
    "apple": MethodEntry(schemas.APPLEConfig, "plfl.methods.apple:APPLE",
                         "APPLE (Luo and Wu, IJCAI 2022): personalized mixtures of all core models, weights learned"),
    "fedphp": MethodEntry(schemas.FedPHPConfig, "plfl.methods.fedphp:FedPHP",
                          "FedPHP (Li et al., ECML-PKDD 2021): personalized models inherited by a moving average"),
}


def method_entry(name: str) -> MethodEntry:
    """The registry entry of ``name``.

    Raises:
        ConfigError: unknown name (the message lists the valid ones).
    """
    if name not in METHODS:
        raise ConfigError(f"Unknown method.name {name!r}; valid names: {', '.join(sorted(METHODS))}.")
    return METHODS[name]


def method_schema(name: str) -> type:
    """The ``method.*`` config dataclass of method ``name`` (see :func:`method_entry`)."""
    return method_entry(name).config


def method_class(name: str) -> type:
    """The :class:`plfl.methods.base.Method` subclass of ``name``, imported now (torch with it)."""
    module, _, cls = method_entry(name).implementation.partition(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["METHODS", "MethodEntry", "method_class", "method_entry", "method_schema"]
