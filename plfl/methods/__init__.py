"""Federated learning methods, by ``method.name``."""

from __future__ import annotations

from plfl.errors import ConfigError
from plfl.methods.base import FederationContext, Method, MethodConfig
from plfl.methods.fedala import FedALA
from plfl.methods.fedavg import FedAvg
from plfl.methods.fedftha import FedFT, FedFTHA
from plfl.methods.local import Local
from plfl.methods.pfedla import HeurpFedLA, PFedLA
from plfl.methods.selffl import SelfFL

METHODS: dict[str, type[Method]] = {cls.name: cls for cls in (
    FedAvg,
    Local,
    FedALA,
    FedFT,
    FedFTHA,
    PFedLA,
    HeurpFedLA,
    SelfFL,
)}


def method_class(name: str) -> type[Method]:
    """The method registered as ``name``.

    Raises:
        ConfigError: unknown name (the message lists the valid ones).
    """
    if name not in METHODS:
        raise ConfigError(f"Unknown method.name {name!r}; valid names: {', '.join(sorted(METHODS))}.")
    return METHODS[name]


def method_schema(name: str) -> type:
    """The config dataclass of method ``name`` (see :func:`method_class`)."""
    return method_class(name).config_class


__all__ = ["FederationContext", "METHODS", "Method", "MethodConfig", "method_class", "method_schema"]
