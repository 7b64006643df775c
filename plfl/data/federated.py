"""The tensors plfl trains on: one :class:`ClientData` per client, gathered in :class:`FederatedData`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class ClientData:
    """One client's tensors: ``x_*`` float32 ``(n, *input_shape)`` (images) or int64 token ids ``(n, L)``
    (text), ``y_*`` int64 ``(n,)``."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def num_train(self) -> int:
        return len(self.y_train)

    @property
    def num_test(self) -> int:
        return len(self.y_test)


@dataclass
class FederatedData:
    """All clients of one data set; ``clients[i]`` is client ``i``."""

    name: str
    clients: list[ClientData]
    num_classes: int
    input_shape: tuple[int, ...]
    # Token-id inputs (text): x holds int64 ids in [0, vocab_size), 0 the padding id; None for images.
    vocab_size: Optional[int] = None
