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


def client_batches(data: ClientData, batch_size: int, seed: int, epochs: int, batch_norm: bool) -> Iterator[Batch]:
    """``epochs`` passes over the client's training split in mini-batches ``(x, y)`` of ``batch_size``
    (the last one may be smaller), each epoch in a new order drawn from (``seed``, epoch): the batches
    ``LocalTrainer.train`` takes with the same seed. As there, with ``batch_norm`` (a model with
    BatchNorm layers, which cannot train on one sample) an epoch whose last batch would hold a
    single sample leaves that sample out.
    """
    n = data.num_train
    size = n - 1 if batch_norm and n > 1 and n % batch_size == 1 else n
    loader = batch_loader(data.x_train, data.y_train, batch_size, seed, size=size)
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)  # what Lightning tells the sampler at each epoch
        yield from loader
