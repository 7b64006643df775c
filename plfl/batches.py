"""The one batch order of every client's training loop, and the loaders that serve it.

Local training visits a client's n training samples epoch by epoch, each epoch in a new order drawn from
(seed, epoch) (:func:`epoch_order`), cut into batches of ``batch_size``. A last batch shorter than
``min_last`` samples is left out (:func:`epoch_size`): a model with BatchNorm layers cannot train on a batch
of one sample (torch raises: a batch statistic needs two values per channel), so with BatchNorm ``min_last``
is 2 (:func:`smallest_batch`), a different sample left out every epoch; a step that splits each batch into
sub-batches needs that many in each (:func:`last_batch_minimum`). PFLlib drops every incomplete last batch
instead; ``federation.drop_last`` does the same.

Lightning's loop (:class:`plfl.client.LocalTrainer`) takes the order through :func:`batch_loader`; the
executors' own loops (per-batch steps, the vectorized executor) through :func:`training_rows`, a table of
sample indices with one row per batch. Both give the same batches for the same seed.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader, Dataset, Sampler

from plfl.seeding import derive_seed

EVAL_BATCH_SIZE = 1000  # samples per evaluation batch


def has_batch_norm(model: nn.Module) -> bool:
    """Whether ``model`` has a BatchNorm layer (and so cannot train on a batch of one sample)."""
    return any(isinstance(m, _BatchNorm) for m in model.modules())


def smallest_batch(batch_norm: bool) -> int:
    """The fewest samples a training batch may hold: 2 for a model with BatchNorm layers, else 1."""
    return 2 if batch_norm else 1


def last_batch_minimum(batch_size: int, batch_norm: bool, sub_batches: int = 1, drop_last: bool = False) -> int:
    """The fewest samples a last batch must hold to be trained on: ``batch_size`` with ``drop_last`` (only full
    batches, PFLlib's rule); else, when a step splits each batch into ``sub_batches`` sub-batches of
    ``batch_size // sub_batches`` (the last takes the rest), enough for each of them to get
    :func:`smallest_batch` samples."""
    if drop_last:
        return batch_size
    return (sub_batches - 1) * (batch_size // sub_batches) + smallest_batch(batch_norm)


def epoch_size(n: int, batch_size: int, min_last: int) -> int:
    """How many of n training samples a local epoch visits: n, or n − (n mod batch_size) when that last
    batch holds fewer than ``min_last`` samples."""
    rest = n % batch_size
    return n - rest if 0 < rest < min_last else n


def epoch_order(n: int, seed: int, local_epoch: int) -> torch.Tensor:
    """The (n,) int64 permutation of 0..n-1 that a training seeded ``seed`` visits in its epoch ``local_epoch``
    (0 first)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed(seed, local_epoch, 0, "shuffling")))


def padded_rows(indices: torch.Tensor, width: int) -> torch.Tensor:
    """(⌈len / width⌉, width) int64: ``indices`` in rows of ``width``, the last one padded with -1."""
    return torch.cat([indices, indices.new_full(((-len(indices)) % width,), -1)]).view(-1, width)


def training_rows(
    n: int, batch_size: int, seed: int, epochs: Optional[int] = None, steps: Optional[int] = None, min_last: int = 1
) -> torch.Tensor:
    """(S, batch_size) int64: the batches of a training on n samples with ``seed``, in order, padded with -1.

    Each local epoch visits the first :func:`epoch_size` of :func:`epoch_order` in batches; ``steps`` counts
    batches across epochs, as Lightning's ``max_steps`` does.
    """
    size = epoch_size(n, batch_size, min_last)
    if size == 0:
        return torch.empty(0, batch_size, dtype=torch.long)
    if epochs is None:
        epochs = -(-steps // -(-size // batch_size))
    rows = torch.cat([padded_rows(epoch_order(n, seed, k)[:size], batch_size) for k in range(epochs)])
    return rows if steps is None else rows[:steps]


def sample_rows(index: torch.Tensor, batch_size: int, min_last: int = 1) -> torch.Tensor:
    """(B, batch_size) int64: the sample ``index`` in its order, cut into batches (the same every epoch),
    padded with -1; a last batch shorter than ``min_last`` is left out."""
    return padded_rows(index[: epoch_size(len(index), batch_size, min_last)], batch_size)


class TensorBatches(Dataset):
    """Batches ``(x[index], y[index])`` for a tensor ``index`` of sample indices (one indexing op per batch)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def _as_batch(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch  # TensorBatches already returns the collated batch


class EpochShuffle(Sampler[int]):
    """Indices 0..n-1 in a new order each local epoch: epoch k's order is :func:`epoch_order` of (seed, k);
    the first ``size`` of them (default n).

    Lightning numbers epochs across all fits of a Trainer and tells samplers
    the epoch with ``set_epoch``; k counts from ``first_epoch``, the Trainer's
    epoch when this fit starts. Drawing from (seed, k) instead of one running
    generator matters: a reused Trainer starts an iteration and discards it at
    the start of every fit after its first, so a running generator would make
    a client's batches depend on how many fits the Trainer ran before (and a
    resumed run would differ from an uninterrupted one).
    """

    def __init__(self, n: int, seed: int, first_epoch: int, size: Optional[int] = None):
        self.n, self.seed, self.first_epoch = n, seed, first_epoch
        self.size = n if size is None else size
        self.epoch = first_epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def order(self) -> torch.Tensor:
        """This epoch's (size,) int64 indices."""
        return epoch_order(self.n, self.seed, self.epoch - self.first_epoch)[: self.size]

    def __iter__(self) -> Iterator[int]:
        yield from self.order().tolist()


class IndexBatches(Sampler[torch.Tensor]):
    """``shuffle``'s order each epoch (None: 0..n-1) in index tensors of ``batch_size`` (the last may be
    smaller). Slicing one index tensor per epoch avoids a BatchSampler's per-sample Python ints."""

    def __init__(self, n: int, batch_size: int, shuffle: Optional[EpochShuffle] = None):
        self.n, self.batch_size, self.shuffle = n, batch_size, shuffle

    def set_epoch(self, epoch: int) -> None:
        if self.shuffle is not None:
            self.shuffle.set_epoch(epoch)

    def __len__(self) -> int:
        return -(-(self.n if self.shuffle is None else len(self.shuffle)) // self.batch_size)

    def __iter__(self) -> Iterator[torch.Tensor]:
        order = torch.arange(self.n) if self.shuffle is None else self.shuffle.order()
        return iter(order.split(self.batch_size))


def batch_loader(
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    seed: Optional[int] = None,
    first_epoch: int = 0,
    min_last: int = 1,
) -> DataLoader:
    """Mini-batches of ``(x, y)``, reshuffled each epoch from ``seed`` (:class:`EpochShuffle`; None: in order);
    with a seed, each epoch visits :func:`epoch_size` samples of its order. ``loader.sampler.set_epoch``
    picks the epoch's order."""
    size = epoch_size(len(y), batch_size, min_last)
    shuffle = None if seed is None else EpochShuffle(len(y), seed, first_epoch, size)
    sampler = IndexBatches(len(y), batch_size, shuffle)
    return DataLoader(TensorBatches(x, y), sampler=sampler, batch_size=None, collate_fn=_as_batch)
