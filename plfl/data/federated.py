"""The tensors plfl trains on: one :class:`ClientData` per client, gathered in :class:`FederatedData`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class ClientData:
    """One client's tensors: ``x_*`` float32 ``(n, *input_shape)`` (images) or int64 token ids ``(n, L)``
    (text), ``y_*`` int64 ``(n,)``. ``x_val``/``y_val``: its validation split (``data.val_fraction``), held out
    of its training split and never trained on; without one (the default when left out) they hold 0 samples."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    x_val: Optional[torch.Tensor] = None
    y_val: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        # New empty tensors, not views of the training split: a view would pickle (to Ray's actors) all of it.
        if self.x_val is None:
            self.x_val = self.x_train.new_empty((0, *self.x_train.shape[1:]))
        if self.y_val is None:
            self.y_val = self.y_train.new_empty((0,))

    @property
    def num_train(self) -> int:
        return len(self.y_train)

    @property
    def num_val(self) -> int:
        return len(self.y_val)

    @property
    def num_test(self) -> int:
        return len(self.y_test)

    @property
    def num_samples(self) -> int:
        """All of the client's samples: training, validation and test."""
        return self.num_train + self.num_val + self.num_test


@dataclass
class FederatedData:
    """All clients of one data set; ``clients[i]`` is client ``i``."""

    name: str
    clients: list[ClientData]
    num_classes: int
    input_shape: tuple[int, ...]
    # Token-id inputs (text): x holds int64 ids in [0, vocab_size), 0 the padding id; None for images.
    vocab_size: Optional[int] = None

    @property
    def has_validation(self) -> bool:
        """Whether the clients hold validation splits (``data.val_fraction`` > 0): every client then has one."""
        return any(c.num_val for c in self.clients)
