"""Partial sharing: FedAvg over part of the model while the other keys never leave the client.

A method of this family is FedAvg except for the ``state_dict`` keys a client keeps, ``local_keys``: the head,
the body, or the BatchNorm layers, say. They are named from the model's structure (a submodule, or every module
of a type), never from substrings of names.
"""

from __future__ import annotations

from typing import Callable, Optional

from torch import nn

from plfl.methods.base import FederationContext, MethodConfig
from plfl.methods.fedavg import FedAvg
from plfl.state import Params
from plfl.tasks import TrainResult


def module_keys(model: nn.Module, select: Callable[[str, nn.Module], bool]) -> frozenset[str]:
    """The ``state_dict`` keys (parameters and buffers) of the submodules of ``model`` for which
    ``select(name, module)`` holds, e.g. ``lambda name, _: name == "head"`` → {head.weight, head.bias}."""
    return frozenset(
        f"{name}.{key}"
        for name, module in model.named_modules()
        if name and select(name, module)
        for key in module.state_dict()
    )


class PartialSharing(FedAvg):
    """FedAvg on every key outside ``local_keys``; a subclass names those in :meth:`keep_local`.

    The server's model (``global_params``) holds the shared keys only. It is what every client
    receives, and the server replaces it by the sample-size weighted mean of the sampled clients'
    shared keys (FedAvg's rule, inherited ``aggregate``). A client's model is the received shared
    keys over its own local keys (``pre_local_init``); before its first round, the initial model's.
    Its local keys are the local initialisation, so there is no ``method.ala``.
    """

    config_class = MethodConfig

    def __init__(self, config: MethodConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        self.local_keys = self.keep_local(context.architecture)
        self.initial_params = initial_params  # every client's local keys before its first round
        self.global_params = self.shared(initial_params)

    def new_client_model(self, round_: int) -> Params:
        """The shared keys over the initial model's local keys: what a client holds after its first
        ``pre_local_init``."""
        return {**self.initial_params, **self.global_params}

    def keep_local(self, model: nn.Module) -> frozenset[str]:
        """The ``state_dict`` keys of ``model`` that never leave a client."""
        raise NotImplementedError

    def shared(self, params: Params) -> Params:
        """``params`` without the local keys: what is sent and averaged."""
        return {k: v for k, v in params.items() if k not in self.local_keys}

    def pre_local_init(self, client_id: int, message: Optional[Params], round_: int) -> Params:
        """The received shared keys over the client's own model (the initial model before its first round)."""
        return self.received_over_own(client_id, message, self.initial_params)

    def client_message(self, client_id: int, result: TrainResult, round_: int) -> Params:
        """The trained model's shared keys."""
        return self.shared(super().client_message(client_id, result, round_))
