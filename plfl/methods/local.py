"""Local training only: no communication; each client trains its own model from the shared initialisation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from plfl.errors import ConfigError
from plfl.methods.base import Method, MethodConfig
from plfl.state import Params


@dataclass
class LocalConfig(MethodConfig):
    name: str = "local"


class Local(Method):
    """Client i keeps training Θ_i; the server sends and receives nothing."""

    name = "local"
    config_class = LocalConfig

    def ala_config(self) -> None:
        if self.config.ala is not None:
            raise ConfigError("method.ala has no effect with method.name=local (there is no global model); remove it.")

    def server_message(self, client_id: int) -> None:
        return None

    def pre_local_init(self, client_id: int, message: Optional[Params], round_: int) -> Params:
        # Before its first training every client starts from the same initial model.
        return self.store.get(client_id, "model") or self.global_params

    def client_message(self, client_id, result) -> None:
        return None

    def aggregate(self, messages: dict[int, Params], round_: int) -> None:
        pass
