"""A client's training mini-batches for methods that train in a loop of their own (APPLE, FedPHP).

Such methods take gradient steps on a loss that ``LocalTrainer.train`` cannot express (a mixture
of several models, a feature-matching term), so they iterate over the batches themselves.
"""

from __future__ import annotations

from typing import Iterator

import torch

from plfl.client import batch_loader
from plfl.data import ClientData


Batch = tuple[torch.Tensor, torch.Tensor]


def client_batches(data: ClientData, batch_size: int, seed: int, epochs: int) -> Iterator[Batch]:
    """``epochs`` passes over the client's training split in mini-batches ``(x, y)`` of ``batch_size``
    (the last one may be smaller), each epoch in a new order drawn from (``seed``, epoch): the order
    ``LocalTrainer.train`` uses for the same seed (without its BatchNorm rule for a last batch of one).
    """
    loader = batch_loader(data.x_train, data.y_train, batch_size, seed)
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)  # what Lightning tells the sampler at each epoch
        yield from loader
