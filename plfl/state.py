"""The client-state store: every client's persistent state, as tensors.

Per-client state (the personalized model, ALA weights, variance statistics
...) lives here as data, never as attributes of a reused module, so that one
module can serve every client and other executors can run the same methods.
"""

from __future__ import annotations

from typing import Any

import torch

Params = dict[str, torch.Tensor]
"""A model's state: ``state_dict`` names → tensors (parameters and buffers)."""


class ClientStateStore:
    """Maps (client id, key) → a tensor, a dict of tensors, or a number.

    The key ``"model"`` holds the client's personalized model (:data:`Params`).
    """

    def __init__(self, num_clients: int):
        self._states: list[dict[str, Any]] = [{} for _ in range(num_clients)]

    def __len__(self) -> int:
        return len(self._states)

    def get(self, client_id: int, key: str, default: Any = None) -> Any:
        return self._states[client_id].get(key, default)

    def set(self, client_id: int, key: str, value: Any) -> None:
        self._states[client_id][key] = value

    def __contains__(self, item: tuple[int, str]) -> bool:
        client_id, key = item
        return key in self._states[client_id]

    def state_dict(self) -> list[dict[str, Any]]:
        """The whole store (for checkpoints): one dict of tensors per client."""
        return self._states

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        if len(states) != len(self._states):
            raise ValueError(f"state for {len(states)} clients given to a store of {len(self._states)}")
        self._states = states
