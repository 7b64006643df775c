"""The one entry point from a ``data.*`` section to the clients' tensors: :func:`load_federated_data`."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from plfl.data.federated import ClientData, FederatedData
from plfl.data.partition import Flower, partitions, split_train_test, split_train_val
from plfl.data.sources import DEFAULT_NUM_CLIENTS, data_sources
from plfl.errors import DataError
from plfl.seeding import derive_seed


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

    With ``cfg.val_fraction`` > 0 every client's training split, whichever the
    source, is then split once more (:func:`hold_out_validation`); at 0 the
    clients are exactly those without the key. With ``cfg.rotation_groups`` > 1
    the clients' images are then rotated by group (:func:`rotated`).

    Raises:
        DataError: files are missing, corrupt, unsafe or inconsistent, or the
            partition is impossible with the given settings; the message names
            the file or key to fix.
    """
    data = _clients(cfg, seed)
    data = hold_out_validation(data, cfg.val_fraction, seed) if cfg.val_fraction else data
    return rotated(data, cfg.rotation_groups) if cfg.rotation_groups > 1 else data


def rotated(data: FederatedData, groups: int) -> FederatedData:
    """``data`` with client i's images rotated counter-clockwise by (i mod ``groups``) · 360°/``groups``
    (torchvision's ``rotate``, nearest pixels, zeros outside; quarter turns are exact): the clusters of IFCA's
    rotated MNIST (Ghosh et al., NeurIPS 2020), whose ground truth is i mod ``groups``.

    Raises:
        DataError: the samples are not images (C, H, W).
    """
    if data.vocab_size is not None or len(data.input_shape) != 3:
        raise DataError(
            f"data.rotation_groups={groups} rotates images; {data.name}'s samples have shape {data.input_shape}. "
            "Set data.rotation_groups=1."
        )
    clients = []
    for i, c in enumerate(data.clients):
        angle = (i % groups) * 360.0 / groups
        x_train, x_test, x_val = (_rotate(x, angle) for x in (c.x_train, c.x_test, c.x_val))
        clients.append(ClientData(x_train, c.y_train, x_test, c.y_test, x_val, c.y_val))
    return dataclasses.replace(data, clients=clients)


def _rotate(images: torch.Tensor, angle: float) -> torch.Tensor:
    """``images`` (n, C, H, W) rotated counter-clockwise by ``angle`` degrees; unchanged at 0 or for n = 0."""
    from torchvision.transforms.v2.functional import rotate

    return rotate(images, angle) if angle and len(images) else images


def hold_out_validation(data: FederatedData, val_fraction: float, seed: int) -> FederatedData:
    """``data`` with each client's training split split into the samples it trains on and its validation split
    (:func:`~plfl.data.partition.split_train_val`: ``ceil(val_fraction · n)`` of its n training samples, at least
    one, stratified by label where possible), drawn from the seed of the stream ``"validation_hold_out"`` of
    ``seed`` and the client (:func:`plfl.seeding.derive_seed`), so that a client's split depends on neither the
    source nor the other clients. The test splits are untouched; both parts keep the training split's order.

    Raises:
        DataError: a client has fewer than 2 training samples (the message names the client).
    """
    clients = []
    for i, client in enumerate(data.clients):
        rng = np.random.default_rng(derive_seed(seed, 0, i, "validation_hold_out"))
        try:
            train, val = split_train_val(np.arange(client.num_train), client.y_train.numpy(), val_fraction, rng)
        except DataError as e:
            raise DataError(f"Client {i}: {e}") from None
        train, val = torch.from_numpy(train), torch.from_numpy(val)
        clients.append(
            ClientData(
                client.x_train[train],
                client.y_train[train],
                client.x_test,
                client.y_test,
                client.x_train[val],
                client.y_train[val],
            )
        )
    return dataclasses.replace(data, clients=clients)


def _clients(cfg: Any, seed: int) -> FederatedData:
    """The clients of ``cfg.source`` with their train and test splits (see :func:`load_federated_data`)."""
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
