"""The one entry point from a ``data.*`` section to the clients' tensors: :func:`load_federated_data`."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from plfl.data.federated import ClientData, FederatedData
from plfl.data.partition import Flower, partitions, split_train_test
from plfl.data.sources import DEFAULT_NUM_CLIENTS, data_sources
from plfl.errors import DataError


def load_federated_data(cfg: Any, seed: int) -> FederatedData:
    """Load ``cfg.source`` (``cfg``: a validated ``data.*`` section, :data:`plfl.data.sources.DataConfig`) and
    split it over clients.

    Pooled sources are partitioned (``cfg.partition``, default 20 clients when
    ``cfg.num_clients`` is None) and each client split into train/test by
    ``cfg.test_fraction``; the same ``seed`` gives the same split. ``pfllib``
    takes clients and splits from its files, or with ``cfg.repartition`` pools
    every client's train and test samples and partitions them the same way.

    Images are float32 ``(C, H, W)``: ``digits`` in [0, 1], ``leaf`` as its
    files store them (FEMNIST: [0, 1], 1.0 = white background), ``imagefolder``
    normalised per channel over the pool (:func:`plfl.data.imagefolder.load_image_folder`),
    the others in [-1, 1] (``(x/255 - 0.5) / 0.5``, as PFLlib normalises).
    Texts (``agnews``) are int64 token ids ``(data.max_length,)``, 0 the padding,
    from a vocabulary trained on the clients' training texts only; the
    result's ``vocab_size`` is then set.

    Raises:
        DataError: files are missing, corrupt, unsafe or inconsistent, or the
            partition is impossible with the given settings; the message names
            the file or key to fix.
    """
    source = data_sources()[cfg.source].of(cfg)
    read = source.read()
    columns = {}
    if isinstance(read, FederatedData):
        if not source.partitioned():
            return read
        x = torch.cat([t for c in read.clients for t in (c.x_train, c.x_test)])
        y = torch.cat([t for c in read.clients for t in (c.y_train, c.y_test)])
        name, num_classes = read.name, read.num_classes
    else:
        (x, y, num_classes, *more), name = read, cfg.source
        columns = more[0] if more else {}  # per-sample columns besides the labels (hf: e.g. FEMNIST's writer_id)

    labels = y.numpy()
    rng = np.random.default_rng(seed)
    partition = partitions()[cfg.partition].of(cfg)
    num_clients = DEFAULT_NUM_CLIENTS if cfg.num_clients is None else cfg.num_clients
    if isinstance(partition, Flower):  # its partitioners may split by a column, and may set the client count
        parts = partition.split(labels, num_clients, rng, columns=columns, num_clients_set=cfg.num_clients is not None)
    else:
        parts = partition.split(labels, num_clients, rng)

    splits = []
    for i, idx in enumerate(parts):
        try:
            splits.append(split_train_test(idx, labels, partition.test_fraction, rng))
        except DataError as e:
            raise DataError(f"Client {i} of the {cfg.partition} partition: {e}") from None
    vocab_size = None
    encoded = source.encode(x, np.concatenate([train for train, _ in splits]))
    if encoded is not None:
        x, vocab_size = encoded
    clients = []
    for train, test in splits:
        train, test = torch.from_numpy(train), torch.from_numpy(test)
        clients.append(ClientData(x[train], y[train], x[test], y[test]))
    return FederatedData(name, clients, num_classes, tuple(x.shape[1:]), vocab_size)
